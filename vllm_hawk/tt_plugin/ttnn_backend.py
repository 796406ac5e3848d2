"""``HAWK_TT_PLATFORM=ttnn``: the KV cache on a Tenstorrent device through ttnn.

Exercised on Tenstorrent's functional simulator (ttsim, prepared by
``scripts/ttsim_env.sh``) in CI: allocation, bank placement, the bank-buffer API and
landing a request's G' are checked byte for byte against the emulated device
(tests/ttsim). Not run on hardware. Runs in the Python 3.12 side environment: numpy and
ttnn only (no torch, no vLLM). Importing this module never needs ttnn; using it without
ttnn raises :class:`TTNNUnavailable`.

What runs where (no SFPI toolchain, the usual case off Tenstorrent's build machines):

* ttnn on the host: device open, allocation (tt-metal's allocator), host tilize/pack and
  host<->device tensor copies, raw DRAM reads/writes at (bank, address) through
  tt-metal's cluster API (``ttnn._ttnn.cluster.read_from_core`` / ``write_to_core``,
  NOC0 coordinates from ``get_dram_bank_table``);
* the host as data mover: there is no RDMA into a simulator, so the receive buffers'
  per-bank regions are host shadows (what a NIC would write) that :meth:`flush_buffer_dma`
  writes to the device; the staged mode's intra-bank copies (a data-movement kernel on
  hardware) are host read+write through the same API;
* NOT runnable: any device kernel. Decode attention (paged SDPA decode),
  ``paged_update_cache`` and ``paged_fill_cache`` need kernels compiled with SFPI:
  :func:`paged_decode_attention` raises :class:`NeedsSFPI`.

tt_transformers' paged cache convention (``models/tt_transformers``): per layer a ``[K,
V]`` pair of tensors ``[num_blocks, num_kv_heads, block_size, head_dim]``, TILE layout,
DRAM interleaved, zero-filled, ``bfloat8_b`` by default; vLLM's block table goes
unchanged to the device as an int32 ROW_MAJOR ``page_table`` ``[batch, max_blocks]``.
Units: bytes; addresses are tt-metal's lockstep DRAM addresses (the same in every bank).
"""

from __future__ import annotations

import itertools
import struct
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_hawk.layout import profiles
from vllm_hawk.layout.device_profiles import DeviceProfile, load_profile
from vllm_hawk.layout.interleave import page_location, pages_per_bank
from vllm_hawk.layout.tt_kv_cache import TILE, TILE_NBYTES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferError, DeviceBuffer

__all__ = [
    "TTNNUnavailable",
    "NeedsSFPI",
    "import_ttnn",
    "TTNNDevice",
    "page_table",
    "paged_decode_attention",
    "tensor_host_bytes",
    "TTNNPlatform",
]


class TTNNUnavailable(RuntimeError):
    """ttnn (tt-metal's Python API) is not importable in this environment."""


class NeedsSFPI(NotImplementedError):
    """The operation runs a device kernel, which needs the SFPI RISC-V toolchain."""


def import_ttnn() -> Any:
    """The ``ttnn`` module, or TTNNUnavailable with what to install."""
    try:
        import ttnn  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken tt-metal install
        raise TTNNUnavailable(f"HAWK_TT_PLATFORM=ttnn needs tt-metal's ttnn package ({e})") from e
    if not hasattr(ttnn, "TILE_LAYOUT"):  # e.g. a folder named ttnn on sys.path
        raise TTNNUnavailable(f"'ttnn' at {getattr(ttnn, '__path__', '?')} is not tt-metal's ttnn")
    return ttnn


def _ttnn_dtype(ttnn, name: str):
    return {"bfloat16": ttnn.bfloat16, "bfloat8_b": ttnn.bfloat8_b, "bfloat4_b": ttnn.bfloat4_b}[name]


def tensor_host_bytes(tensor) -> np.ndarray:
    """The raw host buffer of a ttnn tensor (read back from the device if needed): uint8,
    for TILE layout the tilized/packed tiles exactly as they sit in DRAM, page after page.

    Taken from ``ttnn.dump_tensor``'s file: u64 little-endian header size, flatbuffer
    header, then the buffer."""
    ttnn = import_ttnn()
    host = ttnn.from_device(tensor) if tensor.storage_type() == ttnn.StorageType.DEVICE else tensor
    with tempfile.TemporaryDirectory(prefix="hawk-ttnn-") as tmp:
        path = Path(tmp) / "t.tensorbin"
        ttnn.dump_tensor(str(path), host)
        data = path.read_bytes()
    (hs,) = struct.unpack_from("<Q", data, 0)
    return np.frombuffer(data[8 + hs :], dtype=np.uint8).copy()


def page_table(block_table, num_reqs: int) -> np.ndarray:
    """vLLM's block table rows of the scheduled requests as tt_transformers' page table
    (int32 ``[num_reqs, max_blocks]``; padding entries are ignored by the device ops
    because the sequence lengths bound them)."""
    return np.ascontiguousarray(np.asarray(block_table)[:num_reqs], dtype=np.int32)


def paged_decode_attention(*_args, **_kwargs):
    """Decode attention over the paged cache (``ttnn.transformer.paged_scaled_dot_product_
    attention_decode``). Needs compute kernels: not runnable without SFPI."""
    raise NeedsSFPI(
        "paged decode attention runs compute kernels compiled with the SFPI "
        "toolchain, which this environment lacks (scripts/ttsim_env.sh says which "
        "one it found); the KV cache side (allocation, landing, read-back) runs"
    )


class TTNNDevice:
    """One Tenstorrent chip opened through ttnn (hardware or ttsim), with the
    bank-buffer API of :class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI`.

    On open the device is checked against the profile (bank count, bank offsets and
    sizes, DRAM alignment, unreserved base); a mismatch names the profile file and field.
    """

    def __init__(self, profile: DeviceProfile | str, device_id: int = 0):
        ttnn = self._ttnn = import_ttnn()
        from ttnn._ttnn import cluster  # tt-metal's raw NOC access (UMD underneath)

        self._cluster = cluster
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.device_id = device_id
        self.device = ttnn.open_device(device_id=device_id)
        try:
            table = cluster.get_dram_bank_table(device_id)
            self._check_profile(table, ttnn)
        except Exception:
            ttnn.close_device(self.device)
            raise
        self._noc = [(int(e["noc_x"]), int(e["noc_y"])) for e in table]
        self._offset = [int(e["base_addr"]) for e in table]
        self._tensors: dict[int, Any] = {}
        self._buffers: dict[int, DeviceBuffer] = {}
        self._shadow: dict[int, list[np.ndarray]] = {}
        self._ids = itertools.count(1)

    def _check_profile(self, table, ttnn) -> None:
        p = self.profile
        where = profiles.find("devices", p.name)
        got = {
            "num_banks": len(table),
            "bank_offsets": tuple(int(e["base_addr"]) for e in table),
            "bank_size_bytes": int(table[0]["bank_size"]),
            "dram_alignment_bytes": int(ttnn.get_dram_alignment()),
            "dram_unreserved_base": int(ttnn.get_allocator_base_address(self.device, ttnn.BufferType.DRAM)),
        }
        for field, value in got.items():
            if getattr(p, field) != value:
                raise ValueError(
                    f"{where}: field {field!r} is {getattr(p, field)!r}, the device (tt-metal) says {value!r}"
                )

    @property
    def num_banks(self) -> int:
        return self.profile.num_banks

    def close(self) -> None:
        for t in self._tensors.values():
            self._ttnn.deallocate(t)
        self._tensors.clear()
        self._buffers.clear()
        self._ttnn.close_device(self.device)

    # ---- raw DRAM access (tt-metal cluster API) ------------------------------------
    def read_bank(self, bank: int, address: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of DRAM bank ``bank`` at lockstep address ``address``: uint8."""
        x, y = self._noc[self._check_bank(bank)]
        raw = self._cluster.read_from_core(self.device_id, x, y, address + self._offset[bank], nbytes)
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def write_bank(self, bank: int, address: int, data: np.ndarray | bytes) -> None:
        """Write bytes into DRAM bank ``bank`` at lockstep address ``address``."""
        x, y = self._noc[self._check_bank(bank)]
        buf = data if isinstance(data, bytes) else np.ascontiguousarray(data, dtype=np.uint8).tobytes()
        self._cluster.write_to_core(self.device_id, x, y, address + self._offset[bank], buf)

    # ---- interleaved buffers ----------------------------------------------------------
    def allocate_buffer(self, num_pages: int, page_nbytes: int) -> DeviceBuffer:
        """An interleaved DRAM buffer of ``num_pages`` pages of ``page_nbytes`` bytes: a
        ROW_MAJOR uint8 ttnn tensor ``[num_pages, page_nbytes]`` (one row = one page)."""
        ttnn = self._ttnn
        t = ttnn.allocate_tensor_on_device(
            ttnn.Shape([num_pages, page_nbytes]),
            ttnn.uint8,
            ttnn.ROW_MAJOR_LAYOUT,
            self.device,
            ttnn.DRAM_MEMORY_CONFIG,
        )
        return self._register(t, num_pages, page_nbytes)

    def allocate_bank_buffers(self, size_per_bank: int) -> DeviceBuffer:
        """One ``size_per_bank``-byte region per bank (a receive buffer): num_banks pages."""
        return self.allocate_buffer(self.num_banks, size_per_bank)

    def _register(self, tensor, num_pages: int, page_nbytes: int) -> DeviceBuffer:
        ap = self.profile.aligned_page(page_nbytes)
        buf = DeviceBuffer(
            next(self._ids),
            int(tensor.buffer_address()),
            pages_per_bank(num_pages, self.num_banks) * ap,
            page_nbytes,
            num_pages,
            ap,
            self.num_banks,
        )
        self._tensors[buf.buffer_id] = tensor
        self._buffers[buf.buffer_id] = buf
        return buf

    def free_buffer(self, buf: DeviceBuffer) -> None:
        self._known(buf)
        self._ttnn.deallocate(self._tensors.pop(buf.buffer_id))
        del self._buffers[buf.buffer_id]
        self._shadow.pop(buf.buffer_id, None)

    def tensor(self, buf: DeviceBuffer):
        """The ttnn tensor behind a buffer."""
        return self._tensors[self._known(buf).buffer_id]

    def live_buffers(self) -> list[DeviceBuffer]:
        return list(self._buffers.values())

    # ---- bank-buffer API (paper Table 6); host shadows stand in for TLB windows -------
    def get_device_num_bank(self) -> int:
        return self.num_banks

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Give every bank's region of ``buffer`` a host shadow (zeroed) that a transport
        can register and write; :meth:`flush_buffer_dma` moves it to the device."""
        self._known(buffer)
        if buffer.buffer_id in self._shadow:
            raise BankBufferError(f"map_buffer_dma: buffer {buffer.buffer_id} is already mapped")
        self._shadow[buffer.buffer_id] = [np.zeros(buffer.size_per_bank, np.uint8) for _ in range(self.num_banks)]

    def get_buffer_address_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Host virtual address of ``buffer``'s shadow region for ``bank``."""
        return int(self._mapped(buffer, "get_buffer_address_bank")[self._check_bank(bank)].ctypes.data)

    def get_buffer_size_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        self._known(buffer)
        self._check_bank(bank)
        return buffer.size_per_bank

    def flush_buffer_dma(self, buffer: DeviceBuffer, nbytes: list[int] | None = None) -> None:
        """The host as data mover: write each bank's shadow (its first ``nbytes[bank]``
        bytes, default all) to the device at the buffer's address."""
        shadows = self._mapped(buffer, "flush_buffer_dma")
        for b, sh in enumerate(shadows):
            n = buffer.size_per_bank if nbytes is None else int(nbytes[b])
            if n:
                self.write_bank(b, buffer.address, sh[:n])

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        self._mapped(buffer, "unmap_buffer_dma")
        del self._shadow[buffer.buffer_id]

    def allocate_tile_tensor(self, shape, dtype: str, data: np.ndarray | None = None) -> DeviceBuffer:
        """A TILE tensor in DRAM (one tile per page): allocated only, or written from
        ``data`` (float32, tilized and packed on the host by ttnn)."""
        ttnn = self._ttnn
        dt = _ttnn_dtype(ttnn, dtype)
        if data is None:
            t = ttnn.allocate_tensor_on_device(
                ttnn.Shape(list(shape)), dt, ttnn.TILE_LAYOUT, self.device, ttnn.DRAM_MEMORY_CONFIG
            )
        else:
            t = ttnn.Tensor(
                np.ascontiguousarray(data, dtype=np.float32), dt, self.device, ttnn.TILE_LAYOUT, ttnn.DRAM_MEMORY_CONFIG
            )
        *lead, h, w = shape
        tiles = int(np.prod(lead, dtype=np.int64)) * -(-h // TILE) * -(-w // TILE)
        return self._register(t, tiles, TILE_NBYTES[dtype])

    # ---- the paged KV cache ------------------------------------------------------------
    def allocate_kv_cache(self, spec: TTKVCacheSpec) -> tuple[TTKVCacheLayout, list[DeviceBuffer]]:
        """tt_transformers' paged cache: per layer K then V, zero-filled TILE tensors
        ``spec.tensor_shape`` in ``spec.dtype``, DRAM interleaved (one tile per page).
        Returns the layout (addresses from ``buffer_address()``) and the buffers K0, V0, ..."""
        zeros = np.zeros(spec.tensor_shape, dtype=np.float32)
        bufs: list[DeviceBuffer] = []
        try:
            for _ in range(2 * spec.num_layers):
                bufs.append(self.allocate_tile_tensor(spec.tensor_shape, spec.dtype, zeros))
        except Exception:
            for b in bufs:
                self.free_buffer(b)
            raise
        addrs = tuple((bufs[2 * i].address, bufs[2 * i + 1].address) for i in range(spec.num_layers))
        return TTKVCacheLayout(spec, self.num_banks, self.profile.aligned_page(spec.tile_nbytes), addrs), bufs

    def page_table_tensor(self, block_table, num_reqs: int):
        """tt_transformers' page table on the device: int32 ROW_MAJOR, DRAM."""
        ttnn = self._ttnn
        return ttnn.Tensor(
            page_table(block_table, num_reqs), ttnn.int32, self.device, ttnn.ROW_MAJOR_LAYOUT, ttnn.DRAM_MEMORY_CONFIG
        )

    def land(self, gprime: np.ndarray, plan, recv: DeviceBuffer | None = None) -> dict:
        """Land one request's G' (uint8) into the KV cache, the host moving the bytes.

        ``plan``: a :class:`~vllm_hawk.transform.plan.TransferPlan` or anything with
        ``mode`` and ``rdma`` / ``intra_bank`` op lists (src_offset, bank, dst_offset,
        nbytes). staged: ``rdma`` into ``recv``'s mapped shadows (what the NIC does), flush
        to the device, then the intra-bank copies recv -> KV pages (read + write per bank);
        direct: ``rdma`` straight to the KV pages. Returns bytes moved per step."""
        g = np.ascontiguousarray(gprime, dtype=np.uint8).reshape(-1)
        ops = plan.rdma
        if plan.mode == "direct":
            for s, b, d, n in zip(
                *(np.asarray(getattr(ops, f)).tolist() for f in ("src_offset", "bank", "dst_offset", "nbytes")),
                strict=False,
            ):
                self.write_bank(b, d, g[s : s + n])
            return {"direct_bytes": int(np.sum(ops.nbytes))}
        if recv is None:
            raise ValueError("land: staged mode needs a mapped receive buffer")
        shadows = self._mapped(recv, "land")
        used = [0] * self.num_banks
        for s, b, d, n in zip(
            *(np.asarray(getattr(ops, f)).tolist() for f in ("src_offset", "bank", "dst_offset", "nbytes")),
            strict=False,
        ):
            if d + n > recv.size_per_bank:
                raise BankBufferError(
                    f"land: segment of {n} B at {d} overflows the {recv.size_per_bank} B receive region of bank {b}"
                )
            shadows[b][d : d + n] = g[s : s + n]
            used[b] = max(used[b], d + n)
        self.flush_buffer_dma(recv, used)
        intra = plan.intra_bank
        for b in range(self.num_banks):
            if not used[b]:
                continue
            region = self.read_bank(b, recv.address, used[b])  # what the device holds now
            sel = np.asarray(intra.bank) == b
            for s, d, n in zip(
                np.asarray(intra.src_offset)[sel].tolist(),
                np.asarray(intra.dst_offset)[sel].tolist(),
                np.asarray(intra.nbytes)[sel].tolist(),
                strict=False,
            ):
                self.write_bank(b, d, region[s : s + n])
        return {"rdma_bytes": sum(used), "intra_bank_bytes": int(np.sum(intra.nbytes))}

    def read_kv_tensor(self, buf: DeviceBuffer) -> np.ndarray:
        """One KV tensor read back through ttnn: its tiles, uint8 ``[tiles, tile_nbytes]``."""
        return tensor_host_bytes(self.tensor(buf)).reshape(buf.num_pages, buf.page_size)

    # ---- helpers ----------------------------------------------------------------------
    def _check_bank(self, bank: int) -> int:
        if not 0 <= bank < self.num_banks:
            raise BankBufferError(f"bank {bank} out of range: {self.profile.name} has {self.num_banks} banks")
        return bank

    def _known(self, buffer: DeviceBuffer) -> DeviceBuffer:
        if self._buffers.get(buffer.buffer_id) != buffer:
            raise BankBufferError(f"unknown or freed buffer id {buffer.buffer_id}")
        return buffer

    def _mapped(self, buffer: DeviceBuffer, what: str) -> list[np.ndarray]:
        self._known(buffer)
        if buffer.buffer_id not in self._shadow:
            raise BankBufferError(f"{what}: buffer {buffer.buffer_id} is not mapped (call map_buffer_dma first)")
        return self._shadow[buffer.buffer_id]

    def page_location(self, buf: DeviceBuffer, page: int) -> tuple[int, int]:
        """(bank, lockstep address) of a buffer's page."""
        bank, off = page_location(page, self.num_banks, buf.aligned_page_size)
        return bank, buf.address + off


def ops_from_arrays(mode: str, arrays: dict[str, np.ndarray]) -> SimpleNamespace:
    """A plan-like object for :meth:`TTNNDevice.land` from arrays ``rdma_<field>`` and
    ``intra_<field>`` (as the 3.11 side saves a TransferPlan's op lists)."""
    fields = ("src_offset", "bank", "dst_offset", "nbytes")
    rdma = SimpleNamespace(**{f: arrays[f"rdma_{f}"] for f in fields})
    intra = SimpleNamespace(**{f: arrays[f"intra_{f}"] for f in fields}) if mode == "staged" else None
    return SimpleNamespace(mode=mode, rdma=rdma, intra_bank=intra)


def _cpu_platform_base() -> type:
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # vLLM absent (e.g. the 3.12 ttnn env): the class still imports
        return object
    return CpuPlatform


class TTNNPlatform(_cpu_platform_base()):  # type: ignore[misc]
    """Platform for real hardware: checks ttnn, then refuses to run the model on the
    host. The KV-cache side is :class:`TTNNDevice`; decode attention needs the
    Tenstorrent vLLM plugin's runner and SFPI-compiled kernels."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        import_ttnn()
        raise NotImplementedError(
            "HAWK_TT_PLATFORM=ttnn: the KV-cache side (TTNNDevice: allocate_kv_cache, page "
            "tables, bank-buffer API, landing G') runs, on hardware or ttsim; decode attention "
            "needs the Tenstorrent vLLM plugin's runner and SFPI-compiled kernels; use "
            "HAWK_TT_PLATFORM=emulated on machines without them"
        )
