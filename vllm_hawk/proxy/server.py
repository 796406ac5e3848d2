"""Disaggregation proxy: OpenAI-compatible front for prefill and decode vLLM servers.

For each ``/v1/completions`` or ``/v1/chat/completions`` request:

1. pick a prefill server (round robin) and send it the request with ``max_tokens = 1``,
   no streaming, and ``kv_transfer_params = {"do_remote_decode": true}``; its answer
   carries the ``kv_transfer_params`` that locate the KV (engine, blocks, side channel);
2. pick a decode server (round robin) and send it the ORIGINAL request plus those
   ``kv_transfer_params``; stream (or return) its answer to the client unchanged.

Upstream errors keep their HTTP status and body; an unreachable upstream is 502 (the
message names the server). A client that disconnects cancels the handler, which closes
the upstream connection, and vLLM aborts the request there (its blocks are freed).
Headers ``x-hawk-prefill``, ``x-hawk-decode`` and ``x-hawk-prefill-ms`` tell which
servers served a request and how long the prefill step took.

Other routes: ``GET /health`` (200 while the proxy runs; ``?deep=1`` also asks every
upstream's ``/health`` and answers 503 naming the ones that fail), ``GET /v1/models``
(from a decode server).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Pool:
    """Round-robin over upstream base URLs (``http://host:port``)."""

    urls: list[str]
    _next: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("need at least one upstream URL")
        self.urls = [u.rstrip("/") for u in self.urls]

    def pick(self) -> str:
        return self.urls[next(self._next) % len(self.urls)]


def _error(status: int, message: str, kind: str = "BadGateway") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


def prefill_body(body: dict, path: str) -> dict:
    """The request the prefill server gets: one token, no streaming, KV kept for decode."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], *, timeout_s: float = 600.0) -> None:
        self.prefill = Pool(list(prefill))
        self.decode = Pool(list(decode))
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)
        self.session: aiohttp.ClientSession | None = None
        self.served = 0

    # ---------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in GENERATE_ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout,
                                             connector=aiohttp.TCPConnector(limit=0))

    async def _stop(self, _app) -> None:
        if self.session is not None:
            await self.session.close()

    @staticmethod
    def _headers(request: web.Request, rid: str) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": rid}
        if "Authorization" in request.headers:
            h["Authorization"] = request.headers["Authorization"]
        return h

    # ---------------------------------------------------------------- routes
    async def health(self, request: web.Request) -> web.Response:
        out = {"status": "ok", "prefill": self.prefill.urls, "decode": self.decode.urls}
        if request.query.get("deep") in ("1", "true", "yes"):
            urls = self.prefill.urls + self.decode.urls
            results = await asyncio.gather(*(self._ping(u) for u in urls))
            bad = [u for u, ok in zip(urls, results) if not ok]
            if bad:
                out.update(status="degraded", unhealthy=bad)
                return web.json_response(out, status=503)
        return web.json_response(out)

    async def _ping(self, url: str) -> bool:
        try:
            async with self.session.get(url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def models(self, request: web.Request) -> web.StreamResponse:
        url = self.decode.pick()
        try:
            async with self.session.get(url + "/v1/models") as r:
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode server {url} unreachable: {e}")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not JSON", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "BadRequestError")
        path = request.path
        rid = request.headers.get("X-Request-Id") or f"hawk-{uuid.uuid4().hex}"
        headers = self._headers(request, rid)

        # 1. prefill
        p_url = self.prefill.pick()
        t0 = time.perf_counter()
        try:
            async with self.session.post(p_url + path, json=prefill_body(body, path),
                                         headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    return web.Response(status=r.status, body=raw, content_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"prefill server {p_url} unreachable: {e!s}")
        prefill_ms = (time.perf_counter() - t0) * 1e3
        try:
            params = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return _error(502, f"prefill server {p_url} returned no kv_transfer_params "
                               "(is it a vLLM with HawkConnector as kv_producer?)")

        # 2. decode
        d_body = dict(body)
        d_body["kv_transfer_params"] = params
        d_url = self.decode.pick()
        info = {"x-hawk-prefill": p_url, "x-hawk-decode": d_url,
                "x-hawk-prefill-ms": f"{prefill_ms:.2f}"}
        try:
            async with self.session.post(d_url + path, json=d_body, headers=headers) as r:
                if r.status != 200 or not body.get("stream"):
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type=r.content_type, headers=info)
                resp = web.StreamResponse(status=200, headers={
                    **info, "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache"})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                self.served += 1
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode server {d_url} failed: {e!s}")


async def serve(proxy: Proxy, host: str, port: int) -> web.AppRunner:
    """Start the proxy in the running loop; returns the runner (``await runner.cleanup()``)."""
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
