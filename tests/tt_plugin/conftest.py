"""Engine runs shared by the tt_plugin tests: each runs ONCE per session, in a subprocess
(vLLM picks its platform once per process, so the stock CPU reference and the emulated
Tenstorrent platform cannot share one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: device:kv_dtype[:abort][:chips=N] engines of the emulated run, one after the other; the
#: multi-chip ones (n300: 2 Wormhole chips; a 2-chip Blackhole group) are compared with the
#: single-chip p150a runs of the same KV dtype; 3 chips cannot split 4 KV heads (``fails``)
TT_CONFIGS = (
    "p150a:bfloat16:abort",
    "n150:bfloat16",
    "p150a:bfloat8_b",
    "n300:bfloat8_b",
    "p150a:bfloat16:chips=2",
    "p150a:bfloat16:chips=3:fails",
)


def _run(out: Path, *args: str, timeout: float = 600) -> dict:
    import torch

    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAWK_TT_", "VLLM_TARGET_DEVICE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, str(HERE / "engine_run.py"), str(out), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
        ).returncode
    if rc != 0:
        pytest.fail(
            f"engine_run {args[1:]} exited {rc}; last lines of {log}:\n" + "\n".join(log.read_text().splitlines()[-25:])
        )
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    return str(build_tiny_llama())


@pytest.fixture(scope="session")
def reference_run(tiny_model, tmp_path_factory) -> dict:
    """Stock CPU engine, bf16 model and bf16 KV."""
    return _run(tmp_path_factory.mktemp("tt") / "reference.pt", tiny_model, "reference")


@pytest.fixture(scope="session")
def tt_runs(tiny_model, tmp_path_factory) -> dict:
    """Emulated Tenstorrent engines, keyed ``device:kv_dtype``."""
    return _run(tmp_path_factory.mktemp("tt") / "tt.pt", tiny_model, "tt", *TT_CONFIGS)
