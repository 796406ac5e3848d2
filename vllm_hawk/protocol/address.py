"""Where a prefill's side channel listens: tensor-parallel rank ``r`` of a prefill that
names ``host:port`` (and a port stride) in its ``kv_transfer_params`` listens on
``tcp://host:(port + r * stride)``; an IPv6 host is bracketed. Used by the decode's
connector and by the proxy, which must not import vLLM."""

from __future__ import annotations

MAX_TP_RANKS = 64  # prefill tensor-parallel ranks a request may name


def side_channel_endpoint(host: str, port: int, rank: int = 0, stride: int = 1) -> str:
    """ZMQ endpoint of prefill TP rank ``rank``'s side channel."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port + rank * stride}"
