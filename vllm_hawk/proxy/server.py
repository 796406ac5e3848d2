"""Disaggregation proxy: OpenAI-compatible front for prefill and decode vLLM servers.

For each ``/v1/completions`` or ``/v1/chat/completions`` request:

0. choose the decode server and where the prompt is prefilled
   (:mod:`vllm_hawk.proxy.placement`, decode-first serving): a short prompt, or one whose
   prefix the decode holds, goes straight to the decode, which prefills it itself (the
   request as the client sent it, no ``kv_transfer_params``); the others go P/D:
1. pick a prefill server (round robin) and send it the request with ``max_tokens = 1``,
   no streaming, and ``kv_transfer_params = {"do_remote_decode": true}``; its answer
   carries the ``kv_transfer_params`` that locate the KV (engine, blocks, side channel);
2. send the decode server the ORIGINAL request plus those ``kv_transfer_params``; stream
   (or return) its answer to the client unchanged.

A request the decode refuses (an error status before any output: its API server
rejected it, so its engine never saw it) has its prefill blocks released at once by
the proxy (:mod:`vllm_hawk.proxy.release`; needs the shared secret the connectors use),
instead of at the end of the prefill's hand-over hold (``handover_s``). The hand-over
itself needs nothing from the proxy: the prefill holds the request until a decode
engine's heartbeat takes it up, as behind any other front (vLLM's router).

Upstream errors keep their HTTP status and body; an unreachable upstream is 502 (the
message names the server). A client that disconnects cancels the handler, which closes
the upstream connection, and vLLM aborts the request there (its blocks are freed).
Headers ``x-hawk-prefill`` (the prefill server, or ``local``: the decode prefilled),
``x-hawk-prefill-reason`` (why, as in ``hawk_proxy_prefills_total``), ``x-hawk-decode``
and ``x-hawk-prefill-ms`` (a remote prefill's step) tell who served a request.

Limits (:class:`Limits`, all aiohttp settings or asyncio timeouts around aiohttp calls):

* upstream: ``connect_s`` (TCP connect, aiohttp ``ClientTimeout.sock_connect``),
  ``first_byte_s`` (request sent -> response headers: the prefill's queue and compute, a
  streaming decode's headers, which vLLM sends before it schedules the request),
  ``generate_s`` (the same for a non-streaming decode, whose headers come after its last
  token), ``idle_s`` (between two chunks of an upstream body); no total cap, so a long
  but healthy stream is never cut. A stream that breaks, stalls past ``idle_s`` or ends
  without ``data: [DONE]`` ends with an SSE ``data: {"error": ...}`` event, never silently.
* clients: ``header_s`` (the request line and headers must arrive within it; aiohttp's
  ``keepalive_timeout``, which also covers a connection's first request), ``body_s`` (the
  whole request body must arrive within it, counted from the headers: an asyncio timeout
  around ``request.read()``; 408 and the connection closed beyond it), ``write_s``
  (a client must accept each chunk within it: one that stops reading is dropped and its
  upstream closed, so the decode aborts the request), ``max_body_nbytes`` (aiohttp
  ``client_max_size``: 413 beyond it), and JSON amplification: a body with more than
  ``max_json_tokens`` structural characters (``[ { , :``, counted on the bytes before
  parsing) is refused with 413 (a 50 MB body of empty lists once took 1.4 GiB to parse);
  too deep nesting is refused with 400. A client that disconnects cancels its handler
  (``handler_cancellation``), which closes the upstream connection.

Timings per request (prefill, decode first chunk, TTFT at the proxy) are Prometheus
histograms at ``GET /metrics`` (:mod:`vllm_hawk.proxy.metrics`).

Other routes: ``GET /health`` (200 while the proxy runs; ``?deep=1`` also asks every
upstream's ``/health`` and answers 503 naming the ones that fail), ``GET /v1/models``
(from a decode server).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, fields

import aiohttp
from aiohttp import web

from vllm_hawk.proxy.decide import Policy
from vllm_hawk.proxy.metrics import ProxyMetrics
from vllm_hawk.proxy.placement import Placed, Placement

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

    def next_index(self) -> int:
        return next(self._next) % len(self.urls)

    def pick(self) -> str:
        return self.urls[self.next_index()]


@dataclass(frozen=True)
class Limits:
    """Timeouts (seconds) and sizes of the proxy; see the module doc."""

    connect_s: float = 10.0
    first_byte_s: float = 60.0  # docs/configuration.md#proxy-timeouts: measured prefill x margin
    generate_s: float = 600.0  # a non-streaming decode's whole answer (its headers follow the last token)
    idle_s: float = 120.0
    header_s: float = 10.0
    body_s: float = 10.0  # docs/configuration.md#proxy-timeouts: 16 MiB at 13 Mbit/s
    write_s: float = 30.0
    max_body_nbytes: int = 16 << 20
    max_json_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"proxy limit {f.name}={v!r} must be a positive number")


_STRUCTURAL = (b"[", b"{", b",", b":")


def parse_body(raw: bytes, limits: Limits) -> tuple[dict | None, web.Response | None]:
    """The request's JSON object, or the error response; bounded before parsing."""
    tokens = sum(raw.count(c) for c in _STRUCTURAL)
    if tokens > limits.max_json_tokens:
        return None, _error(
            413,
            f"request body has {tokens} JSON structural characters, more than {limits.max_json_tokens}",
            "BadRequestError",
        )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, _error(400, "request body is not JSON", "BadRequestError")
    except RecursionError:
        return None, _error(400, "request body nests too deeply", "BadRequestError")
    if not isinstance(body, dict):
        return None, _error(400, "request body must be a JSON object", "BadRequestError")
    return body, None


def sse_error(message: str, code: int = 502) -> bytes:
    return (
        b"data: " + json.dumps({"error": {"message": message, "type": "BadGateway", "code": code}}).encode() + b"\n\n"
    )


def _error(status: int, message: str, kind: str = "BadGateway") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


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
    """The proxy's routes over ``prefill`` and ``decode`` base URLs. ``policy``: decode-first
    serving (:class:`~vllm_hawk.proxy.decide.Policy`; its defaults are ``hawk proxy``'s)."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        *,
        limits: Limits | None = None,
        releaser=None,
        policy: Policy | None = None,
    ) -> None:
        self.prefill = Pool(list(prefill))
        self.releaser = releaser  # PrefillReleaser, or None: refused requests wait for their lease
        self.decode = Pool(list(decode))
        self.limits = limits or Limits()
        # No total and no sock_read: first byte and idle-between-chunks are enforced per
        # phase below, so a long healthy stream is never cut.
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=self.limits.connect_s, sock_read=None
        )
        self.session: aiohttp.ClientSession | None = None
        self.served = 0
        self.stats = {
            "truncated_streams": 0,
            "slow_clients_dropped": 0,
            "refused_bodies": 0,
            "slow_bodies_dropped": 0,
            "decode_refused": 0,
            "upstream_resent": 0,
            "upstream_emfile_retries": 0,
        }
        self.metrics = ProxyMetrics()
        self.placement = Placement(policy or Policy(), self.decode, self.metrics)

    # ---------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_nbytes)
        for route in GENERATE_ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        # Idle upstream connections are closed before uvicorn's (vLLM's) 5 s keep-alive ends,
        # so that we rarely send on one it is closing.
        self.session = aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        )

    async def _stop(self, _app) -> None:
        if self.session is not None:
            await self.session.close()
        if self.releaser is not None:
            self.releaser.close()

    async def _decode_refused(self, params: dict) -> None:
        """The decode refused the request before its engine saw it: free the prefill's KV."""
        self.stats["decode_refused"] += 1
        if self.releaser is not None:
            await self.releaser.release(params)

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
            bad = [u for u, ok in zip(urls, results, strict=False) if not ok]
            if bad:
                out.update(status="degraded", unhealthy=bad)
                return web.json_response(out, status=503)
        return web.json_response(out)

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _ping(self, url: str) -> bool:
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def models(self, request: web.Request) -> web.StreamResponse:
        url = self.decode.pick()
        try:
            async with await self._open(lambda: self.session.get(url + "/v1/models")) as r:
                return web.Response(status=r.status, body=await self._read(r), content_type=r.content_type)
        except (TimeoutError, aiohttp.ClientError) as e:
            return _error(502, f"decode server {url} unreachable: {e!s}")

    async def _open(self, make, first_byte_s: float | None = None) -> aiohttp.ClientResponse:
        """Send the upstream request ``make()`` builds; its response headers must come within
        ``first_byte_s`` (default ``limits.first_byte_s``). When the upstream closed a pooled
        keep-alive connection just as we sent on it (``ServerDisconnectedError`` before any
        response; seen under load) the request is sent once more. A connect that failed for lack of file descriptors (a
        client flood at the fd limit: the evictions that free them close on the next loop
        turn) is tried again up to :data:`EMFILE_RETRIES` times, :data:`EMFILE_WAIT_S` apart."""
        first_byte_s = self.limits.first_byte_s if first_byte_s is None else first_byte_s
        for attempt in range(EMFILE_RETRIES + 1):
            try:
                return await asyncio.wait_for(make(), first_byte_s)
            except aiohttp.ServerDisconnectedError:
                self.stats["upstream_resent"] += 1
                return await asyncio.wait_for(make(), first_byte_s)
            except aiohttp.ClientConnectorError as e:
                if getattr(e.os_error, "errno", None) != errno.EMFILE or attempt == EMFILE_RETRIES:
                    raise
                self.stats["upstream_emfile_retries"] += 1
                await asyncio.sleep(EMFILE_WAIT_S)
        raise AssertionError("unreachable")

    async def _read(self, r: aiohttp.ClientResponse) -> bytes:
        """An upstream body, each chunk within ``idle_s`` of the previous one."""
        parts = []
        while True:
            chunk = await asyncio.wait_for(r.content.readany(), self.limits.idle_s)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t_in = time.perf_counter()
        resp = await self._generate(request, t_in)
        self.metrics.requests.labels("ok" if resp.status == 200 else "error").inc()
        return resp

    async def _generate(self, request: web.Request, t_in: float) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self.limits.body_s):
                raw = await request.read()  # aiohttp refuses more than client_max_size (413)
        except web.HTTPRequestEntityTooLarge:
            self.stats["refused_bodies"] += 1
            raise
        except TimeoutError:
            return await self._body_timed_out(request)
        body, err = parse_body(raw, self.limits)
        if err is not None:
            self.stats["refused_bodies"] += 1
            return err
        del raw
        path = request.path
        rid = request.headers.get("X-Request-Id") or f"hawk-{uuid.uuid4().hex}"
        headers = self._headers(request, rid)
        placed = await self.placement.place(self.session, body, path, headers)  # 0. decode, local or remote
        try:
            if placed.local:
                return await self._decode(request, path, body, None, headers, placed, None, t_in)
            got = await self._prefill(path, body, headers)  # 1. prefill
            if isinstance(got, web.Response):
                return got
            # 2. decode (the prefill holds the KV through the hand-over by itself: handover_s)
            return await self._decode(request, path, body, got[2], headers, placed, got[:2], t_in)
        finally:
            self.placement.release(placed)

    async def _prefill(self, path: str, body: dict, headers: dict) -> tuple[str, float, dict] | web.Response:
        """The P/D path's first step on the next prefill server: (its URL, ms, the
        ``kv_transfer_params`` it answered), or the error response for the client."""
        p_url = self.prefill.pick()
        t0 = time.perf_counter()
        try:
            async with await self._open(
                lambda: self.session.post(p_url + path, json=prefill_body(body, path), headers=headers)
            ) as r:
                raw = await self._read(r)
                if r.status != 200:
                    return web.Response(status=r.status, body=raw, content_type=r.content_type)
        except TimeoutError:
            return _error(
                504,
                f"prefill server {p_url} did not answer within its deadline (first byte "
                f"{self.limits.first_byte_s:g} s, hawk proxy --first-byte-timeout-s; idle "
                f"{self.limits.idle_s:g} s, --idle-timeout-s)",
            )
        except aiohttp.ClientError as e:
            return _error(502, f"prefill server {p_url} unreachable: {e!s}")
        prefill_ms = (time.perf_counter() - t0) * 1e3
        self.metrics.prefill.observe(prefill_ms / 1e3)
        try:
            params = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return _error(
                502,
                f"prefill server {p_url} returned no kv_transfer_params "
                "(is it a vLLM with HawkConnector as kv_producer?)",
            )
        return p_url, prefill_ms, params

    async def _body_timed_out(self, request: web.Request) -> web.StreamResponse:
        """408 for a body that did not arrive within ``body_s``, then the connection closes
        (no lingering read of the rest: aiohttp would wait ``lingering_time`` for it)."""
        self.stats["slow_bodies_dropped"] += 1
        resp = _error(
            408,
            f"request body did not arrive within {self.limits.body_s:g} s of its headers "
            "(hawk proxy --body-timeout-s); send the whole body at once",
            "RequestTimeout",
        )
        resp.force_close()  # Connection: close
        with contextlib.suppress(ConnectionError, TimeoutError):
            await resp.prepare(request)
            await asyncio.wait_for(resp.write_eof(), self.limits.write_s)
        if request.protocol is not None:
            request.protocol.force_close()  # closes the transport once the 408 is flushed
        return resp

    async def _decode(
        self,
        request: web.Request,
        path: str,
        body: dict,
        params: dict | None,
        headers: dict[str, str],
        placed: Placed,
        prefill: tuple[str, float] | None,
        t_in: float,
    ) -> web.StreamResponse:
        """The request on ``placed``'s decode: with the prefill's ``kv_transfer_params``
        (``prefill``: its URL and ms), or without any (``params`` None: the decode
        prefills)."""
        d_body = dict(body)
        d_body.pop("kv_transfer_params", None)  # a client's own never reaches an engine
        if params is not None:
            d_body["kv_transfer_params"] = params
        d_url = placed.url
        info = {"x-hawk-prefill": prefill[0] if prefill else "local", "x-hawk-prefill-reason": placed.reason}
        info["x-hawk-decode"] = d_url
        if prefill:
            info["x-hawk-prefill-ms"] = f"{prefill[1]:.2f}"
        t_d = time.perf_counter()
        # a non-streaming answer's headers come after its last token (vLLM): generate_s
        first_byte_s = self.limits.first_byte_s if body.get("stream") else self.limits.generate_s
        try:
            async with await self._open(
                lambda: self.session.post(d_url + path, json=d_body, headers=headers), first_byte_s
            ) as r:
                if r.status == 200:
                    self.placement.served(placed)
                elif params is not None:
                    await self._decode_refused(params)
                if r.status != 200 or not body.get("stream"):
                    return web.Response(
                        status=r.status, body=await self._read(r), content_type=r.content_type, headers=info
                    )
                resp = web.StreamResponse(
                    status=200,
                    headers={
                        **info,
                        "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache",
                    },
                )
                await resp.prepare(request)
                return await self._stream(request, resp, r, d_url, (t_in, t_d))
        except TimeoutError:
            flag = "--first-byte-timeout-s" if body.get("stream") else "--generate-timeout-s"
            return _error(
                504,
                f"decode server {d_url} did not answer within its deadline (first byte "
                f"{first_byte_s:g} s, hawk proxy {flag}; idle {self.limits.idle_s:g} s, --idle-timeout-s)",
            )
        except aiohttp.ClientConnectorError as e:  # never reached: nobody will ask for the KV
            if params is not None:
                await self._decode_refused(params)
            return _error(502, f"decode server {d_url} failed: {e!s}")
        except aiohttp.ClientError as e:
            return _error(502, f"decode server {d_url} failed: {e!s}")

    async def _stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        r: aiohttp.ClientResponse,
        d_url: str,
        t_in_dec: tuple[float, float] | None = None,
    ) -> web.StreamResponse:
        """Relay the decode's SSE stream. A broken, stalled or unterminated upstream stream
        ends with an SSE error event; a client that stops reading is dropped (the upstream
        closes with the ``async with`` around us, and vLLM aborts the request)."""
        lim = self.limits
        tail = b""
        error = ""
        while True:
            try:
                chunk = await asyncio.wait_for(r.content.readany(), lim.idle_s)
            except TimeoutError:
                error = f"decode server {d_url} sent nothing for {lim.idle_s:.0f} s; stream aborted"
                break
            except aiohttp.ClientError as e:
                error = f"decode server {d_url} broke the stream: {e!s}"
                break
            if not chunk:
                if b"[DONE]" not in tail:
                    error = f"decode server {d_url} ended the stream without [DONE] (truncated)"
                break
            tail = (tail + chunk)[-64:]
            if t_in_dec is not None:  # the first chunk: TTFT as the proxy sees it
                now = time.perf_counter()
                self.metrics.ttft.observe(now - t_in_dec[0])
                self.metrics.decode_first_chunk.observe(now - t_in_dec[1])
                t_in_dec = None
            try:
                await asyncio.wait_for(resp.write(chunk), lim.write_s)
            except TimeoutError:
                self.stats["slow_clients_dropped"] += 1
                logger.warning("proxy: client did not read for %.0f s; dropping it and its upstream", lim.write_s)
                if request.transport is not None:
                    request.transport.abort()
                return resp
        if error:
            self.stats["truncated_streams"] += 1
            logger.warning("proxy: %s", error)
            try:
                await asyncio.wait_for(resp.write(sse_error(error)), lim.write_s)
            except (TimeoutError, ConnectionError):
                return resp
        await resp.write_eof()
        self.served += 1
        return resp


class _BoundedServer:
    """aiohttp's protocol factory, keeping client connections below ``max_clients`` so
    that file descriptors stay free for the upstream connections: at the bound, the
    oldest connection that has not sent a whole request yet is dropped for the new one
    (an idle or partial-header flood cannot lock clients out). Each drop is counted
    (``hawk_proxy_clients_evicted_total``) and logged, at most every
    :data:`EVICTION_LOG_S`: a client dropped this way sees its connection closed before
    it could send, which from outside looks like a broken network."""

    def __init__(self, inner: web.Server, max_clients: int, metrics: ProxyMetrics | None = None) -> None:
        self.inner, self.max_clients, self.evicted = inner, max_clients, 0
        self.metrics, self._logged_at = metrics, float("-inf")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        conns = self.inner.connections
        if len(conns) >= self.max_clients:
            # a connection dropped earlier in this loop turn is still listed (until its
            # connection_lost, next turn): not counted, and not dropped again
            live = [h for h in conns if not getattr(h, "_force_close", False)]
            idle = [h for h in live if getattr(h, "_request_count", 1) == 0] if len(live) >= self.max_clients else []
            if idle:
                self.evicted += 1
                if self.metrics is not None:
                    self.metrics.clients_evicted.inc()
                idle[0].force_close()
                if time.monotonic() - self._logged_at >= EVICTION_LOG_S:
                    self._logged_at = time.monotonic()
                    logger.warning(
                        "proxy: %d client connections, the bound for its file descriptors (RLIMIT_NOFILE): "
                        "dropped the oldest one that had sent no request (%d dropped so far); raise "
                        "`ulimit -n` if these are real clients",
                        len(live),
                        self.evicted,
                    )
        return self.inner(*args, **kwargs)


EMFILE_RETRIES = 5  # upstream connects retried after EMFILE (see Proxy._open)
EMFILE_WAIT_S = 0.05
EVICTION_LOG_S = 10.0  # at most one eviction warning this often
BACKLOG = 128  # asyncio accepts up to this many connections in one go (before any eviction closes)
FD_RESERVE = 64  # fds kept for the upstream connections and the process itself


def _soft_fd_limit() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 1 << 20
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def accept_backlog(soft: int | None = None) -> int:
    """Listen backlog, which is also how many connections asyncio accepts in one loop
    turn: :data:`BACKLOG`, less under a small fd limit (a sixteenth of it, at least 8),
    so that the bursts in flight, the clients kept and :data:`FD_RESERVE` fit and
    ``accept()`` rarely runs out of fds (asyncio then accepts nobody for a second)."""
    soft = _soft_fd_limit() if soft is None else soft
    return max(8, min(BACKLOG, soft // 16))


def max_clients_for_fd_limit(soft: int | None = None) -> int:
    """Client connections the proxy keeps: the soft fd limit less three accept bursts
    (:func:`accept_backlog`: one accepted, one whose protocols are being made, which is
    when the evictions happen, and one whose evictions close on the next loop turn), less
    :data:`FD_RESERVE`; at least 16."""
    soft = _soft_fd_limit() if soft is None else soft
    return max(16, soft - 3 * accept_backlog(soft) - FD_RESERVE)


async def serve(proxy: Proxy, host: str, port: int) -> web.AppRunner:
    """Start the proxy in the running loop; returns the runner (``await runner.cleanup()``).
    ``keepalive_timeout`` is the header-read timeout too: aiohttp arms it when a connection
    opens and a partial request does not reset it. Client connections are bounded below
    the fd limit (:class:`_BoundedServer`)."""
    runner = web.AppRunner(
        proxy.app(), handler_cancellation=True, access_log=None, keepalive_timeout=proxy.limits.header_s
    )
    await runner.setup()
    runner._server = _BoundedServer(
        runner._server,
        max_clients_for_fd_limit(),  # TCPSite uses runner.server
        proxy.metrics,
    )
    await web.TCPSite(runner, host, port, backlog=accept_backlog()).start()
    return runner
