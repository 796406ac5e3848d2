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


class PeerFailed(KVFlowError):
    """The peer refused, died or did not answer in time; local resources were released."""
