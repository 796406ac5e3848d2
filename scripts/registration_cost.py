"""Per-fetch cost of per-request registration on Mooncake TCP, without the transfer.

For one request of the llama-3.1-70b TP=4 shape (block 64) at 10 and 160 MB: what each
source/sink registers and unregisters around one transfer, timed (median of 5). Run
with the checkout on PYTHONPATH: ``$(make which-python) scripts/registration_cost.py``.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("MC_FORCE_TCP", "1")

import numpy as np  # noqa: E402

from vllm_hawk.bench.paged_cache import PagedKVCache  # noqa: E402
from vllm_hawk.kvflow import BankBufferPool, TTSink  # noqa: E402
from vllm_hawk.kvflow.exposure import Exposure  # noqa: E402
from vllm_hawk.kvflow.ring import RingBuffer  # noqa: E402
from vllm_hawk.kvflow.streams import source_segments  # noqa: E402
from vllm_hawk.layout.model_shapes import load_model_shape  # noqa: E402
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec  # noqa: E402
from vllm_hawk.npu.emulated import EmulatedDevice  # noqa: E402
from vllm_hawk.protocol import KVReady, Segment  # noqa: E402
from vllm_hawk.transport import make_transport  # noqa: E402


def timed(fn, reps: int = 5) -> float:
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    shape, tp, bs = load_model_shape("llama-3.1-70b"), 4, 64
    heads, per_token = shape.kv_heads_per_rank(tp), shape.kv_bytes_per_token(tp, 2)
    t = make_transport("mooncake")
    for mb in (10, 160):
        n = max(1, round(mb * 1e6 / per_token / bs))
        blocks = np.arange(1, n + 1)
        dev = EmulatedDevice("p150a", 1024 << 20)
        layout, bufs = dev.allocate_kv_cache(
            TTKVCacheSpec(shape.num_layers, n + 1, heads, bs, shape.head_dim, "bfloat16")
        )
        rows = []
        sink = TTSink(dev, layout, bufs, t, "direct")
        plan = sink.plan(blocks)
        segs = [
            Segment(int(b), int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
            for b in range(layout.num_banks)
            if plan.segment_nbytes[b]
        ]
        ready = KVReady(req_id="x", ring_offset=0, total_nbytes=int(plan.total_nbytes), segments=segs)
        landing = sink.land("x", ready, plan, 1 << 40, 1.0)
        landing.unexpose()
        ranges = [(a, nb) for a, _r, nb in landing.entries]

        def direct(i):
            sink.exposure.acquire(f"d{i}", ranges, domains=sink._domains)
            sink.exposure.release(f"d{i}")

        rows.append(("GN-HAWK direct: decode KV pages", timed(direct), len(ranges)))
        sink.close()
        pool = BankBufferPool(dev, int(plan.recv_nbytes_per_bank) + (1 << 20), t)
        rows.append(
            (
                "GN-HAWK staged: decode bank slices",
                timed(lambda i: (pool.acquire(f"s{i}", int(plan.recv_nbytes_per_bank)), pool.release(f"s{i}"))),
                layout.num_banks,
            )
        )
        pool.close()
        cache = PagedKVCache(shape.num_layers, n + 1, heads, bs, shape.head_dim)
        ex = Exposure(t)
        runs = [
            (cache.base_addr + s.offset_bytes, s.nbytes)
            for s in source_segments(cache.region_map, blocks.tolist(), cache.base_addr)
        ]
        rows.append(
            (
                "GG-Direct: prefill block runs (decode alike)",
                timed(lambda i: (ex.acquire(f"g{i}", runs, domains=cache.storages), ex.release(f"g{i}"))),
                len(runs),
            )
        )
        ring = RingBuffer(int(plan.total_nbytes) + (1 << 20), t)
        rows.append(
            (
                "prefill ring range (staged, GN-HAWK)",
                timed(lambda i: (ring.reserve(f"q{i}", int(plan.total_nbytes)), ring.release(f"q{i}"))),
                1,
            )
        )
        ring.close()
        for name, s, k in rows:
            print(f"{mb:4d} MB  {name:44s} register + unregister per fetch {1e3 * s:6.2f} ms ({k} runs)")
        for b in bufs:
            dev.free_buffer(b)
        dev.close()
    t.close()


if __name__ == "__main__":
    main()
