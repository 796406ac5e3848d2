"""Worker and model runner of the emulated Tenstorrent platform.

They are vLLM's CPU worker and CPU model runner (the model itself runs in torch on the
host) with the KV cache moved into an :class:`~vllm_hawk.npu.emulated.EmulatedDevice`:

* the device is a mesh of ``HAWK_TT_CHIPS`` chips (default: the profile's ``chips``), one
  :class:`~vllm_hawk.npu.emulated.EmulatedDevice` each, the KV heads sharded over them
  (:mod:`.mesh`); one chip is a mesh of one.
* ``determine_available_memory``: the KV budget is the device's, not the host's:
  ``HAWK_TT_KV_FRACTION`` of every bank, minus the lockstep rounding (each K or V
  tensor takes ``ceil(tiles / num_banks)`` pages in EVERY bank), for a block of the
  heads ONE chip holds, capped by an explicit ``kv_cache_memory_bytes`` /
  ``VLLM_CPU_KVCACHE_SPACE`` when one is set. A chip count that cannot split the
  model's heads fails here, at start-up, naming ``HAWK_TT_CHIPS``.
* ``initialize_kv_cache_tensors``: allocates K and V per layer on every chip
  (:class:`~vllm_hawk.tenstorrent.emulated.mesh.TTMeshKVCache`), attaches it to each
  attention layer, registers it for connectors (:mod:`vllm_hawk.tenstorrent.registry`) and gives vLLM one
  ``[num_blocks, 1]`` uint8 placeholder per layer instead of a KV view, so that code
  which copies "block i" by position moves nothing instead of corrupting tiles. A tile
  format beyond the accuracy contract (:mod:`vllm_hawk.tenstorrent.kv_accuracy`) is
  warned about then, once per engine.
* block zeroing and copy-on-write copies, which vLLM does on its own views, are done
  through the layout on every chip (``TTMeshKVCache.zero_blocks`` / ``copy_blocks``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.tenstorrent import registry
from vllm_hawk.tenstorrent.device import decode_device
from vllm_hawk.tenstorrent.emulated.attention import TTPagedAttentionBackend, tt_kv_dtype
from vllm_hawk.tenstorrent.emulated.config import ENV_CHIPS, ENV_DEVICE, ENV_KV_DTYPE, TTPluginConfig
from vllm_hawk.tenstorrent.emulated.kv_cache import kv_budget_blocks
from vllm_hawk.tenstorrent.emulated.mesh import TPMismatch, TTMeshKVCache, chip_shards
from vllm_hawk.tenstorrent.kv_accuracy import log_kv_dtype

logger = logging.getLogger("vllm.hawk.tt_plugin")


def _attention_layers(runner) -> dict[str, torch.nn.Module]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(runner.vllm_config, Attention)


class TTEmulatedModelRunner(CPUModelRunner):
    """CPUModelRunner whose KV cache lives in an emulated Tenstorrent device.

    Built by :class:`TTEmulatedWorker` (which turns the CPU runner it constructed into
    this class: no state of its own is needed before the KV cache exists)."""

    hawk_tt_cache: TTMeshKVCache | None = None
    hawk_tt_devices: list[EmulatedDevice] | None = None

    # ---- sizing ----------------------------------------------------------------------
    def hawk_devices(self) -> list[EmulatedDevice]:
        """One emulated chip per mesh chip (``HAWK_TT_CHIPS``, default the profile's
        ``chips``), each with its own banks and allocator."""
        if self.hawk_tt_devices is None:
            cfg = TTPluginConfig.from_env()
            profile = load_profile(decode_device(self.vllm_config, cfg.device, ENV_DEVICE))
            n = cfg.num_chips(profile.chips)
            self.hawk_tt_devices = [EmulatedDevice(profile, bank_size_bytes=cfg.bank_size_bytes) for _ in range(n)]
            logger.info(
                "HAWK emulated Tenstorrent device: %s, %d chip(s) x %d banks x %d MiB",
                profile.name,
                n,
                profile.num_banks,
                cfg.bank_mib,
            )
        return self.hawk_tt_devices

    def hawk_kv_budget_bytes(self) -> int:
        """vLLM-visible KV bytes that fit every chip (see module docstring): each chip
        holds its share of the KV heads, so a block takes that share's tiles per chip."""
        cfg = TTPluginConfig.from_env()
        devs = self.hawk_devices()
        dev = devs[0]
        specs = [s for s in self.get_kv_cache_spec().values()]
        if not specs:
            return 0
        s0 = specs[0]
        if any(
            (s.block_size, s.num_kv_heads, s.head_size, s.page_size_bytes)
            != (s0.block_size, s0.num_kv_heads, s0.head_size, s0.page_size_bytes)
            for s in specs
        ):
            raise NotImplementedError("the emulated Tenstorrent platform needs uniform attention layers")
        where = f"device {dev.profile.name}, {'set' if cfg.chips is not None else 'the profile default'}"
        try:
            shards = chip_shards(s0.num_kv_heads, len(devs), ENV_CHIPS)
        except TPMismatch as e:
            raise TPMismatch(f"{e} ({where})") from None
        hq = self.model_config.get_num_attention_heads(self.parallel_config)
        if hq % len(devs):
            raise TPMismatch(f"{ENV_CHIPS}={len(devs)} does not divide the model's {hq} query heads ({where})")
        dtype = tt_kv_dtype(self.cache_config.cache_dtype)
        probe = TTKVCacheSpec(len(specs), 1, max(sh.count for sh in shards), s0.block_size, s0.head_size, dtype)
        ap = dev.profile.aligned_page(probe.tile_nbytes)
        budget = int(dev.bank_size * cfg.kv_fraction) // ap * ap
        blocks = kv_budget_blocks(probe.tiles_per_block, len(specs), dev.num_banks, ap, budget)
        return blocks * s0.page_size_bytes * len(specs)

    # ---- allocation ------------------------------------------------------------------
    def initialize_kv_cache_tensors(
        self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None
    ) -> dict[str, torch.Tensor]:
        from vllm.v1.kv_cache_interface import AttentionSpec
        from vllm.v1.worker.utils import bind_kv_cache

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
            raise NotImplementedError(
                f"the emulated Tenstorrent platform supports one full-attention KV cache group, got {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        layers = _attention_layers(self)
        names = [n for n in groups[0].layer_names if n in layers]
        for n in names:
            if layers[n].attn_backend is not TTPagedAttentionBackend:
                raise RuntimeError(
                    f"layer {n} uses {layers[n].attn_backend.get_name()}, not {TTPagedAttentionBackend.get_name()}"
                )
        if kernel_block_sizes and kernel_block_sizes[0] != spec.block_size:
            raise NotImplementedError(f"kernel block size {kernel_block_sizes[0]} != block size {spec.block_size}")
        num_blocks = kv_cache_config.num_blocks
        tt_spec = TTKVCacheSpec(
            len(names),
            num_blocks,
            spec.num_kv_heads,
            spec.block_size,
            spec.head_size,
            tt_kv_dtype(self.cache_config.cache_dtype),
        )
        if self.hawk_tt_cache is not None:  # re-initialisation: drop the previous cache
            self.hawk_shutdown()
        cache = TTMeshKVCache(self.hawk_devices(), tt_spec, names, ENV_CHIPS)
        self.hawk_tt_cache = cache
        for i, n in enumerate(names):
            layers[n].hawk_tt_cache = cache
            layers[n].hawk_tt_layer = i
        registry.register(self.vllm_config, cache)
        chip = cache.chips[0]
        logger.info(
            "HAWK KV cache on %s x %d chip(s) (%d of %d KV heads each): %d layers x (K, V) x "
            "%d blocks x %d tiles of %s per chip, %d B per bank per tensor (%d tiles per tensor "
            "over %d banks)",
            chip.device.profile.name,
            cache.num_chips,
            chip.spec.num_kv_heads,
            tt_spec.num_kv_heads,
            len(names),
            num_blocks,
            chip.spec.tiles_per_block,
            tt_spec.dtype,
            chip.layout.size_per_bank,
            chip.spec.tiles_per_tensor,
            chip.num_banks,
        )
        log_kv_dtype(logger, tt_spec.dtype, ENV_KV_DTYPE)  # a lossy format beyond the accuracy contract
        placeholder = torch.zeros((num_blocks, 1), dtype=torch.uint8)
        kv_caches = {n: placeholder for n in names}
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches, kv_cache_groups=groups)
        return kv_caches

    # ---- block operations vLLM performs on its own views ----------------------------
    def _zero_block_ids(self, block_ids: list[int]) -> None:
        if self.hawk_tt_cache is not None and block_ids:
            self.hawk_tt_cache.zero_blocks(block_ids)

    def _update_states(self, scheduler_output):
        copies = getattr(scheduler_output, "kv_cache_block_copies", None)
        zeros = getattr(scheduler_output, "new_block_ids_to_zero", None)
        if (copies or zeros) and self.hawk_tt_cache is not None:
            if zeros:  # same order as vLLM: zero the new blocks, then copy-on-write
                self.hawk_tt_cache.zero_blocks(zeros)
            if copies:
                self.hawk_tt_cache.copy_blocks([(int(s), int(d)) for s, d in copies])
            scheduler_output = dataclasses.replace(
                scheduler_output, kv_cache_block_copies=None, new_block_ids_to_zero=None
            )
        return super()._update_states(scheduler_output)

    # ---- teardown ----------------------------------------------------------------------
    def hawk_shutdown(self) -> None:
        """Unregister and free the device KV cache (idempotent)."""
        cache, self.hawk_tt_cache = self.hawk_tt_cache, None
        if cache is None:
            return
        registry.unregister(self.vllm_config)
        for layer in _attention_layers(self).values():
            for attr in ("hawk_tt_cache", "hawk_tt_layer"):
                if hasattr(layer, attr):
                    delattr(layer, attr)
        cache.close()


class TTEmulatedWorker(CPUWorker):
    """vLLM's CPU worker with :class:`TTEmulatedModelRunner` and a device-sized KV budget."""

    def init_device(self):
        self.use_v2_model_runner = False  # our runner extends the V1 CPU runner
        super().init_device()
        # The CPU runner needs no KV state before initialize_kv_cache; give it our methods.
        self.model_runner.__class__ = TTEmulatedModelRunner

    def determine_available_memory(self) -> int:
        runner: TTEmulatedModelRunner = self.model_runner  # type: ignore[assignment]
        device_bytes = runner.hawk_kv_budget_bytes()
        explicit = self.cache_config.kv_cache_memory_bytes
        size = device_bytes if explicit is None else min(explicit, device_bytes)
        logger.info("HAWK KV budget: %d B (device allows %d B, explicit %s)", size, device_bytes, explicit)
        return size

    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, TTEmulatedModelRunner):
            runner.hawk_shutdown()
        super().shutdown()
