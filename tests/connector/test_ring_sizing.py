"""The prefill ring's size and registration, as the connector sets them from its config.

* ``ring_nbytes`` "auto" (default) sizes the ring for the largest request the engine
  admits: ``max_model_len`` tokens of this rank's heads in the bytes the source produces
  (GN-HAWK: bfloat16 tiles of 64-token blocks; GG staged: the vLLM blocks), Llama-3.1-8B
  at 8,192 tokens: 1 GiB; an explicit byte count wins; the decode's receive buffers keep
  64 MiB under "auto";
* a real :class:`~vllm_hawk.kvflow.PrefillEndpoint` with the auto-sized ring serves a
  request of ``max_model_len`` tokens and refuses a longer one at once, naming the
  request's bytes, the ring's and the field to raise;
* ``registration``: "auto" is "whole" on a device, "per_request" in host memory; bad
  values are refused naming the field;
* a host ring next to a CUDA cache is pinned (the decision only: pinning needs CUDA,
  which CI does not have).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hawk.connector.config import DECODE_RECV_NBYTES, HawkConfigError, parse_config
from vllm_hawk.connector.strategies import prefill_ring_nbytes
from vllm_hawk.kvflow import PrefillEndpoint, RingGatherSource, TileTransformSource, VllmBlockSource
from vllm_hawk.kvflow.exposure import resolve_registration
from vllm_hawk.kvflow.ring import pin_host_ring, ring_nbytes_for
from vllm_hawk.kvflow.sources import tt_paged_desc, vllm_layout_desc
from vllm_hawk.kvflow.streams import head_maps, region_map_from_caches
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.vllm_kv import FlashAttnKVLayout, TransformSource, block_byte_ranges, make_layer_caches
from vllm_hawk.protocol import ErrorMsg, KVReady, KVRequest, Release, make_compat
from vllm_hawk.transport import make_transport

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def engine(max_model_len: int):
    """The part of vLLM's config the ring sizing reads."""
    return SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len))


def source(kind: str, layers: int, heads: int, head_dim: int, block_size: int, blocks: int = 4):
    """A source over real per-layer FlashAttention (NHD) caches of that geometry."""
    caches = make_layer_caches(layers, blocks, heads, block_size, 2 * head_dim)
    for i, c in enumerate(caches):
        c.copy_(torch.arange(c.numel(), dtype=torch.float32).reshape(c.shape).add(i).to(c.dtype))
    rmap = region_map_from_caches(caches, [block_byte_ranges(c, 0) for c in caches])
    desc = vllm_layout_desc(rmap, "vllm-flash-nhd", "bfloat16", block_size, heads, head_dim)
    if kind == "hawk":
        views = TransformSource([FlashAttnKVLayout(heads, block_size, head_dim)] * layers, caches)
        return TileTransformSource(views, desc, load_profile("p150a"))
    storage = [(c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()) for c in caches]
    cls = RingGatherSource if kind == "staged" else VllmBlockSource
    return cls(rmap, desc, storage, head_maps(caches), caches)


def test_ring_defaults_to_auto_and_an_explicit_size_wins():
    cfg = parse_config({"auth": "none"})
    assert cfg.ring_nbytes == "auto" and cfg.registration == "auto" and cfg.recv_nbytes == DECODE_RECV_NBYTES
    cfg = parse_config({"auth": "none", "ring_nbytes": 8 * MiB, "registration": "per_request"})
    assert cfg.ring_nbytes == cfg.recv_nbytes == 8 * MiB and cfg.registration == "per_request"


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("registration", "once", "['auto', 'per_request', 'whole']"),
        ("registration", 1, "['auto', 'per_request', 'whole']"),
        ("ring_nbytes", "big", "'auto'"),
        ("ring_nbytes", 4096, ">= 65536"),
        ("ring_nbytes", 1.5 * MiB, "integer"),
    ],
)
def test_bad_ring_or_registration_is_named(field, value, needle):
    with pytest.raises(HawkConfigError) as e:
        parse_config({"auth": "none", field: value})
    assert f"kv_connector_extra_config.{field}" in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize(
    "kind,block_size,per_token",
    [
        ("hawk", 16, 128 * KiB),  # bf16 tiles: 2 x 32 layers x 8 heads x 128 x 2 bytes per token
        ("staged", 16, 128 * KiB),  # GG staged: the same bytes in vLLM's blocks
    ],
)
def test_auto_ring_holds_one_llama_8b_request_of_max_model_len(kind, block_size, per_token):
    """Llama-3.1-8B (32 layers, 8 KV heads of 128) at TP=1, max_model_len 8,192: 1 GiB
    of request, plus one alignment per share (a share per head at most)."""
    src = source(kind, 32, 8, 128, block_size, blocks=1)
    assert src.request_nbytes(8192) == 8192 * per_token == 1 * GiB
    want = ring_nbytes_for(1 * GiB, 8)
    assert want == 1 * GiB + 8 * 4 * KiB
    assert prefill_ring_nbytes(parse_config({"auth": "none"}), src, engine(8192)) == want
    explicit = parse_config({"auth": "none", "ring_nbytes": 64 * MiB})
    assert prefill_ring_nbytes(explicit, src, engine(8192)) == 64 * MiB


def test_auto_ring_counts_tile_padding_and_only_this_ranks_heads():
    """GN-HAWK pads tokens to whole 64-token blocks; a TP=4 rank holds 2 of 8 heads; a
    source without a ring needs none."""
    src = source("hawk", 32, 2, 128, 16, blocks=1)  # Llama-8B TP=4: 2 heads on this rank
    assert src.request_nbytes(8000) == 125 * 64 * 32 * KiB  # 32 KiB per token for 2 heads
    assert src.request_nbytes(8001) == src.request_nbytes(8064) == 126 * 64 * 32 * KiB
    d = tt_paged_desc(src.layout, "bfloat8_b", src.profile, 64)  # what a bfp8 decode's G' takes
    assert d.tile_nbytes * 64 == 1088 * 64  # 1088/2048 of bf16 per tile (docs/gpu-prefill.md)
    assert prefill_ring_nbytes(parse_config({"auth": "none"}), source("vllm", 2, 2, 64, 32), engine(4096)) == 0


def _ask(ep: PrefillEndpoint, rid: str, dst, num_tokens: int, blocks):
    got, done = {}, threading.Event()

    def reply(msg):
        got["msg"] = msg
        done.set()

    ep.add_request(rid, blocks, num_tokens)
    msg = KVRequest(req_id=rid, dst_layout=dst, num_tokens=num_tokens, dst_block_ids=list(range(len(blocks))))
    out = ep.on_kv_request("decode", msg, reply)
    if out is not None:
        reply(out)
    assert done.wait(30)
    return got["msg"]


def test_an_auto_sized_ring_serves_max_model_len_and_refuses_longer_naming_both_sizes():
    src = source("staged", 2, 2, 64, 32, blocks=16)
    max_model_len = 8 * 32
    cfg = parse_config({"auth": "none"})
    t = make_transport("inprocess")
    compat = make_compat("m", "bfloat16", 32, "x", "y", "vllm")
    ep = PrefillEndpoint(src, t, compat, ring_nbytes=prefill_ring_nbytes(cfg, src, engine(max_model_len)))
    try:
        ready = _ask(ep, "fits", src.layout, max_model_len, np.arange(8))
        assert isinstance(ready, KVReady) and ready.total_nbytes == src.request_nbytes(max_model_len)
        ep.on_release("decode", Release(req_id="fits"), lambda m: None)
        err = _ask(ep, "long", src.layout, 2 * max_model_len, np.arange(16))
        assert isinstance(err, ErrorMsg) and err.code == "layout_mismatch", err  # not asked again
        need = src.request_nbytes(2 * max_model_len)
        assert f"need {need} bytes of ring" in err.detail and f"whole {ep.ring.capacity}-byte ring" in err.detail
        assert "kv_connector_extra_config.ring_nbytes" in err.detail and "--max-model-len" in err.detail
        assert ep.snapshot()["ring_used"] == 0
    finally:
        ep.close()
        t.close()


def test_auto_registration_is_whole_on_a_device_and_per_request_in_host_memory():
    assert resolve_registration("auto", "cuda:0") == "whole"
    assert resolve_registration("auto", "hawkdev:0") == "whole"
    assert resolve_registration("auto", "cpu") == "per_request"
    assert resolve_registration("per_request", "cuda:0") == "per_request"
    assert resolve_registration("whole", "cpu") == "whole"
    with pytest.raises(ValueError, match="registration must be one of"):
        resolve_registration("once", "cpu")


def test_a_host_ring_next_to_a_cuda_cache_is_pinned():
    """The decision only: torch pins host memory through CUDA, which CI lacks."""
    assert pin_host_ring("cpu", "cuda:0") and pin_host_ring(torch.device("cpu"), torch.device("cuda", 1))
    assert not pin_host_ring("cpu", "cpu")  # a CPU engine's host ring: nothing to DMA
    assert not pin_host_ring("cuda:0", "cuda:0")  # a device ring
    assert not pin_host_ring("cpu", "meta")  # another device type: no CUDA pinning
