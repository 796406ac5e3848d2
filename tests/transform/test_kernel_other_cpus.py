"""The transform kernels compiled for CPUs other than this one. Their block-float code is
LLVM vector IR 32 lanes wide: on a host with AVX-512 it maps onto 512-bit registers,
elsewhere LLVM splits it. ``NUMBA_CPU_NAME`` makes numba (and so LLVM) target another
CPU here; the byte-exact tests of ``test_cpu_kernel.py`` run in a subprocess compiled for
Haswell (AVX2, no AVX-512, as on the machines of this kind without it) and for the
x86-64 baseline (SSE2). Each target's numba cache lives beside ours in ``$HAWK_CACHE``."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hawk import envs

# Not importorskip: numba imported at collection breaks vLLM's in-process engine tests
# (its dispatcher trips over llvmlite's module wrappers), see vllm_hawk.transform.cpu_kernel.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("cpu", ["haswell", "x86-64"])
def test_kernel_bytes_compiled_for_another_cpu(cpu):
    env = dict(
        os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(envs.cache_dir() / f"numba-{cpu}")
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(HERE / "test_cpu_kernel.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"kernel compiled for {cpu}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout
