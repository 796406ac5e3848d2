"""Where the proxy has a request's prompt prefilled, and by which decode: the I/O around
:mod:`vllm_hawk.proxy.decide` (the decode's ``/tokenize``, the prefix record, the counters).

Per request, :meth:`Placement.place`:

1. with both decode-first rules off, the next decode in round robin and a remote prefill;
2. otherwise counts the prompt: token ids as they are; a text the byte bound shows short is
   local at once (no round trip); other text and chat messages through ``/tokenize`` on the
   decode round robin would pick next, within ``tokenize_timeout_s``. A round trip that fails
   or times out is counted (``hawk_proxy_tokenize_fallbacks_total``) and the request goes
   P/D as without the rules: it never fails a request;
3. chooses the decode (:func:`~vllm_hawk.proxy.decide.choose_decode`: the one the prefix
   record says holds most of the prompt, else round robin) and decides local or remote
   (:func:`~vllm_hawk.proxy.decide.decide`), counted in ``hawk_proxy_prefills_total``.

The proxy calls :meth:`Placement.served` when the decode accepted the request (its prompt's
blocks are in that decode's cache from then on, as far as the record knows) and
:meth:`Placement.release` when the request is over (requests in flight per decode).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from vllm_hawk.proxy.decide import (
    LOCAL,
    REMOTE,
    SHORT_PROMPT,
    TOKENIZE_FAILED,
    Policy,
    PrefixRecord,
    choose_decode,
    decide,
    prompt_of,
    short_by_bound,
    tokenize_body,
    usable_cached_tokens,
)

logger = logging.getLogger(__name__)
LOG_EVERY_S = 10.0  # at most one warning about failing /tokenize round trips this often


@dataclass
class Placed:
    """One request's placement: the decode (index and base URL), ``where`` its prompt is
    prefilled (``local`` or ``remote``) and why, and its prompt's block hashes (empty when
    the proxy did not count its tokens)."""

    decode: int
    url: str
    where: str
    reason: str
    chain: list[int] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return self.where == LOCAL


class Placement:
    """Decode-first placement over ``decodes`` (a round-robin ``Pool`` of base URLs); see
    the module doc. ``metrics``: the proxy's :class:`~vllm_hawk.proxy.metrics.ProxyMetrics`."""

    def __init__(self, policy: Policy, decodes, metrics) -> None:
        self.policy, self.decodes, self.metrics = policy, decodes, metrics
        self.record = PrefixRecord(policy.block_size, policy.record_blocks)
        self.in_flight = [0] * len(decodes.urls)
        self._logged_at = float("-inf")

    async def place(self, session: aiohttp.ClientSession, body: dict, path: str, headers: dict) -> Placed:
        """Choose the decode and where the prompt of ``body`` (sent to ``path``) is prefilled."""
        first = self.decodes.next_index()
        tokens, where, reason = None, REMOTE, None
        prompt = prompt_of(body, path) if self.policy.on else None
        if prompt is not None and short_by_bound(self.policy, prompt):
            where, reason = LOCAL, SHORT_PROMPT
        elif prompt is not None:
            if prompt.kind == "ids":
                tokens = prompt.value
            else:
                tokens = await self._tokenize(session, self.decodes.urls[first], body, prompt, headers)
                reason = TOKENIZE_FAILED if tokens is None else None
        seed = f"{body.get('model')}\0{body.get('cache_salt')}"
        chain = self.record.chain(tokens, seed) if tokens else []
        held = self.record.held_blocks(chain, len(self.in_flight))
        d = choose_decode(held, self.in_flight, first)
        if reason is None:
            n = len(tokens) if tokens is not None else None
            where, reason = decide(self.policy, n, usable_cached_tokens(held[d], n or 0, self.policy.block_size))
        self.in_flight[d] += 1
        self.metrics.prefills.labels(where, reason).inc()
        return Placed(d, self.decodes.urls[d], where, reason, chain)

    async def _tokenize(self, session, url: str, body: dict, prompt, headers: dict) -> list[int] | None:
        """The decode's token ids for ``prompt`` (vLLM ``POST /tokenize``), or None when the
        round trip fails or takes longer than ``tokenize_timeout_s`` (counted, logged)."""
        t0 = time.perf_counter()
        cause = "error"
        try:
            async with asyncio.timeout(self.policy.tokenize_timeout_s):
                async with session.post(url + "/tokenize", json=tokenize_body(body, prompt), headers=headers) as r:
                    out = await r.json(content_type=None) if r.status == 200 else None
            tokens = out.get("tokens") if isinstance(out, dict) else None
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                self.metrics.tokenize.observe(time.perf_counter() - t0)
                return tokens
            what = f"HTTP {r.status}" if r.status != 200 else "an answer without token ids"
        except TimeoutError:
            cause, what = "timeout", f"no answer within {self.policy.tokenize_timeout_s:g} s (--tokenize-timeout-s)"
        except (aiohttp.ClientError, ValueError) as e:
            what = f"{type(e).__name__}: {e}"
        self.metrics.tokenize_fallbacks.labels(cause).inc()
        if time.monotonic() - self._logged_at >= LOG_EVERY_S:
            self._logged_at = time.monotonic()
            logger.warning(
                "proxy: /tokenize at %s failed (%s); the request goes P/D (logged every %g s at most)",
                url,
                what,
                LOG_EVERY_S,
            )
        return None

    def served(self, placed: Placed) -> None:
        """The decode accepted ``placed``'s request: it holds the prompt's blocks now."""
        if placed.chain:
            self.record.add(placed.decode, placed.chain)
            self.metrics.record_blocks.set(len(self.record))

    def release(self, placed: Placed) -> None:
        """``placed``'s request is over."""
        self.in_flight[placed.decode] -= 1
