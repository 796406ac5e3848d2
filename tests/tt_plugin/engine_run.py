"""Run the tiny Llama in one vLLM engine per config and save what the tests compare.

Run as a subprocess (the vLLM platform is chosen once per process):

    python tests/tt_plugin/engine_run.py OUT.pt MODEL reference
    python tests/tt_plugin/engine_run.py OUT.pt MODEL tt p150a:bfloat16:abort n300:bfloat8_b \
        p150a:bfloat16:chips=2 ...

``reference``: vLLM's stock CPU platform; saves greedy tokens, top-2 logprobs and each
prompt's K/V read from the CPU cache (logical [blocks, H, block_size, D]).
``tt``: HAWK_TT_PLATFORM=emulated, one engine per ``device:kv_dtype[:abort][:chips=N]``
(``chips=N``: HAWK_TT_CHIPS=N; its key keeps ``:chips=N``; ``fails``: the engine must
refuse to start, its error is saved) run one after the other; saves
tokens, logprobs, the bank bytes of each prompt's blocks (all heads, and per chip on a
mesh of several), the K/V the model handed to the cache (captured at
``do_kv_cache_update``) and, with ``abort``, the block-pool and device-buffer counts
around aborted requests.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ (vllm_fixtures)

PROMPTS = [
    "The cache block of the device",
    "Transfer the key and value tensors to the decode server because",
    "In the first year the people said that",
    "A request",
    "Tile layout bank memory read write copy queue batch stream server client proxy router",
]
MAX_TOKENS = 24
BLOCK_SIZE = 64
LLM_KW = dict(dtype="bfloat16", block_size=BLOCK_SIZE, max_model_len=512, max_num_seqs=8, enable_prefix_caching=False)


def _generate(llm):
    from vllm import SamplingParams
    from vllm_fixtures import capture_block_ids

    blocks = capture_block_ids(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in c.logprobs]
        res.append(
            dict(
                prompt_ids=list(o.prompt_token_ids),
                tokens=list(c.token_ids),
                top2=top2,
                blocks=_blocks_of(blocks, o.request_id),
            )
        )
    return res


def _blocks_of(captured: dict, request_id: str) -> list[int]:
    """Block ids of a request; the scheduler's id may carry a suffix (``0-1a2b``)."""
    for rid, groups in captured.items():
        if rid == request_id or rid.startswith(f"{request_id}-"):
            return groups[0]
    raise KeyError(f"request {request_id} not scheduled (seen {list(captured)})")


def run_reference(model: str) -> dict:
    import torch
    from vllm_fixtures import attention_layers, inprocess_llm

    from vllm_hawk.layout.vllm_kv import source_layout_from_layer

    with inprocess_llm(model, **LLM_KW) as llm:
        res = _generate(llm)
        layers = attention_layers(llm)
        for r in res:
            ids = torch.tensor(r["blocks"])
            r["kv"] = []
            for layer in layers.values():
                src = source_layout_from_layer(layer)
                k, v = src.read_blocks(layer.kv_cache, ids)
                r["kv"].append((k.clone(), v.clone()))
    return dict(results=res)


def run_tt(model: str, device: str, kv_dtype: str, abort: bool, chips: str | None = None) -> dict:
    import torch
    from vllm_fixtures import engine_core, inprocess_llm

    from vllm_hawk.tenstorrent import registry
    from vllm_hawk.tenstorrent.emulated.attention import TTPagedAttentionImpl

    os.environ["HAWK_TT_DEVICE"] = device
    os.environ["HAWK_TT_KV_DTYPE"] = kv_dtype
    if chips is None:
        os.environ.pop("HAWK_TT_CHIPS", None)
    else:
        os.environ["HAWK_TT_CHIPS"] = chips
    written: dict[int, list] = {}
    orig = TTPagedAttentionImpl.do_kv_cache_update

    def capture(self, layer, key, value, kv_cache, slot_mapping):
        if getattr(layer, "hawk_tt_cache", None) is not None:
            n = slot_mapping.shape[0]
            written.setdefault(layer.hawk_tt_layer, []).append(
                (key[:n].clone(), value[:n].clone(), slot_mapping.clone())
            )
        return orig(self, layer, key, value, kv_cache, slot_mapping)

    TTPagedAttentionImpl.do_kv_cache_update = capture
    out: dict = {}
    try:
        t0 = time.monotonic()
        with inprocess_llm(model, **LLM_KW) as llm:
            out["startup_s"] = time.monotonic() - t0
            cache = registry.get_kv_cache()
            chip0 = cache.chips[0]
            out["device"] = chip0.device.profile.name
            out["num_chips"] = cache.num_chips
            out["heads"] = [(cache.heads_of(c).start, cache.heads_of(c).count) for c in range(cache.num_chips)]
            out["num_banks"] = chip0.num_banks
            out["num_blocks"] = cache.spec.num_blocks
            out["tiles_per_tensor"] = chip0.spec.tiles_per_tensor
            out["tile_dtype"] = cache.spec.dtype
            out["device_kv_bytes"] = llm.collective_rpc(_device_kv_bytes)[0]
            t0 = time.monotonic()
            res = _generate(llm)
            out["generate_s"] = time.monotonic() - t0
            for r in res:
                r["bank_bytes"] = [
                    (cache.read_block_bytes(i, 0, r["blocks"]), cache.read_block_bytes(i, 1, r["blocks"]))
                    for i in range(cache.spec.num_layers)
                ]
                if cache.num_chips > 1:
                    r["chip_bytes"] = [
                        [
                            (chip.read_block_bytes(i, 0, r["blocks"]), chip.read_block_bytes(i, 1, r["blocks"]))
                            for i in range(cache.spec.num_layers)
                        ]
                        for chip in cache.chips
                    ]
            out["written"] = {
                i: (torch.cat([w[0] for w in ws]), torch.cat([w[1] for w in ws]), torch.cat([w[2] for w in ws]))
                for i, ws in written.items()
            }
            out["results"] = res
            if abort:
                out["abort"] = _abort_check(llm, engine_core(llm), chip0)
        out["registered_after_shutdown"] = registry.registered_keys()
        out["device_buffers_after_shutdown"] = sum(len(c.device.live_buffers()) for c in cache.chips)
    finally:
        TTPagedAttentionImpl.do_kv_cache_update = orig
    return out


def _start_error(model: str, device: str, kv_dtype: str, chips: str | None) -> str | None:
    """Start an engine that must fail; returns the error's text (None if it started)."""
    from vllm_fixtures import inprocess_llm

    os.environ.update(HAWK_TT_DEVICE=device, HAWK_TT_KV_DTYPE=kv_dtype, HAWK_TT_CHIPS=chips or "")
    try:
        with inprocess_llm(model, **LLM_KW):
            return None
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        chain, err = [], e
        while err is not None:
            chain.append(f"{type(err).__name__}: {err}")
            err = err.__cause__ or err.__context__
        return "\n".join(chain)
    finally:
        os.environ.pop("HAWK_TT_CHIPS", None)


def _device_kv_bytes(worker) -> int:
    """The KV bytes the device allows (before the explicit VLLM_CPU_KVCACHE_SPACE cap)."""
    return worker.model_runner.hawk_kv_budget_bytes()


def _abort_check(llm, core, cache) -> dict:
    from vllm import SamplingParams

    pool = core.scheduler.kv_cache_manager.block_pool
    eng = llm.llm_engine
    free0, bufs0 = pool.get_num_free_blocks(), len(cache.device.live_buffers())
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [f"abort-{i}" for i in range(3)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, PROMPTS[i] * 6, sp)
    for _ in range(4):
        eng.step()
    free_mid = pool.get_num_free_blocks()
    eng.abort_request(ids)
    for _ in range(3):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    return dict(
        free_before=free0,
        free_during=free_mid,
        free_after=pool.get_num_free_blocks(),
        unfinished=eng.has_unfinished_requests(),
        buffers_before=bufs0,
        buffers_after=len(cache.device.live_buffers()),
    )


def main() -> None:
    out_path, model, mode, *configs = sys.argv[1:]
    import torch

    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    ensure_vllm_dist()
    if mode == "reference":
        os.environ.pop("HAWK_TT_PLATFORM", None)
        data = run_reference(model)
    else:
        from vllm_hawk.tenstorrent.emulated import ensure_entry_point

        ensure_entry_point()
        os.environ["HAWK_TT_PLATFORM"] = "emulated"
        data = {}
        for spec in configs:
            device, kv_dtype, *flags = spec.split(":")
            chips = next((f.split("=", 1)[1] for f in flags if f.startswith("chips=")), None)
            key = f"{device}:{kv_dtype}" + (f":chips={chips}" if chips else "")
            if "fails" in flags:  # the engine must refuse to start: save its error
                data[key] = dict(error=_start_error(model, device, kv_dtype, chips))
            else:
                data[key] = run_tt(model, device, kv_dtype, "abort" in flags, chips)
    torch.save(data, out_path)


if __name__ == "__main__":
    main()
