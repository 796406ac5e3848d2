"""The Tenstorrent decode's landing route (vllm_hawk/tenstorrent/route.py) on every branch:
the NIC path chosen when the device allows it, the fallback named when it refuses, the
windows held elsewhere named. The route code, TtKmdDevice.open / find_device and the window
plan are real; tt-kmd itself is the FAKE of tests/tt_kmd_fakes.py, below the ioctl boundary
(each fake method is one ioctl or mmap, with the driver's rules)."""

from __future__ import annotations

import pytest
from tt_kmd_fakes import FakeTlbDevice, FakeTlbPool, hold_like_tt_metal

from vllm_hawk.npu.tt_kmd.topology import Arch
from vllm_hawk.tenstorrent.route import ChipLink, RouteRefused, choose_route

MiB, GiB = 1 << 20, 1 << 30
P150_KV_SPAN = 0xFF000000 - 0x100080  # a cache filling a p150a bank
RECV = 8 * MiB  # 64 MiB of receive buffers over 8 banks


def opener(pool: FakeTlbPool, **kw):
    """What TtKmdDevice.open(pci, dev_root) returns: a fresh FAKE fd on the device's pool."""
    return lambda pci, dev_root: FakeTlbDevice(pool=pool, **kw)


ONE_CHIP = (ChipLink(0, 0),)


def route(mode="staged", *, arch="blackhole", banks=8, chips=ONE_CHIP, span=P150_KV_SPAN, **kw):
    base = 0x100040 if arch == "wormhole" else 0x100080  # dram_unreserved_base: the cache and buffers start there
    return choose_route(
        mode,
        arch,
        banks,
        chips,
        kv_span_per_bank=span,
        recv_bytes_per_bank=RECV,
        kv_base_per_bank=base,
        recv_base_per_bank=base,
        **kw,
    )


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_on_the_simulator_the_host_stages_and_says_why(mode):
    r = route(mode, simulator="/x/libttsim.so", open_device=lambda *a: pytest.fail("no device to open"))
    assert (r.path, r.mode) == ("host-staged", "staged")
    assert "TT_METAL_SIMULATOR=/x/libttsim.so" in r.reason and "simulation devices" in r.reason
    assert (f"mode {mode} was asked for" in r.describe()) == bool(r.reason)


def test_chips_without_a_pcie_bar_refuse_direct_and_stage_through_the_host():
    links = (ChipLink(0, 0), ChipLink(1, None))  # an n300: chip 1 is reached over Ethernet
    with pytest.raises(RouteRefused, match=r"mesh chip\(s\) \[1\] have no PCIe BAR"):
        route("direct", arch="wormhole", banks=12, chips=links, open_device=opener(FakeTlbPool()))
    r = route("staged", arch="wormhole", banks=12, chips=links, open_device=opener(FakeTlbPool()))
    assert r.path == "host-staged" and "[1] have no PCIe BAR" in r.reason


def test_no_device_node_is_named(tmp_path):
    r = route("direct", dev_root=str(tmp_path))  # the real TtKmdDevice.open: no /dev/tenstorrent here
    assert r.path == "host-staged" and "mesh chip 0" in r.reason and "tenstorrent" in r.reason


def test_a_driver_without_dmabuf_export_is_named():
    r = route("staged", open_device=opener(FakeTlbPool(), driver_version=(2, 9, 0)))
    assert r.path == "host-staged" and "tt-kmd 2.9.0 cannot export" in r.reason and ">= 2.10.0" in r.reason


def test_p150_staged_goes_through_2mib_windows_next_to_tt_metal():
    pool = FakeTlbPool()
    tt_metal = hold_like_tt_metal(pool)
    try:
        r = route("staged", open_device=opener(pool))
    finally:
        tt_metal.close()
    assert (r.path, r.reason) == ("nic-staged", "")
    assert (r.windows.window_bytes, r.windows.windows_per_bank, r.windows.num_banks) == (2 * MiB, 5, 8)
    assert pool.owner == {}  # the trial allocation gave every window back


def test_p150_direct_falls_back_to_staged_naming_tt_metals_windows():
    pool = FakeTlbPool()
    tt_metal = hold_like_tt_metal(pool)
    try:
        r = route("direct", open_device=opener(pool))
    finally:
        tt_metal.close()
    assert r.path == "nic-staged" and r.windows.window_bytes == 2 * MiB
    assert "direct windows refused" in r.reason and "held by tt-metal (configure_static_tlbs" in r.reason
    assert "mode direct was asked for" in r.describe()


def test_direct_runs_when_4gib_windows_are_free():
    """A p100 (7 channels: tt-metal maps no DRAM window) has its 4 GiB windows free."""
    pool = FakeTlbPool()
    r = route("direct", banks=7, open_device=opener(pool))
    assert (r.path, r.mode, r.reason) == ("nic-direct", "direct", "")
    assert (r.windows.window_bytes, r.windows.total) == (4 * GiB, 7)


def test_windows_taken_beyond_the_plan_are_named_with_their_holder(tmp_path):
    """Another process holds more 2 MiB windows than tt-metal would: the plan fits on paper,
    the trial allocation gets ENOMEM, and the driver's error names who holds the device."""
    node = tmp_path / "tenstorrent0"
    node.write_bytes(b"")
    pool = FakeTlbPool()
    other = FakeTlbDevice(pool=pool, path=node)
    try:
        for _ in range(201 - 30):
            other.allocate_tlb(2 * MiB)
        r = route("staged", open_device=opener(pool, path=node))
    finally:
        other.close()
    assert r.path == "host-staged" and "staged windows refused: mesh chip 0: only 30 of the 40" in r.reason, r.reason
    assert f"{node}" in r.reason and "(pid " in r.reason  # this process holds the node open


def test_wormhole_direct_is_refused_by_window_size_and_staged_by_the_backend():
    """An n150: direct cannot map 1 GiB banks with 16 MiB windows; staged receive buffers
    would fit 16 MiB windows, but HAWK's tt-kmd backend maps Blackhole banks only, so the
    host stages, and the reason says both."""
    pool = FakeTlbPool(arch=Arch.WORMHOLE)
    span = (1 << 30) - 0x100040
    r = route("direct", arch="wormhole", banks=12, span=span, open_device=opener(pool, arch=Arch.WORMHOLE))
    assert r.path == "host-staged", r
    assert "largest window is 16 MiB" in r.reason
    assert "12 banks x 1 window of 16 MiB (staged) would fit" in r.reason and "Blackhole DRAM banks only" in r.reason


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode 'per_tile'"):
        route("per_tile")
