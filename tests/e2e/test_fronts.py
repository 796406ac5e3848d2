"""xPyD behind vLLM's router and ``hawk proxy``, and vLLM's own P/D cases through both
fronts, for GG-Direct and GN-HAWK (the decode on the emulated Tenstorrent platform).

One module-scoped cluster per configuration: two prefills (P0, P1), two decodes (D0,
D1), ``hawk proxy`` over P0 -> D0, and three ``vllm-router --vllm-pd-disaggregation``
instances (round robin): ``1p1d`` (P0 -> D0), ``2p1d`` (P0, P1 -> D0) and ``1p2d``
(P0 -> D0, D1). The router is vLLM's, unchanged: it sends the prefill the request with
``max_tokens`` 1 and ``kv_transfer_params {"do_remote_decode": true}``, then the decode the
original request with the prefill's ``kv_transfer_params``; it renews nothing and releases
nothing, so the prefill's hand-over hold is what keeps each request's KV until the decode
takes it up.

The reference for every output is the engine that computed the KV the decode uses, asked
directly with ``logprobs``: the prefill that served the request (found from the prefills'
request counters), or the decode itself where it had the prompt cached (primed directly).
Greedy tokens must be equal, except where the reference's top-2 logprob gap at the first
differing position is below the setup's tie margin (GG float32: ``GG_TIE_MARGIN``; GN bf16:
``GN_TIE_MARGIN``, see e2e_helpers); ties are printed. After each test nothing is held: no
request or ring range on any prefill, no pull, renewal or receive buffer on any decode, KV
usage 0 on every engine. GN-HAWK: every transferred block's bytes on the decode equal
``tilize_pack`` of the prefill's K/V.

vLLM's P/D cases (its NIXL integration tests check the same situations): a prompt shorter
than one block; a full prefix-cache hit on the decode only (the decode primed directly);
a partial hit; two long prompts with 30 greedy tokens at once; streaming equal to
non-streaming; chat.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from e2e_helpers import (
    BLOCK,
    GG_TIE_MARGIN,
    GN_TIE_MARGIN,
    chat,
    check_new_transfers,
    complete,
    greedy_divergence,
    stream_events,
    token_prompts,
)
from vllm_fixtures import running, wait_idle

from vllm_hawk.bench.local_cluster import scrape_metrics

pytestmark = pytest.mark.vllm

ROUTERS = {"1p1d": ((0,), (0,)), "2p1d": ((0, 1), (0,)), "1p2d": ((0,), (0, 1))}
SETUPS = {
    "GG-Direct": dict(dtype="float32", margin=GG_TIE_MARGIN),
    "GN-HAWK": dict(dtype="bfloat16", margin=GN_TIE_MARGIN),
}
FRONTS = ("proxy", "router")


@pytest.fixture(scope="module", params=list(SETUPS))
def pd(request, tmp_path_factory):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    pytest.importorskip("vllm_router")
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    setup = SETUPS[request.param]
    work = tmp_path_factory.mktemp(request.param)
    dump = work / "hawk-debug"
    c = LocalCluster.configured(
        request.param,
        build_tiny_llama(dtype=setup["dtype"]),
        work,
        dtype=setup["dtype"],
        block_size=BLOCK,
        max_model_len=1024,
        prefills=2,
        decodes=2,
        routers=ROUTERS,
        proxy_over=((0,), (0,)),
        extra_config={"pull_timeout_s": 20.0, "handshake_timeout_s": 3.0},
        extra_env={"HAWK_DEBUG_DIR": str(dump)},
    )
    c.hawk_name, c.hawk_dump, c.hawk_margin = request.param, dump, setup["margin"]
    c.hawk_cfg, c.hawk_checked = {"device": "p150a", "kv_dtype": "bfloat16"}, set()
    with running(c, request.param):
        yield c


@pytest.fixture
def idle_after(pd):
    """Nothing held anywhere once the test is done (and, GN-HAWK, every transfer's bytes exact)."""
    yield
    wait_idle(pd, pd.hawk_dump, timeout_s=60.0)
    if pd.hawk_name == "GN-HAWK":
        check_new_transfers(pd)


def _front(pd, front: str) -> str:
    return pd.proxy_url if front == "proxy" else pd.router_url("1p1d")


def _requests(url: str) -> float:
    return scrape_metrics(url).get("vllm:request_success_total", 0.0)


def _served_by(urls: list[str], send):
    """``send()``'s result and the index of the one server in ``urls`` whose finished
    request count went up by one (requests are sent one at a time; a server counts a
    request as its output handler finishes it, which may trail the response a little)."""
    before = [_requests(u) for u in urls]
    out = send()
    deadline = time.monotonic() + 10.0
    while True:
        moved = [_requests(u) - b for u, b in zip(urls, before, strict=True)]
        if sum(moved) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sorted(moved) == [0.0] * (len(urls) - 1) + [1.0], f"expected one of {urls} to serve it: {moved}"
    return out, moved.index(1.0)


def _check(pd, cases: list[tuple[str, dict, dict]]) -> None:
    """Each (label, P/D output, reference output): equal, or diverging at a tie only."""
    ties, mismatches = [], []
    for label, got, ref in cases:
        div = greedy_divergence(got["token_ids"], ref)
        if div is not None:
            (ties if div[1] < pd.hawk_margin else mismatches).append((label, *div))
    if ties:
        print(f"[{pd.hawk_name}] top-2 ties (case, position, gap): {ties}")
    assert not mismatches, f"outputs differ beyond ties (case, position, gap): {mismatches}"


# ---------------------------------------------------------------- xPyD behind the router
def test_two_prefills_one_decode_behind_the_router(pd, idle_after):
    url = pd.router_url("2p1d")
    cases, used = [], set()
    for p in token_prompts(31, (40, 100, 161, 257)):
        got, who = _served_by(pd.prefill_urls, lambda p=p: complete(url, p, max_tokens=12))
        used.add(who)
        assert got["kv_transfer_params"]["hawk_transfer"]["ok"]
        cases.append((f"{len(p)} tokens, P{who}", got, complete(pd.prefill_urls[who], p, max_tokens=12, logprobs=2)))
    assert used == {0, 1}, "round robin sends to both prefills"
    _check(pd, cases)


def test_one_prefill_two_decodes_behind_the_router(pd, idle_after):
    url = pd.router_url("1p2d")
    prompts = token_prompts(37, (40, 100, 161, 257))
    cases, used = [], set()
    for p in prompts:
        got, who = _served_by(pd.decode_urls, lambda p=p: complete(url, p, max_tokens=12))
        used.add(who)
        cases.append((f"{len(p)} tokens, D{who}", got, complete(pd.prefill_url, p, max_tokens=12, logprobs=2)))
    assert used == {0, 1}, "round robin sends to both decodes"
    _check(pd, cases)


def test_concurrent_requests_behind_both_routers(pd, idle_after):
    """Requests in flight at once through 2P1D and 1P2D: each output equals the engine's."""
    prompts = token_prompts(41, (33, 64, 65, 128, 200, 300))
    urls = [pd.router_url("2p1d"), pd.router_url("1p2d")]
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda ip: complete(urls[ip[0] % 2], ip[1], max_tokens=12), enumerate(prompts)))
    refs = [complete(pd.prefill_url, p, max_tokens=12, logprobs=2) for p in prompts]  # P0 and P1 agree exactly
    _check(pd, [(f"{len(p)} tokens", o, r) for p, o, r in zip(prompts, outs, refs, strict=True)])


# ---------------------------------------------------------------- vLLM's P/D cases
@pytest.mark.parametrize("front", FRONTS)
def test_prompt_shorter_than_one_block(pd, front, idle_after):
    """GG-Direct pulls the one partial block; a Tenstorrent decode (GN-HAWK) recomputes the
    prompt and releases the prefill's blocks (``idle_after``: nothing held)."""
    (p,) = token_prompts(43 + FRONTS.index(front), (5,))
    got = complete(_front(pd, front), p, max_tokens=12)
    fig = (got["kv_transfer_params"] or {}).get("hawk_transfer")
    assert (fig is None) if pd.hawk_name == "GN-HAWK" else fig["ok"], fig
    _check(pd, [("5 tokens", got, complete(pd.prefill_url, p, max_tokens=12, logprobs=2))])


def _hits(url: str) -> float:
    return scrape_metrics(url).get("vllm:prefix_cache_hits_total", 0.0)


@pytest.mark.parametrize("front", FRONTS)
def test_full_prefix_hit_on_the_decode_only(pd, front, idle_after):
    """The decode has the whole prompt cached (primed directly): GG-Direct pulls only the
    last, partial block; a Tenstorrent decode (GN-HAWK) recomputes it and pulls nothing. Its
    own KV is the reference."""
    (p,) = token_prompts(47 + FRONTS.index(front), (3 * BLOCK + 5,))
    ref = complete(pd.decode_url, p, max_tokens=12, logprobs=2)  # primes the decode's prefix cache
    hits = _hits(pd.decode_url)
    got = complete(_front(pd, front), p, max_tokens=12)
    assert _hits(pd.decode_url) - hits >= 3 * BLOCK  # every full block was a local hit
    fig = (got["kv_transfer_params"] or {}).get("hawk_transfer")
    assert (fig is None) if pd.hawk_name == "GN-HAWK" else fig["ok"], fig
    _check(pd, [("full decode hit", got, ref)])


@pytest.mark.parametrize("front", FRONTS)
def test_partial_prefix_hit_on_the_decode(pd, front, idle_after):
    """The decode has the first two blocks cached: it pulls the other three; the prefill
    computed most of the KV and is the reference."""
    (p,) = token_prompts(53 + FRONTS.index(front), (5 * BLOCK,))
    complete(pd.decode_url, p[: 2 * BLOCK], max_tokens=1)  # primes two blocks
    hits = _hits(pd.decode_url)
    got = complete(_front(pd, front), p, max_tokens=12)
    assert 2 * BLOCK <= _hits(pd.decode_url) - hits < 5 * BLOCK
    assert got["kv_transfer_params"]["hawk_transfer"]["ok"]
    _check(pd, [("partial decode hit", got, complete(pd.prefill_url, p, max_tokens=12, logprobs=2))])


@pytest.mark.parametrize("front", FRONTS)
def test_two_long_prompts_thirty_tokens(pd, front, idle_after):
    prompts = token_prompts(59 + FRONTS.index(front), (417, 700))
    url = _front(pd, front)
    with cf.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda p: complete(url, p, max_tokens=30), prompts))
    assert all(len(o["token_ids"]) == 30 for o in outs)
    refs = [complete(pd.prefill_url, p, max_tokens=30, logprobs=2) for p in prompts]
    _check(pd, [(f"{len(p)} tokens", o, r) for p, o, r in zip(prompts, outs, refs, strict=True)])


@pytest.mark.parametrize("front", FRONTS)
def test_streaming_equals_non_streaming(pd, front, idle_after):
    (p,) = token_prompts(61 + FRONTS.index(front), (90,))
    url = _front(pd, front)
    body = {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, events = stream_events(url + "/v1/completions", body)
    # One event may carry all 12 tokens: vLLM's API server merges the deltas it has not
    # sent yet (RequestOutputCollector), which a busy host makes likely.
    assert status == 200 and events and events[-1]["choices"][0]["finish_reason"] == "length", events[-1:]
    streamed = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    whole = complete(url, p, max_tokens=12)
    assert streamed == whole["text"]
    _check(pd, [("non-streaming", whole, complete(pd.prefill_url, p, max_tokens=12, logprobs=2))])


@pytest.mark.parametrize("front", FRONTS)
def test_chat(pd, front, idle_after):
    url = _front(pd, front)
    messages = [{"role": "user", "content": f"The {front} hands the decode the KV of this chat"}]
    got = chat(url, messages, max_tokens=10)
    ref = chat(pd.prefill_url, messages, max_tokens=10, logprobs=True)
    _check(pd, [("chat", got, ref)])
    status, events = stream_events(
        url + "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")) == got["text"]
