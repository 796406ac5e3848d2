"""A Tenstorrent sink reports a receive finished only after the device's DRAM write barrier:
after the NIC's writes (direct) and after the intra-bank copies (staged), before the fetch
returns (what the connector then reports in ``finished_recving``). The emulated device is
the device; its calls are recorded in order."""

from __future__ import annotations

import numpy as np
import pytest
from kvflow_helpers import BS, COMPAT, D, H, L, assert_pool_holds

from vllm_hawk.bench.endpoints import TTDecode, prefill_endpoint
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.transport import make_transport


class RecordingDevice(EmulatedDevice):
    """The emulated p150a, recording the calls that move bytes into DRAM and the barrier."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: list[str] = []

    def dma_written(self, bank, offset, nbytes) -> int:
        self.calls.append("dma_written")
        return super().dma_written(bank, offset, nbytes)

    def copy_in_banks(self, ops) -> int:
        self.calls.append("copy_in_banks")
        return super().copy_in_banks(ops)

    def dram_write_barrier(self) -> None:
        self.calls.append("barrier")
        super().dram_write_barrier()


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_barrier_after_the_last_write_before_the_fetch_returns(mode):
    cache = PagedKVCache(L, 16, H, BS, D).fill_random(7)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, tp, COMPAT, ring_nbytes=1 << 20, claim_wait_s=0.2)
    dev = RecordingDevice("p150a", 8 << 20)
    dec = TTDecode(
        dev, TTKVCacheSpec(L, 16, H, BS, D, "bfloat16"), td, pre.endpoint, COMPAT, recv_nbytes_per_bank=128 << 10
    )
    try:
        src, dst, n = np.array([3, 5]), np.array([9, 2]), 2 * BS - 3
        pre.add_request("r", src, n)
        dev.calls.clear()
        dec.fetch("r", n, dst, mode)
        moved = "copy_in_banks" if mode == "staged" else "dma_written"
        assert moved in dev.calls and dev.calls[-1] == "barrier", dev.calls
        assert_pool_holds(dec, cache, src, n, dst)
    finally:
        dec.close()
        pre.close()
        tp.close()
        td.close()
