"""The prefill's worker-thread path (P4-P7): produce a layer group's bytes and announce them.

:class:`Producer` serves one accepted KVRequest on a worker thread: the first group of
a share plans it and reserves its ring range (P5), each group fills its own bytes (P4 +
P6, staged gather or GN-HAWK transform; a source served in place exposes its block runs
instead) and sends its own ``KVReady`` (P7). Device work runs on the worker thread's
own stream and ends with an event that is waited for before the KVReady
(:mod:`~vllm_hawk.kvflow.device`); a worker issues none outside serving a KVRequest. The
:class:`~vllm_hawk.kvflow.ledger.Ledger` decides at each step (dropped, cancelled,
served, failed); the producer does what it says. It also frees share ranges (P8) for the
endpoint, always with the endpoint's lock held, and turns every
:class:`~vllm_hawk.kvflow.lifecycle.Refusal` into its ``ErrorMsg`` (:meth:`error`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from vllm_hawk.integrity import of_tensors, seeded
from vllm_hawk.kvflow.base import Prepared
from vllm_hawk.kvflow.device import own_stream
from vllm_hawk.kvflow.errors import BufferFull, RingClosed, RingTooSmall
from vllm_hawk.kvflow.ledger import Cancelled, Ledger, layers
from vllm_hawk.kvflow.lifecycle import Refusal, RequestRecord, ShareRecord, Stream
from vllm_hawk.kvflow.sources import src_block_span
from vllm_hawk.protocol import ErrorMsg, KVReady, KVRequest, Segment, SegmentSum
from vllm_hawk.protocol.messages import MAX_SEGMENTS, MAX_STR

logger = logging.getLogger("vllm.hawk.kvflow.prefill")


class Refused(Exception):
    """Raised on the worker path to stop serving with ``refusal`` as the answer."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal


class _Cancelled(Exception):
    """The decode sent Release while the request was still being served."""


def _stop(decision) -> None:
    """Raise what a ledger decision that stops the worker says (None: go on)."""
    if isinstance(decision, Cancelled):
        raise _Cancelled()
    if decision is not None:
        raise Refused(decision)


class Producer:
    """The worker side of one :class:`~vllm_hawk.kvflow.prefill.PrefillEndpoint`: its
    ``source``, ``ring`` (None for a source served in place), ``exposure``, and the
    endpoint's ``lock`` and ``ledger``; ``notify(Notify)`` tells the engine; ``rlog``
    logs refusals rate-limited. The endpoint's other settings are read from ``ep``."""

    def __init__(self, ep, ledger: Ledger, lock, notify, rlog) -> None:
        self.ep, self.ledger, self.lock, self.notify, self.rlog = ep, ledger, lock, notify, rlog

    def error(self, rid: str, r: Refusal) -> ErrorMsg:
        """The ErrorMsg of refusal ``r``; one with a reason is counted in
        ``stats.refusals`` and logged (rate-limited)."""
        if r.reason:
            self.ledger.stats.refusals.count(r.reason)
            self.rlog(r.reason, "prefill: refused input for %s (%s): %s", rid[:64], r.reason, r.detail)
        return ErrorMsg(code=r.code, detail=r.detail[:1000], req_id=rid[:MAX_STR])

    def free(self, keys) -> None:
        """Let go of the ring ranges (if they hold one) and registrations of share ``keys``
        (P8). Called after the ledger retired the shares (released, expired or failed), so
        none of them is served again; the ring and the exposure take only their own locks and
        never call back (lock order, where the endpoint's lock is held: endpoint ->
        ring/exposure)."""
        ring = self.ep.ring
        for key in keys:
            if ring is not None and key in ring.alloc.live():
                with contextlib.suppress(KeyError):  # a reserve whose registration failed let go of it
                    ring.release(key)
            self.ep.exposure.release(key)

    def serve(self, msg: KVRequest, reply) -> None:
        """Worker: produce and announce one layer group of a share (a whole request is the
        group of all its layers). On failure see :meth:`_failed`."""
        with self.lock:
            req, rec = self.ledger.job(msg)
        try:
            out = self._produce(msg, req, rec)
        except Exception as e:  # noqa: BLE001 - every failure becomes a typed reply
            self._failed(msg, req, rec, e, reply)
            return
        reply(out)  # P7

    def _produce(self, msg: KVRequest, req: RequestRecord | None, rec: ShareRecord | None) -> KVReady:
        """Produce ``msg``'s layer group into the share's range and mark it served; raises
        :class:`Refused` or :class:`_Cancelled` (or whatever the source raises)."""
        ep = self.ep
        with self.lock:
            _stop(self.ledger.interrupt(rec))
        first, end, _ = src_block_span(
            msg.first_block, msg.dst_layout.block_size, msg.num_tokens, ep.source.layout.block_size
        )
        src = req.src_blocks[first:end]
        st = rec.stream
        prep, off, planned = self._plan(msg, st, src, rec.key)
        if prep.nbytes:
            with self.lock:
                _stop(self.ledger.interrupt(rec, dropped=False))
        if planned and ep.observer is not None:
            ep.observer(msg.req_id, msg, src)
        lo, hi = layers(msg)
        if prep.nbytes:
            t0 = time.perf_counter()
            view = ep.ring.view(off, prep.nbytes)
            with own_stream(ep.source.device):  # this worker's own stream, never the legacy default one
                if st.whole:
                    prep.fill(ep.ring.base_addr + off, view)  # P4 + P6
                else:
                    prep.fill_layers(ep.ring.base_addr + off, view, lo, hi)
                ep.ring.synchronize()  # an event after the fill: the bytes are in the ring before KVReady
            with self.lock:
                add = not st.whole or rec.key != msg.req_id
                self.ledger.note_produce(msg.req_id, time.perf_counter() - t0, add=add)
        segs = prep.segments(off) if st.whole else prep.segments_layers(off, lo, hi)
        if len(segs) > MAX_SEGMENTS:  # a KVReady the decode would drop: refuse now, naming why
            raise Refused(Refusal("", "layout_mismatch", _too_many_segments(len(segs), ep.source, msg)))
        if not prep.nbytes and ep.registration == "per_request":  # served in place: expose its runs
            ep.exposure.acquire(
                rec.key, [(ep.export_base + s.offset_bytes, s.nbytes) for s in segs], domains=ep.export_regions
            )
        out = KVReady(
            req_id=msg.req_id,
            ring_offset=off,
            total_nbytes=sum(s.nbytes for s in segs),
            segments=segs,
            lease_ms=int(ep.lease_s * 1000),
            chip=msg.dst_chip,
            checksums=self._checksums(prep, segs) if msg.checksum else [],
        )
        with self.lock:  # the cancel check and the move to served are one step
            _stop(self.ledger.served(rec, time.monotonic()))
        return out

    def _checksums(self, prep: Prepared, segs: list[Segment]) -> list[SegmentSum]:
        """Each segment's checksum over its bytes as the decode will read them (the ring
        range just filled, or the cache runs served in place), taken on the source's device
        on this worker's own stream, seeded by the bytes' format (:mod:`vllm_hawk.integrity`)."""
        ep = self.ep
        with own_stream(ep.source.device):
            if prep.nbytes:  # ring offsets are from the ring's base, the export base
                views = [ep.ring.view(s.offset_bytes, s.nbytes) for s in segs]
            else:
                views = [ep.source.export_view(ep.export_base + s.offset_bytes, s.nbytes) for s in segs]
            return [SegmentSum(*seeded(raw, prep.wire_format)) for raw in of_tensors(views)]

    def _plan(self, msg: KVRequest, st: Stream, src: np.ndarray, key: str):
        """The share's plan and ring offset: made (and the range reserved, P5) by the first
        group served, shared by the others. Returns (prep, offset, made now)."""
        with self.lock:  # the stream's planning lock is the producer's, made by the first group
            if st.lock is None:
                st.lock = threading.Lock()
        with st.lock:
            if st.prep is not None:
                return st.prep, max(st.offset, 0), False
            prep = self.ep.source.prepare(msg, src, self.ep.export_base)
            if not st.whole and (not prep.nbytes or prep.fill_layers is None):
                raise Refused(Refusal("", "layout_mismatch", "this source does not serve layer groups"))
            if prep.nbytes:
                st.offset = self._reserve(key, msg, prep.nbytes)  # P5
            st.prep = prep
            return prep, max(st.offset, 0), True

    def _reserve(self, key: str, msg: KVRequest, nbytes: int) -> int:
        timeout = self.ep.claim_wait_s  # a far-future deadline must not hold the worker
        if msg.deadline_ms:
            timeout = min(timeout, max(0.0, msg.deadline_ms / 1000.0 - time.time()))
        try:
            return self.ep.ring.reserve(key, nbytes, timeout)
        except RingClosed as e:
            raise Refused(Refusal("", "internal", f"prefill endpoint is closing: {e}")) from None
        except RingTooSmall as e:  # never fits: refused for good (a no_space would be asked again)
            raise Refused(Refusal("ring_too_small", "layout_mismatch", _ring_too_small(msg, e))) from None
        except BufferFull as e:
            raise Refused(Refusal("", "no_space", str(e))) from None

    def _failed(self, msg: KVRequest, req: RequestRecord | None, rec: ShareRecord | None, e: Exception, reply) -> None:
        """A group could not be served (:meth:`~vllm_hawk.kvflow.ledger.Ledger.failed`):
        free what the ledger says, then answer the error, or (cancelled: the decode sent
        Release) answer nothing and tell the engine if that finished the request."""
        rid = msg.req_id
        with self.lock:
            f = self.ledger.failed(msg, req, rec)
            self.free(f.free)  # P8, before the share can be asked for again
        if f.quiet:
            return  # the last group still in flight finishes the cancel
        if f.cancelled:  # no reply: nobody waits for it
            logger.warning(
                "prefill: %s released by the decode before its KVReady (%s); range freed",
                rid,
                "cancelled" if isinstance(e, _Cancelled) else f"{type(e).__name__}: {e}",
            )
            if f.notify is not None:
                self.notify(f.notify)
            return
        if isinstance(e, Refused):
            reply(self.error(rid, e.refusal))
        else:
            logger.exception("prefill: serving %s failed", rid)
            reply(self.error(rid, Refusal("", "internal", f"{type(e).__name__}: {str(e)[:900]}")))


def _ring_too_small(msg: KVRequest, e: RingTooSmall) -> str:
    share = f" (heads {msg.head_start}..{msg.head_start + msg.num_heads - 1})" if msg.num_heads else ""
    return (
        f"request {msg.req_id[:64]!r}{share}: {msg.num_tokens} tokens need {e.nbytes} bytes of ring, more than the "
        f"prefill's whole {e.capacity}-byte ring: raise the prefill's kv_connector_extra_config.ring_nbytes to at "
        f'least {e.want} ("auto" sizes it for max_model_len, docs/gpu-prefill.md), or '
        "lower --max-model-len"
    )


def _too_many_segments(n: int, source, msg: KVRequest) -> str:
    share = f"heads {msg.head_start}..{msg.head_start + msg.num_heads - 1} of " if msg.num_heads else ""
    return (
        f"KVReady would carry {n} segments ({share}{len(msg.dst_block_ids)} blocks served in place by "
        f"{source.name}: one per byte run per layer), the protocol allows "
        f"{MAX_SEGMENTS}; use mode staged (the ring gathers each layer into one segment), contiguous blocks, "
        "or a head-outer cache layout for shares"
    )
