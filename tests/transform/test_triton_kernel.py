"""The GPU transform kernel (:mod:`vllm_hawk.transform.triton_kernel`) under Triton's
interpreter: byte-equal to the torch path and the numba kernel over the whole matrix of
:mod:`vllm_hawk.bench.gpu_matrix` (run by :mod:`triton_matrix`: every source layout x
source blocks 16/32/64 x destination 32/64 x bf16/bfp8/bfp4 x whole request / layer
groups / head share; scattered blocks, a partial last block, a non-zero first block), and
how :func:`~vllm_hawk.transform.kv_transform.transform_kv` chooses it. Triton lives in a
side folder (``HAWK_TRITON_DIR``, ``make triton-env``): the tests skip without it locally
and fail under CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from vllm_fixtures import triton_dir

from vllm_hawk.transform import kv_transform as kt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_interpreted_kernel_equals_torch_and_numba_over_the_matrix():
    d = triton_dir()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([d, str(ROOT), str(HERE)])}
    r = subprocess.run(
        [sys.executable, str(HERE / "triton_matrix.py")], capture_output=True, text=True, timeout=900, cwd=HERE, env=env
    )
    assert r.stdout.strip(), r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"triton matrix: {res['cases']} cases, {res['launches']} launches, {res['seconds']} s")
    assert res["cases"] == 6 * 3 * 2 * 3 * 3
    assert not res["failed"], res["failed"][:10]
    assert res["refs"] == ["numba", "numba-regrouped"]
    # one launch per request (whole, share) or per layer group: 1 + 2 + 1 per combination
    assert res["launches"] == res["cases"] // 3 * 4
    assert r.returncode == 0, r.stderr[-4000:]


def test_auto_chooses_triton_only_for_a_cuda_g_prime():
    x = torch.zeros(1, dtype=torch.bfloat16)
    out = torch.zeros(1, dtype=torch.uint8)
    assert not kt.uses_triton("auto", x, out, "bfloat8_b")  # CPU: the numba kernel
    assert kt.uses_triton("triton", x, out, "bfloat8_b")  # forced (the interpreter runs it)
    assert not kt.uses_triton("torch", x, out, "bfloat16")
    meta = torch.empty(1, dtype=torch.uint8, device="meta")
    have = kt._HAVE_TRITON
    try:  # a G' on CUDA takes the kernel when Triton imports and the formats are its own
        kt._HAVE_TRITON = True
        cuda = type("FakeCudaTensor", (), {"device": torch.device("cuda", 0)})()  # the device is all it reads
        assert kt.uses_triton("auto", x, cuda, "bfloat8_b")
        assert not kt.uses_triton("auto", x, cuda, "float32")  # not a KV tile format: the torch path
        assert not kt.uses_triton("auto", x.to(torch.int8), cuda, "bfloat16")
        kt._HAVE_TRITON = False
        assert not kt.uses_triton("auto", x, cuda, "bfloat8_b")  # no Triton: the torch path
    finally:
        kt._HAVE_TRITON = have
    assert not kt.uses_triton("auto", x, meta, "bfloat8_b")


def test_the_dispatchers_copy_of_the_kernels_dtypes_is_the_kernels():
    """kv_transform keeps the kernel's targets and sources without importing Triton."""
    d = triton_dir()
    code = (
        "import torch; from vllm_hawk.transform import kv_transform as kt, triton_kernel as t\n"
        "assert kt.TRITON_TARGETS == tuple(t.TARGETS), (kt.TRITON_TARGETS, t.TARGETS)\n"
        "assert kt.TRITON_SOURCES == t.SOURCE_DTYPES, (kt.TRITON_SOURCES, t.SOURCE_DTYPES)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([d, str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


def test_forcing_triton_on_cpu_without_the_interpreter_is_refused():
    d = triton_dir()
    code = (
        "import torch; from test_cpu_kernel import _plan; from vllm_hawk.transform import triton_kernel as t\n"
        "p = _plan(1, 1, 32, 32, 'bfloat16', [0])\n"
        "t.launch([], 1, 32, p, torch.zeros(p.total_nbytes, dtype=torch.uint8), 0, 1, None, None)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([d, str(ROOT), str(HERE)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "runs only under TRITON_INTERPRET=1" in r.stderr, r.stderr[-2000:]
