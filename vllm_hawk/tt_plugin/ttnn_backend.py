"""``HAWK_TT_PLATFORM=ttnn``: the KV cache on real Tenstorrent hardware through ttnn.

UNTESTED: no Tenstorrent hardware or working ``ttnn.open_device`` on the machines this
was written on. Everything here is import-guarded: importing the module never needs
ttnn; using it without ttnn raises :class:`TTNNUnavailable`.

How tt-metal's ``models/tt_transformers`` take vLLM's paged cache (the convention this
follows; read in ``tt_transformers/tt/generator_vllm.py``): per layer a ``[K, V]`` pair
of ttnn tensors ``[num_blocks, num_kv_heads, block_size, head_dim]``, TILE layout,
``DRAM_MEMORY_CONFIG`` (interleaved over the DRAM banks), ``bfloat8_b`` unless the model
says otherwise; vLLM's block table is passed unchanged as ``page_table`` (int32
``[batch, max_blocks_per_req]``) to the model's ``prefill_forward`` / ``decode_forward``,
whose attention writes with ``paged_fill_cache`` / ``paged_update_cache`` and reads with
the paged SDPA decode op. The byte layout is therefore the one
:class:`~vllm_hawk.layout.tt_kv_cache.TTKVCacheLayout` models, with each tensor's
lockstep address taken from the device buffer (:func:`layout_from_tensors`), so a
connector can target it exactly as it targets the emulated device.

The model forward itself belongs to the Tenstorrent vLLM plugin (its worker and model
runner call tt_transformers); :class:`TTNNPlatform` only refuses to start with a clear
message until that runner is wired in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_hawk.layout.device_profiles import DeviceProfile
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TTNNUnavailable", "import_ttnn", "allocate_kv_cache", "page_table",
           "layout_from_tensors", "TTNNPlatform"]


class TTNNUnavailable(RuntimeError):
    """ttnn (tt-metal's Python API) is not importable in this environment."""


def import_ttnn() -> Any:
    """The ``ttnn`` module, or TTNNUnavailable with what to install."""
    try:
        import ttnn  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken tt-metal install
        raise TTNNUnavailable(f"HAWK_TT_PLATFORM=ttnn needs tt-metal's ttnn package ({e})") from e
    if not hasattr(ttnn, "TILE_LAYOUT"):  # e.g. a folder named ttnn on sys.path
        raise TTNNUnavailable(f"'ttnn' at {getattr(ttnn, '__path__', '?')} is not tt-metal's ttnn")
    return ttnn


def allocate_kv_cache(mesh_device: Any, spec: TTKVCacheSpec) -> list[tuple[Any, Any]]:
    """Per layer (K, V) ttnn tensors, zero-filled, TILE, DRAM interleaved, ``spec.dtype``."""
    import torch

    ttnn = import_ttnn()
    dtype = {"bfloat16": ttnn.bfloat16, "bfloat8_b": ttnn.bfloat8_b, "bfloat4_b": ttnn.bfloat4_b}[spec.dtype]
    zeros = torch.zeros(spec.tensor_shape, dtype=torch.bfloat16)
    return [tuple(ttnn.as_tensor(zeros, device=mesh_device, layout=ttnn.TILE_LAYOUT,
                                 memory_config=ttnn.DRAM_MEMORY_CONFIG, dtype=dtype)
                  for _ in range(2))
            for _ in range(spec.num_layers)]


def page_table(block_table: "torch.Tensor", num_reqs: int) -> "torch.Tensor":
    """vLLM's block table rows of the scheduled requests as tt_transformers' page table
    (int32 ``[num_reqs, max_blocks]``, host tensor; padding entries are ignored by the
    device ops because the sequence lengths bound them)."""
    import torch

    return block_table[:num_reqs].to(device="cpu", dtype=torch.int32).contiguous()


def layout_from_tensors(kv: list[tuple[Any, Any]], spec: TTKVCacheSpec,
                        profile: DeviceProfile) -> TTKVCacheLayout:
    """The :class:`TTKVCacheLayout` of tensors from :func:`allocate_kv_cache`
    (``buffer_address()`` is the lockstep address, the same in every bank)."""
    addrs = tuple((int(k.buffer_address()), int(v.buffer_address())) for k, v in kv)
    return TTKVCacheLayout(spec, profile.num_banks, profile.aligned_page(spec.tile_nbytes), addrs)


def _cpu_platform_base() -> type:
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # vLLM absent: the class still imports, for documentation/tests
        return object
    return CpuPlatform


class TTNNPlatform(_cpu_platform_base()):  # type: ignore[misc]
    """Placeholder platform for real hardware: checks ttnn, then refuses to run the model
    on the host (the Tenstorrent vLLM plugin's runner must drive tt_transformers)."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        import_ttnn()
        raise NotImplementedError(
            "HAWK_TT_PLATFORM=ttnn: the KV-cache side (allocate_kv_cache, page_table, "
            "layout_from_tensors) is provided, but the model runner for real hardware is the "
            "Tenstorrent vLLM plugin's; use HAWK_TT_PLATFORM=emulated on machines without one")
