"""The connector holds at overload: prefill vLLM + decode vLLM (staged mode, a
2 MiB prefill ring, a decode receive ring that never runs out, an 8 s lease renewed by
the decode's heartbeat, a 120 s hand-over hold) + ``hawk proxy``, one module-scoped trio.

* A request the decode refuses has its prefill blocks released within a second, not at
  the hand-over hold's end: by the proxy when the decode's API server refused it (its
  engine never saw it), by the decode's connector when its engine did.
* Three times the pair's capacity (measured first, closed loop; more if the queue does
  not build) for a bounded time: no request fails under
  ``kv_load_failure_policy: recompute``, the proxy drops no client, no transfer fails and no
  lease expires (so none was recomputed either), requests waited in the decode's queue
  far longer than the lease, and afterwards nothing is held: the prefill holds no
  request and no ring range, the decode has no pull in flight and renews nothing, and
  vLLM's KV usage is 0 on both sides.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import resource
import time

import pytest
from vllm_fixtures import RequestNotSent, connector_states, kv_usage, running, wait_idle
from vllm_fixtures import http_post_json as _post

pytestmark = pytest.mark.vllm

LEASE_S = 8.0  # queue waits at 3x capacity outlast it several times
# the hand-over (prefill done -> the decode engine sees the request, through the proxy and a busy
# API server) took more than 8 s for 83 of 983 requests at this load; the prefill holds a request
# that long by itself, with no renewal from the proxy
HANDOVER_S = 120.0
OVERLOAD = 3.0  # x the measured capacity
LOAD_S = 24.0  # seconds of arrivals at OVERLOAD x capacity, at least (see the load test)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    work = tmp_path_factory.mktemp("overload")
    dump = work / "hawk-debug"  # state-<role>-<pid>.json: the workers' snapshots
    c = LocalCluster(
        build_tiny_llama(dtype="float32"),
        work,
        block_size=32,
        max_model_len=1024,
        max_num_seqs=8,
        decode_policy="recompute",
        extra_config={
            "mode": "staged",
            "ring_nbytes": 2 << 20,
            "claim_wait_s": 0.1,
            "lease_s": LEASE_S,
            "handover_s": HANDOVER_S,
            "renew_interval_s": 0.5,
            "pull_timeout_s": 30.0,
            "handshake_timeout_s": 3.0,
        },
        # the 2 MiB ring under test is the prefill's: the decode's receive ring holds its
        # max_pulls (2) pulls of the longest prompt (1024 tokens x 4 KiB) with room to spare,
        # so a pull never fails for want of receive memory (0.1 s claim wait on a busy CPU)
        decode_config={"ring_nbytes": 16 << 20},
        extra_env={"HAWK_DEBUG_DIR": str(dump)},
    )
    c.hawk_dump = dump
    with running(c):
        yield c


def _prompt(rng: random.Random) -> list[int]:
    return [0] + [rng.randrange(2, 1024) for _ in range(rng.randrange(64, 300))]


def _one(url: str, prompt: list[int]) -> dict:
    """One completion; a request whose connection the proxy closed before sending it is
    sent once more, as HTTP clients do (``resent``): it never reached the pipeline."""
    t0 = time.monotonic()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        status, out = _post(url + "/v1/completions", body, timeout=300.0)
        resent = False
    except RequestNotSent:
        resent = True
        try:
            status, out = _post(url + "/v1/completions", body, timeout=300.0)
        except RequestNotSent as e:
            status, out = 0, str(e)
    ok = status == 200 and out["usage"]["completion_tokens"] == MAX_TOKENS
    return {
        "ok": ok,
        "status": status,
        "s": time.monotonic() - t0,
        "err": "" if ok else str(out)[:300],
        "resent": resent,
    }


@pytest.fixture()
def client_threads():
    """Requests in flight the client may hold: each costs the proxy about 3 fds (client,
    prefill, decode), and the proxy drops clients beyond its fd bound (hawk_proxy_clients_evicted);
    the test process's soft fd limit is raised to its hard one for the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = hard if hard != resource.RLIM_INFINITY else 1 << 20
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield max(64, min(4096, (top - 400) // 3))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


REFUSALS = {
    # refused by the decode's API server (the prefill's copy has no stream_options): only
    # the proxy knows, and releases
    "api-server": {"max_tokens": 4, "stream_options": {"include_usage": True}},
    # refused by the decode's engine (beyond its context): its connector releases
    "engine": {"max_tokens": 100_000},
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_request_refused_by_the_decode_frees_its_prefill_blocks_at_once(cluster, refusal):
    before = wait_idle(cluster, cluster.hawk_dump)["prefill"]
    body = {"model": "tiny", "prompt": [0] + list(range(5, 300)), **REFUSALS[refusal]}
    status, out = _post(cluster.proxy_url + "/v1/completions", body)
    t_refused = time.monotonic()
    assert status == 400, out
    deadline = t_refused + 1.0
    while True:  # released by the proxy or the decode, not by the hand-over hold (120 s)
        if kv_usage(cluster.prefill_url) == 0.0:
            break
        assert time.monotonic() < deadline, "prefill blocks still held 1 s after the decode refused the request"
        time.sleep(0.05)
    freed_s = time.monotonic() - t_refused
    deadline = time.monotonic() + 3.0  # the state file is rewritten every 0.5 s
    while True:
        p = connector_states(cluster.hawk_dump)["prefill"]["prefill"]
        if p["released"] == before["released"] + 1 and p["held"] == 0:
            break
        assert time.monotonic() < deadline, (before, p)
        time.sleep(0.1)
    assert p["expired"] == before["expired"], (before, p)  # released, not expired
    print(f"prefill blocks of the refused request freed {freed_s * 1e3:.0f} ms after the refusal")


def test_three_times_capacity_fails_nothing_and_leaks_nothing(cluster, client_threads, record_property):
    from vllm_hawk.bench.local_cluster import scrape_metrics

    rng = random.Random(13)
    url = cluster.proxy_url
    wait_idle(cluster, cluster.hawk_dump)
    # capacity: a closed loop of 8 clients (max_num_seqs) for a few seconds; it also warms the
    # pair up (the side-channel handshake, which on a loaded 2-CPU machine may take longer
    # than this test's 2 s lease: those first pulls are recomputed and not counted below)
    with cf.ThreadPoolExecutor(8) as pool:
        t0 = time.monotonic()
        futs = [
            pool.submit(lambda: [_one(url, _prompt(random.Random(i * 1000 + k))) for k in range(3)]) for i in range(8)
        ]
        warm = [r for f in futs for r in f.result()]
        capacity = len(warm) / (time.monotonic() - t0)  # requests / s
    assert all(r["ok"] for r in warm), [r for r in warm if not r["ok"]][:3]
    time.sleep(1.0)  # the state file is rewritten every 0.5 s
    failed0 = scrape_metrics(cluster.decode_url).get("vllm:hawk_failed_transfers_total", 0.0)
    expired0 = connector_states(cluster.hawk_dump)["prefill"]["prefill"]["expired"]
    rate0 = rate = OVERLOAD * capacity
    # Poisson arrivals for LOAD_S, and on (up to 3 x LOAD_S) until some request has waited
    # 1.5 leases. How long the queue must grow depends on how well `capacity` was measured;
    # a closed loop of 8 underrates a pair that batches more under an open load, so past
    # LOAD_S the rate grows 1.5x per lease until the queue holds requests that long.
    t_start, at, futs, ramp_at = time.monotonic(), 0.0, [], LOAD_S
    with cf.ThreadPoolExecutor(client_threads) as pool:  # a thread per request in flight
        while at < 3 * LOAD_S:
            time.sleep(max(0.0, t_start + at - time.monotonic()))
            futs.append((time.monotonic(), pool.submit(_one, url, _prompt(rng))))
            at += rng.expovariate(rate)
            if at >= LOAD_S:
                if any(time.monotonic() - t0 > 1.5 * LEASE_S for t0, f in futs if not f.done()):
                    break
                if at >= ramp_at:
                    rate, ramp_at = rate * 1.5, ramp_at + LEASE_S
        res = [f.result() for _t0, f in futs]
    n = len(res)
    took = time.monotonic() - t_start
    lat = sorted(r["s"] for r in res)
    s = wait_idle(cluster, cluster.hawk_dump, 30.0)
    failed = [r for r in res if not r["ok"]]
    resent = sum(r["resent"] for r in res)
    evicted = scrape_metrics(url).get("hawk_proxy_clients_evicted_total", 0.0)
    summary = {
        "capacity_rps": round(capacity, 2),
        "offered_rps": round(rate0, 2),
        "last_rps": round(rate, 2),
        "requests": n,
        "seconds": round(took, 1),
        "failed": len(failed),
        "resent": resent,
        "proxy_evicted": evicted,
        "p50_s": round(lat[len(lat) // 2], 2),
        "max_s": round(lat[-1], 2),
        "renewed": s["prefill"]["renewed"],
        "heartbeats": s["decode"].get("heartbeats"),
        "backpressured": s["decode"].get("backpressured"),
    }
    print(f"overload: {summary}")
    record_property("overload", summary)
    assert not failed, failed[:3]
    assert evicted == 0, summary  # the client stays below the proxy's fd bound (_client_threads)
    assert resent <= n // 20, summary  # a connection closed before its request: rare, not the rule
    # the longest requests waited in the decode's queue many leases long, and still pulled their KV
    assert lat[-1] > 1.5 * LEASE_S, summary
    assert s["prefill"]["expired"] == expired0, s  # no lease ran out: the heartbeat renewed them
    assert s["prefill"]["renewed"] > 0, s
    assert scrape_metrics(cluster.decode_url).get("vllm:hawk_failed_transfers_total", 0.0) == failed0  # none recomputed
