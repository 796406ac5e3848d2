"""``hawk bench accuracy``'s per-layer part on the shipped tiny Llama (no engine), and the
accuracy contract it feeds (:mod:`vllm_hawk.tenstorrent.kv_accuracy`).

The bench's prompt set on both shipped models (bf16 and float32 weights) through the
product's transform, the emulated decode's read path and its attention: bf16-landed KV
gives PCC 1.0 against itself in every layer; bfloat8_b and bfloat4_b give the figures the
contract records from the bench (lowest per-layer PCC and lowest single-prompt PCC, over
both models) within ``TOLERANCE``, and per layer bf16 >= bfloat8_b >= bfloat4_b. The
warning fires for the format that misses the contract (bfloat4_b: greedy tokens change
beyond the tie margin) and for an unmeasured one, not for bfloat16 or bfloat8_b."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_hawk.bench import accuracy_greedy, accuracy_layers
from vllm_hawk.tenstorrent.emulated.config import ENV_KV_DTYPE
from vllm_hawk.tenstorrent.kv_accuracy import MEASURED, PCC_GATE, kv_dtype_warning, log_kv_dtype

#: the contract's figures are the bench's rounded to 6 decimals; bf16 matmuls of another
#: CPU (AMX or not) may round a K/V element differently, which moves a PCC by about 1e-5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def results():
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    prompts = accuracy_layers.prompt_set()
    return {
        m: accuracy_layers.layer_pcc(accuracy_layers.capture(build_tiny_llama(dtype=m), prompts))
        for m in ("bfloat16", "float32")
    }


def test_pcc_is_comp_pcc():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert accuracy_layers.pcc(x, x.clone()) == 1.0
    assert accuracy_layers.pcc(x, torch.zeros_like(x)) == 0.0
    assert accuracy_layers.pcc(x, 3 * x + 1) == pytest.approx(1.0, abs=1e-12)
    assert accuracy_layers.pcc(x, -x) == pytest.approx(-1.0, abs=1e-12)
    y = x + 0.5 * torch.randn(1000, generator=torch.Generator().manual_seed(1))
    want = torch.corrcoef(torch.stack([x, y]).double())[0, 1].item()
    assert accuracy_layers.pcc(x, y) == pytest.approx(want, abs=1e-12)


def test_bf16_against_itself_is_exact(results):
    for rows in results.values():
        bf16 = rows[0]
        assert bf16.dtype == "bfloat16"
        assert bf16.per_layer == [1.0] * len(bf16.per_layer) and bf16.worst_prompt == bf16.per_layer


@pytest.mark.parametrize("dtype", ["bfloat8_b", "bfloat4_b"])
def test_lossy_formats_give_the_recorded_figures(results, dtype):
    got = [r for rows in results.values() for r in rows if r.dtype == dtype]
    assert min(r.min for r in got) == pytest.approx(MEASURED[dtype].min_layer_pcc, abs=TOLERANCE)
    assert min(min(r.worst_prompt) for r in got) == pytest.approx(MEASURED[dtype].worst_prompt_pcc, abs=TOLERANCE)


def test_per_layer_order_bf16_bfp8_bfp4(results):
    for rows in results.values():
        bf16, bfp8, bfp4 = (r.per_layer for r in rows)
        assert all(a >= b >= c for a, b, c in zip(bf16, bfp8, bfp4, strict=True)), (bf16, bfp8, bfp4)


def test_warning_fires_where_the_contract_is_missed(caplog):
    assert kv_dtype_warning("bfloat16", ENV_KV_DTYPE) is None
    assert kv_dtype_warning("bfloat8_b", ENV_KV_DTYPE) is None
    bfp4 = kv_dtype_warning("bfloat4_b", ENV_KV_DTYPE)
    assert bfp4 is not None and bfp4.startswith("KV tile format bfloat4_b (HAWK_TT_KV_DTYPE) is lossy")
    assert "no top-2 tie in 6 of 16 prompts" in bfp4 and "docs/tenstorrent.md#kv-accuracy" in bfp4
    assert "never measured" in kv_dtype_warning("float8", "the model's cache")
    # vLLM's logging config (once any test imported vllm) stops "vllm.*" records from
    # propagating to the root logger, where caplog listens: listen on the logger itself,
    # and only there, whichever test ran first
    logger = logging.getLogger("vllm.hawk.test_accuracy")
    logger.addHandler(caplog.handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            assert log_kv_dtype(logger, "bfloat16", ENV_KV_DTYPE) is None
            assert log_kv_dtype(logger, "bfloat4_b", ENV_KV_DTYPE) == bfp4
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, bfp4)]
    # the recorded figures: every format meets the PCC gate; only bfloat4_b changes greedy tokens
    assert all(m.min_layer_pcc >= PCC_GATE for m in MEASURED.values())
    assert [d for d, m in MEASURED.items() if m.shortfalls()] == ["bfloat4_b"]


def test_greedy_agreement_counts():
    ref = [{"tokens": [5, 6, 7, 8], "gaps": [1.0, 0.0, 1.0, 1.0]}, {"tokens": [1, 2, 3, 4], "gaps": [1.0] * 4}]
    same = [{"tokens": r["tokens"]} for r in ref]
    a = accuracy_greedy.agreement(ref, same, 0.01)
    assert (a["prefix"], a["overall"], a["decisive"], a["prompts_equal"]) == (1.0, 1.0, 1.0, 2)
    # prompt 0 diverges at a tie (position 1), prompt 1 beyond the margin (position 2), then rejoins
    got = [{"tokens": [5, 9, 7, 8]}, {"tokens": [1, 2, 0, 4]}]
    a = accuracy_greedy.agreement(ref, got, 0.01)
    assert (a["prefix"], a["overall"]) == (3 / 8, 6 / 8)
    assert a["decisive"] == 3 / 4  # decisive positions up to the divergences: prompt 0 (0), prompt 1 (0, 1, 2)
    assert (a["prompts_equal"], a["divergences_at_ties"]) == (0, 1)
    assert [p["first_divergence"] for p in a["per_prompt"]] == [1, 2]
