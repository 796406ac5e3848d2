"""tt_transformers' paged KV cache on simulated chips, through the decode's hand-over.

On ttsim (p150a, n150), for block sizes 32 and 64 and both tt_transformers dtypes
(bfloat8_b, its default, and bfloat16), Llama-3.1-8B-like heads (8 KV heads, head_dim 128),
2 layers of 64 blocks: the cache is made by the ttnn calls of ``allocate_vllm_kv_cache``
(:func:`tt_decode_helpers.tt_transformers_kv_cache`: ``kv_cache[submesh][layer] = [K, V]``,
``ttnn.as_tensor`` with a ``cache_file_name``, so tiles are made on the host for both
dtypes: without one, bf16 with ``device=`` tilizes with a device kernel, which ttsim here
cannot build, while bfloat8_b tiles are always made on the host) and handed to
:class:`~vllm_hawk.tenstorrent.vllm_tt.kv_cache.TTNNMeshKVCache`:

a. every tensor's address (K0, V0, K1, V1) is ttnn's and our allocator's
   (:class:`~vllm_hawk.npu.emulated.EmulatedDevice` allocating the same tensors), and
   the pages per bank are ttnn's;
b. data written through ttnn into K0 and V1 (``ttnn.copy_host_to_device_tensor`` of
   random bf16) read back with raw bank reads (``TTNNChip.read_bank`` at ``page_location``) is our
   packer's bytes exactly and unpacks to the elements ``ttnn.to_torch`` reads;
c. one transfer landed by the connector's Tenstorrent sink (TTSink, staged, through
   ``make_sinks`` as the worker builds it; the prefill's TileTransformSource runs the
   transform) reads back through ``ttnn.to_torch`` as the prefill's KV after
   tilize/pack, every other block still zero;

and a cache of two submeshes (data parallelism) is refused, naming it.

Mock clusters (tt-metal's ``TT_METAL_MOCK_CLUSTER_DESC_PATH``: every driver call is mocked,
so allocation runs but no data moves): on an N300 (1x2) and a T3K (2x4) the replicated
cache vllm-tt-plugin asks for (heads per chip) and one sharded over the heads dim
(``ShardTensorToMesh(dim=1)``) have the per-chip shapes and one lockstep address on every
chip, chips in the mesh's order, and TTNNMeshKVCache gives chip ``c`` heads ``[c*H/n,
(c+1)*H/n)``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tt_decode_helpers import run_on_mock, run_on_sim

from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.layout.formats import tilize_pack, unpack_untilize
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice

pytestmark = pytest.mark.tt_decode

L, NB, H, D = 2, 64, 8, 128
BLOCK_SIZES, DTYPES = (32, 64), ("bfloat8_b", "bfloat16")
SRC_BLOCKS, SRC_IDS, DST_IDS = 8, [5, 2, 7], [40, 3, 17]
SEED = 11
CASES = [(bs, dt) for bs in BLOCK_SIZES for dt in DTYPES]
B_TENSORS = (0, 2 * L - 1)  # check b on the first (K0) and the last (V of the last layer) tensor

JOB = r"""
import json, sys, time
from pathlib import Path
import numpy as np, torch, ttnn
sys.path.insert(0, "tests/tt_decode")
from tt_decode_helpers import tt_transformers_kv_cache
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV, tt_compat
from vllm_hawk.connector.strategies import make_sinks, make_source
from vllm_hawk.kvflow import DecodeEndpoint, PrefillEndpoint
from vllm_hawk.npu.ttnn_chip import TTNNChip, ttnn_dtype
from vllm_hawk.tenstorrent.vllm_tt.kv_cache import TTNNMeshKVCache
from vllm_hawk.transport import make_transport

P = json.loads(PARAMS)
job, L, NB, H, D = Path(P["job"]), P["L"], P["NB"], P["H"], P["D"]


def land(cache, bs, profile):
    src = PagedKVCache(L, P["src_blocks"], H, bs, D).fill_random(P["seed"])
    compat = tt_compat("m", "bfloat16", bs, profile)
    cfg = HawkConfig(device_profile=profile, mode="staged", ring_nbytes=8 << 20)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    kv = LocalKV(compat, src.desc, src.region_map, src.storages, src.kv_views(), caches=src.layers)
    pre = PrefillEndpoint(make_source(cfg, kv), tp, compat, ring_nbytes=8 << 20)
    sink = make_sinks(cfg, LocalKV(compat, None, tt_cache=cache), td)[0]
    dec = DecodeEndpoint(td, pre.endpoint, compat, pull_timeout_s=120)
    try:
        n = len(P["src_ids"]) * bs - 5
        pre.add_request("r", P["src_ids"], n)
        res = dec.fetch("r", n, sink, P["dst_ids"])
        return {"nbytes": res.nbytes, "mode": sink.mode, "kind": type(sink).__name__, "idle": sink.idle()}
    finally:
        dec.close(); sink.close(); pre.close(); tp.close(); td.close()


def case(bs, dt):
    key, r = f"{bs}.{dt}", {}
    t0 = time.perf_counter()
    mesh = ttnn.open_mesh_device(ttnn.MeshShape(1, 1))
    chip = TTNNChip(mesh, P["profile"])
    kv = tt_transformers_kv_cache(ttnn, [mesh], (NB, H, bs, D), L, ttnn_dtype(ttnn, dt), job / f"cache.{key}")
    tensors = [t for pair in kv[0] for t in pair]
    r["tensor_addresses"] = [t.buffer_address() for t in tensors]
    r["ttnn_pages"] = [[t.buffer_num_pages(), t.buffer_aligned_page_size()] for t in tensors]
    try:
        TTNNMeshKVCache([chip], [kv[0], kv[0]], H, bs)
    except ValueError as e:
        r["two_submeshes"] = str(e)
    cache = TTNNMeshKVCache([chip], kv, H, bs)
    c0 = cache.chips[0]
    r["buffers"] = [[b.address, b.size_per_bank, b.num_pages, b.aligned_page_size] for b in c0.buffers]
    r["spec"] = [cache.spec.num_layers, cache.spec.num_blocks, cache.spec.num_kv_heads, cache.spec.block_size,
                 cache.spec.head_dim, cache.spec.dtype]
    r["zero_before"] = cache.nonzero_blocks() == []
    t1 = time.perf_counter()
    r["land"] = land(cache, bs, P["profile"])
    r["land_s"] = round(time.perf_counter() - t1, 2)
    others = sorted(set(range(NB)) - set(P["dst_ids"]))
    r["others_zero"] = []
    for i, t in enumerate(tensors):  # c. read back through ttnn
        x = ttnn.to_torch(t)
        np.save(job / f"{key}.landed{i}.npy", x[P["dst_ids"]].float().numpy())
        r["others_zero"].append(not bool(x[others].any()))
        np.save(job / f"{key}.landed_bytes{i}.npy", c0.read_block_bytes(i // 2, i % 2, P["dst_ids"]))
    t1 = time.perf_counter()
    for i in P["b_tensors"]:  # b. written through ttnn, read from the banks
        t, buf = tensors[i], c0.buffers[i]
        g = torch.Generator().manual_seed(P["seed"] + 1 + i)
        x = torch.randn(tuple(t.shape), generator=g).to(torch.bfloat16)
        host = ttnn.from_torch(x, dtype=t.dtype, layout=ttnn.TILE_LAYOUT, mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
        ttnn.copy_host_to_device_tensor(host, t)
        banks = [chip.read_bank(b, buf.address, buf.size_per_bank) for b in range(chip.num_banks)]
        loc = [chip.page_location(buf, p) for p in range(buf.num_pages)]
        pages = np.stack([banks[b][a - buf.address : a - buf.address + buf.page_size] for b, a in loc])
        np.save(job / f"{key}.banks{i}.npy", pages)
        np.save(job / f"{key}.ttnn{i}.npy", ttnn.to_torch(t).float().numpy())
    r["banks_s"] = round(time.perf_counter() - t1, 2)
    cache.close()
    for t in tensors:
        ttnn.deallocate(t)
    chip.close()
    ttnn.close_mesh_device(mesh)
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return key, r


print("RESULT " + json.dumps(dict(case(bs, dt) for bs, dt in P["cases"])))
"""


def job_code(params: dict) -> str:
    return f"PARAMS = {json.dumps(json.dumps(params))}\n" + JOB


@pytest.fixture(scope="module", params=["p150a", "n150"])
def sim(request, manifest, tmp_path_factory):
    device = request.param
    job = tmp_path_factory.mktemp(f"tt_cache_{device}")
    params = {
        "job": str(job),
        "profile": device,
        "L": L,
        "NB": NB,
        "H": H,
        "D": D,
        "src_blocks": SRC_BLOCKS,
        "src_ids": SRC_IDS,
        "dst_ids": DST_IDS,
        "seed": SEED,
        "cases": CASES,
        "b_tensors": B_TENSORS,
    }
    t0 = time.monotonic()
    res = run_on_sim(manifest, device, job_code(params), timeout_s=600)
    times = ", ".join(f"{k} {v['seconds']}s (land {v['land_s']}s, banks {v['banks_s']}s)" for k, v in res.items())
    print(f"[tt_cache] {device}: job {time.monotonic() - t0:.1f}s: {times}")
    return device, job, res


def predicted_addresses(device: str, bs: int, dtype: str) -> list[int]:
    """K0, V0, K1, V1 as our allocator places them (a fresh device, the same tensors)."""
    emu = EmulatedDevice(device, bank_size_bytes=64 << 20)
    try:
        layout, _ = emu.allocate_kv_cache(TTKVCacheSpec(L, NB, H, bs, D, dtype))
        return [a for pair in layout.addresses for a in pair]
    finally:
        emu.close()


@pytest.mark.parametrize("bs,dtype", CASES)
def test_addresses_are_ttnn_and_our_allocators(sim, bs, dtype):
    device, _, res = sim
    r = res[f"{bs}.{dtype}"]
    spec = TTKVCacheSpec(L, NB, H, bs, D, dtype)
    assert r["spec"] == [L, NB, H, bs, D, dtype]  # nesting unwrapped: 2 layers, not 1 submesh
    assert r["tensor_addresses"] == predicted_addresses(device, bs, dtype)
    assert [b[0] for b in r["buffers"]] == r["tensor_addresses"]
    nb = {"p150a": 8, "n150": 12}[device]
    for (num_pages, aligned), (_, per_bank, our_pages, our_aligned) in zip(r["ttnn_pages"], r["buffers"], strict=True):
        assert (num_pages, aligned) == (our_pages, our_aligned) == (spec.tiles_per_tensor, spec.tile_nbytes)
        assert per_bank == -(-num_pages // nb) * aligned
    assert r["zero_before"]


@pytest.mark.parametrize("bs,dtype", CASES)
def test_two_submeshes_are_refused_naming_data_parallelism(sim, bs, dtype):
    msg = sim[2][f"{bs}.{dtype}"]["two_submeshes"]
    assert "2 submeshes" in msg and "data parallelism" in msg, msg


@pytest.mark.parametrize("bs,dtype", CASES)
def test_bank_reads_are_what_ttnn_wrote(sim, bs, dtype):
    device, job, _ = sim
    for i in B_TENSORS:
        g = torch.Generator().manual_seed(SEED + 1 + i)
        x = torch.randn((NB, H, bs, D), generator=g).to(torch.bfloat16)
        pages = np.load(job / f"{bs}.{dtype}.banks{i}.npy")
        want = tilize_pack(x.to(torch.float32), dtype).numpy().reshape(pages.shape)
        bad = np.nonzero((pages != want).any(axis=1))[0]
        assert bad.size == 0, f"{device} {dtype} bs {bs} tensor {i}: {bad.size} pages differ, first {bad[:4]}"
        ttnn_elems = torch.from_numpy(np.load(job / f"{bs}.{dtype}.ttnn{i}.npy"))
        ours = unpack_untilize(torch.from_numpy(pages), dtype, x.shape)
        assert torch.equal(ours, ttnn_elems), f"{device} {dtype} bs {bs} tensor {i}: unpacked != ttnn.to_torch"
        if dtype == "bfloat16":
            assert torch.equal(ours, x.to(torch.float32))


@pytest.mark.parametrize("bs,dtype", CASES)
def test_landed_transfer_reads_back_through_ttnn(sim, bs, dtype):
    device, job, res = sim
    r = res[f"{bs}.{dtype}"]
    assert r["land"]["kind"] == "TTSink" and r["land"]["mode"] == "staged" and r["land"]["idle"]
    assert all(r["others_zero"])  # only the destination blocks were written
    views = PagedKVCache(L, SRC_BLOCKS, H, bs, D).fill_random(SEED).kv_views()
    ids = torch.tensor(SRC_IDS)
    for layer, (k, v) in enumerate(views):
        for kv, x in ((0, k), (1, v)):
            i = 2 * layer + kv
            src = x.index_select(0, ids).to(torch.float32)
            packed = tilize_pack(src, dtype)
            got_bytes = np.load(job / f"{bs}.{dtype}.landed_bytes{i}.npy")
            assert np.array_equal(got_bytes, packed.numpy().reshape(got_bytes.shape)), (device, dtype, bs, i)
            got = torch.from_numpy(np.load(job / f"{bs}.{dtype}.landed{i}.npy"))
            assert torch.equal(got, unpack_untilize(packed, dtype, src.shape)), (device, dtype, bs, i)
            if dtype == "bfloat16":
                assert torch.equal(got, src)
    spec = TTKVCacheSpec(L, NB, H, bs, D, dtype)
    assert r["land"]["nbytes"] == 2 * L * len(SRC_IDS) * spec.tiles_per_block * spec.tile_nbytes


# ---- mock clusters -------------------------------------------------------------------------

MOCK_JOB = r"""
import json, sys
from pathlib import Path
import torch, ttnn
sys.path.insert(0, "tests/tt_decode")
from tt_decode_helpers import tt_transformers_kv_cache
from vllm_hawk.npu.ttnn_chip import TTNNChip
from vllm_hawk.tenstorrent.vllm_tt.kv_cache import TTNNMeshKVCache

P = json.loads(PARAMS)
L, NB, H, BS, D = P["L"], P["NB"], P["H"], P["BS"], P["D"]
mesh = ttnn.open_mesh_device(ttnn.MeshShape(*P["mesh"]))
n = mesh.get_num_devices()
out = {"num_devices": n, "device_ids": list(mesh.get_device_ids())}
chips = [TTNNChip(mesh, P["profile"], c) for c in range(n)]
out["chip_device_ids"] = [c.device_id for c in chips]


def parts(t):
    return [[list(p.shape), p.buffer_address(), mesh.get_device_id(c)]
            for p, c in zip(ttnn.get_device_tensors(t), t.device_coords())]


def describe(kv):
    cache = TTNNMeshKVCache(chips, kv, H, BS)
    r = {"parts": [parts(t) for pair in kv[0] for t in pair],
         "layouts": [[list(a) for a in c.layout.addresses] for c in cache.chips],
         "heads": [[cache.heads_of(c).start, cache.heads_of(c).count] for c in range(n)]}
    cache.close()
    return r


tmp = Path(P["tmp"])
# vllm-tt-plugin's shape: heads per chip, replicated (model_runner._kv_cache_shape)
rep = tt_transformers_kv_cache(ttnn, [mesh], (NB, H // n, BS, D), L, ttnn.bfloat8_b, tmp)
out["replicated"] = describe(rep)
sharded = [[ttnn.as_tensor(torch.zeros((NB, H, BS, D)), device=mesh, mesh_mapper=ttnn.ShardTensorToMesh(mesh, dim=1),
                           layout=ttnn.TILE_LAYOUT, memory_config=ttnn.DRAM_MEMORY_CONFIG, dtype=ttnn.bfloat8_b)
            for _ in "kv"] for _ in range(L)]
out["sharded"] = describe([sharded])
full = tt_transformers_kv_cache(ttnn, [mesh], (NB, H, BS, D), L, ttnn.bfloat8_b, tmp / "full")
try:
    TTNNMeshKVCache(chips, full, H, BS)
except ValueError as e:
    out["all_heads_per_chip"] = str(e)
for c in chips:
    c.close()
ttnn.close_mesh_device(mesh)
print("RESULT " + json.dumps(out))
"""

BH, BS_MOCK = 8, 32


def _links(*pairs) -> list:
    return [[{"chip": a, "chan": ca}, {"chip": b, "chan": cb}] for a, ca, b, cb in pairs]


def _wormhole_desc(chips: dict, links: list, mmio: dict, harvest: dict, boards: list) -> dict:
    """A UMD cluster descriptor (tt-umd ``ClusterDescriptor::create_from_yaml``; JSON is YAML)."""
    return {
        "arch": {str(c): "wormhole_b0" for c in chips},
        "chips": {str(c): xyz for c, xyz in chips.items()},
        "ethernet_connections": links,
        "chips_with_mmio": [{str(k): v} for k, v in mmio.items()],
        "harvesting": {str(c): {"noc_translation": True, "harvest_mask": m} for c, m in harvest.items()},
        "boards": [[{"board_id": bid}, {"board_type": "n300"}, {"chips": cs}] for bid, cs in boards],
    }


#: N300: two Wormhole chips on one board, chip 0 on PCIe (tt-umd
#: tests/cluster_descriptor_examples/wormhole_N300.yaml)
N300 = _wormhole_desc(
    {0: [0, 0, 0, 0], 1: [1, 0, 0, 0]},
    _links((0, 8, 1, 0), (0, 9, 1, 1)),
    {0: 0},
    {0: 65, 1: 5},
    [(72058994491072686, [0, 1])],
)
#: T3K: four N300 boards, chips 0-3 on PCIe, 4-7 reached over ethernet (tt-metal
#: tests/tt_metal/tt_fabric/custom_mock_cluster_descriptors/t3k_cluster_desc.yaml)
T3K = _wormhole_desc(
    {0: [1, 0, 0, 0], 1: [1, 1, 0, 0], 2: [2, 0, 0, 0], 3: [2, 1, 0, 0]}
    | {4: [0, 0, 0, 0], 5: [0, 1, 0, 0], 6: [3, 0, 0, 0], 7: [3, 1, 0, 0]},
    _links(
        *[(0, 6, 2, 6), (0, 7, 2, 7), (0, 8, 4, 0), (0, 9, 4, 1), (0, 14, 1, 14), (0, 15, 1, 15)],
        *[(1, 0, 3, 0), (1, 1, 3, 1), (1, 8, 5, 0), (1, 9, 5, 1), (2, 8, 6, 0), (2, 9, 6, 1)],
        *[(2, 14, 3, 14), (2, 15, 3, 15), (3, 8, 7, 0), (3, 9, 7, 1), (4, 6, 5, 6), (4, 7, 5, 7)],
        *[(6, 6, 7, 6), (6, 7, 7, 7)],
    ),
    {0: 0, 1: 1, 2: 3, 3: 2},
    {0: 544, 1: 513, 2: 640, 3: 513, 4: 576, 5: 513, 6: 513, 7: 528},
    [(72058994491928619, [4, 0]), (72058994491928729, [5, 1]), (72058994491928743, [6, 2])]
    + [(72058994491928746, [7, 3])],
)
#: (descriptor, mesh shape, tt-metal's device ids in mesh order, as measured with ttnn 0.81.1)
MOCKS = {"n300": (N300, (1, 2), [0, 1]), "t3k": (T3K, (2, 4), [4, 0, 2, 6, 5, 1, 3, 7])}


@pytest.mark.parametrize("name", list(MOCKS))
def test_mock_cluster_replicated_and_sharded_caches(manifest, tmp_path: Path, name):
    desc, shape, order = MOCKS[name]
    path = tmp_path / f"{name}_cluster_desc.yaml"
    path.write_text(json.dumps(desc))
    params = {"mesh": shape, "profile": "n300", "tmp": str(tmp_path), "L": L, "NB": 16, "H": BH, "BS": BS_MOCK, "D": D}
    t0 = time.monotonic()
    r = run_on_mock(manifest, path, f"PARAMS = {json.dumps(json.dumps(params))}\n" + MOCK_JOB)
    print(f"[tt_cache] mock {name}: job {time.monotonic() - t0:.1f}s")
    n = shape[0] * shape[1]
    assert r["num_devices"] == n and r["device_ids"] == order and r["chip_device_ids"] == order
    per_chip = [16, BH // n, BS_MOCK, D]
    for kind in ("replicated", "sharded"):
        c = r[kind]
        for t, tensor_parts in enumerate(c["parts"]):
            assert [p[0] for p in tensor_parts] == [per_chip] * n, (kind, t)
            assert [p[2] for p in tensor_parts] == order, (kind, t)  # parts in the mesh's device order
            assert len({p[1] for p in tensor_parts}) == 1, (kind, t)  # one lockstep address on every chip
        addrs = [[k[0][1], v[0][1]] for k, v in zip(c["parts"][::2], c["parts"][1::2], strict=True)]
        assert c["layouts"] == [addrs] * n
        assert c["heads"] == [[k * (BH // n), BH // n] for k in range(n)]
    spec = TTKVCacheSpec(L, 16, BH // n, BS_MOCK, D, "bfloat8_b")
    emu = EmulatedDevice("n300", bank_size_bytes=64 << 20)
    try:
        want, _ = emu.allocate_kv_cache(spec)
    finally:
        emu.close()
    assert r["replicated"]["layouts"][0] == [list(a) for a in want.addresses]
    assert f"{BH} heads per chip; {BH} KV heads over {n} chips" in r["all_heads_per_chip"]
