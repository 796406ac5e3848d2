"""Tenstorrent device profiles: DRAM banks, alignment and usable size per bank.

Profiles are YAML files shipped in the package, ``vllm_hawk/layout/profiles/devices/<name>.yaml``
(user folders named by ``HAWK_CONFIG_DIR`` are searched first, see
:mod:`vllm_hawk.layout.profiles`); :func:`load_profile` takes a name or a path. Units: bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hawk.layout import profiles


@dataclass(frozen=True)
class DeviceProfile:
    """DRAM organisation of one Tenstorrent chip.

    num_banks: DRAM banks that interleaved buffers span (p150a 8, p100 7, n150 12).
    bank_size_bytes: bytes of each bank's DRAM view (soc descriptor ``dram_bank_size``).
    dram_unreserved_base: first byte tt-metal's allocator may hand out in every bank (the
    bytes below are reserved by tt-metal's HAL: 0x100080 Blackhole, 0x100040 Wormhole,
    measured on ttsim); usable bytes per bank = bank_size_bytes - dram_unreserved_base.
    dram_alignment_bytes: page alignment (A).
    bank_offsets: byte offset of each bank inside its channel (Wormhole odd banks: 1 GiB).
    bank_channels: GDDR channel of each bank.
    chips: chips of the board (n300: 2), each organised as the fields above describe; a
    buffer lives on one chip, so every other field is per chip.
    """

    name: str
    arch: str
    num_banks: int
    bank_size_bytes: int
    dram_alignment_bytes: int
    bank_offsets: tuple[int, ...]
    bank_channels: tuple[int, ...]
    dram_unreserved_base: int = 0
    chips: int = 1

    @property
    def usable_bank_bytes(self) -> int:
        """Bytes per bank tt-metal's DRAM allocator manages (no trace region)."""
        return self.bank_size_bytes - self.dram_unreserved_base

    def aligned_page(self, page_nbytes: int) -> int:
        """Page size rounded up to the DRAM alignment (bytes)."""
        a = self.dram_alignment_bytes
        return -(-page_nbytes // a) * a


def available_profiles() -> list[str]:
    """Names of every device profile: shipped ones and those in ``HAWK_CONFIG_DIR``."""
    return profiles.available("devices")


_FIELDS = {
    "name": str,
    "arch": str,
    "num_banks": int,
    "bank_size_bytes": int,
    "dram_unreserved_base": int,
    "dram_alignment_bytes": int,
    "bank_offsets": list,
    "bank_channels": list,
}


def load_profile(name_or_path: str | os.PathLike) -> DeviceProfile:
    """Load a profile by name (``p150a``) or by YAML path. Errors name the file and field."""
    import yaml  # here, not at the top: the tt-kmd backend imports DeviceProfile in the QEMU guest's bare Python

    path, text = profiles.read("devices", name_or_path)
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of profile fields")
    for field, typ in _FIELDS.items():
        if field not in raw:
            raise ValueError(f"{path}: missing field {field!r}")
        if not isinstance(raw[field], typ):
            raise ValueError(f"{path}: field {field!r} must be {typ.__name__}, got {raw[field]!r}")
    nb = raw["num_banks"]
    for field in ("bank_offsets", "bank_channels"):
        if len(raw[field]) != nb:
            raise ValueError(f"{path}: field {field!r} has {len(raw[field])} entries, num_banks is {nb}")
    if nb <= 0 or raw["bank_size_bytes"] <= 0:
        raise ValueError(f"{path}: num_banks and bank_size_bytes must be positive")
    base = raw["dram_unreserved_base"]
    if not 0 <= base < raw["bank_size_bytes"]:
        raise ValueError(f"{path}: field 'dram_unreserved_base' must be in [0, bank_size_bytes), got {base:#x}")
    a = raw["dram_alignment_bytes"]
    if a <= 0 or a & (a - 1):
        raise ValueError(f"{path}: dram_alignment_bytes must be a power of two, got {a}")
    if base % a:
        raise ValueError(
            f"{path}: field 'dram_unreserved_base' {base:#x} is not a multiple of dram_alignment_bytes {a}"
        )
    chips = raw.get("chips", 1)
    if not isinstance(chips, int) or chips <= 0:
        raise ValueError(f"{path}: field 'chips' must be a positive int, got {chips!r}")
    return DeviceProfile(
        name=raw["name"],
        arch=raw["arch"],
        num_banks=nb,
        bank_size_bytes=raw["bank_size_bytes"],
        dram_alignment_bytes=a,
        bank_offsets=tuple(raw["bank_offsets"]),
        bank_channels=tuple(raw["bank_channels"]),
        dram_unreserved_base=base,
        chips=chips,
    )
