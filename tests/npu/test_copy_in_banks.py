"""The emulated device's intra-bank copies across all banks at once (the staged mode's
D6-D7): the same bytes as bank-by-bank copies, on the thread pool for large copies and
inline for small ones; errors still reach the caller."""

import os

import numpy as np
import pytest

from vllm_hawk.npu.emulated import PARALLEL_COPY_MIN_NBYTES, EmulatedDevice


def _ops(dev, nbytes, runs):
    src = np.arange(runs, dtype=np.int64) * nbytes
    dst = src + runs * nbytes
    return [(b, src, dst, np.full(runs, nbytes, dtype=np.int64)) for b in range(dev.num_banks)]


@pytest.mark.parametrize("nbytes", [4 << 10, PARALLEL_COPY_MIN_NBYTES * 2])
def test_copy_in_banks_equals_bank_by_bank(nbytes):
    dev = EmulatedDevice("p150a", bank_size_bytes=8 << 20)
    try:
        rng = np.random.default_rng(0)
        runs = 8
        for b in dev.banks:
            b[: runs * nbytes] = rng.integers(0, 256, runs * nbytes, dtype=np.uint8)
        want = [b.copy() for b in dev.banks]
        for w in want:
            w[runs * nbytes : 2 * runs * nbytes] = w[: runs * nbytes]
        assert dev.copy_in_banks(_ops(dev, nbytes, runs)) == runs * dev.num_banks
        for b, w in zip(dev.banks, want, strict=False):
            assert np.array_equal(b, w)
        threaded = nbytes >= PARALLEL_COPY_MIN_NBYTES and (os.cpu_count() or 1) > 1
        assert (dev._copy_pool is not None) == threaded
    finally:
        dev.close()
    assert dev._copy_pool is None


def test_copy_in_banks_reports_a_bad_bank():
    dev = EmulatedDevice("p150a", bank_size_bytes=8 << 20)
    try:
        ops = _ops(dev, PARALLEL_COPY_MIN_NBYTES, 2)
        ops[3] = (dev.num_banks, *ops[3][1:])
        with pytest.raises(Exception, match=str(dev.num_banks)):
            dev.copy_in_banks(ops)
    finally:
        dev.close()
