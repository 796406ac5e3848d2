"""Errors of the Algorithm 1 library. Every message names the request and what ran out."""

from __future__ import annotations


class KVFlowError(RuntimeError):
    """A KV transfer failed; ``req_id`` names the request (may be empty)."""

    def __init__(self, msg: str, req_id: str = "") -> None:
        super().__init__(msg)
        self.req_id = req_id


class BufferFull(KVFlowError):
    """A bounded buffer (prefill ring, decode bank-buffer pool) had no room within the
    caller's deadline, or the request can never fit. Nothing was overwritten."""


class RingTooSmall(BufferFull):
    """A request needs more bytes than the whole ring (``nbytes`` > ``capacity``): it can
    never fit, however long it waits; a ring of ``want`` bytes (``nbytes`` aligned) would."""

    def __init__(self, msg: str, req_id: str = "", nbytes: int = 0, capacity: int = 0, want: int = 0) -> None:
        super().__init__(msg, req_id)
        self.nbytes, self.capacity, self.want = nbytes, capacity, want or nbytes


class RingClosed(KVFlowError):
    """The ring was aborted (its endpoint is closing): no reservation is handed out and
    every caller waiting for room is woken with this error."""


class PeerFailed(KVFlowError):
    """The peer refused, died or did not answer in time; local resources were released."""


class TransferUnsettled(PeerFailed):
    """A failed direct (or per-tile) fetch whose READs had not drained within the bound:
    they may still write into the KV pages of ``unsafe_blocks`` (destination block ids).
    Those blocks must not be used (or reused for another request) until the transport is
    closed or the device's KV pool is reset. ``settled`` (a ``threading.Event``, when
    known) is set once the batch has drained: the blocks are safe from then on."""

    def __init__(self, msg: str, req_id: str = "", unsafe_blocks: tuple[int, ...] = (), settled=None) -> None:
        super().__init__(msg, req_id)
        self.unsafe_blocks = tuple(unsafe_blocks)
        self.settled = settled


class IntegrityError(PeerFailed):
    """The bytes that landed are not the bytes the prefill produced (a checksum mismatch,
    or a KVReady without the checksums asked for): the KV is never used, the pull fails
    and vLLM's ``kv_load_failure_policy`` recomputes or fails the request. ``chip``: the
    destination chip (or decode rank); ``mismatches``: the segments that failed
    (:class:`vllm_hawk.integrity.Mismatch`)."""

    def __init__(self, msg: str, req_id: str = "", chip: int = 0, mismatches: tuple = ()) -> None:
        super().__init__(msg, req_id)
        self.chip, self.mismatches = chip, tuple(mismatches)
