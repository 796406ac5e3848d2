"""Pure tt-kmd parts: Blackhole bank -> NOC endpoints, TLB window arithmetic, arch errors,
and the error raised when /dev/tenstorrent is absent. No device, no fakes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from vllm_hawk.npu.tt_kmd import sysfs
from vllm_hawk.npu.tt_kmd.device import TtDeviceNotFoundError, TtKmdDevice, find_device
from vllm_hawk.npu.tt_kmd.topology import (
    BLACKHOLE_DRAM_BANK_BYTES,
    BLACKHOLE_DRAM_NOC0,
    BLACKHOLE_TLB_4G_WINDOW_BYTES,
    Arch,
    CoordSystem,
    UnsupportedArchError,
    arch_from_pci_device_id,
    bar4_window_count,
    blackhole_bank_channels,
    blackhole_bank_endpoint,
    blackhole_dram_translated,
    plan_tlb_window,
    require_blackhole,
)

GiB = 1 << 30
PAGE = 4096


def test_pci_ids_map_to_arches() -> None:
    assert arch_from_pci_device_id(0xB140) is Arch.BLACKHOLE
    assert arch_from_pci_device_id(0x401E) is Arch.WORMHOLE
    with pytest.raises(ValueError, match="0xfaca"):
        arch_from_pci_device_id(0xFACA)


def test_wormhole_is_refused_naming_the_window_size_not_the_export() -> None:
    require_blackhole(Arch.BLACKHOLE)
    with pytest.raises(UnsupportedArchError) as info:
        require_blackhole(Arch.WORMHOLE)
    text = str(info.value)
    assert "tt-kmd exports Wormhole TLB windows as dma-bufs too" in text and "cannot export" not in text
    assert "1 MiB, 2 MiB, 16 MiB (BAR0) against DRAM banks of 1 GiB" in text
    assert "staged receive buffers of at most 16 MiB per bank" in text


def test_unharvested_bank0_port0_is_the_tile_tt_kmd_demo_targets() -> None:
    # tt-kmd tools/rdma/nic_bh_p2p_dma.c aims its window at translated (17, 12).
    ep = blackhole_bank_endpoint(0)
    assert (ep.x, ep.y, ep.noc, ep.coords) == (17, 12, 0, CoordSystem.TRANSLATED)


def test_unharvested_translated_layout() -> None:
    table = blackhole_dram_translated(0)
    assert len(table) == 8
    for bank, ports in enumerate(table):
        x = 17 if bank < 4 else 18
        y0 = 12 + 3 * (bank % 4)
        assert ports == ((x, y0), (x, y0 + 1), (x, y0 + 2))


def test_noc0_endpoints_are_the_soc_descriptor_table() -> None:
    assert blackhole_bank_endpoint(0, coords=CoordSystem.NOC0).x == 0
    assert (
        blackhole_bank_endpoint(5, port=2, coords=CoordSystem.NOC0).x,
        blackhole_bank_endpoint(5, port=2, coords=CoordSystem.NOC0).y,
    ) == (9, 3)
    # tt-metal's preferred worker endpoint of every channel is port 2.
    assert [BLACKHOLE_DRAM_NOC0[c][2] for c in range(8)] == [
        (0, 11),
        (0, 3),
        (0, 8),
        (0, 6),
        (9, 11),
        (9, 3),
        (9, 8),
        (9, 6),
    ]
    flat = [xy for ch in BLACKHOLE_DRAM_NOC0 for xy in ch]
    assert len(set(flat)) == 24 and {x for x, _ in flat} == {0, 9}


@pytest.mark.parametrize("channel", range(8))
def test_one_harvested_channel_leaves_seven_distinct_banks(channel: int) -> None:
    mask = 1 << channel
    assert blackhole_bank_channels(mask) == [c for c in range(8) if c != channel]
    table = blackhole_dram_translated(mask)
    assert len(table) == 7
    flat = [xy for ports in table for xy in ports]
    assert len(set(flat)) == 21
    # 4 banks fill column 17 (y 12..23); 3 banks take column 18 y 12..20, the harvested
    # channel keeps 18/21..23 (tt-umd fill_dram_noc0_translated_mapping).
    assert sorted(xy for xy in flat if xy[0] == 17) == [(17, y) for y in range(12, 24)]
    assert sorted(xy for xy in flat if xy[0] == 18) == [(18, y) for y in range(12, 21)]
    # NOC0 endpoints skip the harvested channel.
    assert blackhole_bank_endpoint(channel if channel < 7 else 6, coords=CoordSystem.NOC0, harvest_mask=mask).x in (
        0,
        9,
    )


def test_harvesting_masks_that_blackhole_cannot_have() -> None:
    with pytest.raises(ValueError, match="at most one"):
        blackhole_bank_channels(0b11)
    with pytest.raises(ValueError, match="beyond 8 channels"):
        blackhole_bank_channels(1 << 8)
    with pytest.raises(ValueError, match="7 DRAM banks"):
        blackhole_bank_endpoint(7, harvest_mask=1)
    with pytest.raises(ValueError, match="port 3"):
        blackhole_bank_endpoint(0, port=3)


def test_window_plan_inside_a_bank() -> None:
    plan = plan_tlb_window(0x1234_5640, 10_000, BLACKHOLE_TLB_4G_WINDOW_BYTES, PAGE)
    assert plan.window_base == 0
    assert plan.offset == 0x1234_5640
    assert plan.export_offset == 0x1234_5000
    assert plan.map_length == 0x1234_5640 + 10_000 + (-(0x1234_5640 + 10_000)) % PAGE
    assert plan.map_length % PAGE == 0 and plan.export_size % PAGE == 0
    assert plan.export_offset + plan.dmabuf_offset == plan.offset
    assert plan.export_offset + plan.export_size >= plan.offset + plan.nbytes


def test_window_plan_whole_bank_and_aligned_base() -> None:
    plan = plan_tlb_window(0, BLACKHOLE_DRAM_BANK_BYTES, BLACKHOLE_TLB_4G_WINDOW_BYTES, PAGE)
    assert (plan.offset, plan.map_length, plan.export_offset, plan.export_size, plan.dmabuf_offset) == (
        0,
        BLACKHOLE_DRAM_BANK_BYTES,
        0,
        BLACKHOLE_DRAM_BANK_BYTES,
        0,
    )
    high = plan_tlb_window(5 * GiB + 64, 64, 4 * GiB, PAGE)
    assert high.window_base == 4 * GiB and high.offset == GiB + 64


def test_window_plan_rejects_ranges_crossing_a_window() -> None:
    with pytest.raises(ValueError, match="crosses"):
        plan_tlb_window(4 * GiB - 64, 128, 4 * GiB, PAGE)
    with pytest.raises(ValueError, match="power of two"):
        plan_tlb_window(0, 1, 3 * GiB, PAGE)
    with pytest.raises(ValueError, match="nbytes > 0"):
        plan_tlb_window(0, 0, 4 * GiB, PAGE)


def test_bar4_window_count() -> None:
    assert bar4_window_count(32 * GiB) == 8
    assert bar4_window_count(64 * GiB) == 8
    assert bar4_window_count(6 * GiB) == 1  # partial windows are not exposed
    assert bar4_window_count(0) == 0


def test_absent_dev_tenstorrent_names_path_and_fix(tmp_path: Path) -> None:
    with pytest.raises(TtDeviceNotFoundError) as info:
        find_device(root=tmp_path)
    assert info.value.errno == errno.ENOENT
    msg = str(info.value)
    assert str(tmp_path / "dev/tenstorrent") in msg and "tt-kmd" in msg and "modprobe tenstorrent" in msg
    with pytest.raises(TtDeviceNotFoundError, match="tt-kmd"):
        TtKmdDevice(tmp_path / "dev/tenstorrent/0")


def test_this_machine_has_no_tenstorrent_device() -> None:
    if sysfs.device_ordinals():
        pytest.skip("a Tenstorrent device is present")
    with pytest.raises(TtDeviceNotFoundError, match="/dev/tenstorrent"):
        TtKmdDevice.open()


def test_missing_ordinal_lists_the_present_ones(tmp_path: Path) -> None:
    (tmp_path / "dev/tenstorrent").mkdir(parents=True)
    (tmp_path / "dev/tenstorrent/0").touch()
    (tmp_path / "dev/tenstorrent/by-id").mkdir()
    assert sysfs.device_ordinals(tmp_path) == [0]
    assert find_device(root=tmp_path) == tmp_path / "dev/tenstorrent/0"
    with pytest.raises(TtDeviceNotFoundError, match=r"holds only \[0\]"):
        find_device(3, root=tmp_path)


def test_sysfs_resource_and_version_parsing() -> None:
    text = "\n".join(
        [
            "0x0000000090000000 0x000000009fffffff 0x000000000014220c",
            "0x0000000000000000 0x0000000000000000 0x0000000000000000",
            "0x00000000a0000000 0x00000000a00fffff 0x0000000000040200",
            "0x0000000000000000 0x0000000000000000 0x0000000000000000",
            "0x0000002000000000 0x00000027ffffffff 0x000000000014220c",
        ]
    )
    sizes = sysfs.parse_resource_file(text)
    assert sizes[0] == 256 << 20 and sizes[1] == 0 and sizes[4] == 32 * GiB
    assert sysfs.parse_version("2.10.1-pre") == (2, 10, 1)
    assert sysfs.parse_version("1.34") is None
