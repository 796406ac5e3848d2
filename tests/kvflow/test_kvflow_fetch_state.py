"""The decode's per-fetch state (kvflow.decode._Fetch): where its read deadline and the
claim wait come from. No transport or prefill involved."""

from __future__ import annotations

import time

import numpy as np

from vllm_hawk.kvflow.decode import LEASE_MARGIN_S, WHOLE, FetchResult, _Fetch
from vllm_hawk.protocol import KVReady


def _state(timeout: float) -> _Fetch:
    t0 = time.monotonic()
    fs = _Fetch("r", 32, None, np.arange(2), 0, WHOLE, timeout, t0, t0 + timeout, True, None)
    fs.res = FetchResult("r", "staged")
    return fs


def test_new_fetch_reads_until_its_own_deadline():
    fs = _state(5.0)
    assert fs.t_ready == fs.t0 and fs.read_deadline == fs.deadline and fs.note == ""
    assert fs.ready is None and fs.landing is None and fs.futs == [] and fs.handles == []


def test_first_ready_without_lease_keeps_the_fetch_deadline():
    fs = _state(5.0)
    ready = KVReady(req_id="r", ring_offset=0, total_nbytes=0, segments=[])
    fs.first_ready(ready)
    assert fs.ready is ready and fs.t_ready >= fs.t0
    assert fs.res.request_s == fs.t_ready - fs.t0
    assert fs.read_deadline == fs.deadline and fs.note == ""


def test_first_ready_caps_the_read_deadline_by_a_short_lease():
    fs = _state(60.0)
    fs.first_ready(KVReady(req_id="r", ring_offset=0, total_nbytes=0, segments=[], lease_ms=8000))
    assert fs.read_deadline == fs.t_ready + 8.0 - LEASE_MARGIN_S
    assert "lease of 8000 ms" in fs.note


def test_claim_wait_is_bounded_by_the_read_deadline():
    fs = _state(60.0)
    assert fs.claim_wait(5.0) == 5.0
    fs.read_deadline = time.monotonic() + 0.5
    assert 0.0 < fs.claim_wait(5.0) <= 0.5
    fs.read_deadline = time.monotonic() - 1.0
    assert fs.claim_wait(5.0) == 0.0
