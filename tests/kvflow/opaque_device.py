"""A torch device whose memory host code cannot address: the tests' stand-in for a GPU.

A CUDA KV cache holds real bytes, but its ``data_ptr()`` is a device address: host code
that copies through it (``ctypes.memmove``, ``.numpy()``, the numba kernel) crashes or
reads garbage, and work queued on it runs later, asynchronously. A test that runs the
prefill side on such a device catches every host-only operation without a GPU. What the
CPU build of torch 2.13 offers for that:

* ``meta`` tensors: shapes without data, so no bytes to compare;
* a ``PrivateUse1`` backend in C++ (how out-of-tree accelerators plug in; torch's own
  ``openreg`` test backend): real, but thousands of lines and an extension build;
* what this module does, with torch's public extension points: ``PrivateUse1`` renamed
  :data:`NAME` (``torch.utils.rename_privateuse1_backend``), its tensors a wrapper
  subclass that keeps the bytes in a hidden host tensor and runs every aten operation on
  it (``__torch_dispatch__``; factory operations through a ``torch.library`` fallback for
  the ``PrivateUse1`` key), a device module ``torch.hawkdev`` (``torch._register_device_module``)
  with a stream, and the one piece torch takes only from C++, a ``DeviceGuardImpl`` (tensor
  indexing asks for it): :data:`GUARD_CPP`, built with g++ against torch's headers (about
  2 s, cached under ``HAWK_CACHE``).

What host code sees: tensors on ``hawkdev:0``; ``.numpy()`` and the storage's pointer are
refused; ``data_ptr()`` is the address of a *decoy*, host memory of the same size filled
with ``0xA5``, never of the bytes. A host copy through it reads ``0xA5`` (wrong bytes, so a
byte comparison fails) and a host write lands in the decoy (:func:`decoys_untouched` turns
False); nothing crashes. Transports get that address as device memory at ``"hawkdev:0"``.

Streams and events, as CUDA's contract has them (the part the prefill relies on):
``torch.hawkdev.Stream()`` makes a stream (independent of every other, as torch's
non-blocking CUDA pool streams are); ``torch.hawkdev.stream(s)`` makes it the calling
thread's current stream for the block (per thread; outside one it is the legacy
default stream, :data:`DEFAULT_STREAM`); every operation is queued on the issuing
thread's current stream and is *done* only after that stream's ``synchronize()``, an
``Event`` recorded after it and ``synchronize()``d (``query()`` tells without waiting),
``torch.hawkdev.synchronize()`` (everything), or a copy to the host on that stream (a
synchronous device -> host copy). :func:`busy` tells whether work was queued that nobody
waited for (on any stream, or on one), :func:`syncs` counts the waits, :func:`ops` lists
every operation with the thread and stream that issued it (``mark()`` starts a window).

Capture: :func:`capture` stands for a CUDA graph capture on the calling thread with
``capture_error_mode="global"`` (vLLM 0.32's): while it is open, any device call (an
operation, a stream or event created, recorded or synchronised) from another thread
marks it invalidated, as CUDA_ERROR_STREAM_CAPTURE_INVALIDATED would. That is stricter
than CUDA (a kernel launched on an unrelated non-blocking stream is legal there; the
warm-up's allocations, pageable copies and synchronisations are not), so a pass here
means no HAWK thread touches the device at all during the capture.

A fake at the hardware boundary (CUDA), used by tests only. :func:`enable` changes torch
for the whole process (the rename cannot be undone): call it in a process of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._pytree import tree_map

from vllm_hawk import envs

__all__ = [
    "CANARY",
    "DEFAULT_STREAM",
    "GUARD_CPP",
    "NAME",
    "UPLOAD",
    "Op",
    "busy",
    "capture",
    "decoys_untouched",
    "enable",
    "mark",
    "ops",
    "syncs",
]

NAME = "hawkdev"
CANARY = 0xA5
UPLOAD = "upload"  # Op.what of a host -> device copy
#: ``c10::impl::DeviceGuardImplInterface`` for PrivateUse1: one device, one stream.
GUARD_CPP = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
using c10::Device;
using c10::DeviceType;
using c10::Stream;
struct OpaqueGuard final : public c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType T = DeviceType::PrivateUse1;
  DeviceType type() const override { return T; }
  Device exchangeDevice(Device) const override { return Device(T, 0); }
  Device getDevice() const override { return Device(T, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const noexcept override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, OpaqueGuard);
}  // namespace
"""

_lock = threading.RLock()
_state = {"enabled": False, "syncs": 0, "capture": None}
_tls = threading.local()  # .stream: this thread's current stream (None: the legacy default)
_log: list = []  # every device call, an Op each
_stream_ids = itertools.count(1)
_streams: list = []  # every stream made (the legacy default one first), for busy()
_decoys: dict[int, np.ndarray] = {}  # hidden storage's address -> its decoy
_keep: list = []  # the guard library and the torch.library registration, alive for the process


def _guard_library() -> Path:
    """The compiled guard (built once per torch version under ``HAWK_CACHE``)."""
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256((torch.__version__ + GUARD_CPP).encode()).hexdigest()[:12]
    out = envs.cache_dir() / "opaque-device" / f"guard-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "guard.cpp", Path(tmp) / "guard.so"
        src.write_text(GUARD_CPP)
        cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(src)]
        cmd += [f"-L{torch_dir / 'lib'}", "-lc10", "-o", str(lib)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        except FileNotFoundError:
            raise RuntimeError("the opaque test device needs g++ (apt-get install g++)") from None
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"building the opaque device's guard failed:\n{e.stderr[-2000:]}") from None
        os.replace(lib, out)  # atomic: a concurrent build loses nothing
    return out


def _decoy_of(inner: torch.Tensor) -> int:
    """Address of the decoy of ``inner``'s storage (made on first use)."""
    st = inner.untyped_storage()
    key = st.data_ptr()
    with _lock:
        d = _decoys.get(key)
        if d is None or d.size < st.nbytes():
            d = _decoys[key] = np.full(max(1, st.nbytes()), CANARY, dtype=np.uint8)
    return d.ctypes.data


class OpaqueTensor(torch.Tensor):
    """A tensor on :data:`NAME` whose bytes live in ``self.hidden`` (a host tensor that host
    code is never given)."""

    hidden: torch.Tensor

    @staticmethod
    def __new__(cls, hidden: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            hidden.shape,
            strides=hidden.stride(),
            storage_offset=hidden.storage_offset(),
            dtype=hidden.dtype,
            device=torch.device(NAME, 0),
            requires_grad=False,
        )
        r.hidden = hidden
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def data_ptr(self) -> int:
        """The decoy's address (see the module doc), offset like the real view."""
        h = self.hidden
        return _decoy_of(h) + (h.data_ptr() - h.untyped_storage().data_ptr())

    def tolist(self):
        return self.cpu().tolist()

    def __repr__(self) -> str:
        return f"OpaqueTensor({self.cpu()!r}, device='{NAME}:0')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _to_host(x):
    if isinstance(x, OpaqueTensor):
        return x.hidden
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith(NAME):
        return "cpu"
    return x


#: Operations that take tensors of both devices, as CUDA's do: copies, and advanced
#: indexing with host index tensors (moved to the device by the kernel).
_MIXED_OK = {"aten::copy_", "aten::_to_copy", "aten::index", "aten::index_put_", "aten::_index_put_impl_"}


def _check_devices(func, args, kwargs) -> None:
    """Refuse host tensors (other than 0-dim ones) next to device tensors, as CUDA does."""
    if func._schema.name in _MIXED_OK:
        return
    flat = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    host = [x for x in flat if not isinstance(x, OpaqueTensor) and x.dim() > 0]
    if host and len(host) < len(flat):
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {NAME}:0 and cpu "
            f"({func._schema.name})"
        )


def _run(func, args, kwargs):
    """Run ``func`` on the hidden host tensors; wrap the results that live on the device."""
    _check_devices(func, args, kwargs)
    dev = kwargs.get("device")
    to_host = (func is torch.ops.aten._to_copy.default and dev is not None and torch.device(dev).type == "cpu") or (
        func is torch.ops.aten.copy_.default and not isinstance(args[0], OpaqueTensor)
    )
    out = func(*tree_map(_to_host, args), **tree_map(_to_host, kwargs))
    if not func.is_view:  # a view is metadata: no device work (CUDA launches nothing)
        nb = bool(kwargs.get("non_blocking", False))
        name = func._schema.name
        if func is torch.ops.aten.copy_.default and not to_host and not isinstance(args[1], OpaqueTensor):
            nb, name = nb or (len(args) > 2 and bool(args[2])), UPLOAD
        s = _issue(name, nb)
        if to_host:
            with _lock:
                s.done = s.queued  # a copy to the host waits for its stream's queue
    if func._schema.is_mutable:  # in place / out=: return the caller's own tensors
        mutated = [
            a for a, s in zip(args, func._schema.arguments, strict=False) if s.alias_info and s.alias_info.is_write
        ]
        mutated += [
            kwargs[s.name]
            for s in func._schema.arguments
            if s.alias_info and s.alias_info.is_write and s.name in kwargs
        ]
        if len(mutated) == 1:
            return mutated[0]
    if to_host:
        return out
    return tree_map(lambda x: OpaqueTensor(x) if isinstance(x, torch.Tensor) else x, out)


def _factory(op, *args, **kwargs):
    """``PrivateUse1`` kernels of operations without a device tensor argument (``torch.empty(...,
    device="hawkdev")``, the allocation inside ``.to("hawkdev")``)."""
    kwargs = {k: _to_host(v) for k, v in kwargs.items()}
    out = op(*tree_map(_to_host, args), **kwargs)
    _issue(op._schema.name, False)
    return tree_map(lambda x: OpaqueTensor(x) if isinstance(x, torch.Tensor) else x, out)


class Op(NamedTuple):
    """One device call: the issuing thread's name, the stream's id (0: the legacy default
    stream), what it was (an aten operation's name, or ``stream.synchronize`` ...) and
    whether a copy was issued ``non_blocking``."""

    thread: str
    stream: int
    what: str
    non_blocking: bool = False


class Capture:
    """An open :func:`capture`: ``invalidated`` once another thread touched the device;
    ``offenders`` lists those calls."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.offenders: list[Op] = []

    @property
    def invalidated(self) -> bool:
        return bool(self.offenders)


def _device_call(stream_id: int, what: str, nb: bool = False) -> None:
    """Log a device call (``_lock`` held) and hold it against an open capture."""
    op = Op(threading.current_thread().name, stream_id, what, nb)
    _log.append(op)
    cap = _state["capture"]
    if cap is not None and threading.get_ident() != cap.thread:
        cap.offenders.append(op)


class Stream:
    """A stream of the device (``torch.hawkdev.Stream``): work queued on it is done after
    its :meth:`synchronize`, an event recorded after it, or a device synchronisation."""

    def __init__(self, device=None, priority: int = 0, *, _id: int | None = None) -> None:
        self.id = next(_stream_ids) if _id is None else _id
        self.device = f"{NAME}:0"
        self.queued = self.done = 0
        with _lock:
            _streams.append(self)
            if _id is None:
                _device_call(self.id, "Stream")

    def synchronize(self) -> None:
        with _lock:
            _device_call(self.id, "stream.synchronize")
            self.done = self.queued
            _state["syncs"] += 1

    def query(self) -> bool:
        with _lock:
            return self.done >= self.queued

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<hawkdev stream {self.id}>"


#: The legacy default stream: every thread's current stream outside ``torch.hawkdev.stream(s)``.
DEFAULT_STREAM = Stream(_id=0)


class Event:
    """``torch.hawkdev.Event``: :meth:`record` marks what its stream has queued so far;
    :meth:`synchronize` waits for exactly that."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.stream: Stream | None = None
        self.seq = 0

    def record(self, stream: Stream | None = None) -> None:
        s = stream or _current()
        with _lock:
            _device_call(s.id, "event.record")
            self.stream, self.seq = s, s.queued

    def query(self) -> bool:
        with _lock:
            return self.stream is None or self.stream.done >= self.seq

    def synchronize(self) -> None:
        with _lock:
            if self.stream is None:
                return
            _device_call(self.stream.id, "event.synchronize")
            self.stream.done = max(self.stream.done, self.seq)
            _state["syncs"] += 1

    def wait(self, stream: Stream | None = None) -> None:
        pass


def _current() -> Stream:
    return getattr(_tls, "stream", None) or DEFAULT_STREAM


def _issue(what: str, non_blocking: bool) -> Stream:
    """Queue one operation on the calling thread's current stream; returns the stream."""
    s = _current()
    with _lock:
        s.queued += 1
        _device_call(s.id, what, non_blocking)
    return s


@contextlib.contextmanager
def _stream_context(s: Stream | None):
    """``torch.hawkdev.stream(s)``: ``s`` is this thread's current stream in the block."""
    prev = getattr(_tls, "stream", None)
    _tls.stream = s if s is not None else prev
    try:
        yield s
    finally:
        _tls.stream = prev


def _synchronize(device=None) -> None:
    with _lock:
        _device_call(_current().id, "synchronize")
        for s in _streams:
            s.done = s.queued
        _state["syncs"] += 1


def _device_module() -> types.ModuleType:
    m = types.ModuleType(f"torch.{NAME}")
    m.is_available = lambda: True
    m.is_initialized = lambda: True
    m.device_count = lambda: 1
    m.current_device = lambda: 0
    m._is_in_bad_fork = lambda: False
    m.Stream, m.Event = Stream, Event
    m.stream = _stream_context
    m.current_stream = lambda device=None: _current()
    m.default_stream = lambda device=None: DEFAULT_STREAM
    m.synchronize = _synchronize
    return m


def enable() -> torch.device:
    """Install the device in this process (idempotent); returns ``torch.device("hawkdev", 0)``."""
    with _lock:
        if _state["enabled"]:
            return torch.device(NAME, 0)
        _keep.append(ctypes.CDLL(str(_guard_library()), mode=ctypes.RTLD_GLOBAL))
        torch.utils.rename_privateuse1_backend(NAME)
        torch._register_device_module(NAME, _device_module())
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(_factory, dispatch_key="PrivateUse1")
        _keep.append(lib)
        _state["enabled"] = True
    return torch.device(NAME, 0)


def busy(stream: Stream | int | None = None) -> bool:
    """True when operations were queued (on ``stream``, a stream or its id, or on any) that
    nobody waited for."""
    with _lock:
        picked = [s for s in _streams if stream is None or s is stream or s.id == stream]
        return any(s.queued > s.done for s in picked)


def syncs() -> int:
    """Waits for the device so far (stream, event and device synchronisations)."""
    with _lock:
        return int(_state["syncs"])


def mark() -> int:
    """The start of a window of :func:`ops`."""
    with _lock:
        return len(_log)


def ops(since: int = 0) -> list[Op]:
    """The device calls since ``since`` (a :func:`mark`), in order."""
    with _lock:
        return list(_log[since:])


@contextlib.contextmanager
def capture():
    """A CUDA graph capture on the calling thread, ``capture_error_mode="global"`` (see the
    module doc): yields a :class:`Capture` that is invalidated by any device call from
    another thread until the block ends."""
    cap = Capture()
    with _lock:
        if _state["capture"] is not None:
            raise RuntimeError("opaque device: a capture is already open")
        _state["capture"] = cap
    try:
        yield cap
    finally:
        with _lock:
            _state["capture"] = None


def decoys_untouched() -> bool:
    """True when no host code wrote through a device tensor's ``data_ptr()``."""
    with _lock:
        return all(bool((d == CANARY).all()) for d in _decoys.values())


if __name__ == "__main__":  # build the guard ahead (CI warms its cache)
    print(_guard_library(), file=sys.stderr)
