"""The prefill side over a KV cache that host code cannot address: what a CUDA GPU's cache
is. Each scenario runs in its own process (:mod:`device_memory_proc`) on the opaque test
device (:mod:`opaque_device`: real bytes, a decoy behind every
pointer, asynchronous work until a stream synchronisation), serving real KVRequests.

Checked for the GN-HAWK transform (bf16, bfloat8_b, 16-token source blocks into a
64-token decode), the staged gather and blocks served in place:

* the ring (G' or the gathered streams) is on the cache's device and every byte equals
  what the same endpoint produces from the same cache in host memory;
* every registration names the device's location (``hawkdev:0``; ``cuda:0`` on a GPU);
  device memory is registered whole, once (``registration`` "auto"), for every request,
  and is gone after the endpoint closes (``per_request``: each request's, gone after its
  Release);
* no work queued on the device is outstanding when KVReady goes out;
* no host code wrote through a device pointer.

A transport that reaches host memory only gets a host ring (the gather copies device ->
host with torch). Two negative controls show that the checks catch the failures they
are for: the staged gather as a raw ``ctypes.memmove`` (what the prefill did before)
produces wrong bytes, and a KVReady without the synchronisation is seen as such.

Capture safety (vLLM captures CUDA graphs right after ``register_kv_caches``, with
``capture_error_mode="global"``: device work from any other host thread during the
capture invalidates it): the GN-HAWK prefill built as the connector builds it returns
with its warm-up finished and waited for, having queued nothing on the legacy default
stream; a capture held open while the endpoint idles (a KVRequest parked for its
hand-over included) sees no device call from any thread; serving then runs on the
prefill worker's own stream only, with non-blocking index uploads, and each KVReady goes
out after an event recorded behind the transform was waited for. The warm-up thread the
connector started before is caught invalidating a capture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


POSITIVE = [
    "hawk-bf16",
    "hawk-bfp8",
    "hawk-16-to-64",
    "staged",
    "in-place",
    "host-staged-ring",
    "host-pointer-copy",
    "once-hawk",
    "once-staged",
    "once-in-place",
    "per-request-staged",
]


def run_scenarios(*names: str) -> dict:
    """``{scenario: facts}`` from one process running ``names`` in order."""
    r = subprocess.run(
        [sys.executable, str(HERE / "device_memory_proc.py"), *names],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def facts() -> dict:
    return run_scenarios(*POSITIVE)


@pytest.mark.parametrize("name", ["hawk-bf16", "hawk-bfp8", "hawk-16-to-64", "staged"])
def test_ring_sources_produce_on_the_device(facts, name):
    f = facts[name]
    assert f["ring_device"] == "hawkdev:0"
    assert f["equal_to_host"], "the device ring's bytes differ from the host path's"
    assert f["checksums_equal_to_host"], "the checksums taken on the device differ from the host kernel's"
    assert f["registration"] == "whole"  # "auto" on a device: the ring, once
    assert len(f["registered_live"]) == 1 and f["registered_live"][0][2] == "hawkdev:0"
    assert f["registered_after_close"] == 0
    assert not f["busy_at_reply"], "KVReady went out with device work still queued"
    assert f["syncs"] >= 1 and f["decoys_untouched"]


def test_blocks_served_in_place_are_registered_as_device_memory(facts):
    f = facts["in-place"]
    assert "ring_device" not in f and f["equal_to_host"] and f["checksums_equal_to_host"]
    assert f["registration"] == "whole" and f["registered_live"]
    assert all(loc == "hawkdev:0" for _a, _n, loc in f["registered_live"])
    assert f["registered_after_close"] == 0 and not f["busy_at_reply"] and f["decoys_untouched"]


@pytest.mark.parametrize("name", ["once-hawk", "once-staged", "once-in-place"])
def test_device_memory_is_registered_once_for_every_request(facts, name):
    """Three requests, one registration of device memory per region (Mooncake registers a
    GPU range on every NIC, and its dma-buf route may keep an fd per registration)."""
    f = facts[name]
    regions = len(f["registered_live"])
    assert f["registration"] == "whole" and f["registrations"] == regions >= 1, f
    assert f["registered_after_release"] == regions and f["registered_after_close"] == 0


def test_per_request_registration_registers_each_request_and_frees_it(facts):
    f = facts["per-request-staged"]
    assert f["registration"] == "per_request" and f["registrations"] == 3
    assert len(f["registered_live"]) == 1 and f["registered_after_release"] == 0


def test_a_host_only_transport_gets_a_host_ring(facts):
    f = facts["host-staged-ring"]
    assert f["ring_device"] == "cpu" and f["equal_to_host"] and not f["busy_at_reply"]
    assert f["registration"] == "per_request"  # "auto" in host memory


def test_the_device_hides_its_bytes_from_host_pointers(facts):
    f = facts["host-pointer-copy"]
    assert f["read"] == [0xA5] * 4 and f["want"] == [0, 1, 2, 3] and f["numpy_refused"]


def test_a_raw_pointer_gather_is_caught():
    f = run_scenarios("negative-raw-pointer-gather")["negative-raw-pointer-gather"]
    assert not f["equal_to_host"]


def test_a_kvready_before_the_device_is_done_is_caught():
    f = run_scenarios("negative-no-sync")["negative-no-sync"]
    assert f["busy_at_reply"]


def test_start_up_survives_a_cuda_graph_capture():
    f = run_scenarios("startup-capture")["startup-capture"]
    # start-up (make_prefill, as register_kv_caches runs it): warm-up here, on its own stream, waited for
    assert f["startup_threads"] == ["MainThread"] and f["startup_ops"] > 0
    assert not f["startup_busy"] and f["startup_ends_with_device_sync"]
    assert f["startup_default_stream_work"] == [], "start-up queued work on the legacy default stream"
    assert "hawk-transform-warm" not in f["new_threads"]
    # the capture while the endpoint idles: nothing touches the device
    assert not f["capture_invalidated"], f["capture_offenders"]
    assert f["capture_calls"] == 0
    # serving: the worker alone, on its own non-default stream, KVReady after the event
    assert f["serving_threads"] == ["hawk-prefill_0"]
    streams = f["streams_per_thread"]["hawk-prefill_0"]
    assert len(streams) == 1 and streams[0] != 0
    assert f["uploads"] > 0 and f["uploads_blocking"] == 0
    assert set(f["replies"]) == {"r0", "r1"}
    for r in f["replies"].values():
        assert r["kvready"] and not r["busy_at_reply"]
        assert r["last_calls"] == ["event.record", "event.synchronize"] and r["stream_syncs"] == 0
    assert f["equal_to_host"] and f["decoys_untouched"]


def test_a_warm_up_thread_during_a_capture_is_caught():
    f = run_scenarios("negative-threaded-warm-during-capture")["negative-threaded-warm-during-capture"]
    assert f["capture_invalidated"] and f["offender_threads"] == ["hawk-transform-warm"]
