"""Per-layer attention-output correlation of KV landed in each Tenstorrent tile format.

Teacher forcing: transformers runs the served model (its own dtype) once per prompt on the
prompt plus its greedy next token ``t`` (the first decode step's input); an attention hook
records, per layer, K and V of every position (``[kv_heads, tokens, head_dim]``, after RoPE:
what the KV cache holds) and the query of the last position (``[heads, head_dim]``: the
decode step's). Every layer thus sees the served model's own inputs, and its number
measures that layer's KV quantization alone, which is what a per-layer PCC gate measures.

Per format, the K/V land as a GN-HAWK pair lands them, through the product's code:

* the prompt's blocks before the last block boundary before its last token (what a
  Tenstorrent decode takes, ``HawkConnectorScheduler.matched_end``) sit in a prefill cache
  of vLLM's FlashAttention layout (:class:`~vllm_hawk.bench.paged_cache.PagedKVCache`),
  go through the prefill's transform into G' (:func:`~vllm_hawk.transform.transform_source`
  with a direct plan for an emulated p150a's cache of that dtype) and are copied into
  the KV pages as the plan's READs say (what the transport does, byte for byte);
* the decode writes the rest of the prompt and ``t`` itself
  (:meth:`~vllm_hawk.tenstorrent.emulated.kv_cache.TTPagedKVCache.write_tokens`);
* the decode's attention (:func:`~vllm_hawk.tenstorrent.emulated.kv_cache.paged_attention`:
  reads the tiles, unpacks them) gives each prompt's decode-step output ``[heads,
  head_dim]`` in the model's dtype.

A layer's PCC (:func:`pcc`, tt-metal's ``comp_pcc``) compares its outputs over the whole
prompt set, flattened, with those of the bf16-landed KV; the worst single prompt is kept
too. No vLLM engine runs here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.layout.vllm_kv import TransformSource
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache, paged_attention
from vllm_hawk.transform import make_plan, transform_source

__all__ = ["BLOCK", "Capture", "LayerPCC", "capture", "decode_outputs", "layer_pcc", "pcc", "prompt_set"]

BLOCK = 32  # tokens per block, prefill and decode (LocalCluster's default, the CPU engine's smallest)
DEVICE = "p150a"
_ATTN_NAME = "hawk_accuracy_capture"


def prompt_set(count: int = 16, vocab: int = 1024, seed: int = 32) -> list[list[int]]:
    """``count`` token-id prompts, BOS (0) then seeded ids in ``[2, vocab)``, of lengths
    spread over 33..600 tokens (across block boundaries; the same for the same arguments)."""
    rng = random.Random(seed)
    lengths = np.linspace(33, 600, count).round().astype(int) + [rng.randrange(0, 8) for _ in range(count)]
    return [[0] + [rng.randrange(2, vocab) for _ in range(int(n) - 1)] for n in lengths]


def pcc(golden: torch.Tensor, calculated: torch.Tensor) -> float:
    """Pearson correlation of two tensors, flattened, as tt-metal's ``comp_pcc``
    (``models/common/utility_functions.py``): 1.0 when equal, 0.0 when exactly one is all
    zero, else ``corrcoef`` in float64 (inf/NaN masked to 0)."""
    g = torch.nan_to_num(golden.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0).reshape(-1)
    c = torch.nan_to_num(calculated.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0).reshape(-1)
    if torch.equal(g, c):
        return 1.0
    if bool(g.any()) != bool(c.any()):
        return 0.0
    return float(np.corrcoef(g.numpy(), c.numpy())[0, 1])


@dataclass
class Capture:
    """One prompt's teacher-forced decode step: per layer K, V ``[kv_heads, L + 1, head_dim]``
    (prompt of ``L`` tokens, then ``t``) and the query ``[heads, head_dim]`` of ``t``, in
    the model's dtype; ``scale``: the attention's softmax scale."""

    prompt_len: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    scale: float


def _load(model_dir) -> torch.nn.Module:
    """The model as served (its config's dtype), its attention recording into ``model.hawk_record``."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def record(module, query, key, value, attention_mask, **kw):
        module.hawk_record[module.layer_idx] = (query[0, :, -1], key[0], value[0], kw["scaling"])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_ATTN_NAME, record)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto", attn_implementation=_ATTN_NAME)
    model.eval()
    shared: dict = {}
    for layer in model.model.layers:
        layer.self_attn.hawk_record = shared
    model.hawk_record = shared
    return model


@torch.no_grad()
def capture(model_dir, prompts: list[list[int]]) -> list[Capture]:
    """Teacher-forced decode steps of ``prompts`` (see the module doc)."""
    model = _load(model_dir)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        t = int(model(ids).logits[0, -1].argmax())
        model.hawk_record.clear()
        model(torch.tensor([p + [t]]))
        rec = [model.hawk_record[i] for i in range(len(model.hawk_record))]
        out.append(Capture(len(p), [r[1] for r in rec], [r[2] for r in rec], [r[0] for r in rec], float(rec[0][3])))
    return out


def _land(dev: EmulatedDevice, plan, g: torch.Tensor) -> None:
    """Copy G' into the KV pages as a direct plan's READs say (the transport's byte copies)."""
    ops = plan.rdma
    for s, b, d, n in zip(*(x.tolist() for x in (ops.src_offset, ops.bank, ops.dst_offset, ops.nbytes)), strict=True):
        dev.bank_tensor(b)[d : d + n] = g[s : s + n]


def _prefill_cache(cap: Capture, transferred: int) -> PagedKVCache:
    """The prefill's cache (FlashAttention layout) holding the first ``transferred`` tokens
    of every layer in blocks ``1..n`` (block 0 is vLLM's null block)."""
    kv_heads, _, dim = cap.keys[0].shape
    n = transferred // BLOCK
    cache = PagedKVCache(len(cap.keys), n + 1, kv_heads, BLOCK, dim, cap.keys[0].dtype)
    ids = torch.arange(1, n + 1)
    for layer, (k, v) in enumerate(zip(cap.keys, cap.values, strict=True)):
        kb, vb = (x[:, :transferred].reshape(kv_heads, n, BLOCK, dim).transpose(0, 1) for x in (k, v))
        cache.adapter.write_blocks(cache.layers[layer], ids, kb, vb)
    return cache


def _land_prompt(cache: TTPagedKVCache, cap: Capture, blocks: np.ndarray) -> None:
    """One prompt's K/V into ``blocks`` of ``cache``, as a GN-HAWK pair lands them (module doc)."""
    transferred = (cap.prompt_len - 1) // BLOCK * BLOCK  # what a Tenstorrent decode takes (matched_end)
    if transferred:
        plan = make_plan(cache.layout, blocks[: transferred // BLOCK], "direct")
        src = TransformSource.of_views(_prefill_cache(cap, transferred).kv_views())
        g = torch.empty(plan.total_nbytes, dtype=torch.uint8)
        _land(cache.device, plan, transform_source(src, np.arange(1, plan.dst_blocks.size + 1), BLOCK, plan, g))
    pos = torch.arange(transferred, cap.prompt_len + 1)  # the decode writes the rest of the prompt, then t
    slots = torch.from_numpy(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
    for layer, (k, v) in enumerate(zip(cap.keys, cap.values, strict=True)):
        cache.write_tokens(layer, k[:, transferred:].transpose(0, 1), v[:, transferred:].transpose(0, 1), slots)


def decode_outputs(caps: list[Capture], dtype: str) -> list[torch.Tensor]:
    """Per layer, each prompt's decode-step attention output ``[prompts, heads, head_dim]``
    from KV landed in tile format ``dtype`` (see the module doc), prompt ``r`` in its own blocks."""
    layers, (kv_heads, _, dim) = len(caps[0].keys), caps[0].keys[0].shape
    nblk = [-(-(c.prompt_len + 1) // BLOCK) for c in caps]
    spec = TTKVCacheSpec(layers, sum(nblk), kv_heads, BLOCK, dim, dtype)
    # every bank could hold the whole cache (the emulated banks are mapped lazily)
    dev = EmulatedDevice(DEVICE, bank_size_bytes=max(16 << 20, 2 * layers * spec.tiles_per_tensor * spec.tile_nbytes))
    cache = TTPagedKVCache(dev, spec)
    table = torch.zeros(len(caps), max(nblk), dtype=torch.int32)
    first = 0
    for r, c in enumerate(caps):
        blocks = np.arange(first, first + nblk[r])
        table[r, : nblk[r]] = torch.from_numpy(blocks)
        _land_prompt(cache, c, blocks)
        first += nblk[r]
    seq_lens = torch.tensor([c.prompt_len + 1 for c in caps])
    starts = torch.arange(len(caps) + 1)
    outs = []
    for layer in range(layers):
        q = torch.stack([c.queries[layer] for c in caps])  # [prompts, heads, head_dim]
        o = torch.empty_like(q)
        outs.append(paged_attention(cache, layer, q, starts, seq_lens, table, caps[0].scale, o))
    cache.close()
    dev.close()
    return outs


@dataclass
class LayerPCC:
    """One format's per-layer PCC against bf16 (over the prompt set) and each layer's worst prompt."""

    dtype: str
    per_layer: list[float]
    worst_prompt: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.per_layer)


def layer_pcc(caps: list[Capture], dtypes=("bfloat16", "bfloat8_b", "bfloat4_b")) -> list[LayerPCC]:
    """Per-layer PCC of each format's decode outputs against the bf16-landed ones."""
    ref = decode_outputs(caps, "bfloat16")
    out = []
    for dtype in dtypes:
        got = ref if dtype == "bfloat16" else decode_outputs(caps, dtype)
        per_layer = [pcc(r, g) for r, g in zip(ref, got, strict=True)]
        worst = [min(pcc(r[i], g[i]) for i in range(r.shape[0])) for r, g in zip(ref, got, strict=True)]
        out.append(LayerPCC(dtype, per_layer, worst))
    return out
