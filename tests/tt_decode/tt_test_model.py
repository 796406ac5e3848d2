"""A TEST model for vllm-tt-plugin: the tiny Llama of :mod:`vllm_hawk.bench.tiny_model` behind the plugin's
model interface, so that vLLM 0.25.1 + vllm-tt-plugin can serve it on Tenstorrent's simulator.

It is not a Tenstorrent model and nothing in vllm_hawk's runtime uses it. tt_transformers'
models run their layers as device kernels, which cannot be compiled here (no SFPI
toolchain, ../shared/ttsim/README.md); this one computes on the host and uses the device
for its paged KV cache only. It is a contract double of tt_transformers' ``Generator``
(tenstorrent/tt-metal ``models/tt_transformers/tt/generator.py`` and ``generator_vllm.py``):
what the real model requires of its caller, it requires too, and refuses the rest:

* ``allocate_kv_cache`` returns what ``allocate_vllm_kv_cache`` returns:
  ``kv_cache[submesh][layer] = [K, V]`` (one submesh: no data parallelism), each
  ``ttnn.as_tensor(zeros(shape), mesh_mapper=ReplicateTensorToMesh, layout=TILE_LAYOUT,
  memory_config=DRAM_MEMORY_CONFIG, dtype=...)``, shape ``[num_blocks, kv_heads per chip,
  block_size, head_dim]``; ``bfloat8_b`` unless ``optimizations="accuracy"`` (then
  ``bfloat16``), as tt_transformers' precision settings choose it;
* ``prefill_forward`` / ``decode_forward`` take exactly the keyword arguments vllm-tt-plugin
  passes a model without device sampling (``submit_prefill``: ``tokens``, ``page_table``,
  ``kv_cache``, ``enable_trace``, ``prompt_lens``, ``start_pos``, and ``empty_slots`` /
  ``sampling_params`` when it has them; ``submit_decode``: ``tokens``, ``page_table``,
  ``kv_cache``, ``start_pos``, ``enable_trace``, ``read_from_device``) -- an unknown one is a
  ``TypeError`` -- and index the cache as the generators do, ``kv_cache[model_id]`` with
  ``model_id = user_id // max_batch_size``;
* a prefill that starts after cached tokens (``start_pos > 0``: a prefix hit or a KV
  transfer) must start on a block boundary that is a multiple of 32, or it fails as the
  real kernels do (the Galaxy generator asserts ``start_pos % block_size == 0``;
  ``q_chunk_size`` derived from ``start & -start`` makes chunked SDPA ``TT_FATAL``; the page
  table is sliced from ``start // block_size``). vllm-tt-plugin (this snapshot: vLLM's
  synchronous scheduler, which its ``TTScheduler`` subclasses) also passes a request's
  later tokens through ``prefill_forward``, one per call, starting where the request's
  previous call ended: those are its decode steps, not prefix prefills, and are not checked;
* new K/V rows go into the device cache by read-modify-write of the touched tiles at their
  (bank, address) through tt-metal's cluster API (``paged_fill_cache`` /
  ``paged_update_cache`` are kernels);
* attention reads the cache back through ttnn (``ttnn.to_torch`` of each chip's tensor) and
  runs in float32 on the host, over the blocks of vLLM's page table.

The bundle folder for vllm-tt-plugin's ``EXTRA_MODELS_DIR`` is ``tt_models/`` next to this
module (``vllm_metadata.json``: arch ``LlamaForCausalLM`` -> this class, as
``tests.tt_decode.tt_test_model``: the servers of a LocalCluster have the repository root on
``PYTHONPATH``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from vllm_hawk.layout.formats import tilize_pack, unpack_untilize
from vllm_hawk.npu.ttnn_chip import DEVICE_LOCK, TTNNChip, import_ttnn

__all__ = ["TinyLlamaTTTestModel", "BUNDLES_DIR", "ARCH_PROFILES"]

#: the EXTRA_MODELS_DIR holding this test model's bundle
BUNDLES_DIR = Path(__file__).resolve().parent / "tt_models"
#: device profile of each simulated architecture the test model runs on
ARCH_PROFILES = {"BLACKHOLE": "p150a", "WORMHOLE_B0": "n150"}
#: token budget of the whole KV cache (vllm-tt-plugin's ``get_max_tokens_all_users``): small,
#: so that allocating it on the simulator takes a fraction of a second
MAX_TOKENS_ALL_USERS = 4096


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k.removeprefix("model."): v.to(torch.float32) for k, v in load_file(path / "model.safetensors").items()}


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


class TinyLlamaTTTestModel:
    """TEST model (see module doc). Host compute in float32; KV cache on the device."""

    model_capabilities: dict = {}  # no device sampling, no async decode, no prefix caching

    def __init__(
        self, hf_config, mesh_device, weights: dict[str, torch.Tensor], optimizations, max_batch_size: int
    ) -> None:
        ttnn = self._ttnn = import_ttnn()
        self.cfg, self.mesh, self.w = hf_config, mesh_device, weights
        self.max_batch_size = max_batch_size  # per submesh (model_id = user_id // max_batch_size)
        self._ends: dict[int, int] = {}  # a request's first block -> the end of its last prefill call
        self.n_layers = hf_config.num_hidden_layers
        self.n_heads = hf_config.num_attention_heads
        self.n_kv = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.n_heads
        self.eps = hf_config.rms_norm_eps
        self.kv_dtype = ttnn.bfloat16 if optimizations == "accuracy" else ttnn.bfloat8_b
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = 1.0 / (_rope_theta(hf_config) ** half)
        with DEVICE_LOCK:
            arch = mesh_device.arch().name
            n = mesh_device.get_num_devices()
        if arch not in ARCH_PROFILES:
            raise NotImplementedError(f"the tiny test model runs on {sorted(ARCH_PROFILES)}, not {arch}")
        if self.n_kv % n:
            raise ValueError(f"{self.n_kv} KV heads do not split over {n} chips")
        self.chips = [TTNNChip(mesh_device, ARCH_PROFILES[arch], c) for c in range(n)]
        self.kv_per_chip = self.n_kv // n

    # ---- vllm-tt-plugin's model interface ---------------------------------------------
    @classmethod
    def initialize_vllm_model(
        cls, hf_config, mesh_device, max_batch_size, *, max_seq_len=None, tt_data_parallel=1, optimizations=None
    ):
        if tt_data_parallel != 1:
            raise ValueError("the tiny test model runs without data parallelism")
        path = Path(hf_config.name_or_path)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"{path}: no model.safetensors (the tiny test model loads local files only)")
        return cls(hf_config, mesh_device, _load_weights(path), optimizations, max_batch_size)

    @classmethod
    def get_max_tokens_all_users(cls, *, max_model_len, max_num_seqs, **_kw) -> int:
        return min(MAX_TOKENS_ALL_USERS, max_model_len * max_num_seqs)

    def allocate_kv_cache(self, kv_cache_shape, dtype, num_layers):
        """tt_transformers' ``allocate_vllm_kv_cache`` (see module doc): one submesh, per
        layer ``[K, V]``; the tiles are made on the host first (``as_tensor`` without a
        device, then ``to_device``): given the device, ttnn tilizes a bfloat16 tensor with a
        device kernel (SFPI). The device tensors are the same."""
        ttnn = self._ttnn
        zeros = torch.zeros(kv_cache_shape, dtype=torch.float32)
        with DEVICE_LOCK:
            host = ttnn.as_tensor(
                zeros, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh), layout=ttnn.TILE_LAYOUT, dtype=self.kv_dtype
            )
            submesh = [
                [ttnn.to_device(host, self.mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG) for _kv in "kv"]
                for _ in range(num_layers)
            ]
        return [submesh]

    def warmup_model_prefill(self, *, kv_cache, enable_trace, can_sample_on_device) -> None:
        """Nothing to compile or trace (host compute); the cache is checked as the generators index it."""
        self._model_cache(kv_cache, 0)

    def warmup_model_decode(self, *, kv_cache, enable_trace, max_batch_size, num_blocks, can_sample_on_device) -> None:
        """Nothing to compile or trace (host compute); the cache is checked as the generators index it."""
        self._model_cache(kv_cache, 0)

    def prefill_forward(
        self,
        *,
        tokens,
        page_table,
        kv_cache,
        prompt_lens,
        start_pos,
        enable_trace,
        empty_slots=None,
        sampling_params=None,
    ):
        """Rows ``b``: tokens ``[start_pos[b], prompt_lens[b])`` of user ``empty_slots[b]``;
        logits of each row's last token, float32 ``[B, 1, vocab]``."""
        if sampling_params is not None:
            raise AssertionError("sampling_params given to a model without device sampling")
        if not isinstance(page_table, torch.Tensor):
            raise AssertionError(f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
        slots = list(range(len(prompt_lens))) if empty_slots is None else list(empty_slots)
        starts = np.zeros(len(prompt_lens), np.int64) if start_pos is None else np.asarray(start_pos, np.int64)
        ends = np.asarray(prompt_lens, np.int64)
        rows = []
        for b, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            layers = self._model_cache(kv_cache, slots[b] // self.max_batch_size)
            first_block = int(page_table[b, 0])
            if s and self._ends.get(first_block) != s:  # a prefix prefill (not the request's next token)
                self._check_prefill_start(s, int(layers[0][0].shape[2]), f"row {b} (prompt_lens {e}, slot {slots[b]})")
            self._ends[first_block] = e
            rows.append((torch.as_tensor(tokens[b, s:e]), s, page_table[b]))
        return self._forward(rows, layers)

    def decode_forward(self, *, tokens, page_table, kv_cache, start_pos, enable_trace, read_from_device):
        """One token per row at ``start_pos`` (-1: a padding row); float32 ``[B, 1, vocab]``
        (host tensors: vllm-tt-plugin takes them whatever ``read_from_device`` says)."""
        layers = self._model_cache(kv_cache, 0)
        pos = torch.as_tensor(start_pos).tolist()
        rows = [(tokens[b, :1], int(p), page_table[b]) for b, p in enumerate(pos) if p >= 0]
        logits = self._forward(rows, layers)
        out = torch.zeros((len(pos), 1, logits.shape[-1]), dtype=torch.float32)
        live = [b for b, p in enumerate(pos) if p >= 0]
        out[live] = logits
        return out

    def _model_cache(self, kv_cache, model_id: int) -> list:
        """``kv_cache[model_id]``: that submesh's per-layer ``[K, V]`` (the generators' indexing)."""
        if not isinstance(kv_cache, list) or len(kv_cache) != 1 or len(kv_cache[0]) != self.n_layers:
            raise AssertionError(
                f"kv_cache must be allocate_kv_cache's [submesh][layer][K, V] (1 submesh, {self.n_layers} layers)"
            )
        if model_id != 0:
            raise AssertionError(f"user slot of model {model_id}: one submesh holds users [0, {self.max_batch_size})")
        return kv_cache[model_id]

    @staticmethod
    def _check_prefill_start(start: int, block_size: int, where: str) -> None:
        """The real prefix-prefill path's precondition (see module doc)."""
        if start % block_size or start % 32:
            raise AssertionError(
                f"prefill {where}: start_pos {start} is not a multiple of the block size {block_size} and of 32: "
                "tt_transformers' prefix prefill (paged_fill_cache, chunked SDPA) cannot start there"
            )

    # ---- the model ---------------------------------------------------------------------
    def _forward(self, rows, kv_cache) -> torch.Tensor:
        """rows: (token ids [n], first position, page-table row); ``kv_cache``: one submesh's
        per-layer ``[K, V]``; last-token logits [R, 1, V]."""
        w = self.w
        xs = [w["embed_tokens.weight"][t.long()] for t, _, _ in rows]
        for layer in range(self.n_layers):
            p = f"layers.{layer}."
            qs, ks, vs = [], [], []
            for x, (_t, start, _pt) in zip(xs, rows, strict=True):
                h = self._norm(x, w[p + "input_layernorm.weight"])
                q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
                pos = torch.arange(start, start + x.shape[0])
                qs.append(self._rope(q.view(-1, self.n_heads, self.head_dim), pos))
                ks.append(self._rope(k.view(-1, self.n_kv, self.head_dim), pos))
                vs.append(v.view(-1, self.n_kv, self.head_dim))
            self._write_kv(kv_cache[layer], rows, ks, vs)
            k_all, v_all = (self._read(kv_cache[layer][i]) for i in (0, 1))
            for i, (x, (_t, start, pt)) in enumerate(zip(xs, rows, strict=True)):
                att = self._attention(qs[i], k_all, v_all, pt, start)
                x = x + att @ w[p + "self_attn.o_proj.weight"].T
                h = self._norm(x, w[p + "post_attention_layernorm.weight"])
                gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
                xs[i] = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        last = torch.stack([self._norm(x[-1], w["norm.weight"]) for x in xs])
        return (last @ w["lm_head.weight"].T).unsqueeze(1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """HF Llama rotary embedding of ``x`` [n, heads, head_dim] at positions ``pos``."""
        ang = pos.to(torch.float32).view(-1, 1) * self.inv_freq.view(1, -1)
        emb = torch.cat([ang, ang], dim=-1).unsqueeze(1)
        half = self.head_dim // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * emb.cos() + rot * emb.sin()

    def _attention(self, q, k_all, v_all, page_row, start: int) -> torch.Tensor:
        """Causal attention of ``q`` [n, Hq, D] (positions start..) over the request's cached
        tokens ``[0, start + n)``, K/V from the device cache ``[blocks, Hkv, bs, D]``."""
        n, bs = q.shape[0], k_all.shape[2]
        end = start + n
        blocks = torch.as_tensor(page_row[: -(-end // bs)]).long()
        k = k_all[blocks].transpose(0, 1).reshape(self.n_kv, -1, self.head_dim)[:, :end]
        v = v_all[blocks].transpose(0, 1).reshape(self.n_kv, -1, self.head_dim)[:, :end]
        group = self.n_heads // self.n_kv
        qh = q.transpose(0, 1).reshape(self.n_kv, group * n, self.head_dim)
        scores = torch.bmm(qh, k.transpose(1, 2)) / math.sqrt(self.head_dim)
        qpos = torch.arange(start, end).repeat(group)
        scores.masked_fill_(torch.arange(end).view(1, -1) > qpos.view(-1, 1), float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1), v)
        return o.reshape(self.n_heads, n, self.head_dim).transpose(0, 1).reshape(n, -1)

    # ---- the device cache ------------------------------------------------------------
    def _read(self, tensor) -> torch.Tensor:
        """All chips' parts of one K or V tensor read back through ttnn: float32
        ``[num_blocks, n_kv, block_size, head_dim]`` (chip c's heads at their place)."""
        ttnn = self._ttnn
        with DEVICE_LOCK:
            parts = [ttnn.to_torch(part) for part in ttnn.get_device_tensors(tensor)]
        return torch.cat([p.to(torch.float32) for p in parts[: len(self.chips)]], dim=1)

    def _write_kv(self, layer_kv, rows, ks, vs) -> None:
        """Store the rows' new K/V: per chip, per touched block, read its tiles, set the new
        token rows, repack and write the tiles back (the block's other rows keep their values)."""
        dtype = "bfloat16" if self.kv_dtype == self._ttnn.bfloat16 else "bfloat8_b"
        for c, chip in enumerate(self.chips):
            heads = slice(c * self.kv_per_chip, (c + 1) * self.kv_per_chip)
            for tensor, new in zip(layer_kv, (ks, vs), strict=True):
                buf = chip.adopt_tile_tensor(tensor)
                try:
                    self._write_rows(chip, buf, dtype, rows, [x[:, heads] for x in new])
                finally:
                    chip.free_buffer(buf)

    def _write_rows(self, chip: TTNNChip, buf, dtype: str, rows, new) -> None:
        num_blocks, heads, bs, dim = (int(s) for s in chip.tensor(buf).shape)
        tpb = buf.num_pages // num_blocks
        by_block: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (_t, start, pt), x in zip(rows, new, strict=True):
            for i in range(x.shape[0]):
                pos = start + i
                by_block.setdefault(int(pt[pos // bs]), []).append((pos % bs, x[i]))
        for block, toks in by_block.items():
            pages = [chip.page_location(buf, block * tpb + j) for j in range(tpb)]
            raw = np.stack([chip.read_bank(b, a, buf.page_size) for b, a in pages])
            vals = unpack_untilize(torch.from_numpy(raw), dtype, (1, heads, bs, dim))
            for off, x in toks:
                vals[0, :, off] = x
            packed = tilize_pack(vals, dtype).numpy().reshape(tpb, buf.page_size)
            for (b, a), tile in zip(pages, packed, strict=True):
                chip.write_bank(b, a, tile)


def bundle_metadata() -> dict:
    """The bundle's ``vllm_metadata.json`` (tests check the file says this)."""
    return json.loads((BUNDLES_DIR / "hawk-tiny-llama-test" / "vllm_metadata.json").read_text())
