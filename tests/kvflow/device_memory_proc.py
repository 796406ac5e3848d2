"""The prefill side over a KV cache in device memory, in a process of its own (the opaque
device changes torch for the whole process): ``python device_memory_proc.py SCENARIO``
prints one JSON line of facts that ``test_device_memory.py`` checks.

The device is :mod:`opaque_device` (``hawkdev``): real bytes, but host
code that reads or writes them through a pointer gets a canary-filled decoy instead. Each
scenario serves real ``KVRequest``s from a :class:`PrefillEndpoint` over a cache on that
device and the same endpoint over the same cache in host memory, and reports whether the
ring bytes agree, where the ring is, what was registered under which location, and
whether the device was idle whenever a KVReady went out.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import opaque_device
import torch

from vllm_hawk.bench.recording_transport import RecordingTransport
from vllm_hawk.integrity import ALGORITHM
from vllm_hawk.kvflow import PrefillEndpoint, RingGatherSource, TileTransformSource, VllmBlockSource
from vllm_hawk.kvflow.device import synchronize
from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import head_maps, region_map_from_caches
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.formats import tile_format
from vllm_hawk.layout.vllm_kv import FlashAttnKVLayout, TransformSource, block_byte_ranges, make_layer_caches
from vllm_hawk.protocol import KVReady, KVRequest, LayoutDesc, Release, make_compat
from vllm_hawk.transport import make_transport

L, H, D, BLOCKS = 2, 2, 64, 24
PROFILE = "p150a"


def caches_on(device, block_size: int, seed: int) -> list[torch.Tensor]:
    """Per-layer FlashAttention (NHD) caches with seeded values, copied to ``device``."""
    host = make_layer_caches(L, BLOCKS, H, block_size, 2 * D)
    g = torch.Generator().manual_seed(seed)
    for c in host:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    if torch.device(device).type == "cpu":
        return host
    out = make_layer_caches(L, BLOCKS, H, block_size, 2 * D, device=device)
    for h, d in zip(host, out, strict=True):
        d.copy_(h.to(device))
    synchronize(device)  # as after the engine's forward: whatever is queued later is the prefill side's
    return out


def source(kind: str, caches: list[torch.Tensor], block_size: int):
    region_map = region_map_from_caches(caches, [block_byte_ranges(c, 0) for c in caches])
    desc = vllm_layout_desc(region_map, "vllm-flash-nhd", "bfloat16", block_size, H, D)
    if kind == "hawk":
        lay = FlashAttnKVLayout(H, block_size, D)
        return TileTransformSource(TransformSource([lay] * L, caches), desc, load_profile(PROFILE))
    storage = [(caches[0].data_ptr(), L * BLOCKS * desc.tile_nbytes)]
    cls = RingGatherSource if kind == "staged" else VllmBlockSource
    return cls(region_map, desc, storage, head_maps(caches), caches)


def tt_desc(dtype: str, block_size: int) -> LayoutDesc:
    prof, tb = load_profile(PROFILE), tile_format(dtype).tile_nbytes
    return LayoutDesc(
        name="tt-paged",
        dtype=dtype,
        block_size=block_size,
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_banks=prof.num_banks,
        tile_nbytes=tb,
        page_nbytes=prof.aligned_page(tb),
    )


def serve(
    src, transport, dst: LayoutDesc, num_tokens, src_blocks, dst_blocks, requests=1, checksum=ALGORITHM, **kw
) -> dict:
    """``requests`` requests, one after another, through one endpoint: add, KVRequest
    (asking for ``checksum``), KVReady, the bytes and checksums (the first one's), Release;
    then close. ``kw``: the endpoint's."""
    compat = make_compat("tiny", "bfloat16", 0, "any", "any", PROFILE)
    ep = PrefillEndpoint(src, transport, compat, ring_nbytes=4 << 20, **kw)
    live = getattr(transport, "live", lambda: [])
    facts: dict = {"registration": ep.registration}
    try:
        for i in range(requests):
            got, done, rid = {}, threading.Event(), f"r{i}"

            def reply(msg, got=got, done=done):
                got["msg"], got["busy_at_reply"] = msg, opaque_device.busy()
                done.set()

            ep.add_request(rid, src_blocks, num_tokens)
            msg = KVRequest(
                req_id=rid, dst_layout=dst, num_tokens=num_tokens, dst_block_ids=list(dst_blocks), checksum=checksum
            )
            out = ep.on_kv_request("decode", msg, reply)
            if out is not None:
                reply(out)
            assert done.wait(120), "no KVReady"
            ready = got["msg"]
            assert isinstance(ready, KVReady), ready
            facts["busy_at_reply"] = facts.get("busy_at_reply", False) or got["busy_at_reply"]
            if i == 0:
                facts["segments"] = len(ready.segments)
                facts["checksums"] = [[c.a, c.b] for c in ready.checksums]
                if ep.ring is not None:
                    facts["ring_device"] = str(ep.ring.device)
                    view = ep.ring.view(ready.ring_offset, ready.total_nbytes)
                    facts["bytes"] = view.cpu().numpy().tobytes().hex()
                facts["registered_live"] = [list(r) for r in live()]
            ep.on_release("decode", Release(req_id=rid), lambda m: None)
        facts["registered_after_release"] = len(live())
    finally:
        ep.close()
    facts["registered_after_close"] = len(live())
    facts["registrations"] = len(getattr(transport, "registered", ()))
    return facts


def registered_once(kind: str, registration: str = "auto") -> dict:
    """Three requests through one endpoint over a device cache: a device ring (or a cache
    served in place) is registered whole, once, under ``auto``; ``per_request`` registers
    per request (the contrast)."""
    dev = opaque_device.enable()
    bs = 32
    dst = tt_desc("bfloat16", 32) if kind == "hawk" else source(kind, caches_on("cpu", bs, 0), bs).layout
    t = RecordingTransport({"cpu", f"{dev.type}:0"})
    return serve(
        source(kind, caches_on(dev, bs, 5), bs), t, dst, 70, [3, 9, 4], [0, 1, 2], 3, registration=registration
    )


def run(kind: str, src_bs: int, dst: LayoutDesc, tokens: int, checksum: str = ALGORITHM) -> dict:
    dev = opaque_device.enable()
    rng = np.random.default_rng(3)
    n_src = -(-tokens // src_bs)
    src_blocks = rng.permutation(BLOCKS)[:n_src]
    dst_blocks = rng.permutation(40)[: -(-tokens // dst.block_size)]
    syncs0 = opaque_device.syncs()
    on_dev = serve(
        source(kind, caches_on(dev, src_bs, 5), src_bs),
        RecordingTransport({"cpu", f"{dev.type}:0"}),
        dst,
        tokens,
        src_blocks,
        dst_blocks,
        checksum=checksum,
    )
    t = make_transport("inprocess")
    try:
        on_host = serve(
            source(kind, caches_on("cpu", src_bs, 5), src_bs), t, dst, tokens, src_blocks, dst_blocks, checksum=checksum
        )
    finally:
        t.close()
    on_dev["syncs"] = opaque_device.syncs() - syncs0
    on_dev["equal_to_host"] = on_dev.pop("bytes", None) == on_host.get("bytes")
    # the checksums taken on the device (torch operations on its stream) are the host kernel's
    on_dev["checksums_equal_to_host"] = len(on_dev["checksums"]) == on_dev["segments"] and on_dev.pop(
        "checksums"
    ) == on_host.get("checksums")
    on_dev["decoys_untouched"] = opaque_device.decoys_untouched()
    return on_dev


def host_staged_ring(dst: LayoutDesc) -> dict:
    """A transport that reaches host memory only: the ring falls back to host memory and
    the gather copies device -> host with torch."""
    dev = opaque_device.enable()
    t = make_transport("inprocess")
    try:
        facts = serve(source("staged", caches_on(dev, 32, 5), 32), t, dst, 70, [3, 9, 4], [0, 1, 2])
        host = serve(source("staged", caches_on("cpu", 32, 5), 32), t, dst, 70, [3, 9, 4], [0, 1, 2])
    finally:
        t.close()
    facts["equal_to_host"] = facts.pop("bytes") == host["bytes"]
    facts["decoys_untouched"] = opaque_device.decoys_untouched()
    return facts


def host_pointer_copy() -> dict:
    """The detector itself: a host memmove through a device tensor's data_ptr (what a raw
    pointer copy of KV memory does) gets the canary, not the bytes."""
    import ctypes

    dev = opaque_device.enable()
    x = torch.arange(64, dtype=torch.uint8).to(dev)
    buf = (ctypes.c_uint8 * 64)()
    ctypes.memmove(buf, x.data_ptr(), 64)
    return {"read": list(buf)[:4], "want": x.cpu().tolist()[:4], "numpy_refused": _refused(x.numpy)}


def negative(kind: str) -> dict:
    """The checks have teeth: the prefill with a host-only operation put back (``raw``:
    the staged gather as ``ctypes.memmove`` over the KV addresses; ``no-sync``: KVReady
    without waiting for the device) fails them."""
    import ctypes

    from kvflow_helpers import gather_copies

    from vllm_hawk.kvflow import RingBuffer
    from vllm_hawk.kvflow.base import Prepared
    from vllm_hawk.kvflow.streams import ring_segments

    if kind == "raw":

        def prepare(self, msg, src_blocks, export_base):
            ids, rmap = src_blocks.tolist(), self.region_map

            def fill(addr, view):
                for dst, src, nb in gather_copies(rmap, ids, addr):
                    ctypes.memmove(dst, src, nb)

            return Prepared(len(ids) * rmap.block_nbytes, fill, lambda off: ring_segments(rmap, len(ids), off))

        RingGatherSource.prepare = prepare
    else:
        RingBuffer.synchronize = lambda self: None
    # no checksums: their copy to the host would wait for the device and hide the missing sync
    return run("staged", 32, source("staged", caches_on("cpu", 32, 0), 32).layout, 70, checksum="")


CAPTURE_S = 1.5  # how long the capture stays open while the endpoint idles


def _local_kv(dev, bs: int):
    """What the connector's ``describe_local`` makes of vLLM's FlashAttention caches on ``dev``."""
    from vllm_hawk.connector.describe import LocalKV, tt_compat

    caches = caches_on(dev, bs, 5)
    region_map = region_map_from_caches(caches, [block_byte_ranges(c, 0) for c in caches])
    lay = FlashAttnKVLayout(H, bs, D)
    return LocalKV(
        tt_compat("tiny", "bfloat16", bs, PROFILE),
        vllm_layout_desc(region_map, "vllm-paged/FLASH_ATTN", "bfloat16", bs, H, D),
        region_map,
        [(caches[0].data_ptr(), L * BLOCKS * region_map.block_nbytes)],
        TransformSource([lay] * L, caches),
        heads=head_maps(caches),
        num_kv_heads=H,
        caches=caches,
        adapters=[lay] * L,
    )


def _connector_prefill(kv, dev):
    """The GN-HAWK prefill exactly as the connector builds it at ``register_kv_caches``
    (:func:`~vllm_hawk.connector.strategies.make_prefill`, the configuration parsed from a
    ``kv_connector_extra_config``) over ``kv``."""
    from types import SimpleNamespace

    from vllm_hawk.connector import strategies
    from vllm_hawk.connector.config import parse_config

    extra = {
        "pair": "gn-hawk",
        "device_profile": PROFILE,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": _free_port(),
        "auth": "hmac",
        "shared_secret": "s" * 32,
        "ring_nbytes": 4 << 20,
    }
    cfg = parse_config(extra, side="prefill")
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1))
    transport = RecordingTransport({"cpu", f"{dev.type}:0"})
    return strategies.make_prefill(cfg, kv, transport, vllm_config, tp_rank=0, tp_size=1, on_finished=None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def startup_capture() -> dict:
    """Start-up, then a capture while the endpoint idles, then serving (see the test)."""
    dev = opaque_device.enable()
    bs, tokens = 16, 70  # vLLM's CUDA block size: 16-token sources into 32-token tiles
    dst = tt_desc("bfloat8_b", 32)
    kv = _local_kv(dev, bs)
    before = set(threading.enumerate())
    m0 = opaque_device.mark()
    ep = _connector_prefill(kv, dev)
    facts: dict = {}
    try:
        start = opaque_device.ops(m0)
        facts["startup_busy"] = opaque_device.busy()
        facts["startup_threads"] = sorted({o.thread for o in start})
        # work queued on the legacy default stream (the closing device-wide wait is none)
        facts["startup_default_stream_work"] = [o.what for o in start if o.stream == 0 and o.what != "synchronize"]
        facts["startup_ends_with_device_sync"] = any(o.what == "synchronize" for o in start)
        facts["startup_ops"] = len(start)
        facts["new_threads"] = sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())
        rng = np.random.default_rng(3)
        src_blocks = rng.permutation(BLOCKS)[: -(-tokens // bs)]
        dst_blocks = [int(b) for b in rng.permutation(40)[: -(-tokens // dst.block_size)]]
        replies, done = {}, threading.Semaphore(0)

        def reply_to(rid):
            def reply(msg):  # on the worker that produced it, as the side channel's outbox gets it
                replies[rid] = (msg, opaque_device.busy(), opaque_device.mark(), threading.current_thread().name)
                done.release()

            return reply

        def ask(rid):
            msg = KVRequest(req_id=rid, dst_layout=dst, num_tokens=tokens, dst_block_ids=dst_blocks)
            out = ep.on_kv_request("decode", msg, reply_to(rid))
            if out is not None:
                reply_to(rid)(out)

        # the capture: the endpoint idles, its side channel up; a decode's KVRequest that
        # beats the engine's hand-over arrives (on another thread, as the server's would)
        mc = opaque_device.mark()
        with opaque_device.capture() as cap:
            early = threading.Thread(target=ask, args=("r0",), name="side-channel")
            early.start()
            early.join()
            threading.Event().wait(CAPTURE_S)
        facts["capture_invalidated"] = cap.invalidated
        facts["capture_calls"] = len(opaque_device.ops(mc))
        facts["capture_offenders"] = [list(o) for o in cap.offenders[:5]]
        m1 = opaque_device.mark()
        ep.add_request("r0", src_blocks, tokens)  # the hand-over: the parked KVRequest is served
        ep.add_request("r1", src_blocks, tokens)
        ask("r1")
        for _ in range(2):
            assert done.acquire(timeout=120), "no KVReady"
        serving = opaque_device.ops(m1)
        facts["serving_threads"] = sorted({o.thread for o in serving})
        workers = {o.thread for o in serving}
        facts["streams_per_thread"] = {t: sorted({o.stream for o in serving if o.thread == t}) for t in workers}
        uploads = [o for o in serving if o.what == opaque_device.UPLOAD]
        facts["uploads"], facts["uploads_blocking"] = len(uploads), sum(not o.non_blocking for o in uploads)
        facts["replies"] = {}
        for rid, (msg, busy, at, thread) in replies.items():
            mine = [o for o in opaque_device.ops(m1)[: at - m1] if o.thread == thread]
            facts["replies"][rid] = {
                "kvready": isinstance(msg, KVReady),
                "busy_at_reply": busy,
                "last_calls": [o.what for o in mine[-2:]],
                "stream_syncs": sum(o.what in ("stream.synchronize", "synchronize") for o in mine),
            }
        ring = {
            rid: ep.ring.view(m.ring_offset, m.total_nbytes).cpu().numpy().tobytes() for rid, (m, *_) in replies.items()
        }
        t = make_transport("inprocess")
        try:
            host = serve(source("hawk", caches_on("cpu", bs, 5), bs), t, dst, tokens, src_blocks, dst_blocks)
        finally:
            t.close()
        facts["equal_to_host"] = all(b.hex() == host["bytes"] for b in ring.values())
        facts["decoys_untouched"] = opaque_device.decoys_untouched()
    finally:
        ep.close()
    return facts


def threaded_warm_during_capture() -> dict:
    """The check has teeth: the warm-up as the connector ran it before (a
    ``hawk-transform-warm`` thread, started just before vLLM's capture) invalidates it."""
    dev = opaque_device.enable()
    src = source("hawk", caches_on(dev, 16, 5), 16)
    with opaque_device.capture() as cap:
        t = threading.Thread(target=lambda: src.warm(src.profile), daemon=True, name="hawk-transform-warm")
        t.start()
        t.join(60)
    return {"capture_invalidated": cap.invalidated, "offender_threads": sorted({o.thread for o in cap.offenders})}


def _refused(fn) -> bool:
    try:
        fn()
    except RuntimeError:
        return True
    return False


SCENARIOS = {
    "hawk-bf16": lambda: run("hawk", 32, tt_desc("bfloat16", 32), 70),
    "hawk-bfp8": lambda: run("hawk", 32, tt_desc("bfloat8_b", 32), 70),
    "hawk-16-to-64": lambda: run("hawk", 16, tt_desc("bfloat8_b", 64), 150),
    "staged": lambda: run("staged", 32, source("staged", caches_on("cpu", 32, 0), 32).layout, 70),
    "in-place": lambda: run("vllm", 32, source("vllm", caches_on("cpu", 32, 0), 32).layout, 70),
    "host-staged-ring": lambda: host_staged_ring(source("staged", caches_on("cpu", 32, 0), 32).layout),
    "host-pointer-copy": host_pointer_copy,
    "once-hawk": lambda: registered_once("hawk"),
    "once-staged": lambda: registered_once("staged"),
    "once-in-place": lambda: registered_once("vllm"),
    "per-request-staged": lambda: registered_once("staged", "per_request"),
    "negative-raw-pointer-gather": lambda: negative("raw"),
    "negative-no-sync": lambda: negative("no-sync"),
    "startup-capture": startup_capture,
    "negative-threaded-warm-during-capture": threaded_warm_during_capture,
}

if __name__ == "__main__":
    print(json.dumps({name: SCENARIOS[name]() for name in sys.argv[1:]}))
