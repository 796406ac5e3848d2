"""GN-HAWK in HawkConnector: a Tenstorrent decode destination and the prefill's transform.

Decode side (:class:`TTDestination`): the engine runs on the Tenstorrent platform plugin
(:mod:`vllm_hawk.tt_plugin`); its KV cache is found in :mod:`vllm_hawk.tt_plugin.registry`
(the tensors vLLM passes to ``register_kv_caches`` are placeholders). The pull sends the
destination layout (device profile via the handshake's compat fields, tile dtype, block
size, banks, page size) and the destination block ids; the prefill answers with G' in its
ring and one segment per bank. Then, in ONE batch of READs:

* ``staged``: each bank's segment -> that bank's receive buffer (a slice of a
  :class:`~vllm_hawk.kvflow.bank_pool.BankBufferPool` taken through the bank-buffer API),
  then intra-bank copies into the KV pages (``copy_in_bank``, D6-D7);
* ``direct``: the plan's page runs straight into the KV pages (the KV buffers mapped with
  ``map_buffer_dma`` and registered with the transport).

Prefill side (:func:`serve_tt`): the request's last ``len(dst_block_ids)`` source blocks
(of the ``ceil(num_tokens / block_size)`` the decode asks for; the first ones may be a
local prefix hit on the decode) are transformed with :func:`~vllm_hawk.transform.transform_kv`
from the zero-copy K/V views of its vLLM cache straight into a reserved ring range.

Debugging/tests: with ``HAWK_CONNECTOR_DUMP_DIR`` set, the prefill saves the logical K/V
of the blocks it sends (``prefill-<req>.pt``) and the decode the bank bytes of the blocks
it filled (``decode-<req>.pt``), right after each transfer.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from vllm_hawk.protocol import KVReady, KVRequest, LayoutDesc, Segment, make_compat

DUMP_ENV = "HAWK_CONNECTOR_DUMP_DIR"
SRC_LAYOUT = "vllm-any"  # the prefill converts from whatever vLLM layout it has
MAX_DST_BLOCK_ID = 1 << 24


def tt_compat(model_id: str, dtype: str, block_size: int, profile: str):
    """Compatibility fields of both sides of a GN-HAWK pair (device profile ``profile``)."""
    return make_compat(model=model_id[:256], dtype=dtype, block_size=block_size,
                       src_layout=SRC_LAYOUT, dst_layout=f"tt-paged/{profile}"[:256],
                       device_profile=profile)


def model_id(vllm_config, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    hf = vllm_config.model_config.hf_config
    return (f"{getattr(hf, 'model_type', '?')}:L{num_layers}:KV{num_kv_heads}:D{head_dim}"
            f":V{getattr(hf, 'vocab_size', 0)}")


def _dump(name: str, obj) -> None:
    d = os.environ.get(DUMP_ENV)
    if not d:
        return
    Path(d).mkdir(parents=True, exist_ok=True)
    tmp = Path(d) / f".{name}.tmp"
    torch.save(obj, tmp)
    tmp.rename(Path(d) / name)


def _safe(rid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in rid)


# --------------------------------------------------------------------------- prefill

def check_tt_request(msg: KVRequest, mine: LayoutDesc, profile_name: str, held_tokens: int) -> str:
    """'' when a Tenstorrent destination can be served, else why not (bounds everything
    sized from the peer's layout before any plan)."""
    from vllm_hawk.layout.device_profiles import load_profile
    from vllm_hawk.layout.formats import tile_format
    from vllm_hawk.layout.tt_kv_cache import KV_DTYPES

    d = msg.dst_layout
    for f in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
        if getattr(mine, f) != getattr(d, f):
            return f"destination {f} is {getattr(d, f)!r}, this prefill has {getattr(mine, f)!r}"
    if d.dtype not in KV_DTYPES or tile_format(d.dtype).tile_nbytes != d.tile_nbytes:
        return f"destination dtype {d.dtype!r} with {d.tile_nbytes}-byte tiles is not supported"
    if d.block_size % 32 or d.head_dim % 32:
        return "destination block_size/head_dim are not multiples of the 32-wide tile"
    prof = load_profile(profile_name)
    if d.num_banks != prof.num_banks:
        return f"destination has {d.num_banks} banks; device profile {profile_name!r} has {prof.num_banks}"
    if d.page_nbytes != prof.aligned_page(d.tile_nbytes):
        return (f"destination page of {d.page_nbytes} bytes; {profile_name!r} pages "
                f"{d.tile_nbytes}-byte tiles into {prof.aligned_page(d.tile_nbytes)}")
    if msg.num_tokens <= 0 or msg.num_tokens > held_tokens:
        return f"num_tokens {msg.num_tokens} not in [1, {held_tokens}] (the prefill's length)"
    n_req = -(-msg.num_tokens // d.block_size)
    ids = list(msg.dst_block_ids)
    if not 0 < len(ids) <= n_req or len(set(ids)) != len(ids):
        return f"{len(ids)} destination block ids for at most {n_req} blocks (must be distinct, >= 1)"
    if max(ids) >= MAX_DST_BLOCK_ID:
        return f"destination block id {max(ids)} >= {MAX_DST_BLOCK_ID}"
    return ""


def serve_tt(msg: KVRequest, src_block_ids: list[int], views, src_block_size: int, ring,
             reserve_timeout_s: float, lease_ms: int) -> tuple[KVReady, float]:
    """P4-P7 for a Tenstorrent destination: G' of the request in the ring; (KVReady,
    transform seconds). ``views``: a :class:`~vllm_hawk.layout.vllm_kv.TransformSource`
    or per-layer (K, V) strided views. Raises BufferFull when the ring has no room in time
    (nothing held); on any other failure the ring range is freed before raising."""
    from vllm_hawk.kvflow.prefill import spec_from_desc
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout
    from vllm_hawk.layout.vllm_kv import as_transform_source
    from vllm_hawk.transform import make_plan, transform_kv

    d = msg.dst_layout
    dst = np.asarray(msg.dst_block_ids, dtype=np.int64)
    n_req = -(-msg.num_tokens // d.block_size)
    src = np.asarray(src_block_ids[n_req - dst.size:n_req], dtype=np.int64)
    layout = TTKVCacheLayout(spec_from_desc(d, int(dst.max()) + 1), d.num_banks, d.page_nbytes,
                             ((0, 0),) * d.num_layers)
    plan = make_plan(layout, dst, "staged")
    rid = msg.req_id
    off = ring.reserve(rid, plan.total_nbytes, reserve_timeout_s)  # P5
    try:
        t0 = time.perf_counter()
        views, src = as_transform_source(views).select(src)  # gathers for packed layouts (amx)
        if os.environ.get(DUMP_ENV):
            ids = torch.as_tensor(src)
            _dump(f"prefill-{_safe(rid)}.pt", {
                "src_blocks": src.tolist(), "dst_blocks": dst.tolist(), "num_tokens": msg.num_tokens,
                "dtype": d.dtype, "kv": [(k.index_select(0, ids).clone(), v.index_select(0, ids).clone())
                                         for k, v in views]})
        transform_kv(views, src, src_block_size, plan, out=ring.view(off, plan.total_nbytes))  # P4+P6
        t_tf = time.perf_counter() - t0
        segs = [Segment(int(b), off + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
                for b in range(d.num_banks) if plan.segment_nbytes[b]]
        return KVReady(req_id=rid, ring_offset=off, total_nbytes=plan.total_nbytes, segments=segs,
                       lease_ms=lease_ms), t_tf
    except BaseException:
        ring.release(rid)
        raise


def warm_transform(views, mine: LayoutDesc, profile_name: str) -> None:
    """Compile the transform kernels (numba, seconds on first use) before the first
    request: one block of each tile dtype into a scratch buffer."""
    from vllm_hawk.kvflow.prefill import spec_from_desc
    from vllm_hawk.layout.device_profiles import load_profile
    from vllm_hawk.layout.formats import tile_format
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout
    from vllm_hawk.layout.vllm_kv import as_transform_source
    from vllm_hawk.transform import make_plan, transform_kv

    views, ids = as_transform_source(views).select([0])
    prof = load_profile(profile_name)
    for dtype in ("bfloat16", "bfloat8_b"):
        tb = tile_format(dtype).tile_nbytes
        d = LayoutDesc(name="tt-paged", dtype=dtype, block_size=mine.block_size,
                       num_layers=mine.num_layers, num_kv_heads=mine.num_kv_heads,
                       head_dim=mine.head_dim, num_banks=prof.num_banks, tile_nbytes=tb,
                       page_nbytes=prof.aligned_page(tb))
        layout = TTKVCacheLayout(spec_from_desc(d, 1), d.num_banks, d.page_nbytes,
                                 ((0, 0),) * d.num_layers)
        transform_kv(views, ids, mine.block_size, make_plan(layout, [0], "staged"))


# --------------------------------------------------------------------------- decode

class TTDestination:
    """The decode engine's Tenstorrent KV cache as a pull destination (see module doc).

    cache: the plugin's ``TTPagedKVCache``; mode: ``staged`` | ``direct``; transport:
    the pull service's transport (receive buffers or KV pages get registered with it);
    recv_nbytes: receive-pool bytes over all banks (staged)."""

    def __init__(self, cache, mode: str, transport, recv_nbytes: int) -> None:
        from vllm_hawk.kvflow.decode import layout_desc

        self.cache, self.mode, self.transport = cache, mode, transport
        self.device = cache.device
        self.tt_layout = cache.layout
        self.layout = layout_desc(cache.layout, "tt-paged")
        self.num_banks = cache.layout.num_banks
        self.pool = None
        self._pages = None
        self._regions: list[int] = []
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        if mode == "staged":
            from vllm_hawk.kvflow.bank_pool import BankBufferPool

            align = self.device.profile.dram_alignment_bytes
            per_bank = max(align, recv_nbytes // self.num_banks // align * align)
            self.pool = BankBufferPool(self.device, per_bank, transport)
        else:
            from vllm_hawk.kvflow.decode import KVPageAddresses, merged_ranges

            self._pages = KVPageAddresses(self.device, cache.buffers)
            try:
                for a, n in merged_ranges(self._pages.regions()):
                    transport.register(a, n)
                    self._regions.append(a)
            except BaseException:
                self.close()
                raise

    # region_map is what PullService's vLLM path uses; a TT destination has none.
    region_map = None

    def plan(self, dst_blocks):
        from vllm_hawk.transform import make_plan

        return make_plan(self.tt_layout, np.asarray(dst_blocks, dtype=np.int64), self.mode)

    def check_ready(self, ready: KVReady, plan, ring_nbytes: int) -> None:
        want = [(int(b), ready.ring_offset + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
                for b in range(self.num_banks) if plan.segment_nbytes[b]]
        got = [(s.bank, s.offset_bytes, s.nbytes) for s in ready.segments]
        if got != want or ready.total_nbytes != plan.total_nbytes:
            raise ValueError(f"KVReady segments do not match the transfer plan (got {got[:3]}..., "
                             f"want {want[:3]}...)")
        if ready.ring_offset + ready.total_nbytes > ring_nbytes:
            raise ValueError("KVReady range lies outside the prefill's registered ring")

    def land(self, rid: str, ready: KVReady, plan, remote_base: int, read, timeout_s: float,
             fig: dict, dump_key: str | None = None) -> None:
        """D2-D7: ONE batch of READs (``read(entries)``), then the intra-bank copies."""
        base = remote_base
        with self._lock:
            self._inflight.add(rid)
        try:
            if self.mode == "staged":
                recv = self.pool.acquire(rid, plan.recv_nbytes_per_bank, min(timeout_s, 5.0))
                try:
                    entries = [(recv.addr(s.bank), base + s.offset_bytes, s.nbytes) for s in ready.segments]
                    t0 = time.monotonic()
                    read(entries)
                    t1 = time.monotonic()
                    n_copy = 0
                    for b in range(self.num_banks):
                        o = plan.intra_bank.for_bank(b)
                        if len(o):
                            self.device.copy_in_bank(b, o.src_offset + recv.device_offset, o.dst_offset,
                                                     o.nbytes)
                            n_copy += len(o)
                    fig["copy_ms"] = round(1e3 * (time.monotonic() - t1), 3)
                    fig["intra_bank_ops"] = n_copy
                finally:
                    self.pool.release(rid)
            else:
                ops = plan.rdma
                local = self._pages.addresses(ops.bank, ops.dst_offset, ops.nbytes).tolist()
                remote = (base + ready.ring_offset + ops.src_offset).tolist()
                entries = list(zip(local, remote, ops.nbytes.tolist()))
                t0 = time.monotonic()
                read(entries)
                t1 = time.monotonic()
            fig["read_ms"] = round(1e3 * (t1 - t0), 3)
            fig["entries"] = len(entries)
            fig["nbytes"] = sum(e[2] for e in entries)
            per_bank = [0] * self.num_banks
            for s in ready.segments:
                per_bank[s.bank] += s.nbytes
            fig["bytes_per_bank"] = per_bank
            fig["tile_dtype"] = self.layout.dtype
            fig["banks"] = self.num_banks
        finally:
            with self._lock:
                self._inflight.discard(rid)
        if os.environ.get(DUMP_ENV):
            blocks = [int(b) for b in plan.dst_blocks]
            c = self.cache
            _dump(f"decode-{_safe(dump_key or rid)}.pt", {
                "dst_blocks": blocks, "dtype": c.spec.dtype, "device": self.device.profile.name,
                "bytes": [(c.read_block_bytes(i, 0, blocks).clone(), c.read_block_bytes(i, 1, blocks).clone())
                          for i in range(c.spec.num_layers)]})

    def snapshot(self) -> dict:
        """Idle check: receive slices held and pulls landing right now."""
        with self._lock:
            out = {"inflight": len(self._inflight)}
        if self.pool is not None:
            out.update(recv_live=len(self.pool.live()), recv_idle=self.pool.is_idle())
        return out

    def close(self) -> None:
        for a in self._regions:
            try:
                self.transport.unregister(a)
            except Exception:  # noqa: BLE001
                pass
        self._regions = []
        if self._pages is not None:
            self._pages.close()
            self._pages = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
