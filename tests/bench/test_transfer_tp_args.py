"""``hawk bench transfer``'s TP options, checked before any process starts (pure)."""
import pytest

from vllm_hawk.bench import transfer_bench


def test_tp_mismatch_is_one_line_and_exit_2(capsys):
    assert transfer_bench.main(["--prefill-tp", "3", "--decode-tp", "4", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefill TP 3 -> decode TP 4 with 8 KV heads" in err and "Traceback" not in err


def test_heterogeneous_tp_is_refused_with_where_it_is_measured(capsys):
    assert transfer_bench.main(["--prefill-tp", "4", "--chips", "2", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefill TP 4 -> decode TP 2" in err and "e2e tests" in err


def test_default_is_the_papers_configuration():
    """Llama-3.1-70B, prefill TP=4 -> 4 chips: chip d pulls prefill rank d's two heads."""
    pulls = transfer_bench.tp_plan("llama-3.1-70b", 4, 4)
    assert [(p.prefill_rank, p.head, p.count) for p in pulls] == [(d, 2 * d, 2) for d in range(4)]
    with pytest.raises(SystemExit):  # --tp is deprecated and sets both sides alone
        transfer_bench.main(["--tp", "4", "--chips", "4"])
