"""plan_route_windows on every branch: the four device profiles in both modes, windows held
by tt-metal (default and given), alignment of the span, and the refusal texts."""

from __future__ import annotations

import pytest

from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.npu.tt_kmd.topology import Arch
from vllm_hawk.npu.tt_kmd.window_plan import (
    DEVICE_WINDOWS,
    PLAN_PROFILES,
    RouteWindows,
    WindowsRefused,
    plan_route_windows,
    plan_table,
    tt_metal_held_windows,
    windows_covering,
)

MiB, GiB = 1 << 20, 1 << 30
BH_BANK, WH_BANK = 0xFF000000, 1 << 30
BASE_BH, BASE_WH = 0x100080, 0x100040


def test_device_windows_are_tt_kmds_pools_less_the_kernels_window() -> None:
    assert {
        "blackhole": {2 * MiB: 201, 4 * GiB: 8},
        "wormhole": {1 * MiB: 156, 2 * MiB: 10, 16 * MiB: 19},
    } == DEVICE_WINDOWS


def test_tt_metal_holds_the_4g_windows_only_with_all_eight_dram_channels() -> None:
    assert tt_metal_held_windows("blackhole", 8) == {2 * MiB: 156, 4 * GiB: 8}
    assert tt_metal_held_windows("blackhole", 7) == {2 * MiB: 156, 4 * GiB: 0}  # p100: channel harvested
    assert tt_metal_held_windows("wormhole_b0", 12) == {1 * MiB: 98, 2 * MiB: 0, 16 * MiB: 0}
    assert tt_metal_held_windows(Arch.WORMHOLE, 12) == tt_metal_held_windows("wormhole", 12)
    with pytest.raises(ValueError, match="grayskull"):
        tt_metal_held_windows("grayskull", 8)


def test_p150_staged_takes_2m_windows_next_to_tt_metal() -> None:
    plan = plan_route_windows("blackhole", "staged", 8, 1 * MiB, base_per_bank=2 * MiB)
    assert plan == RouteWindows("blackhole", "staged", 2 * MiB, 1, 8)
    assert plan.total == 8 and plan.describe() == "8 banks x 1 window of 2 MiB (staged)"


def test_alignment_of_the_span_counts_windows() -> None:
    # 1 MiB from 0x100080 crosses the 2 MiB boundary at 0x200000: two windows per bank
    plan = plan_route_windows("blackhole", "staged", 8, 1 * MiB, base_per_bank=BASE_BH)
    assert (plan.window_bytes, plan.windows_per_bank) == (2 * MiB, 2)
    assert plan.describe() == "8 banks x 2 windows of 2 MiB (staged)"
    assert windows_covering(0, 2 * MiB, 2 * MiB) == 1
    assert windows_covering(1, 2 * MiB, 2 * MiB) == 2
    assert windows_covering(2 * MiB - 1, 2, 2 * MiB) == 2


def test_p150_direct_is_refused_naming_tt_metals_dram_windows() -> None:
    with pytest.raises(WindowsRefused) as info:
        plan_route_windows("blackhole", "direct", 8, BH_BANK - BASE_BH, base_per_bank=BASE_BH)
    text = str(info.value)
    assert "8 of the 8 windows of 4 GiB are held by tt-metal" in text
    assert "configure_static_tlbs maps one per DRAM channel" in text
    assert "user-mode driver change" in text and "use mode staged" in text


def test_p150_direct_with_nothing_held_takes_one_4g_window_per_bank() -> None:
    plan = plan_route_windows("blackhole", "direct", 8, BH_BANK - BASE_BH, held={}, base_per_bank=BASE_BH)
    assert plan.describe() == "8 banks x 1 window of 4 GiB (direct)"


def test_p100_direct_finds_the_4g_windows_tt_metal_leaves() -> None:
    plan = plan_route_windows("blackhole", "direct", 7, BH_BANK - BASE_BH, base_per_bank=BASE_BH)
    assert plan == RouteWindows("blackhole", "direct", 4 * GiB, 1, 7)


def test_ties_go_to_the_smaller_window() -> None:
    # p100: 2 MiB and 4 GiB both need 1 window per bank; the 2 MiB pool is the one to draw from
    assert plan_route_windows("blackhole", "staged", 7, 64 << 10).window_bytes == 2 * MiB


def test_large_staged_buffers_exhaust_the_2m_windows_tt_metal_leaves() -> None:
    # 8 banks x 6 windows = 48 > 45 free 2 MiB windows; the 4 GiB ones are tt-metal's
    with pytest.raises(WindowsRefused, match="held by tt-metal.*ring_nbytes"):
        plan_route_windows("blackhole", "staged", 8, 12 * MiB)
    held = {2 * MiB: 201 - 10, 4 * GiB: 8}
    with pytest.raises(WindowsRefused, match=r"free: 10 of 2 MiB, 0 of 4 GiB"):
        plan_route_windows("blackhole", "staged", 8, 1 * MiB, held=held, base_per_bank=BASE_BH)


def test_n150_staged_takes_16m_windows_and_falls_back_to_smaller_ones() -> None:
    plan = plan_route_windows("wormhole", "staged", 12, 4 * MiB, base_per_bank=BASE_WH)
    assert plan.describe() == "12 banks x 1 window of 16 MiB (staged)"
    # 16 MiB windows taken by someone else: 1 MiB windows (5 per bank = 60 of the 58 free) do not
    # fit either, 2 MiB ones (3 x 12 = 36 > 10) neither -> refused; a small buffer fits 1 MiB ones
    held = {1 * MiB: 98, 2 * MiB: 0, 16 * MiB: 19}
    with pytest.raises(WindowsRefused):
        plan_route_windows("wormhole", "staged", 12, 4 * MiB, held=held, base_per_bank=BASE_WH)
    small = plan_route_windows("wormhole", "staged", 12, 256 << 10, held=held, base_per_bank=2 * MiB)
    assert (small.window_bytes, small.windows_per_bank) == (1 * MiB, 1)


def test_wormhole_direct_is_refused_by_the_window_size() -> None:
    for banks in (12,):
        with pytest.raises(WindowsRefused) as info:
            plan_route_windows("wormhole_b0", "direct", banks, WH_BANK - BASE_WH, base_per_bank=BASE_WH)
        assert "a Wormhole's largest window is 16 MiB, its banks hold 1 GiB" in str(info.value)
        assert "use mode staged" in str(info.value)


def test_blackhole_spans_beyond_every_window_name_the_arch_limit() -> None:
    with pytest.raises(WindowsRefused, match="blackhole's TLB windows cannot cover it"):
        plan_route_windows("blackhole", "staged", 8, 5 * GiB, held={})


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="mode 'fast'"):
        plan_route_windows("blackhole", "fast", 8, MiB)
    with pytest.raises(ValueError, match="span_per_bank > 0"):
        plan_route_windows("blackhole", "staged", 8, 0)
    with pytest.raises(ValueError, match="num_banks > 0"):
        plan_route_windows("wormhole", "staged", 0, MiB)


def test_plan_table_covers_the_four_profiles_in_both_modes() -> None:
    rows = {(r.profile, r.mode): r for r in plan_table([load_profile(n) for n in PLAN_PROFILES])}
    assert set(rows) == {(p, m) for p in PLAN_PROFILES for m in ("staged", "direct")}
    assert rows["p150a", "staged"].cell() == "8 banks x 5 windows of 2 MiB (staged)"
    assert rows["p150a", "direct"].plan is None and "held by tt-metal" in rows["p150a", "direct"].cell()
    assert rows["p100", "direct"].cell() == "7 banks x 1 window of 4 GiB (direct)"
    assert rows["n150", "staged"].cell() == "12 banks x 1 window of 16 MiB (staged)"
    assert "largest window is 16 MiB" in rows["n150", "direct"].cell()
    assert (rows["n300", "staged"].chips, rows["n300", "staged"].chips_reached) == (2, 1)
