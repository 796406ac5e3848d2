"""GN-HAWK end to end on Tenstorrent's stack: vLLM 0.32 prefill on the CPU -> HawkConnector
over Mooncake TCP -> vLLM 0.25.1 + vllm-tt-plugin + the HAWK decode worker on a simulated
chip (ttsim), through ``hawk proxy``. The decode model is the TEST model bundle (host
compute, KV cache in tt-metal tensors on the simulated chip).

One cluster per configuration (module-scoped, one after the other):

* ``p150a-bf16-staged``: Blackhole, bf16 KV tiles, per-bank receive buffers then intra-bank
  copies, ``kv_load_failure_policy: recompute``;
* ``n150-bfp8-direct``: Wormhole, bfloat8_b KV tiles, direct mode asked for (the simulator
  has no NIC path into DRAM: the worker lands staged and says why),
  ``kv_load_failure_policy: fail``.

Checked: the KV bytes of every transfer, read back through ttnn from the tt-metal tensors,
equal ``tilize_pack`` of the prefill's K/V, and at the engine's first transfer no other
block of the cache holds a non-zero byte; the outputs through the proxy equal the decode
server's own (the same model decoding alone on that platform), and those equal the tiny
Llama's reference (transformers, float32) — each except at top-2 ties (GN_TIE_MARGIN); a
request the decode refuses frees its prefill blocks; with the prefill killed mid-pull the
request is recomputed or fails as the policy says, and so is one whose KV the prefill
overwrote after taking its checksums (a FAKE fault, tests/integrity/faults); afterwards
nothing is held on either side, and at shutdown the worker stops the connector before it
closes the mesh. Neither KV dtype is warned about (both meet the KV accuracy contract).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e.e2e_helpers import GN_TIE_MARGIN, check_new_transfers, greedy_divergence, tt_transfer_blocks
from tt_decode_helpers import decode_env, hf_greedy
from vllm_fixtures import complete, connector_states, http_post_json, kv_usage, running, token_prompts, wait_idle

BLOCK = 32
MAX_TOKENS = 8
FAULTS = str(Path(__file__).resolve().parents[1] / "integrity" / "faults")
REUSED_TOKENS = 7 * BLOCK  # pulls of 7 blocks (a 225-token prompt's) meet a block reused before the READ
CONFIGS = {
    "p150a-bf16-staged": dict(device="p150a", kv_dtype="bfloat16", mode="staged", policy="recompute"),
    "n150-bfp8-direct": dict(device="n150", kv_dtype="bfloat8_b", mode="direct", policy="fail"),
}


def prompts() -> list[list[int]]:
    """Across block boundaries (block 32): one past a boundary (the decode recomputes 1
    token), two whole blocks (it recomputes the second), several, inside one block (no
    transfer: it recomputes the prompt). The first one moves KV (see test_kv_bytes_and_outputs)."""
    return token_prompts(23, (33, 64, 100, 5))


@pytest.fixture(scope="module", params=list(CONFIGS))
def gn(request, manifest, prefill_python, tmp_path_factory):
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    cfg = CONFIGS[request.param]
    work = tmp_path_factory.mktemp(request.param)
    dump = work / "dump"
    c = LocalCluster(
        build_tiny_llama(dtype="bfloat16"),
        work,
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=1024,
        max_num_seqs=4,
        python=prefill_python,
        decode_tt_plugin={
            "python": sys.executable,
            "env": decode_env(manifest, cfg["device"]),
            "device": cfg["device"],
            "kv_dtype": cfg["kv_dtype"],
        },
        decode_policy=cfg["policy"],
        extra_config={"pull_timeout_s": 10.0, "handshake_timeout_s": 3.0, "mode": cfg["mode"], "ring_nbytes": 16 << 20},
        prefill_config={"lease_s": 30.0},
        extra_args=["--no-enable-prefix-caching"],
        extra_env={"HAWK_DEBUG_DIR": str(dump)},
        # a FAKE fault for test_a_block_reused_before_the_read_is_never_served: the prefill
        # overwrites its KV after the checksums of pulls of REUSED_TOKENS tokens only
        prefill_env={"HAWK_TEST_FAULT": "reuse", "HAWK_TEST_FAULT_TOKENS": REUSED_TOKENS, "PYTHONPATH": FAULTS},
        startup_timeout_s=900.0,
    )
    c.hawk_name, c.hawk_cfg, c.hawk_dump, c.hawk_checked = request.param, cfg, dump, set()
    with running(c, request.param):
        yield c
    # stopped: the worker shut the connector down (receive buffers freed) before the mesh closed
    assert "KV connector shut down; closing the mesh" in (work / "decode.log").read_text()


def test_worker_names_the_landing_route(gn):
    """On the simulator there is no tt-kmd device: the host stages the NIC's bytes (receive
    buffers only, never a host copy of the KV cache), and the worker says so; asked for
    direct mode, it says why it runs staged."""
    log = (gn.hawk_dump.parent / "decode.log").read_text()
    assert "landing route host-staged (mode staged" in log, log[-3000:]
    if gn.hawk_cfg["mode"] == "direct":
        assert "mode direct was asked for: tt-metal runs on its simulator (TT_METAL_SIMULATOR=" in log


def test_accuracy_warning_only_beyond_the_contract(gn):
    """The worker warns about the model's KV cache dtype exactly when it misses the KV
    accuracy contract (docs/tenstorrent.md "KV accuracy"): bf16 and bfloat8_b meet it."""
    from vllm_hawk.tenstorrent.kv_accuracy import kv_dtype_warning
    from vllm_hawk.tenstorrent.vllm_tt.worker import KV_DTYPE_SOURCE

    log = (gn.hawk_dump.parent / "decode.log").read_text()
    warning = kv_dtype_warning(gn.hawk_cfg["kv_dtype"], KV_DTYPE_SOURCE)
    if warning is None:
        assert "beyond the accuracy contract" not in log
    else:
        assert log.count(warning) == 1, log[-3000:]


def test_kv_bytes_and_outputs(gn):
    ties, mismatches, first = [], [], True
    for p in prompts():
        d = complete(gn.proxy_url, p, max_tokens=MAX_TOKENS)
        checked = check_new_transfers(gn)  # exact bytes, read back through ttnn at landing
        fig = (d["kv_transfer_params"] or {}).get("hawk_transfer") or {}
        nblk = tt_transfer_blocks(len(p), BLOCK)  # block-aligned: the contract double refuses other starts
        if not nblk:
            assert not checked and not fig, (checked, fig)
        else:
            assert len(checked) == 1 and checked[0]["blocks"] == nblk, checked
            assert fig.get("ok") and fig.get("banks") == (12 if gn.hawk_cfg["device"] == "n150" else 8), fig
        if first:  # the engine's first transfer: nothing else in the cache is non-zero
            import torch

            landed = torch.load(gn.hawk_dump / f"decode-{checked[0]['key']}")
            assert landed["nonzero_blocks"] == sorted(landed["dst_blocks"]), landed["nonzero_blocks"]
            first = False
        alone = complete(gn.decode_url, p, max_tokens=MAX_TOKENS, logprobs=2)
        ref = hf_greedy(gn.model, p, MAX_TOKENS)
        for what, got, want in (("P/D vs decode alone", d, alone), ("decode alone vs transformers", alone, ref)):
            div = greedy_divergence(got["token_ids"], want)
            if div is not None:
                (ties if div[1] < GN_TIE_MARGIN else mismatches).append((what, len(p), *div))
    print(f"[{gn.hawk_name}] top-2 ties (what, prompt_len, position, gap): {ties}")
    assert not mismatches, f"outputs differ beyond ties: {mismatches}"


def test_decode_refusal_frees_the_prefill(gn):
    before = wait_idle(gn, gn.hawk_dump, timeout_s=60)["prefill"]
    body = {"model": "tiny", "prompt": [0] + list(range(5, 100)), "max_tokens": 100_000}
    status, out = http_post_json(gn.proxy_url + "/v1/completions", body)
    assert status == 400, out
    deadline = time.monotonic() + 5.0
    while kv_usage(gn.prefill_url) != 0.0:
        assert time.monotonic() < deadline, "prefill blocks still held 5 s after the decode refused the request"
        time.sleep(0.1)
    deadline = time.monotonic() + 5.0  # the state file is rewritten every 0.5 s
    while True:
        p = connector_states(gn.hawk_dump)["prefill"]["prefill"]
        if p["released"] == before["released"] + 1 and p["held"] == 0:
            break
        assert time.monotonic() < deadline, (before, p)
        time.sleep(0.1)


def test_nothing_held_afterwards(gn):
    seen = wait_idle(gn, gn.hawk_dump, timeout_s=60)
    assert seen["decode"]["inflight"] == 0 and seen["decode"].get("recv_live", 0) == 0, seen


def test_a_block_reused_before_the_read_is_never_served(gn):
    """The prefill overwrites the KV of a 7-block pull after taking its checksums (the FAKE
    fault): the decode's check fails the pull, logged with the request, segment and bank;
    ``recompute``: the decode prefills locally and answers as alone; ``fail``: the request
    fails. Never an answer from the bad KV."""
    p = token_prompts(29, (REUSED_TOKENS + 1,))[0]
    alone = complete(gn.decode_url, p, max_tokens=MAX_TOKENS)
    body = {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, out = http_post_json(gn.proxy_url + "/v1/completions", {**body, "return_token_ids": True})
    if gn.hawk_cfg["policy"] == "recompute":
        assert status == 200 and out["choices"][0]["token_ids"] == alone["token_ids"], out
        fig = out["kv_transfer_params"]["hawk_transfer"]
        assert fig["ok"] is False and "failed the integrity check" in fig["error"], fig
    else:
        assert status != 200 or out["choices"][0]["finish_reason"] not in ("length", "stop"), out
    log = (gn.hawk_dump.parent / "decode.log").read_text()
    assert "failed the integrity check (format tt-tiles/" in log and "segment 0 (bank 0" in log, log[-3000:]


def test_prefill_killed_mid_pull(gn):
    """Last: it kills the prefill. The decode already holds a side channel to it, so the
    pull sends its KVRequest at once; the frozen prefill never answers, and is killed while
    the pull waits. ``recompute``: the decode prefills locally and answers as alone;
    ``fail``: the request fails. Then the decode holds nothing."""
    p = [0] + list(range(7, 77))
    alone = complete(gn.decode_url, p, max_tokens=MAX_TOKENS)
    body = {"model": "tiny", "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, out = http_post_json(gn.prefill_url + "/v1/completions", body)
    assert status == 200, out
    params = out["kv_transfer_params"]
    pgid = gn.servers["prefill"].pgid
    os.killpg(pgid, signal.SIGSTOP)
    result: dict = {}
    body = {
        "model": "tiny",
        "prompt": p,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    t = threading.Thread(target=lambda: result.update(r=http_post_json(gn.decode_url + "/v1/completions", body)))
    t.start()
    deadline = time.monotonic() + 30.0
    while connector_states(gn.hawk_dump).get("decode", {}).get("decode", {}).get("inflight") != 1:
        assert time.monotonic() < deadline, connector_states(gn.hawk_dump)
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    t.join(120)
    status, out = result["r"]
    if gn.hawk_cfg["policy"] == "recompute":
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == alone["token_ids"]
    else:
        assert status != 200 or out["choices"][0]["finish_reason"] not in ("length", "stop"), out
    deadline = time.monotonic() + 30.0
    while True:
        d = connector_states(gn.hawk_dump)["decode"]["decode"]
        if d["inflight"] == 0 and d.get("recv_live", 0) == 0 and d.get("renewing", 0) == 0:
            break
        assert time.monotonic() < deadline, d
        time.sleep(0.2)
    assert kv_usage(gn.decode_url) == 0.0
