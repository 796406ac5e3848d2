"""``HAWK_TT_PAGED``: a vLLM attention backend whose KV cache is the emulated device's
tiled, bank-interleaved paged cache (:class:`~vllm_hawk.tenstorrent.emulated.kv_cache.TTPagedKVCache`),
one per chip, KV heads sharded over the chips (:class:`~vllm_hawk.tenstorrent.emulated.mesh.TTMeshKVCache`).

* KV update (``do_kv_cache_update``, called by vLLM before ``forward``): the new tokens'
  K/V are packed to the tile format (bf16, bfloat8_b or bfloat4_b) and written into the banks.
* ``forward``: for each request, the tiles of its blocks up to its sequence length are
  read from the banks and unpacked, then causal attention runs in float32 (GQA,
  any mix of prefill, chunked prefill and decode in one batch). Prefill attends over
  the cache too, so the values it sees are the stored (possibly quantized) ones, as in
  a device kernel that reads the paged cache. On a mesh each chip computes the query
  heads of its KV heads from its own cache and the outputs are gathered.

The layer finds its cache through ``layer.hawk_tt_cache`` / ``layer.hawk_tt_layer``,
set by the platform's model runner when the KV cache is allocated. Until then (vLLM's
profiling and warm-up passes, where ``attn_metadata`` is None) the backend does nothing.

Not supported (refused when a layer is built): sliding window, ALiBi, logit soft-cap,
attention sinks, encoder / cross attention, MLA, fp8 KV caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from vllm_hawk.layout.formats import tile_format
from vllm_hawk.tenstorrent.emulated.config import ATTN_BACKEND_NAME, ATTN_BACKEND_PATH, TTPluginConfig, kv_dtype_for
from vllm_hawk.tenstorrent.emulated.mesh import TTMeshKVCache

BACKEND_NAME, BACKEND_PATH = ATTN_BACKEND_NAME, ATTN_BACKEND_PATH


def tt_kv_dtype(cache_dtype: str = "auto") -> str:
    """The tile format this process's engines store KV in (see :mod:`.config`)."""
    return kv_dtype_for(cache_dtype, TTPluginConfig.from_env())


class TTPagedAttentionBackend(AttentionBackend):
    """K/V in Tenstorrent tiles in emulated DRAM banks; see the module docstring."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(32)]  # tokens per block: whole tile rows

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 96, 128, 160, 192, 224, 256]  # whole tile columns

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # vLLM's own buffer is never used for KV (placeholders only); any layout will do.
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @staticmethod
    def get_impl_cls() -> type[TTPagedAttentionImpl]:
        return TTPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TTPagedMetadataBuilder]:
        return TTPagedMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Page size = the bytes one block takes on the device: K and V tiles of all heads.

        Per (head, token) that is ``2 * head_size * tile_nbytes / 1024`` bytes (bf16: 4 per
        value pair, bfloat8_b: 2.125, bfloat4_b: 1.125). Lockstep rounding of the last page row per bank is
        accounted for when the worker sizes the cache, not here."""
        import dataclasses

        fmt = tile_format(tt_kv_dtype())
        per_state = (spec.head_size + spec.head_size_v) * fmt.tile_nbytes
        if per_state % 1024:
            raise ValueError(f"head_size {spec.head_size} does not fill whole tiles")
        return dataclasses.replace(spec, state_content_bytes=per_state // 1024)


@dataclass
class TTPagedMetadata:
    """Per-step batch description (host tensors; the emulated device is the host)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: tokens in the cache after this step
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block * block_size + offset, -1 = pad


class TTPagedMetadataBuilder(AttentionMetadataBuilder[TTPagedMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> TTPagedMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return TTPagedMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: n + 1],
            seq_lens=m.seq_lens[:n].cpu(),
            block_table=m.block_table_tensor[:n].cpu(),
            slot_mapping=m.slot_mapping,
        )


class TTPagedAttentionImpl(AttentionImpl[TTPagedMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap or None,
            "sinks": sinks,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        bad = [k for k, v in unsupported.items() if v is not None]
        if bad or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} does not support {bad or attn_type}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.tile_dtype = tt_kv_dtype(kv_cache_dtype)
        self.attn_type = attn_type

    def do_kv_cache_update(
        self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        cache: TTMeshKVCache | None = getattr(layer, "hawk_tt_cache", None)
        if cache is None:  # profiling / warm-up before the KV cache exists
            return
        n = slot_mapping.shape[0]
        cache.write_tokens(layer.hawk_tt_layer, key[:n], value[:n], slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TTPagedMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME}: fused output quantization")
        if attn_metadata is None:  # profiling run: no KV cache, nothing to attend
            return output
        cache: TTMeshKVCache = layer.hawk_tt_cache  # type: ignore[attr-defined]
        n = attn_metadata.num_actual_tokens
        cache.paged_attention(
            layer.hawk_tt_layer,
            query[:n],
            attn_metadata.query_start_loc,  # type: ignore[attr-defined]
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            self.scale,
            output[:n],
        )
        return output
