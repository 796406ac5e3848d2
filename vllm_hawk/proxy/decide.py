"""Decode-first serving: which requests the proxy sends straight to a decode (pure logic, no I/O).

A decode engine prefills a prompt itself when its request carries no ``kv_transfer_params``
(HawkConnector then does nothing for it). For a short prompt that costs less than the P/D
path's second hop (the prefill's request, the hand-over, the pull); for a prompt whose
prefix the decode holds already it computes only the rest. :func:`decide` applies two
rules, each turned off by 0 (:class:`Policy`, the proxy's flags):

* ``--local-prefill-max-tokens N``: a prompt of fewer than N tokens prefills on the decode;
* ``--local-prefill-min-cached F``: a prompt whose prefix, as far as the proxy knows, is in
  the chosen decode's prefix cache for at least a fraction F of its tokens prefills there.

Token counts are the decode's: a prompt of token ids is counted as it is; text and chat
messages are counted by the decode's vLLM ``/tokenize`` (:func:`tokenize_body` builds its
request), except where :func:`text_token_bound` already shows a text prompt short. The
bound holds for byte-level BPE tokenizers and SentencePiece with byte fallback, whose every
token covers at least one byte of the text: tokens <= UTF-8 bytes + :data:`SPECIAL_TOKENS`.
A tokenizer whose normalizer lengthens text (NFKC) can break it; ``--tokenize-always``
then skips the bound.

Prefix coverage "where known" is :class:`PrefixRecord`: the proxy's own bounded record of
the full prompt blocks each decode has prefilled or received (vLLM caches both), as chains
of block hashes. It is an estimate: vLLM evicts blocks without telling, prefix caching may
be off, and output tokens are not recorded. Where it overestimates, the decode prefills the
tokens it lacks itself (the answer is the same; only the time differs); where it
underestimates, the request goes P/D and the decode pulls only what it lacks.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from dataclasses import dataclass

#: at most this many tokens a tokenizer adds to a text besides its bytes' (BOS, EOS, a
#: SentencePiece prefix space)
SPECIAL_TOKENS = 4
LOCAL, REMOTE = "local", "remote"
#: why a prompt is prefilled where it is (the ``reason`` label of ``hawk_proxy_prefills_total``)
SHORT_PROMPT, CACHED_PREFIX = "short_prompt", "cached_prefix"
LONG_PROMPT, RULES_OFF, NOT_COUNTED, TOKENIZE_FAILED = "long_prompt", "rules_off", "not_counted", "tokenize_failed"
#: fields of a chat request that /tokenize takes too (vLLM 0.32 ``TokenizeChatRequest``)
CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "media_io_kwargs",
    "mm_processor_kwargs",
)


@dataclass(frozen=True)
class Policy:
    """The decode-first rules and their record (each field is the ``hawk proxy`` flag of the
    same name). ``max_local_tokens`` (tokens) and ``min_cached`` (a fraction of the prompt's
    tokens): 0 turns the rule off. ``block_size``: the decodes' KV block (tokens);
    ``record_blocks``: most block hashes the record keeps over all decodes;
    ``tokenize_timeout_s``: one /tokenize round trip; ``tokenize_always``: no byte bound."""

    # Measured (CPU figures, GN-HAWK on 2 shared cores, tiny Llama; docs/benchmarks.md#decode-first-serving):
    # local<256 took 94-100% of ShareGPT-like prompts local, TTFT P50 x0.14 (1 req/s) and x0.044 (4 req/s) of
    # P/D, and no LongBench-like prompt (256+ tokens); larger N helped too on this CPU (no crossover within
    # the 1,024-token context), so 256 is the smallest N that took the short workload's gain.
    max_local_tokens: int = 256
    # cached>=0.5 (the cached rule alone, prefix caching on): 58-62% of multiturn prompts local, TTFT P50 x0.52
    # (1 req/s) and x0.32 (4 req/s), the best of 0.5, 0.75 and 0.9
    min_cached: float = 0.5
    block_size: int = 32
    record_blocks: int = 65536
    tokenize_timeout_s: float = 1.0
    tokenize_always: bool = False

    def __post_init__(self) -> None:
        def bad(flag: str, value, allowed: str) -> ValueError:
            return ValueError(f"--{flag} {value!r}: {allowed}")

        for flag, v, least in (
            ("local-prefill-max-tokens", self.max_local_tokens, 0),
            ("decode-block-size", self.block_size, 1),
            ("prefix-record-blocks", self.record_blocks, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise bad(flag, v, f"must be a whole number >= {least}")
        if not isinstance(self.min_cached, (int, float)) or not 0 <= self.min_cached < 1:
            raise bad(
                "local-prefill-min-cached",
                self.min_cached,
                "must be a fraction at least 0 and below 1 (0 turns the rule off; vLLM always computes a "
                "prompt's last token, so no prefix covers all of it)",
            )
        if not isinstance(self.tokenize_timeout_s, (int, float)) or not self.tokenize_timeout_s > 0:
            raise bad("tokenize-timeout-s", self.tokenize_timeout_s, "must be a positive number of seconds")

    @property
    def on(self) -> bool:
        return bool(self.max_local_tokens or self.min_cached)


@dataclass(frozen=True)
class Prompt:
    """What a request asks the model to read: ``ids`` (token ids), ``text`` (a completion's
    prompt) or ``chat`` (messages); ``value`` the ids, text or messages."""

    kind: str
    value: object


def prompt_of(body: dict, path: str) -> Prompt | None:
    """The one prompt of a ``/v1/completions`` or ``/v1/chat/completions`` body, or None
    (several prompts, prompt embeddings, messages with images or other media, or not a
    prompt the proxy can count)."""
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        return Prompt("chat", msgs) if isinstance(msgs, list) and msgs and all(map(_text_only, msgs)) else None
    p = body.get("prompt")
    if body.get("prompt_embeds") is not None:
        return None
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return Prompt("text", p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return Prompt("ids", p)
    return None


def _text_only(message) -> bool:
    """A chat message whose content is text (no image, audio or video part to fetch)."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


def text_token_bound(text: str) -> int:
    """Most tokens ``text`` can be for a tokenizer whose every token covers at least one of
    its UTF-8 bytes: its bytes plus :data:`SPECIAL_TOKENS`."""
    return len(text.encode("utf-8", "surrogatepass")) + SPECIAL_TOKENS


def short_by_bound(policy: Policy, prompt: Prompt) -> bool:
    """True when the byte bound alone shows a text prompt shorter than ``max_local_tokens``
    (no /tokenize needed)."""
    if policy.tokenize_always or not policy.max_local_tokens or prompt.kind != "text":
        return False
    return len(prompt.value) < policy.max_local_tokens and text_token_bound(prompt.value) < policy.max_local_tokens


def tokenize_body(body: dict, prompt: Prompt) -> dict:
    """The vLLM 0.32 ``POST /tokenize`` request that counts ``prompt`` as the decode will
    (``TokenizeCompletionRequest``: ``prompt``, ``add_special_tokens`` default true;
    ``TokenizeChatRequest``: ``messages`` and the chat template's fields). Its answer:
    ``{"count", "max_model_len", "tokens"}``."""
    out = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if prompt.kind == "chat":
        out["messages"] = prompt.value
        out.update({k: body[k] for k in CHAT_TOKENIZE_FIELDS if body.get(k) is not None})
    else:
        out["prompt"] = prompt.value
        if isinstance(body.get("add_special_tokens"), bool):
            out["add_special_tokens"] = body["add_special_tokens"]
    return out


def decide(policy: Policy, n_tokens: int | None, cached_tokens: int = 0) -> tuple[str, str]:
    """``(LOCAL or REMOTE, reason)`` for a prompt of ``n_tokens`` tokens (None: not counted)
    of which the chosen decode holds ``cached_tokens`` (:meth:`PrefixRecord.covered`)."""
    if not policy.on:
        return REMOTE, RULES_OFF
    if n_tokens is None:
        return REMOTE, NOT_COUNTED
    if n_tokens < policy.max_local_tokens:
        return LOCAL, SHORT_PROMPT
    if policy.min_cached and n_tokens and cached_tokens >= policy.min_cached * n_tokens:
        return LOCAL, CACHED_PREFIX
    return REMOTE, LONG_PROMPT


def usable_cached_tokens(blocks: int, n_tokens: int, block_size: int) -> int:
    """Tokens of an ``n_tokens`` prompt a vLLM decode takes from its prefix cache when it
    holds its first ``blocks`` full blocks: whole blocks, never the last token (vLLM
    computes at least that one)."""
    return min(blocks * block_size, (n_tokens - 1) // block_size * block_size) if n_tokens > 0 else 0


class PrefixRecord:
    """Which decodes hold which prompt prefixes, as chains of block hashes (see module doc).

    A block's hash chains its tokens onto its predecessor's (the first block's onto a seed of
    the model name and ``cache_salt``, which vLLM's own block hashes include), so a hash names
    the whole prefix up to it. One LRU (``OrderedDict``) maps each hash to a bit mask of the
    decodes (by index) that hold it, at most ``max_blocks`` entries (about 110 bytes each,
    measured in ``tests/proxy/test_decide.py``). A chain is recorded last block first, so its
    first blocks are the most recent and eviction drops the tail first, as vLLM's does."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self._held: collections.OrderedDict[int, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def chain(self, tokens: list[int], seed: str = "") -> list[int]:
        """The hash of each full block of ``tokens`` (64-bit blake2b, chained from ``seed``)."""
        h = hashlib.blake2b(seed.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        out = []
        bs = self.block_size
        for i in range(len(tokens) // bs):
            block = tokens[i * bs : (i + 1) * bs]
            h = hashlib.blake2b(h + struct.pack(f"<{bs}Q", *block), digest_size=8).digest()
            out.append(int.from_bytes(h, "little"))
        return out

    def held_blocks(self, chain: list[int], decodes: int) -> list[int]:
        """Per decode index (``range(decodes)``), how many leading blocks of ``chain`` it holds."""
        out = [0] * decodes
        alive = (1 << decodes) - 1
        for i, h in enumerate(chain):
            alive &= self._held.get(h, 0)
            if not alive:
                break
            for d in range(decodes):
                if alive >> d & 1:
                    out[d] = i + 1
        return out

    def add(self, decode: int, chain: list[int]) -> None:
        """Decode ``decode`` now holds every block of ``chain``."""
        bit = 1 << decode
        for h in reversed(chain):
            self._held[h] = self._held.pop(h, 0) | bit
        while len(self._held) > self.max_blocks:
            self._held.popitem(last=False)


#: a decode holding a prompt's prefix is preferred unless it has this many more requests in
#: flight than the least busy decode (then the least busy one takes it; not measured here)
BALANCE_SLACK = 4


def choose_decode(held: list[int], in_flight: list[int], first: int) -> int:
    """The decode (index) for a request: the one holding the most leading blocks of its
    prompt (``held``), unless it has more than :data:`BALANCE_SLACK` requests in flight beyond
    the least busy one; ties and no holder go to round robin, whose next pick is ``first``."""
    n = len(in_flight)
    order = [(first + k) % n for k in range(n)]
    least = min(in_flight)
    fit = [d for d in order if in_flight[d] <= least + BALANCE_SLACK]
    best = max(fit, key=lambda d: held[d])  # max keeps the first of equals: round-robin order
    return best if held[best] else first if first in fit else fit[0]
