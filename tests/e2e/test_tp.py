"""Tensor parallelism end to end: real vLLM engines with ``--tensor-parallel-size`` on
either side, HawkConnector pulling each decode rank's (or chip's) KV heads from the
prefill ranks that hold them (:mod:`vllm_hawk.layout.tp`, :mod:`vllm_hawk.kvflow.shares`).

Configurations (one cluster each, the tiny Llama with 4 KV heads):

* GG-Direct, float32: prefill TP 2 -> decode TP 2 (rank to rank), 2 -> 1 (the decode
  pulls two shards into one cache), 1 -> 2 (each decode rank pulls half of the one
  prefill rank's heads: two shares of one request);
* GN-HAWK, bf16 model: prefill TP 2 -> a decode on 2 emulated Wormhole chips (n300,
  bfloat8_b, direct: each prefill rank feeds its chip), and TP 1 -> 2 emulated
  Blackhole chips (p150a x 2, bf16, staged: the one rank transforms a G' per chip).

For every request:

* greedy tokens equal a single-engine run modulo top-2 ties (GG: the decode server
  asked directly; GN: the prefill server for bf16 KV, the decode server for bfloat8_b,
  as in ``test_gn_hawk``);
* the decode's KV after the pull equals the prefill ranks' K/V of the same heads: GG
  byte for byte, GN as ``tilize_pack`` of them in every chip's banks (debug dumps of
  both sides, ``HAWK_DEBUG_DIR``);
* afterwards both engines are idle: no held request, ring range or pull on any rank.

Slow (2-4 vLLM workers per cluster on 2 cores, about 50 s to start each): marked ``tp``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from e2e_helpers import GG_TIE_MARGIN, GN_TIE_MARGIN, complete, greedy_divergence, tt_transfer_blocks
from vllm_fixtures import http_post_json, running, token_prompts, wait_idle

pytestmark = [pytest.mark.vllm, pytest.mark.tp]

KV_HEADS = 4
BLOCK = 32
MAX_TOKENS = 10
CONFIGS = {
    "GG-P2-D2": dict(prefill_tp=2, decode_tp=2),
    "GG-P2-D1": dict(prefill_tp=2, decode_tp=1),
    "GG-P1-D2": dict(prefill_tp=1, decode_tp=2, decode_config={"prefill_tp": 1}),  # pairing checked at start-up
    "GN-P2-n300": dict(
        prefill_tp=2,
        tt={"device": "n300", "kv_dtype": "bfloat8_b", "chips": 2},
        mode="direct",
        decode_config={"prefill_tp": 2},
    ),
    "GN-P1-p150ax2": dict(prefill_tp=1, tt={"device": "p150a", "kv_dtype": "bfloat16", "chips": 2}, mode="staged"),
}
TIE_MARGIN = {"GG": GG_TIE_MARGIN, "GN": GN_TIE_MARGIN}  # GN: bf16 logits, see e2e_helpers


@pytest.fixture(scope="module", params=list(CONFIGS))
def cluster(request, tmp_path_factory):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    cfg = CONFIGS[request.param]
    gn = "tt" in cfg
    dtype = "bfloat16" if gn else "float32"
    work = tmp_path_factory.mktemp(request.param)
    dump = work / "hawk-debug"
    extra = {"pull_timeout_s": 60.0, "handshake_timeout_s": 30.0}  # 4-6 vLLM processes on 2 cores
    if gn:
        extra.update(mode=cfg["mode"], ring_nbytes=16 << 20)
    c = LocalCluster(
        build_tiny_llama(dtype=dtype, kv_heads=KV_HEADS),
        work,
        dtype=dtype,
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        prefill_tp=cfg["prefill_tp"],
        decode_tp=cfg.get("decode_tp", 1),
        decode_tt=cfg.get("tt"),
        extra_config=extra,
        prefill_config={"lease_s": 120.0},
        decode_config=cfg.get("decode_config", {}),
        extra_args=["--no-enable-prefix-caching"],
        extra_env={"HAWK_DEBUG_DIR": str(dump)},
    )
    c.hawk_name, c.hawk_cfg, c.hawk_dump = request.param, cfg, dump
    with running(c, request.param):
        yield c


def _prompts() -> list[list[int]]:
    return token_prompts(11, (5, 33, 64, 100, 200))


def _all_heads(parts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """K or V ``[n, H, N, D]`` from per-rank ``[n, H/tp, N, D]`` (rank order = head order;
    with more ranks than heads a rank's one head is a replica: every (tp/H)-th rank)."""
    return torch.cat(parts if tp <= KV_HEADS else parts[:: tp // KV_HEADS], dim=1)


def _prefill_kv(d: Path, rid: str, p_tp: int) -> tuple[list, int]:
    """Per layer (K, V) of all heads the prefill sent for ``rid`` and its token count."""
    ranks = [torch.load(d / (f"prefill-{rid}-r{r}.pt" if p_tp > 1 else f"prefill-{rid}.pt")) for r in range(p_tp)]
    kv = [
        tuple(_all_heads([x["kv"][layer][i] for x in ranks], p_tp) for i in (0, 1))
        for layer in range(len(ranks[0]["kv"]))
    ]
    return kv, ranks[0]["num_tokens"]


def _check_gg(c, rid: str) -> None:
    p_tp, d_tp = c.hawk_cfg["prefill_tp"], c.hawk_cfg["decode_tp"]
    d = Path(c.hawk_dump)
    src, n_tokens = _prefill_kv(d, rid, p_tp)
    dec = [torch.load(d / (f"decode-{rid}-r{r}.pt" if d_tp > 1 else f"decode-{rid}.pt")) for r in range(d_tp)]
    for layer, kv in enumerate(src):
        for i, name in enumerate("KV"):
            want = kv[i][-len(dec[0]["dst_blocks"]) :]
            got = _all_heads([x["kv"][layer][i] for x in dec], d_tp)
            assert want.shape == got.shape, (layer, name, want.shape, got.shape)
            # [n, H, N, D] -> tokens: only the prompt's tokens are the prefill's to send
            w = want.permute(0, 2, 1, 3).reshape(-1, KV_HEADS, want.shape[-1])[:n_tokens]
            g = got.permute(0, 2, 1, 3).reshape(-1, KV_HEADS, got.shape[-1])[:n_tokens]
            assert torch.equal(w, g), f"{rid}: layer {layer} {name} differs after the pull"


def _check_gn(c, rid: str) -> None:
    from vllm_hawk.layout.formats import tilize_pack

    d = Path(c.hawk_dump)
    src, _n = _prefill_kv(d, rid, c.hawk_cfg["prefill_tp"])
    dec = torch.load(d / f"decode-{rid}.pt")  # every chip's banks, as one chip holding all heads
    assert dec["dtype"] == c.hawk_cfg["tt"]["kv_dtype"]
    for layer, (kv, got) in enumerate(zip(src, dec["bytes"], strict=False)):
        for i, name in enumerate("KV"):
            want = tilize_pack(kv[i].to(torch.float32), dec["dtype"]).reshape(got[i].shape)
            assert torch.equal(want, got[i]), f"{rid}: layer {layer} {name} bank bytes differ"


def test_tp_pair_serves_exactly(cluster, record_property):
    name, cfg = cluster.hawk_name, cluster.hawk_cfg
    gn = "tt" in cfg
    bfp8 = gn and cfg["tt"]["kv_dtype"] == "bfloat8_b"
    ref_url = cluster.prefill_url if gn and not bfp8 else cluster.decode_url
    d_tp = cfg.get("decode_tp", 1)
    record_property("start_s", round(cluster.start_s, 1))
    ties, mismatches, figs = [], [], []
    t0 = time.monotonic()
    for prompt in _prompts():
        got = complete(cluster.proxy_url, prompt, max_tokens=MAX_TOKENS)
        fig = (got["kv_transfer_params"] or {}).get("hawk_transfer") or {}
        figs.append((len(prompt), fig.get("nbytes"), fig.get("segments"), fig.get("entries")))
        ref = complete(ref_url, prompt, logprobs=2, max_tokens=MAX_TOKENS)
        div = greedy_divergence(got["token_ids"], ref)
        if div is not None:
            (ties if div[1] < TIE_MARGIN[name[:2]] else mismatches).append((len(prompt), *div))
    record_property("serve_s", round(time.monotonic() - t0, 1))
    record_property("ties", ties)
    print(f"[{name}] transfers (prompt_len, bytes, segments, READs): {figs}; ties {ties}")
    assert not mismatches, f"{name}: greedy outputs differ beyond ties: {mismatches}"
    d = Path(cluster.hawk_dump)
    tag = "-r0" if not gn and d_tp > 1 else ""
    landed = sorted(f.name[len("decode-") : -len(f"{tag}.pt")] for f in d.glob(f"decode-*{tag}.pt"))
    # a Tenstorrent decode recomputes a prompt of one block or less: no transfer for it
    pulled = [p for p in _prompts() if not gn or tt_transfer_blocks(len(p), BLOCK)]
    assert len(landed) == len(pulled), [f.name for f in d.iterdir()]
    for rid in landed:
        (_check_gn if gn else _check_gg)(cluster, rid)
    wait_idle(cluster, cluster.hawk_dump, 30.0)
    if name == "GG-P2-D1":  # one configuration is enough
        _mismatched_tp_fails_the_pull_with_both_values(cluster)


def test_a_prefill_holding_kv_for_a_decode_does_not_spin_its_workers(cluster):
    """While a TP prefill holds a finished request for its decode, vLLM keeps stepping the
    engine only to poll the connector. Those steps compute nothing; the connector waits in
    them (``idle_step_wait_ms``) instead of letting every worker spin: spinning, a TP=2
    prefill holding one request used 0.9 and 0.7 of a core in its two workers on a 2-core
    host, and its side channels answered Renews in up to 0.5 s (more under more load:
    missed 1 s deadlines and CURVE handshakes past their 1 s limit). Waiting, 0.10-0.11."""
    import psutil

    if cluster.hawk_cfg["prefill_tp"] < 2:
        pytest.skip("the prefill runs its model in the engine core (no TP workers)")
    prompt = [0] + list(range(7, 100))
    status, out = http_post_json(
        cluster.prefill_url + "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, out
    workers = [
        p
        for p in psutil.Process(cluster.servers["prefill"].proc.pid).children(recursive=True)
        if p.name().startswith("VLLM::Worker")
    ]
    assert len(workers) == cluster.hawk_cfg["prefill_tp"], workers
    before = [sum(p.cpu_times()[:2]) for p in workers]
    time.sleep(5.0)
    used = [(sum(p.cpu_times()[:2]) - b) / 5.0 for p, b in zip(workers, before, strict=True)]
    # the decode takes the request (pull + Release): nothing stays held
    status, got = http_post_json(
        cluster.decode_url + "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": out["kv_transfer_params"]},
    )
    assert status == 200, got
    wait_idle(cluster, cluster.hawk_dump, 30.0)
    print(f"[{cluster.hawk_name}] prefill workers while holding one request: {used} of a core each")
    assert max(used) < 0.5, f"prefill workers used {used} of a core each while only holding KV"


def _mismatched_tp_fails_the_pull_with_both_values(cluster):
    """A prefill that claims a TP size its side channels do not have: the pull fails
    with an error naming both sides' values, and nothing stays held."""
    prompt = [0] + list(range(7, 60))
    status, out = http_post_json(
        cluster.prefill_url + "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, out
    params = dict(out["kv_transfer_params"], remote_tp_size=4)  # the prefill has 2 ranks
    status, out = http_post_json(
        cluster.decode_url + "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params},
    )
    assert status != 200
    log = (Path(cluster.workdir) / "decode.log").read_text()
    assert "TP rank" in log and "of 2" in log and "rank 0 of 4" in log, log[-3000:]
    wait_idle(cluster, cluster.hawk_dump, 30.0)  # the decode released what the real prefill ranks hold
