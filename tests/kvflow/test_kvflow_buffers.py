"""The prefill ring and the decode's per-bank receive pool: bounded, never overwrite,
backpressure with a deadline, release in any order, back to fully free."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hawk.kvflow import BankBufferPool, BufferFull, RingAllocator, RingBuffer, RingClosed
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.transport import make_transport


def _overlaps(ranges):
    s = sorted(ranges)
    return any(a1 > b0 for (_a0, a1), (b0, _b1) in zip(s, s[1:], strict=False))


@given(
    st.lists(st.tuples(st.integers(1, 3000), st.booleans()), min_size=1, max_size=80), st.randoms(use_true_random=False)
)
def test_ring_never_hands_out_overlapping_ranges(ops, rnd):
    ring = RingAllocator(16 * 1024, align=256)
    live: dict[str, tuple[int, int]] = {}
    for i, (n, release_one) in enumerate(ops):
        if release_one and live:
            k = rnd.choice(sorted(live))
            ring.release(k)
            del live[k]
        try:
            off = ring.reserve(f"r{i}", n)
        except BufferFull:
            assert live, "an empty ring refused a range that fits"
            continue
        assert off % 256 == 0 and off + n <= ring.capacity
        live[f"r{i}"] = (off, off + n)
        assert not _overlaps(list(live.values()))
        assert ring.live().keys() == live.keys()
    for k in list(live):
        ring.release(k)
    assert ring.is_empty() and ring.used_bytes() == 0 and ring.free_bytes() == ring.capacity


def test_ring_wraps_and_reuses_space_in_order():
    u = 128
    ring = RingAllocator(10 * u, align=u)
    assert [ring.reserve(k, 3 * u) for k in "abc"] == [0, 3 * u, 6 * u]
    ring.release("b")  # out of order: space behind "a" is not reusable yet
    with pytest.raises(BufferFull, match="ring full"):
        ring.reserve("d", 2 * u)
    ring.release("a")  # tail moves past a and b
    assert ring.reserve("d", 5 * u) == 0  # does not fit at the end (1 unit left): wraps to 0
    with pytest.raises(BufferFull):
        ring.reserve("e", 2 * u)  # [5u, 6u) is only one unit
    ring.release("c")
    assert ring.reserve("e", 4 * u) == 5 * u
    ring.release("d")
    ring.release("e")
    assert ring.is_empty()


def test_ring_backpressure_waits_then_refuses_and_rejects_oversize():
    ring = RingAllocator(1 << 20)
    ring.reserve("a", 1 << 20)
    t0 = time.monotonic()
    with pytest.raises(BufferFull, match="after waiting 0.200 s"):
        ring.reserve("b", 4096, timeout_s=0.2)
    assert 0.19 < time.monotonic() - t0 < 2.0
    threading.Timer(0.1, ring.release, args=("a",)).start()
    assert ring.reserve("b", 4096, timeout_s=5.0) == 0  # woken by the release
    with pytest.raises(BufferFull, match="more than the whole"):
        ring.reserve("huge", (1 << 20) + 1, timeout_s=5.0)  # refused at once, no wait
    with pytest.raises(ValueError, match="already holds"):
        ring.reserve("b", 10)
    with pytest.raises(KeyError):
        ring.release("nope")


def test_ring_buffer_registers_only_live_ranges():
    t = make_transport("inprocess")
    ring = RingBuffer(1 << 20, t)
    assert t._regions.regions() == []  # nothing exposed while idle
    a = ring.reserve("a", 5000)
    b = ring.reserve("b", 100)
    assert t._regions.regions() == [(ring.base_addr + a, 5000), (ring.base_addr + b, 100)]
    ring.release("a")
    assert t._regions.regions() == [(ring.base_addr + b, 100)]
    with pytest.raises(ValueError, match="outside"):
        ring.view(ring.capacity - 10, 20)
    ring.close()
    assert t._regions.regions() == []
    whole = RingBuffer(1 << 20, t, registration="whole")  # the previous behaviour, for the benchmark
    assert t._regions.regions() == [(whole.base_addr, whole.capacity)]
    whole.close()
    assert t._regions.regions() == []
    t.close()


def test_bank_pool_lockstep_slices_backpressure_and_cleanup():
    dev = EmulatedDevice("p150a", 4 << 20)
    t = make_transport("inprocess")
    pool = BankBufferPool(dev, 64 << 10, t)
    assert len(t._regions) == 0  # nothing registered while no slice is handed out
    a = pool.acquire("a", 40 << 10)
    assert sorted(t._regions.regions()) == sorted((a.addr(b), 40 << 10) for b in range(dev.num_banks))
    assert a.device_offset == pool.buffer.address + a.offset
    assert [a.addr(b) - dev.bank_address(b) for b in range(dev.num_banks)] == [a.device_offset] * dev.num_banks
    with pytest.raises(BufferFull, match="pool full"):
        pool.acquire("b", 40 << 10, timeout_s=0.05)
    with pytest.raises(BufferFull, match="raise the receive-buffer size"):
        pool.acquire("c", 65 << 10, timeout_s=5)
    threading.Timer(0.05, pool.release, args=("a",)).start()
    b = pool.acquire("b", 40 << 10, timeout_s=5.0)
    assert b.offset == 0
    pool.release("b")
    assert pool.is_idle()
    pool.close()
    assert len(t._regions) == 0 and dev.live_buffers() == []
    t.close()


def test_bank_pool_concurrent_users_never_share_bytes():
    dev = EmulatedDevice("p150a", 4 << 20)
    pool = BankBufferPool(dev, 32 << 10)
    held: dict[str, tuple[int, int]] = {}
    lock = threading.Lock()
    errors = []

    def user(i):
        rnd = random.Random(i)
        for j in range(30):
            k = f"{i}-{j}"
            n = rnd.randint(1, 12 << 10)
            s = pool.acquire(k, n, timeout_s=5.0)
            with lock:
                if _overlaps(list(held.values()) + [(s.offset, s.offset + n)]):
                    errors.append(k)
                held[k] = (s.offset, s.offset + n)
            time.sleep(rnd.random() * 1e-3)
            with lock:
                del held[k]
            pool.release(k)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and pool.is_idle()
    pool.close()


def test_ring_abort_wakes_waiters_and_refuses_new_reservations():
    ring = RingAllocator(1 << 20)
    ring.reserve("a", 1 << 20)
    got = []

    def waiter():
        try:
            ring.reserve("b", 4096, timeout_s=60.0)
        except Exception as e:  # noqa: BLE001
            got.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    ring.abort()
    th.join(timeout=10.0)
    assert not th.is_alive() and len(got) == 1 and isinstance(got[0], RingClosed)
    with pytest.raises(RingClosed):
        ring.reserve("c", 10)
    ring.release("a")  # live ranges can still be released
    assert ring.is_empty()


def test_exposure_refcounts_overlapping_requests_and_coarsens_within_domains():
    import torch

    from vllm_hawk.kvflow.exposure import Exposure, coarsened

    t = make_transport("inprocess")
    mem = torch.empty(1 << 20, dtype=torch.uint8)
    base = mem.data_ptr()
    ex = Exposure(t)
    ex.acquire("a", [(base, 4096), (base + 8192, 4096)])
    ex.acquire("b", [(base + 4096, 8192)])  # overlaps a's second run: reuses it, registers the gap only
    assert t._regions.regions() == [(base, 4096), (base + 4096, 4096), (base + 8192, 4096)]
    ex.release("a")
    assert t._regions.regions() == [(base + 4096, 4096), (base + 8192, 4096)]  # b still holds these
    ex.release("b")
    assert t._regions.regions() == []
    # more runs than max_ranges: the smallest gaps close, never across domains
    runs = [(base + i * 100, 10) for i in range(10)] + [(base + 5000, 10)]
    out = coarsened(runs, [(base, 1000), (base + 5000, 100)], 2)
    assert out == [(base, 910), (base + 5000, 10)]
    assert coarsened(runs, None, 2) == runs  # no domains: nothing is joined
    ex.acquire("c", runs, domains=[(base, 1000), (base + 5000, 100)], max_ranges=2)
    assert t._regions.regions() == out
    ex.close()
    assert t._regions.regions() == []
    t.close()
