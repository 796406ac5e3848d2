"""``hawk layout --prefill-tp P --decode-tp D``: per decode chip, the prefill ranks and heads
it pulls and each pull's bytes, bytes per DRAM bank, segments and READs (pure)."""

import numpy as np
import pytest

from vllm_hawk.layout.tp import TPMismatch
from vllm_hawk.layout_report import build_layout, layout_report, main, pull_figures
from vllm_hawk.transform.plan import make_plan

TOKENS = 1024  # 16 blocks of 64
# llama-3.1-70b: 8 KV heads, 80 layers, head_dim 128; p150a: 8 DRAM banks; bfloat8_b tiles of 1088 B
TILES_PER_HEAD = 2 * 4  # (64 tokens / 32) x (128 dims / 32) per block
HEAD_NBYTES = 16 * TILES_PER_HEAD * 160 * 1088  # one head of the request, all layers, K and V, in G'


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, sources",
    [
        (4, 4, [[(0, 0, 2)], [(1, 2, 2)], [(2, 4, 2)], [(3, 6, 2)]]),
        (4, 2, [[(0, 0, 2), (1, 2, 2)], [(2, 4, 2), (3, 6, 2)]]),
        (2, 4, [[(0, 0, 2)], [(0, 2, 2)], [(1, 4, 2)], [(1, 6, 2)]]),
        (8, 4, [[(0, 0, 1), (1, 1, 1)], [(2, 2, 1), (3, 3, 1)], [(4, 4, 1), (5, 5, 1)], [(6, 6, 1), (7, 7, 1)]]),
        (1, 1, [[(0, 0, 8)]]),
    ],
)
def test_each_chip_pulls_its_heads_from_the_prefill_ranks_holding_them(prefill_tp, decode_tp, sources):
    r = layout_report(prefill_tp=prefill_tp, decode_tp=decode_tp, tokens=TOKENS)
    assert (r["prefill_tp"], r["decode_tp"], r["kv_heads_per_rank"]) == (prefill_tp, decode_tp, 8 // decode_tp)
    assert len(r["chips"]) == decode_tp
    for chip, want in zip(r["chips"], sources, strict=False):
        assert [(p["prefill_rank"], p["heads"][0], p["heads"][1] - p["heads"][0]) for p in chip["pulls"]] == want
        for p in chip["pulls"]:  # every pull: its heads' bytes, spread evenly over the 8 banks, one segment each
            n = p["heads"][1] - p["heads"][0]
            assert p["target_bytes"] == n * HEAD_NBYTES and set(p["bytes_per_bank"]) == {n * HEAD_NBYTES // 8}
            assert p["segments"] == p["reads_staged"] == 8
            assert p["source_bf16_bytes"] == TOKENS * 2 * 80 * n * 128 * 2
        assert chip["target_bytes"] == r["target_bytes"] == (8 // decode_tp) * HEAD_NBYTES
        assert chip["max_bytes_per_bank"] == chip["target_bytes"] // 8
        assert chip["segments"] == chip["reads_staged"] == 8 * len(chip["pulls"])
    t = r["totals"]
    assert t["target_bytes"] == 8 * HEAD_NBYTES and t["pulls"] == sum(map(len, sources))
    assert t["segments"] == 8 * t["pulls"]
    assert sum(p["pulls_served"] for p in r["prefill_ranks"]) == t["pulls"]


def test_a_whole_chip_pull_has_the_transfer_plans_figures():
    """pull_figures over all of a chip's heads = make_plan's (staged and direct), contiguous
    and fragmented block tables."""
    layout = build_layout("llama-3.1-70b", 4, "p150a", "bfloat8_b", 64, 1024)
    for blocks in (np.arange(1, 17), np.arange(1, 33, 2)):
        f = pull_figures(layout, blocks, 0, 2)
        staged, direct = make_plan(layout, blocks, "staged"), make_plan(layout, blocks, "direct")
        assert f["bytes_per_bank"] == [int(b) for b in staged.segment_nbytes]
        assert f["reads_staged"] == len(staged.rdma) and f["reads_direct"] == len(direct.rdma)


def test_a_part_of_a_chip_moves_its_share():
    layout = build_layout("llama-3.1-70b", 2, "p150a", "bfloat8_b", 64, 1024)
    blocks = np.arange(1, 17)
    halves = [pull_figures(layout, blocks, s, 2) for s in (0, 2)]
    whole = pull_figures(layout, blocks, 0, 4)
    assert [a + b for a, b in zip(*(h["bytes_per_bank"] for h in halves), strict=False)] == whole["bytes_per_bank"]
    assert all(h["reads_direct"] > whole["reads_direct"] / 2 for h in halves)  # a head subset breaks the runs


def test_mismatch_names_both_sizes():
    with pytest.raises(TPMismatch, match="prefill TP 3 -> decode TP 4 with 8 KV heads"):
        layout_report(prefill_tp=3, decode_tp=4)
    with pytest.raises(TPMismatch, match="prefill TP 4 -> decode TP 3"):
        layout_report(prefill_tp=4, decode_tp=3)


def test_cli_mismatch_is_one_line_and_exit_2(capsys):
    assert main(["--prefill-tp", "3", "--decode-tp", "4"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert "prefill TP 3 -> decode TP 4" in out.err and "Traceback" not in out.err


def test_cli_chips_alias_and_deprecated_tp(capsys):
    assert main(["--prefill-tp", "4", "--chips", "2", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "prefill TP=4 (2 KV heads/rank) -> decode TP=2: 2 x p150a" in out
    assert main(["--tp", "2", "--tokens", "64", "--json"]) == 0
    out = capsys.readouterr()
    assert "deprecated" in out.err and '"decode_tp": 2' in out.out and '"prefill_tp": 2' in out.out
    with pytest.raises(SystemExit):
        main(["--tp", "2", "--chips", "2"])
    with pytest.raises(SystemExit):
        main(["--chips", "0"])


def test_replicated_heads_are_named_with_their_serving_rank(capsys):
    # 8 KV heads over 16 prefill ranks: each head on two ranks; the lower one serves it
    r = layout_report(prefill_tp=16, decode_tp=4, tokens=TOKENS)
    assert r["replicated_heads"].startswith("head 0 on ranks 0-1 (served by 0); head 1 on ranks 2-3 (served by 2)")
    assert [p["pulls_served"] for p in r["prefill_ranks"]] == [1, 0] * 8
    assert layout_report(prefill_tp=4, decode_tp=4, tokens=TOKENS)["replicated_heads"] == ""
    assert main(["--prefill-tp", "16", "--decode-tp", "4", "--tokens", str(TOKENS)]) == 0
    assert (
        "replicated KV heads (fewer heads than prefill ranks): head 0 on ranks 0-1 (served by 0)"
        in capsys.readouterr().out
    )
