"""Tensor parallelism end to end (GG-Direct): real vLLM engines with
``--tensor-parallel-size`` on either side, HawkConnector pulling each decode rank's KV
heads from the prefill ranks that hold them (:mod:`vllm_hawk.layout.tp`).

Configurations (prefill TP -> decode TP), one cluster each, all with the tiny float32
Llama (4 KV heads): 2 -> 2 (rank to rank), 2 -> 1 (the decode pulls two shards into
one cache), 1 -> 2 (each decode rank pulls half the heads of the one prefill rank: two
shares of one request). For every request:

* greedy tokens equal the decode server's own run (no transfer), modulo top-2 ties;
* the KV bytes every decode rank holds after the pull equal the prefill ranks' K/V of
  the same heads (debug dumps of both sides, ``HAWK_DEBUG_DIR``);
* afterwards both engines are idle: no held request, ring range or pull on any rank.

Slow (each cluster starts 2-4 vLLM workers on 2 cores): marked ``tp``.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_pd_serving import TIE_MARGIN, _complete, greedy_divergence
from vllm_hawk.testing.local_cluster import wait_idle

pytestmark = [pytest.mark.vllm, pytest.mark.tp]

KV_HEADS = 4
BLOCK = 32
PAIRS = [(2, 2), (2, 1), (1, 2)]


@pytest.fixture(scope="module", params=PAIRS, ids=[f"P{p}-D{d}" for p, d in PAIRS])
def cluster(request, tmp_path_factory):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    from vllm_hawk.testing.local_cluster import LocalCluster
    from vllm_hawk.testing.tiny_model import build_tiny_llama

    p_tp, d_tp = request.param
    work = tmp_path_factory.mktemp(f"tp-p{p_tp}-d{d_tp}")
    dump = work / "hawk-debug"
    c = LocalCluster(build_tiny_llama(dtype="float32", kv_heads=KV_HEADS), work, block_size=BLOCK,
                     max_model_len=512, max_num_seqs=4, prefill_tp=p_tp, decode_tp=d_tp,
                     extra_config={"pull_timeout_s": 20.0, "handshake_timeout_s": 5.0},
                     prefill_config={"lease_s": 30.0}, extra_env={"HAWK_DEBUG_DIR": str(dump)})
    c.hawk_dump = dump
    t0 = time.monotonic()
    c.start()
    c.start_s = time.monotonic() - t0
    try:
        yield c
    finally:
        c.stop()
        assert c.leftover_processes() == [], "processes left after stop()"


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(11)
    return [[0] + [rng.randrange(2, 1024) for _ in range(n - 1)] for n in (5, 33, 64, 100, 200)]


def _shard(kv_per_rank: list, tp: int) -> torch.Tensor:
    """K or V of all heads ``[n, H, N, D]`` from per-rank dumps (rank order; with fewer
    heads than ranks, a rank's single head is a replica)."""
    if tp <= KV_HEADS:
        return torch.cat(kv_per_rank, dim=1)
    return torch.cat(kv_per_rank[:: tp // KV_HEADS], dim=1)


def _check_bytes(c, rid: str, p_tp: int, d_tp: int, n_tokens: int) -> None:
    d = Path(c.hawk_dump)
    tag = lambda tp, r: f"-r{r}" if tp > 1 else ""  # noqa: E731
    pre = [torch.load(d / f"prefill-{rid}{tag(p_tp, r)}.pt") for r in range(p_tp)]
    dec = [torch.load(d / f"decode-{rid}{tag(d_tp, r)}.pt") for r in range(d_tp)]
    n_blocks = len(dec[0]["dst_blocks"])
    for layer in range(len(pre[0]["kv"])):
        for kv in (0, 1):
            src = _shard([p["kv"][layer][kv][-n_blocks:] for p in pre], p_tp)
            dst = _shard([x["kv"][layer][kv] for x in dec], d_tp)
            assert src.shape == dst.shape, (layer, kv, src.shape, dst.shape)
            # tokens past the prompt in the last block are not the prefill's to send
            s = src.permute(0, 2, 1, 3).reshape(-1, KV_HEADS, src.shape[-1])[:n_tokens]
            t = dst.permute(0, 2, 1, 3).reshape(-1, KV_HEADS, dst.shape[-1])[:n_tokens]
            assert torch.equal(s, t), f"{rid}: layer {layer} {'KV'[kv]} differs after the pull"


def test_tp_pair_serves_exactly(cluster, record_property):
    p_tp, d_tp = cluster.prefill_tp, cluster.decode_tp
    record_property("start_s", round(cluster.start_s, 1))
    ties, mismatches = [], []
    t0 = time.monotonic()
    for prompt in _prompts():
        got = _complete(cluster.proxy_url, prompt)
        ref = _complete(cluster.decode_url, prompt, logprobs=2)
        div = greedy_divergence(got["token_ids"], ref)
        if div is not None:
            (ties if div[1] < TIE_MARGIN else mismatches).append((len(prompt), *div))
    record_property("serve_s", round(time.monotonic() - t0, 1))
    record_property("ties", ties)
    assert not mismatches, f"P{p_tp}->D{d_tp}: greedy outputs differ beyond ties: {mismatches}"
    # every pull's bytes, on every rank
    d = Path(cluster.hawk_dump)
    tag = "-r0" if d_tp > 1 else ""
    landed = sorted(d.glob(f"decode-*{tag}.pt"))
    assert len(landed) >= len(_prompts()), [f.name for f in d.iterdir()]
    for f in landed:
        rid = f.name[len("decode-"):-len(f"{tag}.pt")]
        pf = d / f"prefill-{rid}{'-r0' if p_tp > 1 else ''}.pt"
        _check_bytes(cluster, rid, p_tp, d_tp, torch.load(pf)["num_tokens"])
    wait_idle(cluster, cluster.hawk_dump, 30.0)
