"""``hawk bench transfer``: KV transfer latency, prefill process -> decode process (paper Figure 9).

Two processes on this machine: a spawned prefill holding a vLLM-layout (FlashAttention
NHD, bf16) paged KV cache, and this process as the decode with an emulated Tenstorrent
device (default p150a). Latency is measured on the decode side from its request (D1) to
the KV being in its pool; the Release round trip is not counted. Rows:

=================  ==========================================================================
GG-Host            host-staged transport (extra host copy each side + TCP), vLLM layout both sides
GN-Host            GG-Host's transfer into a host receive ring, then the layout fix on the decode
                   side (tilize/pack = the HAWK transform, run after arrival) and the write into
                   the device KV pool: the serving path's sink (``kvflow.gn_host.GNHostSink``)
GG-Direct          Mooncake, vLLM layout to vLLM layout, block runs coalesced, no transform
GG-Staged          opt-in (``--rows``): the connector's GG ``mode: staged``: the prefill gathers the
                   blocks' layer streams (a share: its heads) into its ring, one segment per layer;
                   the decode READs them into a receive ring and copies into its vLLM-layout blocks
GN-HAWK staged     Mooncake + prefill transform into the ring + one READ per bank into the
                   per-bank receive buffers + intra-bank copies (Algorithm 1)
GN-HAWK direct     as staged, but the READs target the KV pages (coalesced runs), no copy
per-tile           the mapping the paper rejects: one READ per tile, direct to the KV pages;
                   capped by time at large sizes (the fraction done is reported, the latency
                   extrapolated linearly from it)
GN-HAWK pipelined  staged, fetched by ``--layer-groups`` layer groups (the engine's layer-group
                   pipelining, ``DecodeEndpoint.fetch(layer_groups=...)``): the prefill
                   transforms group i+1 while the decode reads group i (one READ batch per group)
GN-HAWK direct     direct, by layer groups likewise
  pipelined
=================  ==========================================================================

Every row also reports its ratio to GG-Direct measured in the same run and its CPU time
(user + sys of both processes per request) with the ratio to GG-Direct's.

The comparison is at equal bytes: every row first runs with a bfloat16 target. GN-HAWK
rows are then repeated with a bfloat8_b target, which moves ~47% fewer bytes because the
prefill packs block floats: every row reports the bytes it moved next to its latency.
The prefill's two Mooncake engines are separate. ``--registration`` picks what each side
registers with the transport: ``per_request`` (default: only a live request's ring range,
block runs, receive slices or KV pages, for its transfer) or ``whole`` (the ring, the
GG-Direct cache, the receive pools and the KV pool registered once at start); ``both`` runs
the two one after the other in this invocation and prints per-request / whole latency ratios per row and size.
Block tables are contiguous runs (a fresh cache) unless ``--fragmented``.

Integrity (:mod:`vllm_hawk.integrity`): ``--integrity on`` (default, the connector's) has
the decode ask for checksums, the prefill take them on its device and the decode check
them where the bytes landed; ``off`` skips both; ``both`` alternates the two request by
request (on, off, off, on, ...) in this run and reports, per row and size, the latency and
CPU time with the check over those without it, and the decode's check time (``check ms``;
the prefill's part is in ``request ms``).

Tensor parallelism (default: the paper's Llama-3.1-70B, prefill TP=4 -> 4 p150a chips):
``--prefill-tp P`` spawns one prefill process per rank holding its shard, ``--decode-tp D``
(alias ``--chips``) makes one emulated device per chip with its own decodes. Each chip pulls
its shares (:func:`vllm_hawk.kvflow.shares.plan_shares`, fetched by
:func:`~vllm_hawk.kvflow.shares.fetch_shares`, the connector's path): with P = D the
whole shard of its prefill rank, with P < D part of one rank's shard (that rank serves
D/P chips and frees the request after the last share's Release), with P > D one share
from each of several ranks. GN rows need a chip's heads whole from one prefill rank
(P <= D, as the connector's Tenstorrent mesh does); P > D runs the GG rows only (their
vLLM-layout sinks are restricted to each share's heads) and refuses GN rows, naming both
sizes. Prefill ranks nobody pulls from (replicated heads) are released by chip 0. The
chips' pulls of one request run concurrently (one thread per chip, one per share); its
latency is from the first chip's request to the last chip's KV in place. ``--sizes-mb``
is the request's bf16 KV over all KV heads (each chip gets its share). Every row reports
per chip: the prefill rank(s) it pulled from, bytes moved, bytes per DRAM bank (largest
bank), segments (in KVReady) and READ entries, plus totals. A row whose pull the prefill
refuses (e.g. a share of an NHD cache served in place needs one segment per token and
layer, past the protocol's 4096 per KVReady) is reported as not measured, with the reason.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys

import numpy as np

from vllm_hawk.bench.common import print_table, progress, write_json
from vllm_hawk.child_process import stop_pipe_process
from vllm_hawk.layout_report import tp_args

ROWS = (
    "GG-Host",
    "GN-Host",
    "GG-Direct",
    "GN-HAWK staged",
    "GN-HAWK direct",
    "per-tile",
    "GN-HAWK pipelined",
    "GN-HAWK direct pipelined",
)
EXTRA_ROWS = ("GG-Staged",)  # opt-in (--rows): GG through the prefill's ring, the connector's mode staged
HAWK_BFP8_ROWS = ("GN-HAWK staged", "GN-HAWK direct", "GN-HAWK pipelined", "GN-HAWK direct pipelined")
HAWK_ROWS = ("GN-HAWK staged", "GN-HAWK direct", "GN-HAWK pipelined", "GN-HAWK direct pipelined")
DEFAULT_SIZES = (10, 40, 160, 640)
INTEGRITY_MODES = ("on", "off", "both")  # --integrity: checked pulls, unchecked, or alternating (ratios)


# ---------------------------------------------------------------------------- prefill process
def _prefill_main(cfg: dict, conn) -> None:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    from vllm_hawk.bench.endpoints import prefill_endpoint
    from vllm_hawk.bench.paged_cache import PagedKVCache
    from vllm_hawk.protocol import make_compat
    from vllm_hawk.transport import make_transport

    cache = PagedKVCache(*cfg["shape"]).fill_random(cfg["seed"])
    compat = make_compat(*cfg["compat"])
    transports = {
        "hawk": make_transport("mooncake"),
        "gg_direct": make_transport("mooncake"),
        "gg_host": make_transport("host_staged", chunk_nbytes=cfg["host_chunk"]),
    }
    reg = cfg.get("registration", "per_request")
    eps = {
        "hawk": prefill_endpoint(
            cache,
            transports["hawk"],
            compat,
            "hawk",
            ring_nbytes=cfg["ring_nbytes"],
            claim_wait_s=60,
            lease_s=600,
            registration=reg,
        ),
        "gg_direct": prefill_endpoint(cache, transports["gg_direct"], compat, "vllm", lease_s=600, registration=reg),
        "gg_host": prefill_endpoint(cache, transports["gg_host"], compat, "vllm", lease_s=600, registration=reg),
    }
    if cfg.get("gg_staged"):  # the blocks' layer streams (or a share's heads) gathered into a ring
        transports["gg_staged"] = make_transport("mooncake")
        eps["gg_staged"] = prefill_endpoint(
            cache,
            transports["gg_staged"],
            compat,
            "staged",
            ring_nbytes=cfg["ring_nbytes"],
            claim_wait_s=60,
            lease_s=600,
            registration=reg,
        )
    conn.send({k: e.endpoint for k, e in eps.items()})
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "add":
                _, name, rid, src, n = cmd
                eps[name].add_request(rid, src, n)
                conn.send(None)
            elif cmd[0] == "transform_s":
                conn.send(eps["hawk"].produce_seconds(cmd[1]))
            elif cmd[0] == "cpu_s":
                r = resource.getrusage(resource.RUSAGE_SELF)
                conn.send(r.ru_utime + r.ru_stime)
            elif cmd[0] == "snapshot":
                conn.send({k: {**e.snapshot(), "registrations": e.exposure.registrations} for k, e in eps.items()})
            else:
                break
    finally:
        for e in eps.values():
            e.close()
        for t in transports.values():
            t.close()


class _Prefill:
    """One prefill rank's process; ``wait=False`` returns at once (call :meth:`wait`), so
    several ranks start together."""

    def __init__(self, cfg: dict, start_timeout_s: float = 300.0, wait: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(cfg, child), daemon=True)
        self.proc.start()
        child.close()
        self.start_timeout_s, self.endpoints = start_timeout_s, None
        if wait:
            self.wait()

    def wait(self) -> None:
        if self.endpoints is not None:
            return
        if not self.conn.poll(self.start_timeout_s):
            self.stop()
            raise RuntimeError("prefill process did not start")
        self.endpoints = self.conn.recv()

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def stop(self) -> None:
        stop_pipe_process(self.proc, self.conn, 20)


# ---------------------------------------------------------------------------- decode side
GG_ROWS = ("GG-Host", "GG-Direct", "GG-Staged")  # vLLM-layout decodes: any TP pairing


class HeterogeneousTP(ValueError):
    """A GN row asked for with prefill TP > chips: a chip's heads would come from several
    prefill ranks, and a Tenstorrent chip lands whole head shards (as in the connector)."""


def tp_plan(model: str, prefill_tp: int, decode_tp: int, rows=ROWS) -> list:
    """Per decode chip, its shares (:func:`vllm_hawk.kvflow.shares.plan_shares`) of a
    request. Raises :class:`~vllm_hawk.layout.tp.TPMismatch` (both sizes named) or
    :class:`HeterogeneousTP` (GN rows with ``prefill_tp > decode_tp``)."""
    from vllm_hawk.kvflow.shares import plan_shares
    from vllm_hawk.layout.model_shapes import load_model_shape

    shape = load_model_shape(model)
    h = shape.num_kv_heads
    plans = [plan_shares(h, prefill_tp, decode_tp, d, shape.kv_heads_per_rank(decode_tp)) for d in range(decode_tp)]
    gn = [r for r in rows if r not in GG_ROWS]
    split = [d for d, plan in enumerate(plans) if len(plan) > 1]
    if gn and split:
        raise HeterogeneousTP(
            f"prefill TP {prefill_tp} -> decode TP {decode_tp} ({h} KV heads): chip {split[0]}'s heads come from "
            f"prefill ranks {[ps.prefill_rank for ps in plans[split[0]]]}, and a Tenstorrent chip lands whole head "
            f"shards from one prefill rank (prefill TP <= chips), so rows {gn} cannot run; use "
            f"--prefill-tp <= --decode-tp, or --rows {' '.join(GG_ROWS)}"
        )
    return plans


_HOST_CHUNK_NBYTES = 4 << 20  # the host-staged transport's chunk (bytes), both sides
_KIND_OF_ROW = {"GG-Host": "gg_host", "GN-Host": "gg_host", "GG-Direct": "gg_direct", "GG-Staged": "gg_staged"}
_MODE_OF_ROW = {
    "GN-HAWK staged": "staged",
    "GN-HAWK direct": "direct",
    "per-tile": "per_tile",
    "GN-HAWK pipelined": "staged",
    "GN-HAWK direct pipelined": "direct",
}


def _kind_of(row: str) -> str:
    """The prefill endpoint kind serving ``row``: GG-Host and GN-Host share the host-staged
    vLLM-layout endpoint; every GN-HAWK row and per-tile use ``hawk``."""
    return _KIND_OF_ROW.get(row, "hawk")


def run(
    model: str = "llama-3.1-70b",
    prefill_tp: int = 4,
    decode_tp: int | None = None,
    device_profile: str = "p150a",
    block_size: int = 64,
    sizes_mb=DEFAULT_SIZES,
    repeats: int = 5,
    rows=ROWS,
    per_tile_cap_s: float = 10.0,
    fragmented: bool = False,
    seed: int = 0,
    layer_groups: int = 2,
    registration: str = "per_request",
    integrity: str = "on",
) -> dict:
    """Measure every row for requests of ``sizes_mb`` MB (bf16 KV of all the model's KV heads)
    moved from ``prefill_tp`` prefill processes to ``decode_tp`` chips (default prefill_tp;
    each chip pulls its shares, module doc; the pulls of one request run concurrently, one
    thread per chip). ``block_size`` is in tokens, ``per_tile_cap_s`` in seconds."""
    decode_tp = prefill_tp if decode_tp is None else decode_tp
    bench = _TransferRun(
        model,
        prefill_tp,
        decode_tp,
        device_profile,
        block_size,
        sizes_mb,
        repeats,
        rows,
        per_tile_cap_s,
        fragmented,
        seed,
        layer_groups,
        registration,
        integrity,
    )
    try:
        bench.start()
        bench.measure_all()
        snap = bench.snapshot()
    finally:
        bench.close()
    _normalise(bench.results)
    return {
        "rows": bench.results,
        "failed": bench.failed,
        "targets": check_targets(bench.results),
        "prefill_snapshot": snap,
        "config": bench.config(),
    }


class _DecodeSide:
    """The decode side of one :func:`run`: its transports (one Mooncake engine, one
    host-staged) and per chip (:attr:`chips`, one dict each) an emulated device with one
    decode per row kind, pulling the chip's shares. Sizes are in bytes (``*_nbytes``,
    ``recv_per_bank``, ``need``) or KV blocks (``cache_blocks``)."""

    def __init__(self, run: _TransferRun, compat) -> None:
        self.shape, self.heads, self.block_size = run.shape, run.heads, run.block_size
        self.cache_blocks, self.src_nbytes, self.idle = run.cache_blocks, run.src_nbytes, run.idle
        self.device_profile, self.registration, self.gg_kinds = run.device_profile, run.registration, run.gg_kinds
        self.decode_tp, self.compat = run.decode_tp, compat
        self.mc = self.hs = self.pool = None
        self.closers: list = []
        self.chips: list[dict] = []
        self.prefill_eps: dict = {}

    def open(self) -> None:
        """The transports, the device sizes and (several chips) the pool of chip threads."""
        import concurrent.futures as cf

        from vllm_hawk.transport import make_transport

        self.mc = make_transport("mooncake")
        self.hs = make_transport("host_staged", chunk_nbytes=_HOST_CHUNK_NBYTES)
        self.transport_of = {"hawk": self.mc, "gg_direct": self.mc, "gg_host": self.hs}
        if "gg_staged" in self.gg_kinds:
            self.transport_of["gg_staged"] = self.mc
        self._size_device()
        if self.decode_tp > 1:
            self.pool = cf.ThreadPoolExecutor(self.decode_tp, thread_name_prefix="bench-chip")

    def add_chips(self, plans: list, prefill_eps: dict) -> None:
        """One chip per plan of :func:`tp_plan`; ``prefill_eps``: per prefill rank, its
        endpoints by kind."""
        self.prefill_eps = prefill_eps
        for d, plan in enumerate(plans):
            self.chips.append(self._chip(d, plan))

    def _size_device(self) -> None:
        """The device KV pools' specs (both targets), each bank's receive buffer
        (``recv_per_bank``, bytes) and the device memory a chip needs (``need``, bytes)."""
        from vllm_hawk.layout.device_profiles import load_profile
        from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec

        shape = self.shape
        self.spec = {
            dt: TTKVCacheSpec(shape.num_layers, self.cache_blocks, self.heads, self.block_size, shape.head_dim, dt)
            for dt in ("bfloat16", "bfloat8_b")
        }
        prof = load_profile(self.device_profile)
        nb = prof.num_banks
        # the largest request's G' spread over the banks, + slack
        self.recv_per_bank = -(-self.src_nbytes // nb) + (1 << 20)
        self.need = (
            sum(
                -(-s.tiles_per_tensor // nb) * prof.aligned_page(s.tile_nbytes) * 2 * s.num_layers
                for s in self.spec.values()
            )
            + self.recv_per_bank
        )

    def _endpoint(self, kind: str, rank: int):
        """A further :class:`DecodeEndpoint` of this decode to prefill rank ``rank``'s ``kind`` endpoint."""
        from vllm_hawk.kvflow import DecodeEndpoint

        ep = DecodeEndpoint(self.transport_of[kind], self.prefill_eps[rank][kind], self.compat, pull_timeout_s=600)
        self.closers.append(ep.close)
        return ep

    def _chip(self, d: int, plan: list) -> dict:
        """Chip ``d``: an emulated device and one decode per row kind, pulling ``plan``'s shares."""
        from vllm_hawk.bench.paged_cache import PagedKVCache
        from vllm_hawk.layout.tp import shard_heads
        from vllm_hawk.npu.emulated import EmulatedDevice

        shape = self.shape
        eps = self.prefill_eps[plan[0].prefill_rank]  # the decodes' own endpoints: the chip's first share's rank
        own = shard_heads(shape.num_kv_heads, self.decode_tp, d, "decode tensor_parallel_size (or chips)")
        dev = EmulatedDevice(self.device_profile, max(256 << 20, -(-int(self.need * 1.1) // (1 << 20)) << 20))
        self.closers.append(dev.close)
        c = {"chip": d, "plan": plan, "prefill_ranks": [ps.prefill_rank for ps in plan], "heads": [own.start, own.stop]}
        self._add_hawk_decodes(c, dev, eps)
        dcache = PagedKVCache(shape.num_layers, self.cache_blocks, self.heads, self.block_size, shape.head_dim)
        self._add_vllm_wire_decodes(c, dev, eps, dcache)
        # GG rows with prefill TP > chips: the other ranks' endpoints, and sinks restricted to each share's heads
        c["more_eps"] = {
            (kind, ps.prefill_rank): self._endpoint(kind, ps.prefill_rank) for ps in plan[1:] for kind in self.gg_kinds
        }
        c["views"] = self._head_views(c, plan, dcache)
        # chip 0 releases the prefill ranks nobody pulls from (replicated heads)
        c["idle_eps"] = (
            {(kind, r): self._endpoint(kind, r) for r in self.idle for kind in self.transport_of} if d == 0 else {}
        )
        return c

    def _add_hawk_decodes(self, c: dict, dev, eps: dict) -> None:
        """``c["hawk"]``: per target dtype a decode into the device's KV pool (the bfloat8_b
        one shares the bfloat16 one's device pool)."""
        from vllm_hawk.bench.endpoints import TTDecode

        hawk = c["hawk"] = {}
        for dt in ("bfloat16", "bfloat8_b"):
            hawk[dt] = TTDecode(
                dev,
                self.spec[dt],
                self.mc,
                eps["hawk"],
                self.compat,
                recv_nbytes_per_bank=self.recv_per_bank,
                pool=hawk["bfloat16"].pool if dt != "bfloat16" else None,
                timeout_s=600,
                registration=self.registration,
            )
            self.closers.append(hawk[dt].close)

    def _add_vllm_wire_decodes(self, c: dict, dev, eps: dict, dcache) -> None:
        """The decodes fed from vLLM-layout prefill endpoints: GG-Direct, GG-Host (and
        GG-Staged) into the vLLM-layout cache ``dcache``, GN-Host into the device's KV pool."""
        from vllm_hawk.bench.endpoints import GNHostDecode, VllmDecode
        from vllm_hawk.kvflow.gn_host import wire_layout_of

        reg, compat = self.registration, self.compat
        c["gg_direct"] = VllmDecode(dcache, self.mc, eps["gg_direct"], compat, timeout_s=600, registration=reg)
        self.closers.append(c["gg_direct"].close)
        c["gg_host"] = VllmDecode(dcache, self.hs, eps["gg_host"], compat, timeout_s=600, registration=reg)
        self.closers.append(c["gg_host"].close)
        if "gg_staged" in self.gg_kinds:  # READs into a receive ring, then copies into the blocks
            c["gg_staged"] = VllmDecode(
                dcache,
                self.mc,
                eps["gg_staged"],
                compat,
                mode="staged",
                timeout_s=600,
                recv_nbytes=self.src_nbytes + (1 << 20),
                registration=reg,
            )
            self.closers.append(c["gg_staged"].close)
        # GN-Host: GG-Host's transfer into a receive ring, then the runtime sink's layout fix into the KV pool
        hawk = c["hawk"]["bfloat16"]
        c["gn_host"] = GNHostDecode(
            dev,
            self.spec["bfloat16"],
            self.hs,
            eps["gg_host"],
            compat,
            wire_layout_of(dcache.adapter, dcache.layers[0]),
            recv_nbytes=self.src_nbytes + (1 << 20),
            timeout_s=600,
            registration=reg,
            layout=hawk.layout,
            bufs=hawk.bufs,
        )
        self.closers.append(c["gn_host"].close)

    def _head_views(self, c: dict, plan: list, dcache) -> dict:
        """Per share that is not all of the chip's heads, keyed (first head, heads): each GG
        kind's sink restricted to those heads of ``dcache``."""
        from vllm_hawk.kvflow.sources import vllm_layout_desc
        from vllm_hawk.kvflow.streams import head_maps

        views = {}
        for ps in plan:
            if (ps.dst_start, ps.count) != (0, self.heads):
                m = head_maps(dcache.layers)(ps.dst_start, ps.count)
                desc = vllm_layout_desc(
                    m, dcache.desc.name, dcache.desc.dtype, self.block_size, ps.count, self.shape.head_dim
                )
                views[(ps.dst_start, ps.count)] = {k: c[k].sink.for_heads(m, desc, ps.dst_start) for k in self.gg_kinds}
        return views

    def share_of(self, c: dict, row: str, dtype: str, mode: str, ps) -> tuple:
        """(endpoint, sink, share) of one share of chip ``c``'s pull for ``row``."""
        if row in GG_ROWS:
            k = _kind_of(row)
            ep = c[k].ep if ps.prefill_rank == c["prefill_ranks"][0] else c["more_eps"][(k, ps.prefill_rank)]
            view = c["views"].get((ps.dst_start, ps.count))
            return ep, view[k] if view else c[k].sink, ps
        if row == "GN-Host":  # into the receive ring, then the layout fix into the device's KV pool
            return c["gn_host"].ep, c["gn_host"].sink, ps
        return c["hawk"][dtype].ep, c["hawk"][dtype].sink(mode), ps

    def set_integrity(self, check: bool) -> None:
        """Every decode endpoint of every chip asks for and checks checksums (``check``) or
        not, from its next pull on (the connector's ``integrity`` field, per request here)."""
        for c in self.chips:
            decodes = [*c["hawk"].values(), *(c[k] for k in (*self.gg_kinds, "gn_host"))]
            for ep in [d.ep for d in decodes] + [*c["more_eps"].values(), *c["idle_eps"].values()]:
                ep.integrity = check

    def close_steps(self) -> list:
        """The chip threads stopped; then what closes every decode, device and endpoint (the
        last opened first) and the transports."""
        if self.pool is not None:
            self.pool.shutdown()
        return [*reversed(self.closers), *(t.close for t in (self.mc, self.hs) if t is not None)]


class _TransferRun:
    """The state of one :func:`run`: the prefill rank processes, the decode side
    (:class:`_DecodeSide`: transports, per chip a device and its decodes) and the rows
    measured. Sizes are in bytes (``*_nbytes``, ``per_token``), MB of 1e6 bytes (``*_mb``)
    or KV blocks (``n_blocks``, ``cache_blocks``)."""

    def __init__(
        self,
        model: str,
        prefill_tp: int,
        decode_tp: int,
        device_profile: str,
        block_size: int,
        sizes_mb,
        repeats: int,
        rows,
        per_tile_cap_s: float,
        fragmented: bool,
        seed: int,
        layer_groups: int,
        registration: str,
        integrity: str = "on",
    ) -> None:
        from vllm_hawk.kvflow.shares import idle_ranks
        from vllm_hawk.layout.model_shapes import load_model_shape

        self.model, self.prefill_tp, self.decode_tp = model, prefill_tp, decode_tp
        self.device_profile, self.block_size, self.sizes_mb = device_profile, block_size, sizes_mb
        self.repeats, self.rows, self.per_tile_cap_s, self.fragmented = repeats, rows, per_tile_cap_s, fragmented
        self.seed, self.layer_groups, self.registration = seed, layer_groups, registration
        if integrity not in INTEGRITY_MODES:
            raise ValueError(f"integrity must be one of {INTEGRITY_MODES}, got {integrity!r}")
        self.integrity = integrity
        self.plans = tp_plan(model, prefill_tp, decode_tp, rows)  # raises before any process starts
        shape = self.shape = load_model_shape(model)
        self.heads = shape.kv_heads_per_rank(decode_tp)  # per chip
        self.per_token = shape.kv_bytes_per_token(decode_tp, 2)  # one chip's bytes per token (bf16)
        self.n_blocks = {mb: max(1, round(mb * 1e6 / shape.kv_bytes_per_token(1, 2) / block_size)) for mb in sizes_mb}
        max_n = max(self.n_blocks.values())
        self.cache_blocks = (2 * max_n if fragmented else max_n) + 1
        self.src_nbytes = max_n * block_size * self.per_token  # one chip's share of the largest request
        # one prefill rank's shard of the largest request
        self.rank_nbytes = max_n * block_size * shape.kv_bytes_per_token(prefill_tp, 2)
        self.compat_args = (shape.name, "bfloat16", block_size, "vllm-flash-nhd", "tt-paged", device_profile)
        self.idle = idle_ranks(shape.num_kv_heads, prefill_tp, decode_tp)
        self.gg_kinds = ("gg_direct", "gg_host") + (("gg_staged",) if "GG-Staged" in rows else ())
        self.pre: dict = {}
        self.decode: _DecodeSide | None = None
        self.results: list[dict] = []
        self.failed: list[dict] = []  # rows whose pull was refused: row, dtype, size_mb, error
        self.requests = 0  # requests sent so far: each request id is unique

    # ------------------------------------------------------------------------ set-up
    def start(self) -> None:
        """Start every prefill rank's process, open the decode side while they start, then
        wait for each and build every chip's decodes."""
        from vllm_hawk.protocol import make_compat

        for r in range(self.prefill_tp):
            self.pre[r] = _Prefill(self._prefill_cfg(r), wait=False)
        self.decode = _DecodeSide(self, make_compat(*self.compat_args))
        self.decode.open()
        for p in self.pre.values():
            p.wait()
        self.decode.add_chips(self.plans, {r: p.endpoints for r, p in self.pre.items()})

    @property
    def chips(self) -> list[dict]:
        """Per decode chip its pull and decodes (:class:`_DecodeSide`)."""
        return self.decode.chips if self.decode is not None else []

    def _prefill_cfg(self, rank: int) -> dict:
        """The config of prefill rank ``rank``'s process: its shard's cache shape (layers,
        blocks, KV heads, tokens per block, head dim), seed, and ring size in bytes."""
        shape = self.shape
        return {
            "shape": (
                shape.num_layers,
                self.cache_blocks,
                shape.kv_heads_per_rank(self.prefill_tp),
                self.block_size,
                shape.head_dim,
            ),
            "seed": self.seed + rank,
            "compat": self.compat_args,
            "ring_nbytes": int(self.rank_nbytes * 1.05) + (8 << 20),  # every share of the rank at once
            "host_chunk": _HOST_CHUNK_NBYTES,
            "registration": self.registration,
            "gg_staged": "GG-Staged" in self.rows,
        }

    # ------------------------------------------------------------------------ measurement
    def _fetch(self, c: dict, row: str, dtype: str, rid: str, tokens: int, dst) -> tuple:
        """Chip ``c``'s shares of request ``rid`` (:func:`fetch_shares`, the connector's path):
        (FetchResult, start time in ``time.monotonic`` seconds)."""
        import time

        from vllm_hawk.kvflow.shares import fetch_shares

        t0 = time.monotonic()
        mode = _MODE_OF_ROW.get(row, "")
        groups = self.layer_groups if row.endswith("pipelined") else 1
        r = fetch_shares(
            rid,
            tokens,
            [self.decode.share_of(c, row, dtype, mode, ps) for ps in c["plan"]],
            dst,
            layer_groups=groups,
            time_cap_s=self.per_tile_cap_s if mode == "per_tile" else None,
        )
        return r, t0

    def _one(self, row: str, dtype: str, n: int, src, dst) -> list:
        """One request of ``n`` blocks: every chip's pull (concurrently when there are several
        chips); per chip (FetchResult, start time)."""
        import concurrent.futures as cf

        self.requests += 1
        tokens = n * self.block_size
        rid = f"{row}-{dtype}-{self.requests}"
        kind = _kind_of(row)
        for p in self.pre.values():  # every prefill rank prefilled the request (its shard)
            p.call("add", kind, rid, src, tokens)
        pool = self.decode.pool
        if pool is None:
            out = [self._fetch(self.chips[0], row, dtype, rid, tokens, dst)]
        else:
            futs = [pool.submit(self._fetch, c, row, dtype, rid, tokens, dst) for c in self.chips]
            cf.wait(futs)  # every chip's pull ended (a failure is raised after all of them)
            out = [f.result() for f in futs]
        for ep in (e for (k, _r), e in self.chips[0]["idle_eps"].items() if k == kind):
            ep.release(rid, ok=True)
        if kind == "hawk":
            self._record_transform_s(rid, out)
        return out

    def _record_transform_s(self, rid: str, out: list) -> None:
        """Per chip, the longest prefill transform (seconds) of request ``rid`` over the ranks
        it pulled from, into its FetchResult's ``extra["transform_s"]``."""
        ts = {r: self.pre[r].call("transform_s", rid) or 0.0 for c in self.chips for r in c["prefill_ranks"]}
        for c, (r, _) in zip(self.chips, out, strict=False):
            r.extra["transform_s"] = max(ts[p] for p in c["prefill_ranks"])

    def _prefill_cpu_s(self) -> float:
        """User + system CPU seconds of every prefill process so far."""
        return sum(p.call("cpu_s") for p in self.pre.values())

    def measure_all(self) -> None:
        """Every row at every size with a bfloat16 target, then the bfloat8_b GN-HAWK rows."""
        cases = [(r, "bfloat16", mb) for mb in self.sizes_mb for r in self.rows]
        cases += [(r, "bfloat8_b", mb) for mb in self.sizes_mb for r in HAWK_BFP8_ROWS if r in self.rows]
        rng = np.random.default_rng(self.seed)
        for i, (row, dtype, mb) in enumerate(cases):
            progress(i, len(cases), f"{row} {dtype} {mb} MB")
            self._measure(row, dtype, mb, rng)
        progress(len(cases), len(cases), "done")

    def _measure(self, row: str, dtype: str, mb, rng) -> None:
        """One case: a warm-up request per integrity setting, then the repeats (alternating
        the settings under ``both``); its row into ``results``, or into ``failed`` when the
        prefill refuses the pull."""
        from vllm_hawk.kvflow import PeerFailed

        n = self.n_blocks[mb]
        if self.fragmented:
            src, dst = rng.permutation(self.cache_blocks)[:n], rng.permutation(self.cache_blocks)[:n]
        else:
            src, dst = np.arange(1, n + 1), np.arange(1, n + 1)
        reps = self.repeats if row != "per-tile" else (1 if mb >= 160 else min(self.repeats, 3))
        checks = {"on": (True,), "off": (False,), "both": (True, False)}[self.integrity]
        try:
            for check in checks:  # warm-up
                self.decode.set_integrity(check)
                self._one(row, dtype, n, src, dst)
        except PeerFailed as e:  # the pull is refused (e.g. too many segments): reported, the rest runs
            self.failed.append({"row": row, "dtype": dtype, "size_mb": mb, "error": str(e)})
            return
        runs: dict[bool, list] = {c: [] for c in checks}
        cpu: dict[bool, float] = dict.fromkeys(checks, 0.0)
        for i in range(reps):
            for check in checks if i % 2 == 0 else checks[::-1]:
                self.decode.set_integrity(check)
                c0 = _cpu_s() + self._prefill_cpu_s()
                runs[check].append(self._one(row, dtype, n, src, dst))
                cpu[check] += _cpu_s() + self._prefill_cpu_s() - c0
        fig = {
            c: _row_figures(
                row, dtype, mb, n, self.block_size, self.per_token, runs[c], reps, cpu[c] / reps * 1e3, self.chips
            )
            for c in checks
        }
        out = fig[checks[0]]
        out["integrity"] = self.integrity
        if self.integrity == "both":
            off = fig[False]
            out["latency_unchecked_ms"], out["cpu_unchecked_ms"] = off["latency_ms"], off["cpu_ms"]
            out["check_ratio"] = out["latency_ms"] / off["latency_ms"]
            out["check_cpu_ratio"] = out["cpu_ms"] / off["cpu_ms"] if off["cpu_ms"] > 0 else float("nan")
        self.results.append(out)

    def snapshot(self) -> dict:
        """Every prefill endpoint's counters, keyed ``kind@rankR``."""
        return {f"{k}@rank{r}": v for r, p in self.pre.items() for k, v in p.call("snapshot").items()}

    # ------------------------------------------------------------------------ tear-down and report
    def close(self) -> None:
        """Stop the chip threads, then close every decode, device and endpoint (the last opened
        first), the decode's transports and every prefill process started so far; also after a
        failed start. A failing step is reported on stderr and the rest still run."""
        steps = [*(self.decode.close_steps() if self.decode is not None else ()), *(p.stop for p in self.pre.values())]
        for c in steps:
            try:
                c()
            except Exception as e:  # noqa: BLE001 - the measurements are taken; report, do not end in a traceback
                print(f"hawk bench transfer: clean-up step failed ({type(e).__name__}: {e})", file=sys.stderr)

    def config(self) -> dict:
        """The run's configuration, the chips' pulls (heads as [first, end) ranges) and this
        host's cores and load average."""
        shape = self.shape
        return {
            "model": self.model,
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
            "chips": self.decode_tp,
            "tp": self.decode_tp,
            "device": self.device_profile,
            "block_size": self.block_size,
            "num_kv_heads": shape.num_kv_heads,
            "kv_heads_per_rank": self.heads,
            "num_layers": shape.num_layers,
            "head_dim": shape.head_dim,
            "kv_heads_per_prefill_rank": shape.kv_heads_per_rank(self.prefill_tp),
            "pulls": [_pull_config(c) for c in self.chips],
            "idle_ranks": self.idle,
            "pulls_run": "concurrently, one thread per chip" if self.decode_tp > 1 else "one chip",
            "fragmented": self.fragmented,
            "per_tile_cap_s": self.per_tile_cap_s,
            "repeats": self.repeats,
            "layer_groups": self.layer_groups,
            "cores": os.cpu_count(),
            "load_average": os.getloadavg(),
            "registration": self.registration,
            "integrity": self.integrity,
        }


def _pull_config(c: dict) -> dict:
    """Chip ``c``'s pull: its prefill ranks, heads and shares (source and destination heads
    as [first, end) ranges, consumers of the share's source)."""
    return {
        "chip": c["chip"],
        "prefill_ranks": c["prefill_ranks"],
        "heads": c["heads"],
        "shares": [
            {
                "prefill_rank": ps.prefill_rank,
                "src_heads": [ps.share.head_start, ps.share.head_start + (ps.share.num_heads or ps.count)],
                "dst_heads": [ps.dst_start, ps.dst_start + ps.count],
                "consumers": ps.share.consumers,
            }
            for ps in c["plan"]
        ],
    }


def _at_size(results: list[dict], row: str, mb) -> dict | None:
    """The first measured ``row`` at ``mb`` MB (any target dtype), or None."""
    return next((b for b in results if b["row"] == row and b["size_mb"] == mb), None)


def _normalise(results: list[dict]) -> None:
    """Add to every row its latency ratios to GG-Host, GG-Direct and GG-Staged and its CPU
    time ratio to GG-Direct, each at the same size (NaN where that row was not measured)."""
    for r in results:
        base = _at_size(results, "GG-Host", r["size_mb"])
        r["norm_gg_host"] = r["latency_ms"] / base["latency_ms"] if base else float("nan")
        gd = _at_size(results, "GG-Direct", r["size_mb"])
        r["norm_gg_direct"] = r["latency_ms"] / gd["latency_ms"] if gd else float("nan")
        r["cpu_norm_gg_direct"] = r["cpu_ms"] / gd["cpu_ms"] if gd and gd["cpu_ms"] > 0 else float("nan")
        gs = _at_size(results, "GG-Staged", r["size_mb"])
        r["norm_gg_staged"] = r["latency_ms"] / gs["latency_ms"] if gs else float("nan")


def _row_figures(row, dtype, mb, n, block_size, per_token, runs, reps, cpu_ms, chips) -> dict:
    """One table row from ``runs`` (per repeat: per chip (FetchResult, start)): the request's
    latency is from the first chip's D1 to the last chip's KV in place (a time-capped
    per-tile pull extrapolated linearly); per chip: bytes, bytes per DRAM bank (largest
    bank; NaN where the decode has no banks: GG rows), segments, READ entries; totals."""

    def chip_total(r) -> float:  # D1 -> KV in place, a capped per-tile run extrapolated linearly
        return r.request_s + (r.total_s - r.request_s) / r.fraction

    def latency(run) -> float:
        t0 = min(t for _, t in run)
        return max(t - t0 + chip_total(r) for r, t in run)

    def med(f) -> float:  # median over repeats of the largest figure over the chips
        return statistics.median(max(f(r) for r, _ in run) for run in runs)

    per_chip = []
    for k, c in enumerate(chips):
        r = runs[0][k][0]
        bpb = r.extra.get("bytes_per_bank")
        per_chip.append(
            {
                "chip": c["chip"],
                "prefill_ranks": c["prefill_ranks"],
                "heads": c["heads"],
                "bytes_moved": r.nbytes,
                "bytes_per_bank": max(bpb) if bpb else float("nan"),
                "segments": r.segments,
                "entries": r.entries,
                "latency_ms": statistics.median(chip_total(run[k][0]) for run in runs) * 1e3,
            }
        )
    frac = min(r.fraction for run in runs for r, _ in run)
    return {
        "row": row,
        "dtype": dtype,
        "size_mb": mb,
        "source_bytes": int(n * block_size * per_token) * len(chips),
        "blocks": n,
        "chips": per_chip,
        "bytes_moved": sum(c["bytes_moved"] for c in per_chip),
        "entries": sum(c["entries"] for c in per_chip),
        "segments": sum(c["segments"] for c in per_chip),
        "bytes_per_chip": max(c["bytes_moved"] for c in per_chip),
        "bytes_per_bank": max(c["bytes_per_bank"] for c in per_chip),
        "segments_per_chip": max(c["segments"] for c in per_chip),
        "entries_per_chip": max(c["entries"] for c in per_chip),
        "repeats": reps,
        "latency_ms": statistics.median(latency(run) for run in runs) * 1e3,
        "request_ms": med(lambda r: r.request_s) * 1e3,
        "transform_ms": med(lambda r: r.extra.get("transform_s", r.extra.get("fix_transform_s", 0.0))) * 1e3,
        "transfer_ms": med(lambda r: r.transfer_s / r.fraction) * 1e3,
        "copy_ms": med(lambda r: r.copy_s) * 1e3,
        "check_ms": med(lambda r: r.extra.get("check_s", 0.0)) * 1e3,
        "fraction_done": frac,
        "capped": frac < 1.0,
        "cpu_ms": cpu_ms,
        "all_ms": [latency(run) * 1e3 for run in runs],
    }


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _get(rows, row, dtype, mb):
    return next((r for r in rows if r["row"] == row and r["dtype"] == dtype and r["size_mb"] == mb), None)


def check_targets(rows: list[dict]) -> list[dict]:
    """The benchmark's targets as ratios within this run; each with a note on where time goes."""
    out = []
    for mb in sorted({r["size_mb"] for r in rows}):
        gd = _get(rows, "GG-Direct", "bfloat16", mb)
        hawk = [r for r in rows if r["size_mb"] == mb and r["row"] in HAWK_ROWS]
        if gd and hawk:
            best = min(hawk, key=lambda r: r["latency_ms"])
            lim = 1.10 if mb < 160 else 1.00
            ratio = best["latency_ms"] / gd["latency_ms"]
            out.append(
                {
                    "target": f"best GN-HAWK mode within {lim:.2f}x GG-Direct ({best['row']}, {best['dtype']})",
                    "size_mb": mb,
                    "ratio": ratio,
                    "met": ratio <= lim,
                    "note": "" if ratio <= lim else _where(best, gd),
                }
            )
        sp = _get(rows, "GN-HAWK pipelined", "bfloat16", mb)
        if gd and sp and mb >= 160:
            ratio = sp["latency_ms"] / gd["latency_ms"]
            out.append(
                {
                    "target": "bf16 staged with overlap (layer groups) within 1.15x GG-Direct",
                    "size_mb": mb,
                    "ratio": ratio,
                    "met": ratio <= 1.15,
                    "note": "" if ratio <= 1.15 else _where(sp, gd),
                }
            )
        pt = _get(rows, "per-tile", "bfloat16", mb)
        hs, hd = _get(rows, "GN-HAWK staged", "bfloat16", mb), _get(rows, "GN-HAWK direct", "bfloat16", mb)
        if pt and hs:
            ratio = pt["latency_ms"] / hs["latency_ms"]
            note = (
                f"per-tile extrapolated from {pt['fraction_done']:.0%} of its {pt['entries']} entries; "
                if pt["capped"]
                else ""
            )
            if hd:
                note += (
                    f"vs GN-HAWK direct ({hd['entries']} coalesced entries): {pt['latency_ms'] / hd['latency_ms']:.1f}x"
                )
            out.append(
                {
                    "target": "per-tile >= 10x slower than GN-HAWK (staged)",
                    "size_mb": mb,
                    "ratio": ratio,
                    "met": ratio >= 10,
                    "note": note,
                }
            )
        gh, nh = _get(rows, "GG-Host", "bfloat16", mb), _get(rows, "GN-Host", "bfloat16", mb)
        if gh and nh:
            ratio = nh["latency_ms"] / gh["latency_ms"]
            out.append(
                {
                    "target": "GN-Host slower than GG-Host",
                    "size_mb": mb,
                    "ratio": ratio,
                    "met": ratio > 1,
                    "note": f"layout fix {nh['copy_ms']:.1f} ms after arrival",
                }
            )
    return out


def _where(h: dict, gd: dict) -> str:
    xf_gain = gd["transfer_ms"] - h["transfer_ms"]
    return (
        f"HAWK {h['latency_ms']:.1f} ms = request {h['request_ms']:.1f} (prefill transform "
        f"{h['transform_ms']:.1f}) + transfer {h['transfer_ms']:.1f} ({h['entries']} entries) + intra-bank "
        f"copy {h['copy_ms']:.1f}; GG-Direct {gd['latency_ms']:.1f} ms = request {gd['request_ms']:.1f} + "
        f"transfer {gd['transfer_ms']:.1f} ({gd['entries']} entries). Transfer differs by {xf_gain:+.1f} ms; "
        f"the CPU transform (+copy) is the extra cost on this 2-core host, where a GPU would run it at "
        f"HBM speed; GG-Direct's CPU time {gd.get('cpu_ms', 0):.1f} ms vs HAWK's {h.get('cpu_ms', 0):.1f} ms "
        f"(2 cores shared by both processes)"
    )


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sizes = sorted({r["size_mb"] for r in rows})
    series = [(r, "bfloat16") for r in ROWS + EXTRA_ROWS] + [(r, "bfloat8_b") for r in HAWK_BFP8_ROWS]
    series = [s for s in series if any(_get(rows, s[0], s[1], mb) for mb in sizes)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / len(series)
    for k, (row, dt) in enumerate(series):
        ys = [(_get(rows, row, dt, mb) or {}).get("norm_gg_host", np.nan) for mb in sizes]
        capped = row == "per-tile" and any((_get(rows, row, dt, mb) or {}).get("capped") for mb in sizes)
        label = f"{row} ({'bf16' if dt == 'bfloat16' else 'bfp8'})" + (" [time-capped: extrapolated]" if capped else "")
        ax.bar(np.arange(len(sizes)) + (k - (len(series) - 1) / 2) * w, ys, w, label=label)
    ax.set_xticks(np.arange(len(sizes)), [f"{mb} MB" for mb in sizes])
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("latency / GG-Host (log)")
    cfg = result["config"]
    ax.set_title(
        f"KV transfer latency, {cfg['model']} prefill TP={cfg['prefill_tp']} -> {cfg['chips']} x "
        f"{cfg['device']} (emulated), block {cfg['block_size']}; request KV size (bf16)"
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # --plot may name a folder not made yet
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    """``hawk bench transfer``'s command line (sizes in MB, the per-tile cap in seconds)."""
    ap = argparse.ArgumentParser(prog="hawk bench transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument(
        "--prefill-tp",
        type=int,
        default=None,
        help="prefill tensor-parallel size: one prefill process per rank (default 4)",
    )
    ap.add_argument(
        "--decode-tp",
        "--chips",
        dest="decode_tp",
        type=int,
        default=None,
        help="decode tensor-parallel size = the Tenstorrent decode's chips, one emulated device each "
        "(default: --prefill-tp; GN rows need --prefill-tp <= it)",
    )
    ap.add_argument("--tp", type=int, default=None, help="deprecated: --prefill-tp N --decode-tp N")
    ap.add_argument("--device-profile", default="p150a")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument(
        "--sizes-mb",
        type=float,
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="request sizes: bf16 KV of all the model's KV heads (MB), split over the chips; 1280 on "
        "one chip needs ~8 GB RAM on this host, so it is opt-in",
    )
    ap.add_argument(
        "--rows",
        nargs="+",
        default=list(ROWS),
        choices=ROWS + EXTRA_ROWS,
        help="rows to run (default: all but GG-Staged, the connector's GG mode staged: the prefill "
        "gathers the blocks, or a share's heads, into its ring)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--per-tile-cap-s", type=float, default=10.0)
    ap.add_argument("--fragmented", action="store_true", help="random block tables instead of contiguous runs")
    ap.add_argument(
        "--layer-groups",
        type=int,
        default=2,
        help="layer groups of the pipelined rows (2: the fastest of 2, 4, 8 here, see kvflow.decode)",
    )
    ap.add_argument(
        "--registration",
        default="per_request",
        choices=("per_request", "whole", "both"),
        help="what is registered with the transport (see the module doc); both: ratios per_request/whole",
    )
    ap.add_argument(
        "--integrity",
        default="on",
        choices=INTEGRITY_MODES,
        help="the decode checks each pull's checksums (on, the connector's default) or not (off); both: "
        "alternate request by request and report the cost of the check as ratios",
    )
    ap.add_argument("--out", default="results/bench_transfer.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png; '' for none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.plot is None:
        a.plot = os.path.splitext(a.out)[0] + ".png"
    sizes = [int(s) if float(s).is_integer() else s for s in a.sizes_mb]
    a.prefill_tp, a.decode_tp = tp_args(ap, a)
    try:
        tp_plan(a.model, a.prefill_tp, a.decode_tp, a.rows)  # TPMismatch or HeterogeneousTP before any process
    except ValueError as e:
        print(f"hawk bench transfer: {e}", file=sys.stderr)
        return 2
    if a.registration == "both":
        return _main_both(a, sizes)
    res = run(
        a.model,
        a.prefill_tp,
        a.decode_tp,
        a.device_profile,
        a.block_size,
        sizes,
        a.repeats,
        a.rows,
        a.per_tile_cap_s,
        a.fragmented,
        layer_groups=a.layer_groups,
        registration=a.registration,
        integrity=a.integrity,
    )
    _print_header(res["config"], a)
    _print_rows(res, a.rows)
    if res["config"]["chips"] > 1:
        _print_per_chip(res, max(sizes))
    _print_legend_and_targets(res["targets"])
    path = write_json(a.out, {"bench": "transfer", "args": vars(a), **res})
    print(f"wrote {path}")
    if a.plot:
        try:
            print(f"wrote {plot(res, a.plot)}")
        except Exception as e:  # noqa: BLE001 - the measurements are written already
            print(f"no plot ({type(e).__name__}: {e})")
    return 0


def _print_header(cfg: dict, a: argparse.Namespace) -> None:
    """One line: the model, the TP pairing and each chip's pull, the block tables, repeats and host."""
    pulls = ", ".join(
        f"rank{'s' if len(p['prefill_ranks']) > 1 else ''} {'+'.join(map(str, p['prefill_ranks']))} -> chip {p['chip']}"
        for p in cfg["pulls"]
    )
    print(
        f"KV transfer, decode request -> KV in pool; {cfg['model']} ({cfg['num_kv_heads']} KV heads, "
        f"{cfg['num_layers']} layers) prefill TP={cfg['prefill_tp']} -> {cfg['chips']} x {cfg['device']} emulated "
        f"({cfg['kv_heads_per_prefill_rank']} KV heads per prefill rank, {cfg['kv_heads_per_rank']} per chip; "
        "pulls: "
        + pulls
        + (f"; idle prefill ranks {cfg['idle_ranks']} released by chip 0" if cfg["idle_ranks"] else "")
        + f"; the chips' pulls of a request run {cfg['pulls_run']}), block {cfg['block_size']}, "
        f"{'fragmented' if a.fragmented else 'contiguous'} block tables; median of {a.repeats} "
        f"(per-tile: fewer, capped at {a.per_tile_cap_s:.0f} s and extrapolated); Mooncake TCP loopback, "
        f"{cfg['cores']} cores, load average {cfg['load_average'][0]:.2f} at the end; layer groups "
        f"{a.layer_groups} in the pipelined rows"
    )


def _print_rows(res: dict, rows) -> None:
    """The rows' table (bytes, READ entries, latencies in ms, ratios), then the rows not measured."""
    print_table(
        res["rows"],
        [
            ("row", "row", ""),
            ("dtype", "target", ""),
            ("size_mb", "src MB", ""),
            ("bytes_per_chip", "bytes/chip", ","),
            ("bytes_per_bank", "bytes/bank", ","),
            ("segments_per_chip", "segs/chip", ","),
            ("entries_per_chip", "READs/chip", ","),
            ("bytes_moved", "bytes total", ","),
            ("entries", "READs total", ","),
            ("latency_ms", "latency ms", ".1f"),
            ("norm_gg_host", "/GG-Host", ".3f"),
            ("norm_gg_direct", "/GG-Direct", ".3f"),
            *([("norm_gg_staged", "/GG-Staged", ".3f")] if "GG-Staged" in rows else []),
            ("request_ms", "request ms", ".1f"),
            ("transform_ms", "transform ms", ".1f"),
            ("transfer_ms", "transfer ms", ".1f"),
            ("copy_ms", "copy/fix ms", ".1f"),
            ("check_ms", "check ms", ".1f"),
            *(
                [("check_ratio", "/unchecked", ".3f"), ("check_cpu_ratio", "CPU/unchecked", ".3f")]
                if any("check_ratio" in r for r in res["rows"])
                else []
            ),
            ("fraction_done", "done", ".2f"),
            ("cpu_ms", "CPU ms", ".1f"),
            ("cpu_norm_gg_direct", "CPU/GG-Direct", ".2f"),
        ],
    )
    for f in res["failed"]:
        print(f"\nnot measured: {f['row']} ({f['dtype']}) @ {f['size_mb']} MB: {f['error']}")


def _print_per_chip(res: dict, big) -> None:
    """Per chip at the largest size ``big`` (MB): its heads, prefill ranks, bytes, READs and latency (ms)."""
    print(f"\nper chip at {big} MB (prefill ranks: the ranks the chip pulled its shares from):")
    print_table(
        [
            {
                "row": r["row"],
                "dtype": r["dtype"],
                **c,
                "ranks": "+".join(map(str, c["prefill_ranks"])),
                "heads": f"{c['heads'][0]}..{c['heads'][1] - 1}",
            }
            for r in res["rows"]
            if r["size_mb"] == big
            for c in r["chips"]
        ],
        [
            ("row", "row", ""),
            ("dtype", "target", ""),
            ("chip", "chip", ""),
            ("heads", "KV heads", ""),
            ("ranks", "prefill ranks", ""),
            ("bytes_moved", "bytes", ","),
            ("bytes_per_bank", "bytes/bank", ","),
            ("segments", "segs", ","),
            ("entries", "READs", ","),
            ("latency_ms", "chip ms", ".1f"),
        ],
    )


def _print_legend_and_targets(targets: list[dict]) -> None:
    """What the columns mean, then each target met or missed with its ratio."""
    print(
        "\nsrc MB: the request's bf16 KV over all KV heads; per chip: the largest chip's figure (bytes/bank: its "
        "largest DRAM bank; nan: a vLLM-layout decode, no banks); segments: in KVReady; READs: transfer entries; "
        "latency: first chip's request -> last chip's KV in place; request/transform/transfer/copy: each the "
        "largest over the chips."
    )
    print(
        "request = D1 -> P7 (includes the prefill transform for HAWK rows); transform = prefill transform "
        "(HAWK) or decode-side layout fix (GN-Host); copy/fix = intra-bank copies (staged) or the GN-Host fix "
        "+ write, and the decode's integrity check (check ms; the prefill's checksums are in request); bfloat8_b "
        "rows move fewer bytes: that gain is the format, not a faster transfer."
    )
    print("\ntargets (ratios within this run):")
    for t in targets:
        print(
            f"  [{'met ' if t['met'] else 'MISS'}] {t['target']} @ {t['size_mb']} MB: ratio {t['ratio']:.3f}"
            + (f"\n         {t['note']}" if t["note"] else "")
        )


def _main_both(a, sizes) -> int:
    """Whole-cache registration and per-request registration, one after
    the other in this process: latency ratios per row, target dtype and size."""
    out = {}
    for reg in ("whole", "per_request"):
        print(f"--- registration {reg}", flush=True)
        out[reg] = run(
            a.model,
            a.prefill_tp,
            a.decode_tp,
            a.device_profile,
            a.block_size,
            sizes,
            a.repeats,
            a.rows,
            a.per_tile_cap_s,
            a.fragmented,
            layer_groups=a.layer_groups,
            registration=reg,
        )
    rows = []
    for r in out["per_request"]["rows"]:
        w = _get(out["whole"]["rows"], r["row"], r["dtype"], r["size_mb"])
        if w:
            rows.append(
                {
                    "row": r["row"],
                    "dtype": r["dtype"],
                    "size_mb": r["size_mb"],
                    "whole_ms": w["latency_ms"],
                    "per_request_ms": r["latency_ms"],
                    "ratio": r["latency_ms"] / w["latency_ms"],
                    "whole_all_ms": w["all_ms"],
                    "per_request_all_ms": r["all_ms"],
                }
            )
    print(f"\nper-request vs whole-cache registration, median of {a.repeats}, Mooncake TCP loopback:")
    print_table(
        rows,
        [
            ("row", "row", ""),
            ("dtype", "target", ""),
            ("size_mb", "src MB", ""),
            ("whole_ms", "whole ms", ".1f"),
            ("per_request_ms", "per-request ms", ".1f"),
            ("ratio", "ratio", ".3f"),
        ],
    )
    snap = out["per_request"]["prefill_snapshot"]
    print(
        "prefill registrations made (per_request run): "
        + ", ".join(f"{k} {v.get('registrations', 0)}" for k, v in snap.items())
    )
    path = write_json(a.out, {"bench": "transfer-registration", "args": vars(a), "ratios": rows, **out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
