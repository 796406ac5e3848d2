"""``hawk proxy`` against fake upstream servers (no vLLM): the request flow, round robin,
streaming pass-through, error statuses, health."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from vllm_hawk.proxy.decide import Policy  # noqa: E402
from vllm_hawk.proxy.server import Proxy, prefill_body, serve  # noqa: E402

PD_ONLY = Policy(max_local_tokens=0, min_cached=0)  # every request through the prefill (decode-first off)


class Fake:
    """One fake vLLM server; records the bodies it got."""

    def __init__(self, name: str, *, status: int = 200, params: bool = True) -> None:
        self.name, self.status, self.params = name, status, params
        self.bodies: list[dict] = []
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=self.status)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for t in ("a", "b", "c"):
                await resp.write(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        out = {"choices": [{"text": self.name}]}
        if self.params:
            out["kv_transfer_params"] = {"remote_engine_id": self.name, "remote_block_ids": [1]}
        return web.json_response(out)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


async def _start_fake(fake: Fake) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_post("/v1/chat/completions", fake.completions)
    app.router.add_get("/health", fake.health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return runner


async def _with_proxy(prefill: list[Fake], decode: list[Fake], fn, extra_prefill=(), extra_decode=()):
    runners = [await _start_fake(f) for f in prefill + decode]
    proxy = Proxy(
        [f.url for f in prefill] + list(extra_prefill), [f.url for f in decode] + list(extra_decode), policy=PD_ONLY
    )
    prunner = await serve(proxy, "127.0.0.1", 0)  # port 0: the kernel picks, we read it back
    port = prunner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as s:
            return await fn(s, f"http://127.0.0.1:{port}")
    finally:
        await prunner.cleanup()
        for r in runners:
            await r.cleanup()


def test_prefill_body_asks_for_one_token_and_keeps_kv():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"a": 1}, "max_completion_tokens": 50}
    out = prefill_body(body, "/v1/completions")
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50  # the original is untouched


def test_flow_round_robin_and_streaming():
    p1, p2, d1, d2 = Fake("p1"), Fake("p2"), Fake("d1"), Fake("d2")

    async def fn(s, url):
        texts = []
        for _ in range(4):
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 5}) as r:
                assert r.status == 200
                texts.append((await r.json())["choices"][0]["text"])
                assert r.headers["x-hawk-prefill"] in (p1.url, p2.url)
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "messages": [], "stream": True}) as r:
            assert r.status == 200
            raw = (await r.read()).decode()
        return texts, raw

    texts, raw = asyncio.run(_with_proxy([p1, p2], [d1, d2], fn))
    assert texts == ["d1", "d2", "d1", "d2"]
    assert len(p1.bodies) + len(p2.bodies) == 5 and len(p1.bodies) >= 2
    for b in p1.bodies + p2.bodies:
        assert b["max_tokens"] == 1 and b["stream"] is False
    d_body = d1.bodies[0]
    assert d_body["max_tokens"] == 5 and d_body["kv_transfer_params"]["remote_engine_id"] in ("p1", "p2")
    assert raw.count("data: ") == 4 and raw.rstrip().endswith("[DONE]")


def test_metrics_time_each_phase_of_a_streamed_request():
    async def fn(s, url):
        for _ in range(2):
            async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                await r.read()
        async with s.get(url + "/metrics") as r:
            return r.status, await r.text()

    status, text = asyncio.run(_with_proxy([Fake("p")], [Fake("d")], fn))
    assert status == 200
    for name in ("hawk_proxy_prefill_seconds", "hawk_proxy_decode_first_chunk_seconds", "hawk_proxy_ttft_seconds"):
        assert f"{name}_count 2.0" in text, name
    assert 'hawk_proxy_requests_total{outcome="ok"} 2.0' in text


def test_upstream_errors_keep_their_status():
    bad = Fake("p", status=400)

    async def fn(s, url):
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            return r.status, await r.text()

    status, text = asyncio.run(_with_proxy([bad], [Fake("d")], fn))
    assert status == 400 and "p says no" in text

    status, text = asyncio.run(_with_proxy([Fake("p")], [Fake("d", status=500)], fn))
    assert status == 500 and "d says no" in text

    status, text = asyncio.run(_with_proxy([Fake("p", params=False)], [Fake("d")], fn))
    assert status == 502 and "kv_transfer_params" in text


def test_unreachable_upstream_is_502_naming_it_and_deep_health_is_503():
    from vllm_hawk.bench.local_cluster import free_port

    dead = f"http://127.0.0.1:{free_port()}"

    async def fn(s, url):
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            first = (r.status, await r.text())
        async with s.get(url + "/health") as r:
            shallow = r.status
        async with s.get(url + "/health?deep=1") as r:
            deep = (r.status, await r.json())
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            bad_json = r.status
        return first, shallow, deep, bad_json

    (status, text), shallow, (dstatus, dbody), bad_json = asyncio.run(
        _with_proxy([], [Fake("d")], fn, extra_prefill=[dead])
    )
    assert status == 502 and dead in text
    assert shallow == 200
    assert dstatus == 503 and dbody["unhealthy"] == [dead]
    assert bad_json == 400


def test_cli_parses_several_urls():
    from vllm_hawk.proxy import parse_args

    a = parse_args(
        ["--prefill", "http://a", "http://b", "--decode", "http://c", "--decode", "http://d", "--port", "9000"]
    )
    assert a.prefill == ["http://a", "http://b"] and a.decode == ["http://c", "http://d"]
    assert a.port == 9000
