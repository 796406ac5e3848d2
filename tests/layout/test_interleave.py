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
    else:
        assert p.bank_size_bytes == 0xFF000000
    assert name in available_profiles()


def test_profile_errors_name_file_and_field(tmp_path):
    with pytest.raises(ValueError, match="available"):
        load_profile("p999")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\narch: blackhole\nnum_banks: 2\nbank_size_bytes: 4096\n"
                   "dram_alignment_bytes: 48\nbank_offsets: [0, 0]\nbank_channels: [0, 1]\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*dram_alignment_bytes"):
        load_profile(bad)
    bad.write_text("name: x\narch: blackhole\nnum_banks: 2\nbank_size_bytes: 4096\n"
                   "dram_alignment_bytes: 64\nbank_offsets: [0]\nbank_channels: [0, 1]\n")
    with pytest.raises(ValueError, match="bank_offsets"):
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
    with pytest.raises(OutOfDeviceMemory, match=r"cannot allocate 6144 B per bank x 12 banks.*4096 B free per bank"):
        a.allocate(36, 2048)
    with pytest.raises(ValueError, match="no allocation"):
        a.free(12345)
