"""What this engine's KV cache is, as the connector tells Algorithm 1 (:mod:`vllm_hawk.kvflow`).

* a plain vLLM engine (prefill, or a GG decode): the per-layer caches vLLM hands to
  ``register_kv_caches``, read through the source-layout adapters of
  :mod:`vllm_hawk.layout.vllm_kv` into a :class:`~vllm_hawk.kvflow.KVRegionMap`
  (where each block's bytes are), the buffers to register, and zero-copy logical K/V
  views ``[num_blocks, heads, block_size, head_dim]`` for the GN-HAWK transform;
* an engine on the Tenstorrent platform plugin (GN-HAWK / GN-Host decode): the plugin's
  device KV cache (:mod:`vllm_hawk.tenstorrent.registry`; the tensors vLLM passes are
  placeholders). GN-Host (``layout_fix: decode``): both sides also derive the blocks'
  wire layout (:mod:`vllm_hawk.kvflow.gn_host`) and name it in ``src_layout``.

Both sides derive the handshake's compatibility fields here, so a P/D pair that
disagrees (model, dtype, block size, source layout, device profile, ``layout_fix``) is
refused by name. They name the model's KV heads in all (not this rank's) and the
layout by backend, kernel ISA and dimension order (:func:`~vllm_hawk.layout.vllm_kv.dim_order`),
so that pairs with different tensor-parallel sizes agree, and GG pairs whose block sizes
differ as :func:`~vllm_hawk.protocol.compat.regroups` allows differ in ``block_size`` only;
``LocalKV.heads`` gives the region map of any range of this rank's heads (the shares
of :mod:`vllm_hawk.layout.tp`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_hawk.connector.config import VLLM_PROFILE, HawkConfig, HawkConfigError
from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import KVRegionMap, head_maps, region_map_from_caches
from vllm_hawk.protocol import CompatFields, LayoutDesc, make_compat

SRC_ANY = "vllm-any"  # GN-HAWK: the prefill converts from whatever vLLM layout it has


@dataclass
class LocalKV:
    """This engine's KV cache as the connector sees it."""

    compat: CompatFields
    layout: LayoutDesc
    region_map: KVRegionMap | None = None  # vLLM caches
    storages: list[tuple[int, int]] = field(default_factory=list)  # (addr, nbytes) of each buffer
    views: object = None  # vLLM caches: a TransformSource (what the GN-HAWK transform reads)
    tt_cache: object = None  # Tenstorrent plugin: its TTPagedKVCache
    wire: object = None  # GN-Host (layout_fix 'decode'): the WireLayout of the prefill's blocks
    heads: Callable[[int, int], KVRegionMap] | None = None  # vLLM caches: (start, count) -> map of those heads
    num_kv_heads: int = 0  # the model's KV heads, all ranks together
    caches: list = field(default_factory=list)  # vLLM caches: per-layer tensors [num_blocks, H, N, C], in layer order
    adapters: list = field(default_factory=list)  # vLLM caches: each layer's SourceKVLayout (vllm_hawk.layout.vllm_kv)


def total_kv_heads(vllm_config) -> int:
    """The model's KV heads over all tensor-parallel ranks."""
    return int(vllm_config.model_config.get_total_num_kv_heads())


def _layer_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def model_id(vllm_config, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    hf = vllm_config.model_config.hf_config
    return (
        f"{getattr(hf, 'model_type', '?')}:L{num_layers}:KV{num_kv_heads}:D{head_dim}:V{getattr(hf, 'vocab_size', 0)}"
    )


def tt_compat(
    model: str, dtype: str, block_size: int, profile: str, layout_fix: str = "prefill", src_layout: str = SRC_ANY
) -> CompatFields:
    """Compatibility fields of both sides of a pair with a Tenstorrent decode (device
    profile ``profile``): GN-HAWK (``layout_fix`` 'prefill', any vLLM source layout and
    block size: the transform regroups tokens into the decode's blocks, so the fields
    carry block size 0) or GN-Host ('decode': ``src_layout`` names the blocks' wire
    layout, which the decode reads, in blocks of ``block_size`` on both sides)."""
    return make_compat(
        model=model[:256],
        dtype=dtype,
        block_size=0 if layout_fix == "prefill" else block_size,
        src_layout=src_layout[:256],
        dst_layout=f"tt-paged/{profile}/layout_fix={layout_fix}"[:256],
        device_profile=profile,
    )


def describe_vllm_caches(kv_caches: dict, vllm_config, cfg: HawkConfig) -> LocalKV:
    """Region map, buffers, views, compatibility fields and layout of vLLM's KV caches."""
    from vllm_hawk.layout.vllm_kv import TransformSource, dim_order, source_layout_from_layer

    ctx = vllm_config.compilation_config.static_forward_context
    names = sorted(kv_caches, key=_layer_key)
    caches, templates, adapters = [], [], []
    for name in names:
        cache = kv_caches[name]
        if isinstance(cache, (list, tuple)):
            cache = cache[0]
        layer = ctx.get(name)
        if layer is None or not hasattr(layer, "attn_backend"):
            raise NotImplementedError(f"HawkConnector: KV cache {name!r} is not an attention layer")
        adapter = source_layout_from_layer(layer, cache)
        caches.append(cache)
        templates.append(adapter.block_byte_ranges(cache, 0))
        adapters.append(adapter)
    views = TransformSource(adapters, caches)  # zero-copy views, or a gather for amx
    region_map = region_map_from_caches(caches, templates)
    heads = head_maps(caches)
    seen: dict[int, int] = {}
    for c in caches:
        st = c.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    a0 = adapters[0]
    isa = a0.isa
    orders = sorted({dim_order(c) for c in caches})
    src_layout = f"{a0.name}{'/' + isa if isa else ''}/{'+'.join(orders)}"
    total = total_kv_heads(vllm_config)
    mid = model_id(vllm_config, len(names), total, a0.head_dim)
    dtype = str(a0.dtype).removeprefix("torch.")
    wire = None
    if cfg.device_profile != VLLM_PROFILE and cfg.layout_fix == "decode":  # GN-Host: blocks as they are
        from vllm_hawk.kvflow.gn_host import wire_layout_of

        wires = [wire_layout_of(a, c) for a, c in zip(adapters, caches, strict=False)]
        if len({w.name for w in wires}) != 1:
            raise NotImplementedError(
                f"HawkConnector: GN-Host needs one KV layout in every layer, got {sorted({w.name for w in wires})}"
            )
        wire = wires[0]
        compat = tt_compat(mid, dtype, a0.block_size, cfg.device_profile, "decode", wire.name)
    elif cfg.device_profile != VLLM_PROFILE:  # GN-HAWK: the prefill transforms for the decode
        compat = tt_compat(mid, dtype, a0.block_size, cfg.device_profile)
    else:
        compat = make_compat(
            model=mid[:256],
            dtype=dtype,
            block_size=a0.block_size,
            src_layout=src_layout[:256],
            dst_layout=f"vllm-paged/{src_layout}"[:256],
            device_profile=cfg.device_profile,
        )
    layout = vllm_layout_desc(region_map, f"vllm-paged/{a0.name}", dtype, a0.block_size, a0.num_kv_heads, a0.head_dim)
    return LocalKV(
        compat,
        layout,
        region_map,
        sorted(seen.items()),
        views,
        wire=wire,
        heads=heads,
        num_kv_heads=total,
        caches=caches,
        adapters=adapters,
    )


def describe_tt_cache(cache, vllm_config, cfg: HawkConfig) -> LocalKV:
    """Decode on the Tenstorrent platform plugin: compat fields and layout of its device
    KV cache (the sink registers its own memory)."""
    from vllm_hawk.kvflow.sinks import layout_desc

    s = cache.spec  # all heads; each chip of a mesh holds its share of them (cache.chips)
    chip = cache.chips[0]
    dev = chip.device.profile.name  # cfg.device_profile's unless that names no Tenstorrent device
    if dev != cfg.device_profile:
        raise HawkConfigError(
            f"kv_connector_extra_config.device_profile={cfg.device_profile!r} but this engine's "
            f"Tenstorrent device is {dev!r}: a Tenstorrent decode needs pair 'gn-hawk' or 'gn-host' "
            f"with device_profile={dev!r}"
        )
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    mid = model_id(vllm_config, s.num_layers, total_kv_heads(vllm_config), s.head_dim)
    if cfg.layout_fix == "decode":  # GN-Host: this side reads the prefill's vLLM blocks
        from vllm_hawk.kvflow.gn_host import host_wire_layout

        wire = host_wire_layout(s.num_kv_heads, s.block_size, s.head_dim, vllm_config.model_config.dtype)
        compat = tt_compat(mid, dtype, s.block_size, cfg.device_profile, "decode", wire.name)
        return LocalKV(
            compat, wire.layout_desc(s.num_layers), tt_cache=cache, wire=wire, num_kv_heads=total_kv_heads(vllm_config)
        )
    compat = tt_compat(mid, dtype, s.block_size, cfg.device_profile)
    return LocalKV(compat, layout_desc(chip.layout), tt_cache=cache, num_kv_heads=total_kv_heads(vllm_config))


def tt_cache_of(vllm_config):
    """The engine's Tenstorrent KV cache when it runs the platform plugin, else None."""
    try:
        from vllm_hawk.tenstorrent import registry
    except Exception:  # noqa: BLE001 - plugin not importable: not a Tenstorrent engine
        return None
    try:
        return registry.get_kv_cache(vllm_config)
    except (LookupError, ValueError):
        return None
