"""One chip of a ttnn mesh as a bank-buffer backend (:class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI`).

This is the only way vllm_hawk reaches a Tenstorrent device through ttnn: the HAWK decode
worker on vllm-tt-plugin (:mod:`vllm_hawk.tenstorrent.vllm_tt.worker`) wraps the mesh the
plugin opened, the connector's sink (:class:`~vllm_hawk.kvflow.TTSink`) lands KV through
it, and tests/ttsim checks it on Tenstorrent's simulator. Numpy and ttnn only (no torch, no
vLLM): the ttsim checks run it in the 3.12 ttnn environment too. Importing it never needs ttnn.

What runs where:

* ttnn: device open (tests), allocation (tt-metal's allocator: every address here comes
  from ``buffer_address()`` of a ttnn tensor), host<->device tensor copies, raw DRAM reads
  and writes at (bank, address) through tt-metal's cluster API
  (``ttnn._ttnn.cluster.read_from_core`` / ``write_to_core``, NOC coordinates from
  ``get_dram_bank_table``);
* the host as data mover: a simulator has no NIC writing into it, so ``map_buffer_dma``
  gives each bank's region a host shadow (what a transport registers and writes), and
  :meth:`TTNNChip.dma_written` / :meth:`TTNNChip.copy_in_banks` move those bytes to the
  device (on hardware the NIC writes DRAM through TLB windows: :mod:`vllm_hawk.npu.tt_kmd`;
  the staged mode's intra-bank copies are a data-movement kernel there);
* not runnable without the SFPI toolchain: any device kernel (scripts/ttsim_env.sh).

tt-metal's simulator and UMD are not thread-safe, while the connector lands KV on its pull
threads as the engine thread runs the model: every ttnn and cluster call here holds
:data:`DEVICE_LOCK` (a model that touches the device outside ttnn's queues takes it too).

Units: bytes; addresses are tt-metal's lockstep DRAM addresses (the same in every bank).
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hawk.layout import profiles
from vllm_hawk.layout.device_profiles import DeviceProfile, load_profile
from vllm_hawk.layout.interleave import page_location, pages_per_bank
from vllm_hawk.layout.tt_kv_cache import TILE, TILE_NBYTES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferError, DeviceBuffer, check_bank, known_buffer

__all__ = ["DEVICE_LOCK", "TTNNUnavailable", "TTNNChip", "import_ttnn", "tensor_host_bytes", "ttnn_dtype"]

#: serialises every call into tt-metal (ttsim and UMD are not thread-safe); re-entrant
DEVICE_LOCK = threading.RLock()


class TTNNUnavailable(RuntimeError):
    """ttnn (tt-metal's Python API) is not importable in this environment."""


def import_ttnn() -> Any:
    """The ``ttnn`` module, or TTNNUnavailable with what to install."""
    try:
        import ttnn  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken tt-metal install
        raise TTNNUnavailable(
            f"the Tenstorrent decode needs tt-metal's ttnn package ({e}); "
            "scripts/ensure_env.sh tt builds an environment with it"
        ) from e
    if not hasattr(ttnn, "TILE_LAYOUT"):  # e.g. a folder named ttnn on sys.path
        raise TTNNUnavailable(
            f"'ttnn' at {getattr(ttnn, '__path__', '?')} is not tt-metal's ttnn; "
            "scripts/ensure_env.sh tt builds an environment with it"
        )
    return ttnn


def ttnn_dtype(ttnn, name: str):
    """ttnn's dtype for a tile format name (``bfloat16``, ``bfloat8_b``, ``bfloat4_b``)."""
    return {"bfloat16": ttnn.bfloat16, "bfloat8_b": ttnn.bfloat8_b, "bfloat4_b": ttnn.bfloat4_b}[name]


def dtype_name(ttnn, dtype) -> str:
    """The tile format name of a ttnn dtype (the inverse of :func:`ttnn_dtype`)."""
    for name in ("bfloat16", "bfloat8_b", "bfloat4_b"):
        if dtype == ttnn_dtype(ttnn, name):
            return name
    raise ValueError(f"KV cache dtype {dtype}: the sink lands bfloat16, bfloat8_b or bfloat4_b tiles")


def tensor_host_bytes(tensor) -> np.ndarray:
    """The raw host buffer of a ttnn tensor on one device (read back if on the device):
    uint8, for TILE layout the tilized/packed tiles exactly as they sit in DRAM, page after
    page. Taken from ``ttnn.dump_tensor``'s file: u64 little-endian header size,
    flatbuffer header, then the buffer."""
    ttnn = import_ttnn()
    with DEVICE_LOCK:
        host = ttnn.from_device(tensor) if tensor.storage_type() == ttnn.StorageType.DEVICE else tensor
        with tempfile.TemporaryDirectory(prefix="hawk-ttnn-") as tmp:
            path = Path(tmp) / "t.tensorbin"
            ttnn.dump_tensor(str(path), host)
            data = path.read_bytes()
    (hs,) = struct.unpack_from("<Q", data, 0)
    return np.frombuffer(data[8 + hs :], dtype=np.uint8).copy()


class TTNNChip:
    """Chip ``chip`` of a ttnn ``MeshDevice`` (hardware or ttsim) implementing
    :class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI`.

    On construction the chip is checked against the device profile (bank count, bank
    offsets and sizes, DRAM alignment, unreserved base); a mismatch names the profile file
    and field. Buffers are ttnn tensors on the whole mesh (the allocator is lockstep over
    its chips): those this adapter allocated are freed by :meth:`close`; tensors adopted
    with :meth:`adopt` stay their owner's.
    """

    def __init__(self, mesh, profile: DeviceProfile | str, chip: int = 0, *, owns_mesh: bool = False):
        ttnn = self._ttnn = import_ttnn()
        from ttnn._ttnn import cluster  # tt-metal's raw NOC access (UMD underneath)

        self._cluster = cluster
        self.mesh, self.chip, self._owns_mesh = mesh, chip, owns_mesh
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        with DEVICE_LOCK:
            ids = list(mesh.get_device_ids())
            if not 0 <= chip < len(ids):
                raise ValueError(f"chip {chip} outside the mesh's {len(ids)} chips")
            self.device_id = int(ids[chip])
            table = cluster.get_dram_bank_table(self.device_id)
            self._check_profile(table, ttnn)
        self._noc = [(int(e["noc_x"]), int(e["noc_y"])) for e in table]
        self._offset = [int(e["base_addr"]) for e in table]
        self._tensors: dict[int, Any] = {}
        self._owned: set[int] = set()
        self._buffers: dict[int, DeviceBuffer] = {}
        self._shadow: dict[int, list[np.ndarray]] = {}
        self._recv: set[int] = set()  # receive buffers: the only ones map_buffer_dma shadows
        self._ids = itertools.count(1)

    @classmethod
    def open(cls, profile: DeviceProfile | str) -> TTNNChip:
        """Open a one-chip mesh (tests, tools); :meth:`close` closes it."""
        ttnn = import_ttnn()
        with DEVICE_LOCK:
            mesh = ttnn.open_mesh_device(ttnn.MeshShape(1, 1))
        try:
            return cls(mesh, profile, 0, owns_mesh=True)
        except Exception:
            with DEVICE_LOCK:
                ttnn.close_mesh_device(mesh)
            raise

    def _check_profile(self, table, ttnn) -> None:
        p = self.profile
        where = profiles.find("devices", p.name)
        got = {
            "num_banks": len(table),
            "bank_offsets": tuple(int(e["base_addr"]) for e in table),
            "bank_size_bytes": int(table[0]["bank_size"]),
            "dram_alignment_bytes": int(ttnn.get_dram_alignment()),
            "dram_unreserved_base": int(ttnn.get_allocator_base_address(self.mesh, ttnn.BufferType.DRAM)),
        }
        for field, value in got.items():
            if getattr(p, field) != value:
                raise ValueError(
                    f"{where}: field {field!r} is {getattr(p, field)!r}, the device (tt-metal, chip "
                    f"{self.chip}) says {value!r}"
                )

    @property
    def num_banks(self) -> int:
        return self.profile.num_banks

    def close(self) -> None:
        """Free what this adapter allocated; close the mesh if :meth:`open` opened it."""
        with DEVICE_LOCK:
            for bid in list(self._owned):
                self._ttnn.deallocate(self._tensors[bid])
            self._tensors.clear()
            self._owned.clear()
            self._buffers.clear()
            self._shadow.clear()
            self._recv.clear()
            if self._owns_mesh:
                self._ttnn.close_mesh_device(self.mesh)
                self._owns_mesh = False

    # ---- raw DRAM access (tt-metal cluster API) ------------------------------------
    def read_bank(self, bank: int, address: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of DRAM bank ``bank`` at lockstep address ``address``: uint8."""
        x, y = self._noc[self._check_bank(bank)]
        with DEVICE_LOCK:
            raw = self._cluster.read_from_core(self.device_id, x, y, address + self._offset[bank], nbytes)
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def write_bank(self, bank: int, address: int, data: np.ndarray | bytes) -> None:
        """Write bytes into DRAM bank ``bank`` at lockstep address ``address``."""
        x, y = self._noc[self._check_bank(bank)]
        buf = data if isinstance(data, bytes) else np.ascontiguousarray(data, dtype=np.uint8).tobytes()
        with DEVICE_LOCK:
            self._cluster.write_to_core(self.device_id, x, y, address + self._offset[bank], buf)

    # ---- buffers: ttnn tensors ---------------------------------------------------------
    def adopt(self, tensor, num_pages: int, page_nbytes: int, *, owned: bool = False) -> DeviceBuffer:
        """The DeviceBuffer of a DRAM-interleaved ttnn tensor on this chip (its address from
        ``buffer_address()`` of the chip's part): ``num_pages`` pages of ``page_nbytes``."""
        with DEVICE_LOCK:
            parts = self._ttnn.get_device_tensors(tensor)
            part = parts[self.chip] if len(parts) > 1 else parts[0]
            address = int(part.buffer_address())
        ap = self.profile.aligned_page(page_nbytes)
        buf = DeviceBuffer(
            next(self._ids),
            address,
            pages_per_bank(num_pages, self.num_banks) * ap,
            page_nbytes,
            num_pages,
            ap,
            self.num_banks,
        )
        self._tensors[buf.buffer_id] = tensor
        self._buffers[buf.buffer_id] = buf
        if owned:
            self._owned.add(buf.buffer_id)
        return buf

    def adopt_tile_tensor(self, tensor, *, owned: bool = False) -> DeviceBuffer:
        """:meth:`adopt` for a TILE tensor: one tile per page, its dtype's tile size."""
        shape = list(tensor.shape)
        *lead, h, w = shape
        tiles = int(np.prod(lead, dtype=np.int64)) * -(-h // TILE) * -(-w // TILE)
        return self.adopt(tensor, tiles, TILE_NBYTES[dtype_name(self._ttnn, tensor.dtype)], owned=owned)

    def allocate_buffer(self, num_pages: int, page_nbytes: int) -> DeviceBuffer:
        """An interleaved DRAM buffer of ``num_pages`` pages of ``page_nbytes`` bytes: a
        ROW_MAJOR uint8 ttnn tensor ``[num_pages, page_nbytes]`` (one row = one page)."""
        ttnn = self._ttnn
        with DEVICE_LOCK:
            t = ttnn.allocate_tensor_on_device(
                ttnn.Shape([num_pages, page_nbytes]),
                ttnn.uint8,
                ttnn.ROW_MAJOR_LAYOUT,
                self.mesh,
                ttnn.DRAM_MEMORY_CONFIG,
            )
        return self.adopt(t, num_pages, page_nbytes, owned=True)

    def allocate_bank_buffers(self, size_per_bank: int) -> DeviceBuffer:
        """One ``size_per_bank``-byte region per bank (a receive buffer): num_banks pages."""
        buf = self.allocate_buffer(self.num_banks, size_per_bank)
        self._recv.add(buf.buffer_id)
        return buf

    def allocate_tile_tensor(self, shape, dtype: str, data: np.ndarray | None = None) -> DeviceBuffer:
        """A TILE tensor in DRAM (one tile per page): allocated only, or written from
        ``data`` (float32, tilized and packed on the host by ttnn)."""
        ttnn = self._ttnn
        dt = ttnn_dtype(ttnn, dtype)
        with DEVICE_LOCK:
            if data is None:
                t = ttnn.allocate_tensor_on_device(
                    ttnn.Shape(list(shape)), dt, ttnn.TILE_LAYOUT, self.mesh, ttnn.DRAM_MEMORY_CONFIG
                )
            else:
                arr = np.ascontiguousarray(data, dtype=np.float32)
                t = ttnn.Tensor(arr, dt, self.mesh, ttnn.TILE_LAYOUT, ttnn.DRAM_MEMORY_CONFIG)
        return self.adopt_tile_tensor(t, owned=True)

    def free_buffer(self, buf: DeviceBuffer) -> None:
        """Forget a buffer; deallocate its tensor if this adapter allocated it."""
        self._known(buf)
        t = self._tensors.pop(buf.buffer_id)
        if buf.buffer_id in self._owned:
            self._owned.discard(buf.buffer_id)
            with DEVICE_LOCK:
                self._ttnn.deallocate(t)
        del self._buffers[buf.buffer_id]
        self._shadow.pop(buf.buffer_id, None)
        self._recv.discard(buf.buffer_id)

    def tensor(self, buf: DeviceBuffer):
        """The ttnn tensor behind a buffer."""
        return self._tensors[self._known(buf).buffer_id]

    def live_buffers(self) -> list[DeviceBuffer]:
        return list(self._buffers.values())

    def read_tensor_pages(self, buf: DeviceBuffer) -> np.ndarray:
        """A buffer's pages read back through ttnn: uint8 ``[num_pages, page_size]``."""
        with DEVICE_LOCK:
            parts = self._ttnn.get_device_tensors(self.tensor(buf))
            part = parts[self.chip] if len(parts) > 1 else parts[0]
            return tensor_host_bytes(part).reshape(buf.num_pages, buf.page_size)

    def adopt_kv_cache(self, kv_cache, spec: TTKVCacheSpec) -> tuple[TTKVCacheLayout, list[DeviceBuffer]]:
        """The layout and buffers (K0, V0, K1, ...) of a paged cache a model allocated:
        ``kv_cache[layer] = [K, V]`` ttnn tensors ``spec.tensor_shape`` (this chip's heads),
        TILE layout, DRAM interleaved, in ``spec.dtype``; each is checked against ``spec``."""
        if len(kv_cache) != spec.num_layers:
            raise ValueError(f"KV cache has {len(kv_cache)} layers, the model {spec.num_layers}")
        bufs: list[DeviceBuffer] = []
        for layer, pair in enumerate(kv_cache):
            for kv, t in zip("KV", pair, strict=True):
                self._check_kv_tensor(t, spec, f"layer {layer} {kv}")
                bufs.append(self.adopt_tile_tensor(t))
        addrs = tuple((bufs[2 * i].address, bufs[2 * i + 1].address) for i in range(spec.num_layers))
        return TTKVCacheLayout(spec, self.num_banks, self.profile.aligned_page(spec.tile_nbytes), addrs), bufs

    def _check_kv_tensor(self, t, spec: TTKVCacheSpec, what: str) -> None:
        ttnn = self._ttnn
        got = (tuple(t.shape), dtype_name(ttnn, t.dtype), t.layout == ttnn.TILE_LAYOUT)
        want = (tuple(spec.tensor_shape), spec.dtype, True)
        if got != want:
            raise ValueError(f"KV cache {what}: (shape, dtype, TILE) is {got}, expected {want}")
        mc = t.memory_config()
        if mc.buffer_type != ttnn.BufferType.DRAM or mc.memory_layout != ttnn.TensorMemoryLayout.INTERLEAVED:
            raise ValueError(f"KV cache {what}: memory config {mc} is not DRAM interleaved")

    # ---- bank-buffer API (paper Table 6); host shadows stand in for TLB windows -------
    def get_device_num_bank(self) -> int:
        return self.num_banks

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Give every bank's region of a receive buffer (:meth:`allocate_bank_buffers`) a
        host shadow (zeroed) that a transport can register and write; :meth:`dma_written`
        and :meth:`copy_in_banks` move what was written to the device. Other buffers (the
        model's KV cache: direct mode) are refused: a NIC reaches device DRAM only through
        tt-kmd windows (:mod:`vllm_hawk.npu.ttnn_kmd_chip`), never through a host copy of
        the cache."""
        self._known(buffer)
        if buffer.buffer_id not in self._recv:
            raise BankBufferError(
                f"map_buffer_dma: buffer {buffer.buffer_id} ({buffer.size_per_bank} bytes per bank) is not a "
                "receive buffer: this adapter stages the NIC's bytes in host memory and never shadows the KV "
                "cache; direct mode needs the tt-kmd route (vllm_hawk.tenstorrent.route), else mode 'staged'"
            )
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

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        self._mapped(buffer, "unmap_buffer_dma")
        del self._shadow[buffer.buffer_id]

    def dram_write_barrier(self) -> None:
        """Nothing to wait for: every write here went through tt-metal's ``write_to_core``,
        which returns once the bytes are written."""

    def dma_written(self, bank, offset, nbytes) -> int:
        """The host as data mover, after a READ batch landed in mapped shadows: write each
        range ``(bank, device offset in the bank, nbytes)`` from its shadow to the device
        (arrays, one entry per range; each inside one mapped buffer). Returns the bytes."""
        total = 0
        for b, off, n in zip(*(np.asarray(x, dtype=np.int64).tolist() for x in (bank, offset, nbytes)), strict=True):
            sh, start = self._shadow_at(b, off, n)
            self.write_bank(b, off, sh[off - start : off - start + n])
            total += n
        return total

    def copy_in_banks(self, ops) -> int:
        """The staged mode's D6-D7: ``ops`` holds ``(bank, src_offset, dst_offset, nbytes)``
        per bank (byte offsets inside it; sources in a mapped receive buffer). Each bank's
        source range goes from its shadow to the device (the NIC's writes), is read back
        from the device and written to the destinations (a data-movement kernel on
        hardware). Returns the number of copies."""
        count = 0
        for b, src, dst, n in ops:
            src, dst, n = (np.asarray(x, dtype=np.int64) for x in (src, dst, n))
            if not n.size:
                continue
            lo, hi = int(src.min()), int((src + n).max())
            self.dma_written([b], [lo], [hi - lo])
            region = self.read_bank(b, lo, hi - lo)
            for s, d, k in zip(src.tolist(), dst.tolist(), n.tolist(), strict=True):
                self.write_bank(b, d, region[s - lo : s - lo + k])
            count += int(n.size)
        return count

    # ---- helpers ----------------------------------------------------------------------
    def _shadow_at(self, bank: int, offset: int, nbytes: int) -> tuple[np.ndarray, int]:
        """(shadow of ``bank`` of the mapped buffer holding the range, that buffer's address)."""
        self._check_bank(bank)
        for bid, shadows in self._shadow.items():
            buf = self._buffers[bid]
            if buf.address <= offset and offset + nbytes <= buf.address + buf.size_per_bank:
                return shadows[bank], buf.address
        raise BankBufferError(f"bank {bank}: bytes [{offset}, {offset + nbytes}) lie in no mapped buffer")

    def _check_bank(self, bank: int) -> int:
        return check_bank(bank, self.num_banks, self.profile.name)

    def _known(self, buffer: DeviceBuffer) -> DeviceBuffer:
        return known_buffer(self._buffers, buffer)

    def _mapped(self, buffer: DeviceBuffer, what: str) -> list[np.ndarray]:
        self._known(buffer)
        if buffer.buffer_id not in self._shadow:
            raise BankBufferError(f"{what}: buffer {buffer.buffer_id} is not mapped (call map_buffer_dma first)")
        return self._shadow[buffer.buffer_id]

    def page_location(self, buf: DeviceBuffer, page: int) -> tuple[int, int]:
        """(bank, lockstep address) of a buffer's page."""
        bank, off = page_location(page, self.num_banks, buf.aligned_page_size)
        return bank, buf.address + off

    def write_host(self, buffer: DeviceBuffer, bank: int, offset: int, data: np.ndarray) -> None:
        """Write ``data`` into the mapped shadow of ``buffer`` in ``bank`` at byte ``offset``
        (what a NIC's write does; tests stand in for the transport with it)."""
        raw = np.ascontiguousarray(data, dtype=np.uint8)
        if offset + raw.size > buffer.size_per_bank:
            raise BankBufferError(f"write_host: {raw.size} B at {offset} overflow bank {bank}'s region")
        ctypes.memmove(self.get_buffer_address_bank(buffer, bank) + offset, raw.ctypes.data, raw.size)
