"""Helpers of tests/tt_decode: vLLM 0.25.1 + vllm-tt-plugin + the HAWK decode worker on
Tenstorrent's simulator (ttsim), run by the tt environment's Python (``make
test-tt-decode``); the prefill is vLLM 0.32 on the CPU, run by the main environment's
Python (``HAWK_MAIN_PYTHON``, else ``scripts/ensure_env.sh path main``).

The decode serves the tiny Llama through the TEST model bundle
(:mod:`tt_test_model`, ``EXTRA_MODELS_DIR``): host compute, KV cache on
the simulated chip. Without the simulator runtime or the main environment the tests skip
locally and FAIL under CI (env CI set), as tests/ttsim do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: device profile -> simulator (manifest key)
SIMULATORS = {"p150a": "blackhole", "n150": "wormhole_b0"}


def fail_or_skip(msg: str):
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def ttsim_manifest() -> dict:
    """scripts/ttsim_env.sh --env tt: ttnn of this environment on the simulator."""
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "ttsim_env.sh"), "--env", "tt"], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        fail_or_skip(f"scripts/ttsim_env.sh --env tt failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    manifest = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    if Path(manifest["python"]).resolve() != Path(sys.executable).resolve():
        fail_or_skip(f"tests/tt_decode run by {sys.executable}, not the tt environment's {manifest['python']}")
    print(f"[tt_decode] simulator runtime ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return manifest


def main_python() -> str:
    """The main environment's interpreter (vLLM 0.32 CPU, the prefill side)."""
    py = (
        os.environ.get("HAWK_MAIN_PYTHON")
        or subprocess.run(
            ["bash", str(REPO / "scripts" / "ensure_env.sh"), "path", "main"], capture_output=True, text=True
        ).stdout.strip()
    )
    if not py or not Path(py).exists():
        fail_or_skip(f"no main environment ({py!r}): run scripts/ensure_env.sh main")
    return py


def decode_env(manifest: dict, device: str) -> dict[str, str]:
    """Environment of a decode server on the simulated ``device``: ttnn on ttsim, the TEST
    model bundle as vllm-tt-plugin's only model."""
    from tt_test_model import BUNDLES_DIR

    return {
        **manifest["env"],
        "TT_METAL_SIMULATOR": manifest["simulators"][SIMULATORS[device]],
        "EXTRA_MODELS_DIR": str(BUNDLES_DIR),
        "TT_VLLM_BUILTIN_MODELS": "0",
        # the bundle's main_class is tests.tt_decode.tt_test_model: the repo root, whatever the cwd
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


def hf_greedy(model: Path, prompt: list[int], max_tokens: int) -> dict:
    """The tiny Llama's reference: transformers in float32, greedy; a choice like
    ``complete`` returns (``token_ids``, ``logprobs.top_logprobs`` with the top 2)."""
    import torch
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids, tops = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            lp = torch.log_softmax(m(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            v, i = lp.topk(2)
            tops.append({str(int(i[k])): float(v[k]) for k in range(2)})
            ids.append(int(i[0]))
    return {"token_ids": ids[len(prompt) :], "logprobs": {"top_logprobs": tops}}


def run_on_sim(manifest: dict, device: str, code: str, timeout_s: float = 300.0) -> dict:
    """Run ``code`` (Python; it prints ``RESULT`` and one JSON object on a line) on the simulated
    ``device`` in a fresh process of this environment (tt-metal reads the simulator's
    variables when it starts); returns that object."""
    env = dict(os.environ, **decode_env(manifest, device))  # decode_env puts the repo root first on PYTHONPATH
    return _run_job(env, code, timeout_s, f"simulator job on {device}")


def run_on_mock(manifest: dict, cluster_desc: Path, code: str, timeout_s: float = 300.0) -> dict:
    """:func:`run_on_sim` in tt-metal's mock mode: no simulator, the cluster described by the
    UMD cluster descriptor YAML ``cluster_desc`` (``TT_METAL_MOCK_CLUSTER_DESC_PATH``); every
    driver call is mocked, so devices open and allocate but no byte reaches a device."""
    env = dict(os.environ, **decode_env(manifest, "p150a"))
    del env["TT_METAL_SIMULATOR"]
    env["TT_METAL_MOCK_CLUSTER_DESC_PATH"] = str(cluster_desc)
    return _run_job(env, code, timeout_s, f"mock-cluster job on {cluster_desc.name}")


def _run_job(env: dict[str, str], code: str, timeout_s: float, what: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO
    )
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))  # ttsim prints its own lines too
    return json.loads(line.removeprefix("RESULT "))


def tt_transformers_kv_cache(ttnn, submeshes, kv_cache_shape, num_layers, kv_cache_dtype, tt_cache_path: Path):
    """A paged cache made by the ttnn calls of tt_transformers' ``allocate_vllm_kv_cache``
    (tenstorrent/tt-metal ``models/tt_transformers/tt/generator_vllm.py``, read at commit
    0015d62b): ``kv_cache[submesh][layer] = [K, V]``, each ``ttnn.as_tensor`` of bf16 zeros
    ``kv_cache_shape`` (``[num_blocks, kv heads per chip, block_size, head_dim]``),
    ReplicateTensorToMesh, TILE, DRAM, ``kv_cache_dtype``, with a ``cache_file_name`` per K
    and V: the first layer's K and V are made on the host and dumped, every later one is
    loaded from that file onto the device."""
    import torch

    cache = []
    for submesh in submeshes:
        zeros = torch.zeros(kv_cache_shape, dtype=torch.bfloat16)
        layers = []
        for _ in range(num_layers):
            layers.append(
                [
                    ttnn.as_tensor(
                        zeros,
                        device=submesh,
                        mesh_mapper=ttnn.ReplicateTensorToMesh(submesh),
                        layout=ttnn.TILE_LAYOUT,
                        memory_config=ttnn.DRAM_MEMORY_CONFIG,
                        dtype=kv_cache_dtype,
                        cache_file_name=tt_cache_path / f"empty_{kv}cache_paged_attention{tuple(kv_cache_shape)}",
                    )
                    for kv in "kv"
                ]
            )
        cache.append(layers)
    return cache
