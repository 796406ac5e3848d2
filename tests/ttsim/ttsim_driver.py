"""Run tasks on a simulated Tenstorrent device through ttnn (the 3.12 side of tests/ttsim).

Runs under the ttnn side environment with the variables from scripts/ttsim_env.sh's
manifest and ``TT_METAL_SIMULATOR`` naming one simulator; imports only numpy, ttnn and
the torch-free parts of vllm_hawk (the checkout on PYTHONPATH).

    python ttsim_driver.py JOB_DIR

JOB_DIR/job.json: {"profile": "p150a", "tasks": [TASK, ...]}; each task opens the device
afresh (a fresh allocator) and writes its results into JOB_DIR/result.json (a list, one
entry per task, with "seconds") plus the .npy files named below. Tasks:

* {"kind": "alloc", "ops": [...]}  the allocation sequence of tests/ttsim/sequences.py;
  ops: kv (TILE tensor of a shape and dtype), rm (num_pages x page_nbytes ROW_MAJOR),
  recv (one size_per_bank region per bank), free (an id), until_oom (recv of a size until
  tt-metal says Out of Memory, at most max times); result: one entry per op (address,
  "OOM", None for free, or for "until_oom" the list of addresses),
  then tt-metal's DRAM block table (addresses relative to the unreserved base).
* {"kind": "banks", "dtype": D, "input": "x.npy", "out": "stem"}  write the float32
  tensor x as a TILE tensor, save every bank's bytes at its address as stem.banks.npy
  (uint8 [num_banks, size_per_bank]); then the converse: write stem.in.npy's bytes at
  (bank, address) of a fresh unfilled tensor and save what ttnn reads back as
  stem.readback.npy (uint8 [tiles, tile_nbytes]).
* {"kind": "land", ...}  see :func:`land`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def alloc(dev, ttnn, task: dict) -> dict:
    out, live = [], {}
    for op in task["ops"]:
        kind = op["op"]
        if kind == "free":
            dev.free_buffer(live.pop(op["id"]))
            out.append(None)
            continue
        try:
            if kind == "kv":
                buf = dev.allocate_tile_tensor(op["shape"], op["dtype"])
            elif kind == "rm":
                buf = dev.allocate_buffer(op["num_pages"], op["page_nbytes"])
            elif kind == "recv":
                buf = dev.allocate_bank_buffers(op["size_per_bank"])
            elif kind == "until_oom":
                addrs = []
                for i in range(op["max"]):
                    try:
                        b = dev.allocate_bank_buffers(op["size_per_bank"])
                    except RuntimeError as e:
                        if "Out of Memory" not in str(e):
                            raise
                        break
                    live[f"{op['id']}{i}"] = b
                    addrs.append(b.address)
                out.append(addrs)
                continue
            else:
                raise ValueError(f"job.json: unknown op {kind!r}")
        except RuntimeError as e:
            if "Out of Memory" not in str(e):
                raise
            out.append("OOM")
            continue
        live[op["id"]] = buf
        out.append(buf.address)
    mv = ttnn.get_memory_view(dev.mesh, ttnn.BufferType.DRAM)
    blocks = sorted((int(b["address"]), int(b["size"]), b["allocated"] == "yes") for b in mv.block_table)
    return {
        "results": out,
        "blocks": blocks,
        "total_bytes_per_bank": int(mv.total_bytes_per_bank),
        "free_bytes_per_bank": int(mv.total_bytes_free_per_bank),
        "largest_free_per_bank": int(mv.largest_contiguous_bytes_free_per_bank),
    }


def banks(dev, ttnn, task: dict, job: Path) -> dict:
    x = np.load(job / task["input"])
    buf = dev.allocate_tile_tensor(x.shape, task["dtype"], x)
    raw = np.stack([dev.read_bank(b, buf.address, buf.size_per_bank) for b in range(dev.num_banks)])
    np.save(job / f"{task['out']}.banks.npy", raw)
    dev.free_buffer(buf)
    # converse: bytes written at (bank, address), read back as a tensor through ttnn
    src = np.load(job / f"{task['out']}.in.npy")
    buf2 = dev.allocate_tile_tensor(x.shape, task["dtype"])
    for b in range(dev.num_banks):
        dev.write_bank(b, buf2.address, src[b])
    back = dev.read_tensor_pages(buf2)
    np.save(job / f"{task['out']}.readback.npy", back)
    dev.free_buffer(buf2)
    return {"address": buf.address, "size_per_bank": buf.size_per_bank, "converse_address": buf2.address}


def allocate_kv_cache(dev, spec) -> tuple:
    """tt_transformers' paged cache through the adapter: per layer K then V, zero-filled
    TILE tensors in DRAM; (layout, buffers K0, V0, ...)."""
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout

    zeros = np.zeros(spec.tensor_shape, dtype=np.float32)
    bufs = [dev.allocate_tile_tensor(spec.tensor_shape, spec.dtype, zeros) for _ in range(2 * spec.num_layers)]
    addrs = tuple((bufs[2 * i].address, bufs[2 * i + 1].address) for i in range(spec.num_layers))
    return TTKVCacheLayout(spec, dev.num_banks, dev.profile.aligned_page(spec.tile_nbytes), addrs), bufs


def land_gprime(dev, g: np.ndarray, ops: dict, mode: str, recv, kv_bufs) -> dict:
    """Land G' with the adapter's primitives, as TTSink does, the host standing in for the
    NIC: staged -> ``write_host`` into the mapped receive buffer's shadows, then
    ``copy_in_banks``; direct -> the adapter refuses to map (shadow) a KV buffer, so the
    host writes each READ's bytes at its (bank, address) in DRAM, what a NIC does through a
    tt-kmd window; then the DRAM write barrier."""
    from vllm_hawk.npu.bank_buffer import BankBufferError

    fields = ("src_offset", "bank", "dst_offset", "nbytes")
    rdma = [ops[f"rdma_{f}"].tolist() for f in fields]
    if mode == "direct":
        try:
            dev.map_buffer_dma(kv_bufs[0])
            refused = ""
        except BankBufferError as e:
            refused = str(e)
        for s, b, d, n in zip(*rdma, strict=True):
            dev.write_bank(b, d, g[s : s + n])
        dev.dram_write_barrier()
        return {"direct_bytes": int(np.sum(ops["rdma_nbytes"])), "map_refused": refused}
    for s, b, d, n in zip(*rdma, strict=True):
        dev.write_host(recv, b, d, g[s : s + n])
    intra = [ops[f"intra_{f}"] for f in fields]
    per_bank = [
        (b, intra[0][sel] + recv.address, intra[2][sel], intra[3][sel])
        for b in range(dev.num_banks)
        if (sel := intra[1] == b).any()
    ]
    copies = dev.copy_in_banks(per_bank)
    dev.dram_write_barrier()
    return {"rdma_bytes": int(np.sum(ops["rdma_nbytes"])), "intra_bank_ops": copies}


def land(dev, ttnn, task: dict, job: Path) -> dict:
    """{"kind": "land", "spec": [L, blocks, H, BS, D, dtype], "mode": "staged"|"direct",
    "recv_size_per_bank": N, "gprime": "g.npy", "ops": "ops.npz", "out": "stem",
    "block_table": [[...], ...], "expect_kv": [[K0, V0], ...], "expect_recv": A}

    Allocate the cache through ttnn (addresses must equal expect_kv: our allocator's),
    a receive buffer (staged), map it, land G' with the host as data mover, unmap and free
    it, put the page table on the device and read everything back through ttnn."""
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec

    spec = TTKVCacheSpec(*task["spec"])
    layout, bufs = allocate_kv_cache(dev, spec)
    res: dict = {"kv_addresses": [list(a) for a in layout.addresses]}
    if res["kv_addresses"] != task["expect_kv"]:
        raise AssertionError(f"KV addresses from ttnn {res['kv_addresses']} != ours {task['expect_kv']}")
    res["zero_before"] = all(not dev.read_tensor_pages(b).any() for b in bufs)  # landing is what fills it
    g = np.load(job / task["gprime"])
    recv = None
    if task["mode"] == "staged":
        recv = dev.allocate_bank_buffers(task["recv_size_per_bank"])
        res["recv_address"] = recv.address
        dev.map_buffer_dma(recv)
        res["bank_addrs_distinct"] = len({dev.get_buffer_address_bank(recv, b) for b in range(dev.num_banks)})
        res["bank_sizes"] = [dev.get_buffer_size_bank(recv, b) for b in range(dev.num_banks)]
    t0 = time.perf_counter()
    res["moved"] = land_gprime(dev, g, dict(np.load(job / task["ops"])), task["mode"], recv, bufs)
    res["land_s"] = round(time.perf_counter() - t0, 3)
    if recv is not None:
        dev.unmap_buffer_dma(recv)
        dev.free_buffer(recv)
    table = np.asarray(task["block_table"], dtype=np.int32)
    pt = ttnn.Tensor(table, ttnn.int32, dev.mesh, ttnn.ROW_MAJOR_LAYOUT, ttnn.DRAM_MEMORY_CONFIG)
    res["page_table"] = ttnn.from_device(pt).to_numpy().astype(np.int64).tolist()
    for i, b in enumerate(bufs):
        np.save(job / f"{task['out']}.kv{i}.npy", dev.read_tensor_pages(b))
    for b in bufs:
        dev.free_buffer(b)
    res["live_after"] = len(dev.live_buffers())
    return res


def main(argv: list[str]) -> int:
    job = Path(argv[1]).resolve()
    spec = json.loads((job / "job.json").read_text())
    t0 = time.perf_counter()
    import ttnn

    from vllm_hawk.npu.ttnn_chip import TTNNChip

    results = [{"import_s": round(time.perf_counter() - t0, 3)}]
    for task in spec["tasks"]:
        t1 = time.perf_counter()
        dev = TTNNChip.open(spec["profile"])
        try:
            fn = {
                "alloc": lambda: alloc(dev, ttnn, task),
                "banks": lambda: banks(dev, ttnn, task, job),
                "land": lambda: land(dev, ttnn, task, job),
            }[task["kind"]]
            r = fn()
        finally:
            dev.close()
        r["seconds"] = round(time.perf_counter() - t1, 3)
        results.append(r)
    (job / "result.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
