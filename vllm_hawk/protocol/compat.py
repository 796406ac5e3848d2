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
