"""The prefill's start-up next to CUDA graph capture, and its KVReady latency next to
graph replays: the last two sections of ``scripts/gpu_check.py --suite full``.

* :func:`capture_section`: the connector's prefill is built exactly as
  ``register_kv_caches`` builds it (:func:`~vllm_hawk.connector.strategies.make_prefill`,
  GN-HAWK onto ``profile``, whatever warm-up it runs); right after it returns, as vLLM
  then captures, 10 CUDA graphs of a model step (a matmul and KV writes into other
  blocks) are captured on a non-blocking stream with ``capture_error_mode="global"``.
  Reports each capture's outcome, whether a ``hawk-transform-warm`` thread still ran when
  capture began (``warm_running_at_capture``), and the warm-up's time
  (``make_prefill_ms``: make_prefill's return; ``warm_done_ms``: the end of a warm thread
  still running then). On the CPU there are no CUDA graphs: the captures are skipped, the warm-up runs
  and is timed.
* :func:`replay_section`: the same endpoint serves KVRequests over its side channel
  (a real :class:`~vllm_hawk.protocol.ProtocolClient`), idle and while another thread
  replays that graph on its own stream (on the CPU: runs the step, labelled); each
  KVReady's ring bytes equal those of an endpoint over a host copy of the caches (the CPU
  reference); KVRequest -> KVReady ms, p50 / p95, idle and under load.
"""

from __future__ import annotations

import statistics
import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import torch

from vllm_hawk.bench.gpu_matrix import random_sources
from vllm_hawk.bench.recording_transport import RecordingTransport
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV, tt_compat
from vllm_hawk.connector.strategies import make_prefill
from vllm_hawk.kvflow.device import memory_location
from vllm_hawk.kvflow.sources import tt_paged_desc, vllm_layout_desc
from vllm_hawk.kvflow.streams import head_maps, region_map_from_caches
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.vllm_kv import block_byte_ranges
from vllm_hawk.protocol import KVRequest, ProtocolClient

__all__ = ["ModelStep", "capture_section", "connector_prefill", "replay_section"]

WARM_THREAD = "hawk-transform-warm"


def connector_prefill(src, bs: int, heads: int, dim: int, profile: str, ring_nbytes: int):
    """(PrefillEndpoint, its transport, compat) built by the connector's ``make_prefill``
    over ``src`` (a TransformSource of FlashAttention caches), GN-HAWK onto ``profile``;
    the transport records registrations (no NIC here) and accepts the caches' memory."""
    caches = src.caches
    region_map = region_map_from_caches(caches, [block_byte_ranges(c, 0) for c in caches])
    layout = vllm_layout_desc(region_map, "vllm-flash-nhd", "bfloat16", bs, heads, dim)
    compat = tt_compat("gpu-check", "bfloat16", bs, profile)
    kv = LocalKV(compat, layout, region_map, [], src, heads=head_maps(caches), caches=caches, adapters=src.adapters)
    cfg = HawkConfig(device_profile=profile, auth="none", side_channel_port=0, ring_nbytes=ring_nbytes)
    transport = RecordingTransport({"cpu", memory_location(src.device)})
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1))
    ep = make_prefill(cfg, kv, transport, vllm_config, tp_rank=0, tp_size=1, on_finished=lambda *a: None)
    return ep, transport, compat


class ModelStep:
    """A stand-in for one model step on the caches' device: a ``dim`` x ``dim`` matmul and
    writes of fresh K/V into ``blocks`` of every layer (blocks no request reads)."""

    def __init__(self, caches, blocks, dim: int) -> None:
        dev = caches[0].device
        self.caches, self.idx = caches, torch.as_tensor(np.asarray(blocks), device=dev)
        self.vals = [torch.randn((len(blocks), *c.shape[1:]), device=dev).to(c.dtype) for c in caches]
        self.a, self.b = torch.randn(dim, dim, device=dev), torch.randn(dim, dim, device=dev)
        self.c = torch.empty(dim, dim, device=dev)
        self.steps = 0

    def __call__(self) -> None:
        torch.mm(self.a, self.b, out=self.c)
        for c, v in zip(self.caches, self.vals, strict=True):
            c.index_copy_(0, self.idx, v)
        self.steps += 1


def _warm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WARM_THREAD]


def capture_section(src, bs: int, heads: int, dim: int, profile: str, ring_nbytes: int, step, n: int = 10) -> dict:
    """See the module doc. ``step``: a :class:`ModelStep` over ``src``'s caches."""
    device = src.device
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream() if cuda else None  # pool streams are cudaStreamNonBlocking
    if cuda:  # as vLLM warms its model before capture
        torch.cuda.synchronize()  # the step's tensors were made on the current stream
        with torch.cuda.stream(stream):
            step()
        torch.cuda.synchronize()
    before = set(_warm_threads())
    t0 = time.perf_counter()
    ep, _transport, _compat = connector_prefill(src, bs, heads, dim, profile, ring_nbytes)
    returned_ms = 1e3 * (time.perf_counter() - t0)
    warm = [t for t in _warm_threads() if t not in before]  # alive when make_prefill returned
    running = any(t.is_alive() for t in warm)
    captures = _captures(step, stream, n) if cuda else []
    for t in warm:
        t.join(timeout=600)
    done_ms = 1e3 * (time.perf_counter() - t0)
    ep.close()
    out = {
        "device": str(device),
        "make_prefill_ms": returned_ms,
        "warm_running_at_capture": running,
        "warm_done_ms": done_ms,
        "captures": captures,
        "captures_ok": sum(1 for c in captures if c["ok"]),
    }
    if not cuda:
        out["skipped"] = "captures: no CUDA graphs on CPU (the warm-up ran and is timed)"
    return out


def _captures(step, stream, n: int) -> list[dict]:
    out = []
    for i in range(n):
        g = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        try:
            with torch.cuda.graph(g, stream=stream, capture_error_mode="global"):
                step()
            g.replay()
            torch.cuda.synchronize()
            out.append({"i": i, "ok": True, "ms": 1e3 * (time.perf_counter() - t0)})
        except Exception as e:  # noqa: BLE001 - what a capture raised is the result
            out.append({"i": i, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            torch.cuda.synchronize()
    return out


class _Load:
    """Another thread running the model step until stopped: replays of its CUDA graph on
    its own stream on a GPU, plain calls on the CPU."""

    def __init__(self, step) -> None:
        self.step, self.stop, self.runs = step, threading.Event(), 0
        self.graph = self.stream = None
        if step.caches[0].device.type == "cuda":
            self.stream, self.graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                step()
            torch.cuda.synchronize()
        self.kind = "cuda-graph-replays" if self.graph is not None else "cpu-thread-kv-writes"
        self.thread = threading.Thread(target=self._run, daemon=True, name="gpu-check-load")

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.graph is not None:
                with torch.cuda.stream(self.stream):
                    self.graph.replay()
                self.stream.synchronize()
            else:
                self.step()
            self.runs += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _requests(n: int, pool, bs: int, dst_bs: int, tokens: int, desc, rng) -> list[tuple]:
    """``n`` (KVRequest, source blocks) of ``tokens`` tokens over source blocks drawn
    from ``pool`` (scattered), 4 distinct ones repeated; every second one starts at
    destination block 1."""
    shapes = []
    for k in range(4):
        src = rng.permutation(pool)[: -(-tokens // bs)]
        first = k % 2
        n_dst = -(-tokens // dst_bs) - first
        shapes.append((src, first, rng.permutation(n_dst + 8)[:n_dst].tolist()))
    out = []
    for i in range(n):
        src, first, dst = shapes[i % 4]
        msg = KVRequest(req_id=f"q{i}", dst_layout=desc, num_tokens=tokens, dst_block_ids=dst, first_block=first)
        out.append((msg, src, i % 4))
    return out


def _serve(ep, client, msg, src, tokens: int) -> tuple[float, torch.Tensor]:
    ep.add_request(msg.req_id, src, tokens)
    t0 = time.perf_counter()
    ready = client.request_kv(msg)
    dt = time.perf_counter() - t0
    got = ep.ring.view(ready.ring_offset, ready.total_nbytes).to("cpu", copy=True)  # the ring is reused
    client.release(msg.req_id)
    return dt, got


def replay_section(geo: dict, device, n: int = 20, deadline: float | None = None) -> dict:
    """See the module doc. ``geo``: layers, heads, head_dim, src_block_size,
    dst_block_size, tokens, dtype, profile, step_dim (the step's matmul)."""
    L, H, D, bs = geo["layers"], geo["heads"], geo["head_dim"], geo["src_block_size"]
    n_src = -(-geo["tokens"] // bs)
    blocks = 2 * n_src + 8
    dev, host = random_sources("LBNHC", L, blocks, H, bs, D, device, seed=5)
    rng = np.random.default_rng(3)
    perm = rng.permutation(blocks)
    pool, load_blocks = perm[: blocks - 4], perm[blocks - 4 :]
    step = ModelStep(dev.caches, load_blocks, geo["step_dim"])
    ring = 3 * L * 2 * H * D * 2 * (n_src * bs + geo["dst_block_size"]) + (8 << 20)
    eps = [connector_prefill(s, bs, H, D, geo["profile"], ring) for s in (dev, host)]
    clients = []
    try:
        for ep, _t, compat in eps:
            clients.append(ProtocolClient(ep.endpoint, compat, auth="none", timeout_s=600))
            clients[-1].handshake()
        desc = tt_paged_desc(eps[0][0].source.layout, geo["dtype"], load_profile(geo["profile"]), geo["dst_block_size"])
        reqs = _requests(n, pool, bs, geo["dst_block_size"], geo["tokens"], desc, rng)
        refs = {}
        for msg, src, k in reqs:
            if k not in refs:
                refs[k] = _serve(eps[1][0], clients[1], msg, src, geo["tokens"])[1]
        out = {"device": str(device), "geometry": geo, "requests": n, "skipped": []}
        out["idle"] = _phase(eps[0][0], clients[0], reqs, refs, geo["tokens"], "i")
        if deadline is not None and time.monotonic() > deadline:
            out["skipped"].append("under load: over the time budget")
            return out
        load = _Load(step)
        with load:
            out["load"] = _phase(eps[0][0], clients[0], reqs, refs, geo["tokens"], "l")
        out["load"].update(kind=load.kind, load_runs=load.runs)
        out["registered"] = sorted({loc for _a, _n, loc in eps[0][1].registered})
        return out
    finally:
        for c in clients:
            c.close()
        for ep, _t, _c in eps:
            ep.close()


def _phase(ep, client, reqs, refs, tokens: int, tag: str) -> dict:
    times, equal = [], 0
    for msg, src, k in reqs:
        m = msgspec.structs.replace(msg, req_id=f"{tag}{msg.req_id}")
        dt, got = _serve(ep, client, m, src, tokens)
        times.append(1e3 * dt)
        equal += bool(torch.equal(got, refs[k]))
    q = statistics.quantiles(times, n=20) if len(times) > 1 else times * 19
    return {
        "bytes_equal": equal == len(reqs),
        "equal": equal,
        "kvready_ms_p50": statistics.median(times),
        "kvready_ms_p95": q[18],
    }
