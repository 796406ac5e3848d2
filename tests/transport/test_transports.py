"""Every transport, same tests: batched reads/writes between two real processes
(in-process: two instances), range checks on both sides, dead and hanging peers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import socket
import threading
import time

import pytest
from peer import pattern, start_peer

from vllm_hawk.transport import RegionError, TransferFailed, TransferState, TransferTimeout, Transport, make_transport

KINDS = ["inprocess", "host_staged", "mooncake"]
PEER_NBYTES = 8 << 20
PEER_SEED = 1234


def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


#: Mooncake constructor options for every mooncake transport here, as JSON. The RDMA guest
#: stage (tests/guest) sets {"protocol": "rdma", "device_name": "rxe0", "local_host": IP}.
MOONCAKE_OPTIONS = json.loads(os.environ.get("HAWK_TEST_MOONCAKE_OPTIONS") or "{}")


def _options(kind: str) -> dict:
    # Small pieces so that the host-staged path exercises chunking and its window.
    if kind == "host_staged":
        return {"chunk_nbytes": 256 << 10}
    return dict(MOONCAKE_OPTIONS) if kind == "mooncake" else {}


class LocalPeer:
    """The in-process stand-in for a peer process."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.t = make_transport("inprocess")
        self.buf = ctypes.create_string_buffer(pattern(seed, nbytes), nbytes)
        self.addr = ctypes.addressof(self.buf)
        self.nbytes = nbytes
        self.t.register(self.addr, nbytes)
        self.endpoint = self.t.endpoint

    def get(self, offset: int, n: int) -> bytes:
        return ctypes.string_at(self.addr + offset, n)

    def stop(self) -> None:
        self.t.close()

    kill = stop


def _start(kind: str, seed: int = PEER_SEED, nbytes: int = PEER_NBYTES):
    if kind == "mooncake" and not _mooncake_available():
        pytest.skip("mooncake not installed")
    if kind == "inprocess":
        return LocalPeer(nbytes, seed)
    return start_peer(kind, nbytes, seed, _options(kind))


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(kind):
    p = _start(kind)
    yield p
    p.stop()


@pytest.fixture()
def local(kind):
    if kind == "mooncake" and not _mooncake_available():
        pytest.skip("mooncake not installed")
    t = make_transport(kind, **_options(kind))
    n = 8 << 20
    buf = ctypes.create_string_buffer(n)
    t.register(ctypes.addressof(buf), n)
    yield t, buf
    t.close()


def _disjoint_ranges(rng: random.Random, space: int, count: int, max_len: int):
    """``count`` disjoint (offset, nbytes) ranges inside ``[0, space)``, shuffled."""
    cuts = sorted(rng.sample(range(space // 64), 2 * count))
    out = []
    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
        off = a * 64 + rng.randrange(64)
        out.append((off, max(1, min(max_len, b * 64 - off))))
    rng.shuffle(out)
    return out


def test_protocol_conformance(local):
    t, _ = local
    assert isinstance(t, Transport)
    assert ":" in t.endpoint


def test_memory_locations(local):
    """Host memory registers everywhere; device memory only where the transport reaches it
    (Mooncake: where the engine was seen to, test_mooncake_cuda.py). Mooncake is told each
    range's location: ``*`` for host memory (its NIC topology names host memory by NUMA
    node, which the engine looks up itself), the device's name (``cuda:0``) for device memory."""
    t, _ = local
    assert t.accepts_memory("cpu")
    n = 1 << 16
    buf = ctypes.create_string_buffer(n)
    addr = ctypes.addressof(buf)
    if type(t).__name__ == "MooncakeTransport":
        from vllm_hawk.transport.mooncake import engine_location

        assert engine_location("cpu") == "*" and engine_location("cuda:1") == "cuda:1"
        calls, engine = [], t._engine  # spy on the real engine's register_memory
        real = engine.register_memory
        with contextlib.ExitStack() as undo:
            t._engine = type("Spy", (), {"register_memory": lambda s, *a: (calls.append(a), real(*a))[1]})()
            undo.callback(setattr, t, "_engine", engine)
            t.register(addr, n, "cpu")
        t.unregister(addr)
        assert calls == [(addr, n, "*")]
    else:
        assert not t.accepts_memory("cuda:0")
    if not t.accepts_memory("cuda:0"):
        with pytest.raises(RegionError, match="cuda:0.*(CUDA|mooncake-transfer-engine)"):
            t.register(addr, n, "cuda:0")
        assert t.accepts_memory("cpu")  # nothing half-registered: the same range registers as host memory
        t.register(addr, n)
        t.unregister(addr)


def test_batched_read_random_ranges(local, peer):
    t, buf = local
    base = ctypes.addressof(buf)
    rng = random.Random(7)
    remote = _disjoint_ranges(rng, peer.nbytes, 200, 96 << 10)
    entries, cursor = [], 0
    for off, n in remote:
        entries.append((base + cursor, peer.addr + off, n))
        cursor += n
    h = t.submit("read", peer.endpoint, entries)
    t.wait(h, timeout_s=20)
    assert t.poll(h) is TransferState.DONE and h.settled.is_set()
    want = peer.get(0, peer.nbytes)
    cursor = 0
    for off, n in remote:
        assert ctypes.string_at(base + cursor, n) == want[off : off + n]
        cursor += n


def test_batched_write_random_ranges(local, peer):
    t, buf = local
    base = ctypes.addressof(buf)
    rng = random.Random(11)
    src = rng.randbytes(len(buf))
    ctypes.memmove(base, src, len(src))
    remote = _disjoint_ranges(rng, peer.nbytes, 150, 128 << 10)
    entries, cursor = [], 0
    for off, n in remote:
        entries.append((base + cursor, peer.addr + off, n))
        cursor += n
    t.wait(t.submit("write", peer.endpoint, entries), timeout_s=20)
    cursor = 0
    for off, n in remote:
        assert peer.get(off, n) == src[cursor : cursor + n]
        cursor += n


def test_large_entries_and_many_small_entries(local, peer):
    """A few MiB-sized entries, then more than 2048 2-KiB entries in ONE batch."""
    t, buf = local
    base = ctypes.addressof(buf)
    want = peer.get(0, peer.nbytes)
    t.wait(
        t.submit("read", peer.endpoint, [(base + i * (2 << 20), peer.addr + i * (2 << 20), 2 << 20) for i in range(4)]),
        timeout_s=30,
    )
    assert ctypes.string_at(base, 8 << 20) == want[: 8 << 20]
    ctypes.memset(base, 0, 8 << 20)
    n, sz = 3000, 2048
    entries = [(base + i * sz, peer.addr + (n - 1 - i) * sz, sz) for i in range(n)]
    t.wait(t.submit("read", peer.endpoint, entries), timeout_s=30)
    for i in range(n):
        j = n - 1 - i
        assert ctypes.string_at(base + i * sz, sz) == want[j * sz : (j + 1) * sz]


def test_remote_out_of_range_is_refused(local, peer):
    t, buf = local
    base = ctypes.addressof(buf)
    tail_before = peer.get(peer.nbytes - 100, 100)
    for kind in ("read", "write"):
        h = t.submit(kind, peer.endpoint, [(base, peer.addr + peer.nbytes - 100, 4096)])
        with pytest.raises(TransferFailed, match=f"peer {peer.endpoint}"):
            t.wait(h, timeout_s=10)
        assert t.poll(h) is TransferState.FAILED
    h = t.submit("write", peer.endpoint, [(base, peer.addr - 4096, 4096)])
    with pytest.raises(TransferFailed):
        t.wait(h, timeout_s=10)
    assert peer.get(peer.nbytes - 100, 100) == tail_before
    # The connection/peer is still usable after a refusal.
    t.wait(t.submit("read", peer.endpoint, [(base, peer.addr, 4096)]), timeout_s=10)


def test_local_out_of_range_and_bad_entries(local, peer):
    t, buf = local
    base = ctypes.addressof(buf)
    with pytest.raises(RegionError):
        t.submit("read", peer.endpoint, [(base + len(buf) - 10, peer.addr, 4096)])
    with pytest.raises(ValueError):
        t.submit("read", peer.endpoint, [])
    with pytest.raises(ValueError):
        t.submit("read", peer.endpoint, [(base, peer.addr, 0)])
    with pytest.raises(ValueError):
        t.submit("copy", peer.endpoint, [(base, peer.addr, 1)])
    with pytest.raises(RegionError):
        t.register(base + 10, 10)  # overlaps the registered buffer


def test_dead_peer_fails_fast(kind, local):
    t, buf = local
    p = _start(kind, seed=5, nbytes=1 << 20)
    base = ctypes.addressof(buf)
    t.wait(t.submit("read", p.endpoint, [(base, p.addr, 4096)]), timeout_s=10)
    p.kill()
    t0 = time.monotonic()
    h = t.submit("read", p.endpoint, [(base, p.addr, 4096)] * 1)
    with pytest.raises((TransferFailed, TransferTimeout), match=f"peer {p.endpoint}"):
        t.wait(h, timeout_s=8)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("hkind", ["host_staged", "mooncake"])
def test_hanging_peer_times_out(hkind):
    """A peer that accepts connections and never answers: our deadline, not a hang."""
    if hkind == "mooncake" and not _mooncake_available():
        pytest.skip("mooncake not installed")
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        ls.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(ls.accept()[0])

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    t = make_transport(hkind, **_options(hkind))
    buf = ctypes.create_string_buffer(4096)
    t.register(ctypes.addressof(buf), 4096)
    try:
        peer = f"127.0.0.1:{ls.getsockname()[1]}"
        t0 = time.monotonic()
        h = t.submit("read", peer, [(ctypes.addressof(buf), 0x10000, 4096)])
        # the hanging peer would block a synchronous submit ~60 s; 2 s leaves room for a loaded CI box
        assert time.monotonic() - t0 < 2.0, "submit must not block on the peer"
        assert t.poll(h) is TransferState.PENDING
        with pytest.raises(TransferTimeout, match=r"1 entries .* peer 127\.0\.0\.1"):
            t.wait(h, timeout_s=1.5)
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        th.join()
        t.close()
        for c in held:
            c.close()
        ls.close()
