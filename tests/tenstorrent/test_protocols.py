"""Every Tenstorrent backend implements its protocol: each bank-buffer backend
(:class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI`: the emulated device, a ttnn chip, a
Blackhole over tt-kmd) and both engine integrations' KV caches
(:mod:`vllm_hawk.tenstorrent.kv_cache`). Instances are checked with ``isinstance`` where
they can be built here; the ttnn ones (no ttnn in this environment) are checked on their
class: every protocol member is a class attribute or assigned to ``self`` in the class
(tests/tt_decode checks their instances with ``isinstance`` in the ttnn environment)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferAPI
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.npu.ttnn_chip import TTNNChip
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache
from vllm_hawk.tenstorrent.emulated.mesh import TTMeshKVCache
from vllm_hawk.tenstorrent.kv_cache import ChipKVCache, MeshKVCache
from vllm_hawk.tenstorrent.vllm_tt.kv_cache import TTNNChipKVCache, TTNNMeshKVCache


def protocol_members(proto) -> set[str]:
    """Names a protocol declares: its annotations, methods and properties."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def self_attributes(cls) -> set[str]:
    """Attributes a class's methods assign to ``self`` (``self.x = ...``, ``self.x, self.y = ...``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out = set()
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def missing(cls, proto) -> set[str]:
    return {m for m in protocol_members(proto) if not hasattr(cls, m) and m not in self_attributes(cls)}


def test_protocols_declare_what_the_sinks_and_the_connector_call():
    assert {
        "profile",
        "num_banks",
        "allocate_bank_buffers",
        "free_buffer",
        "live_buffers",
        "dma_written",
        "copy_in_banks",
        "map_buffer_dma",
        "get_device_num_bank",
    } <= protocol_members(BankBufferAPI)
    assert {"device", "layout", "spec", "buffers", "buffer"} <= protocol_members(ChipKVCache)
    assert {"chips", "spec", "heads_of", "num_kv_heads", "layer_names"} <= protocol_members(MeshKVCache)


def test_emulated_device_and_its_caches_pass_isinstance():
    devs = [EmulatedDevice("p150a", 8 << 20) for _ in range(2)]
    spec = TTKVCacheSpec(num_layers=2, num_blocks=4, num_kv_heads=2, block_size=32, head_dim=64, dtype="bfloat16")
    mesh = TTMeshKVCache(devs, spec, ["l0", "l1"])
    try:
        assert all(isinstance(d, BankBufferAPI) for d in devs)
        assert isinstance(mesh, MeshKVCache)
        assert all(isinstance(c, ChipKVCache) and isinstance(c, TTPagedKVCache) for c in mesh.chips)
    finally:
        mesh.close()
        for d in devs:
            d.close()


@pytest.mark.parametrize(
    ("cls", "proto"),
    [(TTNNChip, BankBufferAPI), (TTNNChipKVCache, ChipKVCache), (TTNNMeshKVCache, MeshKVCache)],
    ids=lambda x: x.__name__,
)
def test_ttnn_classes_define_every_protocol_member(cls, proto):
    assert not missing(cls, proto), f"{cls.__name__} lacks {sorted(missing(cls, proto))} of {proto.__name__}"


def test_the_structural_check_catches_a_missing_member():
    class NoCopies:
        def __init__(self):
            self.profile = None

        num_banks = 8

    assert {"copy_in_banks", "dma_written", "free_buffer"} <= missing(NoCopies, BankBufferAPI)
    assert "profile" not in missing(NoCopies, BankBufferAPI)
