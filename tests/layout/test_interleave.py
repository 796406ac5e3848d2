"""Bank interleaving and the lockstep allocator (tt-metal BankManager semantics)."""

import pytest

from vllm_hawk.layout.device_profiles import available_profiles, load_profile
from vllm_hawk.layout.interleave import LockstepAllocator, OutOfDeviceMemory, page_location


@pytest.mark.parametrize("name,banks,align", [("p150a", 8, 64), ("p100", 7, 64), ("n150", 12, 32), ("n300", 12, 32)])
def test_profiles(name, banks, align):
    p = load_profile(name)
    assert (p.num_banks, p.dram_alignment_bytes) == (banks, align)
    assert len(p.bank_offsets) == banks
    if p.arch.startswith("wormhole"):
        assert p.bank_size_bytes == 1 << 30 and p.bank_offsets[1] == 0x40000000
        assert p.dram_unreserved_base == 0x100040  # measured on ttsim (tests/ttsim)
    else:
        assert p.bank_size_bytes == 0xFF000000
        assert p.dram_unreserved_base == 0x100080
    assert p.usable_bank_bytes == p.bank_size_bytes - p.dram_unreserved_base
    assert name in available_profiles()


def test_profile_errors_name_file_and_field(tmp_path):
    with pytest.raises(ValueError, match="available"):
        load_profile("p999")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\narch: blackhole\nnum_banks: 2\nbank_size_bytes: 4096\ndram_unreserved_base: 0\n"
        "dram_alignment_bytes: 48\nbank_offsets: [0, 0]\nbank_channels: [0, 1]\n"
    )
    with pytest.raises(ValueError, match=r"bad.yaml.*dram_alignment_bytes"):
        load_profile(bad)
    bad.write_text(
        "name: x\narch: blackhole\nnum_banks: 2\nbank_size_bytes: 4096\ndram_unreserved_base: 0\n"
        "dram_alignment_bytes: 64\nbank_offsets: [0]\nbank_channels: [0, 1]\n"
    )
    with pytest.raises(ValueError, match="bank_offsets"):
        load_profile(bad)
    bad.write_text(
        "name: x\narch: blackhole\nnum_banks: 2\nbank_size_bytes: 4096\ndram_unreserved_base: 0x48\n"
        "dram_alignment_bytes: 64\nbank_offsets: [0, 0]\nbank_channels: [0, 1]\n"
    )
    with pytest.raises(ValueError, match=r"bad.yaml.*dram_unreserved_base.*0x48"):
        load_profile(bad)
    bad.write_text(
        "name: x\narch: blackhole\nnum_banks: 2\nbank_size_bytes: 4096\n"
        "dram_alignment_bytes: 64\nbank_offsets: [0, 0]\nbank_channels: [0, 1]\n"
    )
    with pytest.raises(ValueError, match=r"bad.yaml.*missing field 'dram_unreserved_base'"):
        load_profile(bad)


def test_page_location():
    assert page_location(0, 8, 1088) == (0, 0)
    assert page_location(7, 8, 1088) == (7, 0)
    assert page_location(8, 8, 1088) == (0, 1088)
    assert page_location(29, 12, 2048) == (5, 4096)


def test_lockstep_sizes_first_fit_and_merge():
    a = LockstepAllocator(load_profile("p150a"), bank_size_bytes=1 << 20)
    x = a.allocate(num_pages=9, page_nbytes=1000)  # 2 pages per bank, aligned 1024
    assert (x.address, x.size_per_bank) == (0, 2048)
    y = a.allocate(8, 4096)
    z = a.allocate(1, 64)
    assert y.address == 2048 and z.address == 2048 + 4096
    a.free(y.address)
    assert a.allocate(1, 100).address == 2048  # first fit, bottom-up
    a.free(x.address)
    a.free(2048)
    a.free(z.address)
    assert a.free_bytes() == 1 << 20 and a.largest_free() == 1 << 20  # neighbours merged


def test_oom_message_says_what_was_asked_and_free():
    a = LockstepAllocator(load_profile("n150"), bank_size_bytes=64 << 10)
    a.allocate(12 * 30, 2048)  # 30 pages per bank = 61440 B
    with pytest.raises(
        OutOfDeviceMemory, match=r"cannot allocate 6144 B per bank x 12 banks.*4096 B free per bank of 65536"
    ):
        a.allocate(36, 2048)
    with pytest.raises(ValueError, match="no allocation"):
        a.free(12345)


def test_device_allocator_starts_at_the_unreserved_base():
    for name, base in (("p150a", 0x100080), ("n150", 0x100040)):
        p = load_profile(name)
        a = LockstepAllocator.for_device(p)
        assert a.allocate(p.num_banks, 2048).address == base
        assert a.capacity == p.bank_size_bytes - base == p.usable_bank_bytes


def test_first_fit_takes_the_lowest_hole_even_when_a_tighter_one_exists():
    """tt-metal 0.81.1 (measured on ttsim): a 2 KiB buffer goes into the low 64 KiB hole,
    not the higher 4 KiB one."""
    a = LockstepAllocator(load_profile("p150a"), 1 << 20)
    big = a.allocate_per_bank(64 << 10)
    a.allocate_per_bank(1024)
    small = a.allocate_per_bank(4096)
    a.allocate_per_bank(1024)
    a.free(big.address)
    a.free(small.address)
    assert a.allocate_per_bank(2048).address == big.address
    assert [(x, z, u) for x, z, u in a.blocks()][:2] == [(0, 2048, True), (2048, (64 << 10) - 2048, False)]
