"""``hawk bench transfer``'s TP options, checked before any process starts (pure), and a
start that fails after its prefill processes began."""

import pytest

from vllm_hawk.bench import transfer_bench


def test_tp_mismatch_is_one_line_and_exit_2(capsys):
    assert transfer_bench.main(["--prefill-tp", "3", "--decode-tp", "4", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefill TP 3 -> decode TP 4 with 8 KV heads" in err and "Traceback" not in err


def test_gn_rows_with_more_prefill_ranks_than_chips_are_refused_naming_both(capsys):
    """A chip's heads from two prefill ranks: a Tenstorrent chip lands whole shards of one
    rank (as in the connector), so GN rows are refused; GG rows alone are planned."""
    assert transfer_bench.main(["--prefill-tp", "4", "--chips", "2", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefill TP 4 -> decode TP 2" in err and "prefill ranks [0, 1]" in err
    assert "--rows GG-Host GG-Direct" in err and "Traceback" not in err
    plans = transfer_bench.tp_plan("llama-3.1-70b", 4, 2, transfer_bench.GG_ROWS)
    assert [[(ps.prefill_rank, ps.dst_start, ps.count) for ps in p] for p in plans] == [
        [(0, 0, 2), (1, 2, 2)],
        [(2, 0, 2), (3, 2, 2)],
    ]


def test_default_is_the_papers_configuration():
    """Llama-3.1-70B, prefill TP=4 -> 4 chips: chip d pulls prefill rank d's two heads whole."""
    plans = transfer_bench.tp_plan("llama-3.1-70b", 4, 4)
    assert [[(ps.prefill_rank, ps.dst_start, ps.count, ps.share.num_heads) for ps in p] for p in plans] == [
        [(d, 0, 2, 0)] for d in range(4)
    ]
    with pytest.raises(SystemExit):  # --tp is deprecated and sets both sides alone
        transfer_bench.main(["--tp", "4", "--chips", "4"])


def test_fewer_prefill_ranks_than_chips_split_one_rank_over_chips():
    """Prefill TP=2 -> 4 chips: each rank's four heads serve two chips, two heads each."""
    plans = transfer_bench.tp_plan("llama-3.1-70b", 2, 4)
    got = [
        [(ps.prefill_rank, ps.share.head_start, ps.share.num_heads, ps.share.consumers, ps.share.index) for ps in p]
        for p in plans
    ]
    assert got == [[(0, 0, 2, 2, 0)], [(0, 2, 2, 2, 1)], [(1, 0, 2, 2, 0)], [(1, 2, 2, 2, 1)]]


def test_a_failed_start_stops_every_prefill_process():
    """A bad device profile is found only after both prefill ranks' processes were started:
    ``run`` raises naming it, and stops them (none is left to run on)."""
    import multiprocessing as mp

    before = set(mp.active_children())  # whatever earlier tests left is not this test's business
    with pytest.raises(Exception, match="no-such-device"):
        transfer_bench.run(prefill_tp=2, decode_tp=2, device_profile="no-such-device", sizes_mb=[1], repeats=1)
    assert set(mp.active_children()) - before == set()
