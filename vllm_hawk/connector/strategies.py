"""What the connector's worker side builds from its configuration, once, at ``register_kv_caches``.

Both sides: :func:`describe_local` (what this engine's KV cache is), :func:`check_tp_size`,
:func:`make_transport_for`.

Prefill: :func:`make_prefill` — a :class:`~vllm_hawk.kvflow.PrefillEndpoint` on this TP
rank's side channel, serving from :func:`make_source`'s source:
:class:`~vllm_hawk.kvflow.TileTransformSource` (``device_profile`` names a Tenstorrent
device and ``layout_fix: prefill``: GN-HAWK), :class:`~vllm_hawk.kvflow.RingGatherSource`
(``mode: staged``; also GN-Host, ``layout_fix: decode``, whose decode fixes the layout)
or :class:`~vllm_hawk.kvflow.VllmBlockSource` (``mode: direct``).

Decode: :func:`make_sinks` — :class:`~vllm_hawk.kvflow.TTSink` per chip on the
Tenstorrent platform plugin (:class:`~vllm_hawk.kvflow.gn_host.GNHostSink` with
``layout_fix: decode``), else :class:`~vllm_hawk.kvflow.VllmPagedSink` /
:class:`~vllm_hawk.kvflow.VllmStagedSink`; :func:`make_planner` (its pulls, see
:mod:`vllm_hawk.kvflow.pull_plan`), which refuses at start-up a ``prefill_tp`` this
decode cannot pull from (:func:`check_pairing`); :func:`decode_endpoint` opens a side
channel to a prefill.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from vllm_hawk.connector import debug
from vllm_hawk.connector.config import RING_AUTO, VLLM_PROFILE, HawkConfig, HawkConfigError, port_stride
from vllm_hawk.connector.describe import LocalKV, describe_tt_cache, describe_vllm_caches, tt_cache_of
from vllm_hawk.integrity import of_tensors
from vllm_hawk.kvflow import (
    DecodeEndpoint,
    PrefillEndpoint,
    RingGatherSource,
    TileTransformSource,
    TTSink,
    VllmBlockSource,
    vllm_sink,
)
from vllm_hawk.kvflow.device import own_stream, synchronize_device
from vllm_hawk.kvflow.exposure import resolve_registration
from vllm_hawk.kvflow.gn_host import GNHostSink
from vllm_hawk.kvflow.prefill import ring_beside_cache
from vllm_hawk.kvflow.pull_plan import PullPlanner, check_targets
from vllm_hawk.kvflow.regroup import Regroup
from vllm_hawk.kvflow.ring import ring_nbytes_for
from vllm_hawk.layout.tp import TPMismatch, shard_heads
from vllm_hawk.npu.bank_buffer import recv_nbytes_per_bank
from vllm_hawk.transport import make_transport

# The worker side's log: under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")

__all__ = [
    "check_pairing",
    "check_tp_size",
    "decode_endpoint",
    "describe_local",
    "make_planner",
    "make_prefill",
    "make_sinks",
    "make_source",
    "make_transport_for",
    "prefill_ring_nbytes",
    "prefill_transforms",
    "tp_rank_and_size",
]


#: the modules whose numba kernels a node compiles at start-up (each has a ``warm()``)
TRANSFORM_KERNELS, CHECKSUM_KERNELS = "vllm_hawk.transform.cpu_kernel", "vllm_hawk.integrity.cpu_kernel"


def _compile_then_load(warm, what: str, modules: tuple[str, ...] = (TRANSFORM_KERNELS,)) -> None:
    """Compile the CPU kernels of ``modules`` before the engine is up (the KV is in host
    memory), then load them (``warm``) while it starts. The compile runs in a child process
    (:func:`~vllm_hawk.transform.cpu_kernel.warm_in_child`; this thread waits without the
    GIL), so no request finds them uncompiled and this process, whose side channel must
    keep answering, only loads them. CPU work only: it cannot break a CUDA graph capture."""
    from vllm_hawk.transform.cpu_kernel import warm_in_child

    t0 = time.monotonic()
    if not warm_in_child(modules):
        logger.warning("HawkConnector: %s kernels did not compile in a child process; compiling here", what)

    def run() -> None:
        try:
            warm()
        except Exception as e:  # noqa: BLE001 - the first request compiles instead
            logger.warning("HawkConnector: %s warm-up failed: %s", what, e)
            return
        logger.info("HawkConnector: %s kernels ready in %.1f s", what, time.monotonic() - t0)

    threading.Thread(target=run, daemon=True, name="hawk-transform-warm").start()


def _warm_on_device(warm, what: str, device) -> None:
    """Run the warm-up of a device (GPU) cache's transform here, in the caller
    (``register_kv_caches``), on this thread's own stream, and wait until the device has
    run everything queued. vLLM captures its CUDA graphs right after (``capture_model``,
    with torch's default ``capture_error_mode="global"``: CUDA work that any other host
    thread issues during a capture invalidates it, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
    so no warm-up may still run, or start, in a thread of ours then. After this, HAWK
    issues device work only on a prefill worker serving a KVRequest. Costs the start-up
    the kernels' compile (Triton JIT: seconds, cached across starts)."""
    t0 = time.monotonic()
    try:
        with own_stream(device):
            warm()
    except Exception as e:  # noqa: BLE001 - the first request compiles instead
        logger.warning("HawkConnector: %s warm-up failed: %s", what, e)
    finally:
        synchronize_device(device)
    logger.info("HawkConnector: %s kernels ready on %s in %.1f s", what, device, time.monotonic() - t0)


def _on_cpu(src) -> bool:
    """The KV a :class:`~vllm_hawk.layout.vllm_kv.TransformSource` reads is in host memory."""
    tensors = list(src.caches) or [t for kv in src.views for t in kv]
    return all(t.device.type == "cpu" for t in tensors)


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and size (0, 1 outside a TP group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no distributed state (a bare engine in a test)
        return 0, 1


def describe_local(kv_caches, vllm_config, cfg: HawkConfig, *, is_producer: bool) -> LocalKV:
    """This engine's KV cache: the Tenstorrent platform plugin's device cache when the
    plugin runs (a decode naming its device), else vLLM's ``kv_caches``."""
    tt_cache = tt_cache_of(vllm_config)
    if tt_cache is None:
        return describe_vllm_caches(kv_caches, vllm_config, cfg)
    if is_producer:
        raise NotImplementedError("HawkConnector: an engine on the Tenstorrent platform is a decode (kv_consumer) only")
    if cfg.device_profile == VLLM_PROFILE:
        raise HawkConfigError(
            "kv_connector_extra_config.device_profile must name the Tenstorrent device "
            "(e.g. 'p150a') on an engine that runs the Tenstorrent platform plugin"
        )
    return describe_tt_cache(tt_cache, vllm_config, cfg)


def check_tp_size(cfg: HawkConfig, tp_size: int) -> None:
    """Raise HawkConfigError unless this configuration serves ``tp_size`` TP ranks."""
    if tp_size > 1 and cfg.layout_fix == "decode":
        raise HawkConfigError(
            f"kv_connector_extra_config.layout_fix='decode' (GN-Host) with "
            f"tensor_parallel_size={tp_size}: GN-Host serves TP=1 only (GN-HAWK and GG "
            "pairs take any TP on both sides)"
        )


def check_pairing(num_kv_heads: int, prefill_tp: int, total: int, targets, local: int, *, chips: bool) -> None:
    """Raise HawkConfigError (naming both sides' values) unless decode targets ``targets``
    of ``total`` (TP ranks, or ``chips`` of a Tenstorrent mesh: those take their heads
    whole from one prefill rank), each holding ``local`` heads, can pull from a prefill
    with ``prefill_tp`` ranks."""
    what = "chips" if chips else "TP ranks"
    try:
        check_targets(num_kv_heads, prefill_tp, total, targets, local, chips=chips)
    except TPMismatch as e:
        raise HawkConfigError(
            f"kv_connector_extra_config.prefill_tp={prefill_tp} cannot feed this decode ({total} "
            f"{what}, {num_kv_heads} KV heads): {e}"
        ) from None


def prefill_transforms(cfg: HawkConfig) -> bool:
    """True when the prefill converts the blocks to the Tenstorrent layout (GN-HAWK)."""
    return cfg.device_profile != VLLM_PROFILE and cfg.layout_fix == "prefill"


def make_source(cfg: HawkConfig, kv: LocalKV):
    """The prefill's source for this configuration (see module doc); a transform's kernels
    are not compiled yet (:func:`make_prefill` warms them)."""
    if prefill_transforms(cfg):
        from vllm_hawk.layout.device_profiles import load_profile

        return TileTransformSource(kv.views, kv.layout, load_profile(cfg.device_profile))
    if cfg.mode == "staged":  # also GN-Host (layout_fix 'decode'): plain vLLM blocks, the decode fixes them
        return RingGatherSource(kv.region_map, kv.layout, kv.storages, kv.heads, kv.caches)
    return VllmBlockSource(kv.region_map, kv.layout, kv.storages, kv.heads, kv.caches)


def prefill_ring_nbytes(cfg: HawkConfig, source, vllm_config) -> int:
    """The prefill ring's bytes: ``ring_nbytes`` when given, else (``"auto"``) one request
    of the engine's ``max_model_len`` tokens in the bytes ``source`` produces for this TP
    rank's heads (:meth:`~vllm_hawk.kvflow.base.KVSource.request_nbytes`), served as up to
    one share per head (:func:`~vllm_hawk.kvflow.ring.ring_nbytes_for`). One such request,
    not several: requests hold their ranges from P5 to their Release, so the ring holds
    several shorter ones at once, and a request of the longest length waits for the ones
    before it (``claim_wait_s``, the decode asks again); set ``ring_nbytes`` to a multiple
    of this size to overlap such requests. 0 for a source without a ring."""
    if not source.uses_ring:
        return 0
    if cfg.ring_nbytes != RING_AUTO:
        return int(cfg.ring_nbytes)
    max_tokens = int(vllm_config.model_config.max_model_len)
    return ring_nbytes_for(source.request_nbytes(max_tokens), max(1, source.layout.num_kv_heads))


def _warm_prefill(source, transport) -> None:
    """The prefill's kernels before its first request: the GN-HAWK transform (where the
    cache is) and the integrity checksum (where the bytes it sums are: the ring's device,
    or the cache's for blocks served in place, :mod:`vllm_hawk.integrity`). Host kernels in
    a thread after a child process compiled them; device ones here, finished and
    synchronised before vLLM captures graphs."""
    from vllm_hawk.integrity import cpu_kernel

    tile = isinstance(source, TileTransformSource)
    transform_on_cpu = tile and _on_cpu(source.views)
    beside = not source.uses_ring or ring_beside_cache(source, transport)
    sums_on = source.device if beside else torch.device("cpu")  # a host ring (kvflow.prefill.ring_device)
    modules = ((TRANSFORM_KERNELS,) if transform_on_cpu else ()) + (
        (CHECKSUM_KERNELS,) if sums_on.type == "cpu" and not cpu_kernel.loaded() else ()
    )
    if modules:
        warms = ([lambda: source.warm(source.profile)] if transform_on_cpu else []) + [cpu_kernel.warm]
        _compile_then_load(
            lambda: [w() for w in warms], "prefill " + " and ".join(m.split(".")[1] for m in modules), modules
        )
    if (tile and not transform_on_cpu) or sums_on.type != "cpu":

        def on_device() -> None:
            if tile and not transform_on_cpu:
                source.warm(source.profile)
            if sums_on.type != "cpu":
                of_tensors([torch.zeros(1 << 12, dtype=torch.uint8, device=sums_on)])

        _warm_on_device(on_device, "prefill transform and checksum", source.device)


def make_prefill(
    cfg: HawkConfig, kv: LocalKV, transport, vllm_config, *, tp_rank: int, tp_size: int, on_finished, debug_dir=None
) -> PrefillEndpoint:
    """The prefill endpoint of TP rank ``tp_rank`` (its side channel: the configured port
    plus ``tp_rank`` port strides); ``debug_dir``: dump what it serves there. A GN-HAWK
    source's kernels are warmed: over a GPU cache here, finished and synchronised before
    this returns (:func:`_warm_on_device`); over a host cache in a thread
    (:func:`_compile_then_load`)."""
    source = make_source(cfg, kv)
    _warm_prefill(source, transport)
    observer = None
    if debug_dir is not None:
        every = prefill_transforms(cfg) or cfg.layout_fix == "decode" or tp_size > 1
        bs = kv.layout.block_size  # GG: dump shares of a TP pull and pulls the decode regroups
        observer = debug.prefill_dumper(
            debug_dir,
            kv.views,
            f"-r{tp_rank}" if tp_size > 1 else "",
            when=None if every else (lambda msg: msg.num_heads > 0 or msg.dst_layout.block_size != bs),
        )
    port = cfg.side_channel_port + tp_rank * port_stride(vllm_config)
    tp_info = (
        dict(
            tp_size=tp_size,
            tp_rank=tp_rank,
            num_kv_heads=kv.num_kv_heads,
            head_start=shard_heads(kv.num_kv_heads, tp_size, tp_rank).start,
            num_heads=kv.layout.num_kv_heads,
        )
        if kv.num_kv_heads
        else None
    )
    ring_nbytes = prefill_ring_nbytes(cfg, source, vllm_config)
    prefill = PrefillEndpoint(
        source,
        transport,
        kv.compat,
        ring_nbytes=ring_nbytes or 1 << 16,  # no ring: unused
        registration=cfg.registration,
        tp_info=tp_info,
        bind=f"tcp://{cfg.side_channel_host}:{port}",
        secret=cfg.secret_bytes,
        auth=cfg.auth,
        claim_wait_s=cfg.claim_wait_s,
        lease_s=cfg.lease_s,
        handover_s=cfg.handover_s,
        max_hold_s=cfg.max_hold_s,
        on_finished=on_finished,
        observer=observer,
    )  # server_id: random per start, so signed requests name this instance
    logger.info(
        "HawkConnector prefill: side channel %s (auth %s), transfer endpoint %s, source %s, transport %s, %s",
        prefill.endpoint,
        cfg.auth,
        transport.endpoint,
        source.name,
        cfg.transport,
        _ring_text(prefill, cfg),
    )
    if cfg.auth == "none":
        logger.warning(
            "HawkConnector prefill: side-channel authentication is OFF (auth 'none'): anyone who "
            "reaches %s can request and release KV",
            prefill.endpoint,
        )
    return prefill


def _ring_text(prefill: PrefillEndpoint, cfg: HawkConfig) -> str:
    """The ring's size, place and registration, for the start-up log."""
    ring = prefill.ring
    if ring is None:
        return f"no ring, registration {prefill.registration}"
    how = "ring_nbytes auto: max_model_len" if cfg.ring_nbytes == RING_AUTO else "ring_nbytes"
    return (
        f"ring {ring.capacity / (1 << 20):.1f} MiB ({how}) on {ring.location}"
        f"{' pinned' if ring.location == 'cpu' and ring.memory.is_pinned() else ''}, registration {ring.registration}"
    )


def _tt_chips(kv: LocalKV) -> list:
    """The chips of the plugin's cache (one cache per chip; a single-chip cache is its own)."""
    return kv.tt_cache.chips


def _tt_sinks(cfg: HawkConfig, kv: LocalKV, transport) -> list:
    """One TTSink per chip of the plugin's cache (each chip: its own banks, buffers, allocator)."""
    route = getattr(kv.tt_cache, "route", None)  # the landing route the worker chose (vllm-tt-plugin)
    mode = cfg.mode if route is None else route.mode
    sinks = []
    try:
        for c in _tt_chips(kv):
            per_bank = recv_nbytes_per_bank(cfg.recv_nbytes, c.layout.num_banks, c.device.profile.dram_alignment_bytes)
            sinks.append(
                TTSink(
                    c.device,
                    c.layout,
                    c.buffers,
                    transport,
                    mode,
                    recv_nbytes_per_bank=per_bank,
                    registration=_sink_registration(cfg),
                )
            )
    except BaseException:
        for x in sinks:
            x.close()
        raise
    return sinks


def make_sinks(cfg: HawkConfig, kv: LocalKV, transport) -> list:
    """The decode's sinks for this configuration (see module doc): one per chip of a
    Tenstorrent mesh (each chip's banks, its heads), else one. With ``integrity`` the
    checksum kernels are compiled (child process) and loaded before the first pull."""
    from vllm_hawk.integrity import cpu_kernel

    if cfg.integrity and not cpu_kernel.loaded():
        _compile_then_load(cpu_kernel.warm, "integrity checksum", (CHECKSUM_KERNELS,))
    if kv.tt_cache is not None and cfg.layout_fix == "decode":
        chips = _tt_chips(kv)
        if len(chips) != 1:
            raise HawkConfigError(
                f"layout_fix 'decode' (GN-Host) with {len(chips)} chips: GN-Host lands on one "
                "chip; use layout_fix 'prefill' (GN-HAWK) for a mesh, or HAWK_TT_CHIPS=1"
            )
        c = chips[0]
        sink = GNHostSink(c.device, c.layout, c.buffers, transport, kv.wire, cfg.recv_nbytes, _sink_registration(cfg))
        _compile_then_load(sink.warm, "GN-Host layout fix")
        return [sink]
    if kv.tt_cache is not None:
        return _tt_sinks(cfg, kv, transport)
    if cfg.device_profile != VLLM_PROFILE:
        raise NotImplementedError(
            f"HawkConnector: device_profile {cfg.device_profile!r} on the decode needs "
            "the Tenstorrent platform plugin (HAWK_TT_PLATFORM)"
        )
    regroup = Regroup(kv.adapters, kv.caches) if kv.adapters else None  # a prefill with smaller blocks
    return [
        vllm_sink(
            kv.region_map,
            kv.layout,
            transport,
            cfg.mode,
            kv.storages,
            cfg.recv_nbytes,
            _sink_registration(cfg),
            regroup=regroup,
        )
    ]


def _sink_registration(cfg: HawkConfig) -> str:
    """``registration`` for the decode's sinks: they register what they land in as host
    memory (receive rings, Tenstorrent bank windows, vLLM caches), so ``auto`` is
    ``per_request`` there."""
    return resolve_registration(cfg.registration, "cpu")


def make_planner(cfg: HawkConfig, kv: LocalKV, sinks: list, peer, *, tp_rank: int, tp_size: int) -> PullPlanner:
    """The decode's pull planner over ``sinks`` (``peer``: side channel, engine id ->
    DecodeEndpoint); with ``prefill_tp`` set, checks at start-up that this decode's
    targets can pull from such a prefill."""
    p = PullPlanner(
        kv.num_kv_heads,
        kv.layout,
        sinks,
        chips=kv.tt_cache is not None,
        rank=tp_rank,
        ranks=tp_size,
        prefill_tp=cfg.prefill_tp,
        head_maps=kv.heads,
        peer=peer,
        log=logger,
    )
    if cfg.prefill_tp:
        check_pairing(p.heads, cfg.prefill_tp, p.total, p.targets, p.local, chips=p.chips)
    return p


def decode_endpoint(cfg: HawkConfig, transport, kv: LocalKV, side_channel: str) -> DecodeEndpoint:
    """A decode's endpoint to the prefill side channel ``side_channel`` (its handshake)."""
    return DecodeEndpoint(
        transport,
        side_channel,
        kv.compat,
        secret=cfg.secret_bytes,
        auth=cfg.auth,
        pull_timeout_s=cfg.pull_timeout_s,
        claim_wait_s=cfg.claim_wait_s,
        handshake_timeout_s=cfg.handshake_timeout_s,
        integrity=cfg.integrity,
    )


def make_transport_for(cfg: HawkConfig):
    """The transport this configuration names (``transport`` and its options)."""
    kind, options = cfg.transport_kind_and_options()
    return make_transport(kind, **options)
