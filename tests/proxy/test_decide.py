"""Decode-first serving's decision (``vllm_hawk.proxy.decide``, pure): the two rules and
their thresholds, the prefix-coverage arithmetic, the byte bound on a tokenizer's count,
the prefix record's LRU bound and memory, the decode choice, and bad flags."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hawk.proxy import parse_args, policy_of
from vllm_hawk.proxy.decide import (
    BALANCE_SLACK,
    CACHED_PREFIX,
    LOCAL,
    LONG_PROMPT,
    NOT_COUNTED,
    REMOTE,
    RULES_OFF,
    SHORT_PROMPT,
    SPECIAL_TOKENS,
    Policy,
    PrefixRecord,
    Prompt,
    choose_decode,
    decide,
    prompt_of,
    short_by_bound,
    text_token_bound,
    tokenize_body,
    usable_cached_tokens,
)

URLS = ["--prefill", "http://p", "--decode", "http://d"]


def test_short_prompt_rule_is_strictly_below_the_threshold_and_zero_turns_it_off():
    p = Policy(max_local_tokens=128, min_cached=0)
    assert decide(p, 127) == (LOCAL, SHORT_PROMPT)
    assert decide(p, 128) == (REMOTE, LONG_PROMPT)
    assert decide(p, 1) == (LOCAL, SHORT_PROMPT)
    assert decide(p, None) == (REMOTE, NOT_COUNTED)
    off = Policy(max_local_tokens=0, min_cached=0)
    assert not off.on and decide(off, 1) == (REMOTE, RULES_OFF)


def test_cached_prefix_rule_compares_the_usable_cached_tokens_with_the_fraction():
    p = Policy(max_local_tokens=0, min_cached=0.5, block_size=32)
    assert decide(p, 200, 100) == (LOCAL, CACHED_PREFIX)
    assert decide(p, 200, 99) == (REMOTE, LONG_PROMPT)
    # both rules: a short prompt is local for being short, whatever is cached
    both = Policy(max_local_tokens=64, min_cached=0.9)
    assert decide(both, 63, 0) == (LOCAL, SHORT_PROMPT)
    assert decide(both, 640, 608) == (LOCAL, CACHED_PREFIX) and decide(both, 640, 575) == (REMOTE, LONG_PROMPT)


@pytest.mark.parametrize(
    "blocks, n, want",
    [
        (0, 100, 0),
        (2, 100, 64),  # two whole blocks held
        (10, 100, 96),  # held beyond the prompt: its whole blocks, not its tail
        (3, 96, 64),  # a prompt of exactly 3 blocks: vLLM computes the last token, so the last block
        (3, 97, 96),
        (5, 1, 0),
        (1, 0, 0),
    ],
)
def test_usable_cached_tokens_whole_blocks_never_the_last_token(blocks, n, want):
    assert usable_cached_tokens(blocks, n, 32) == want


def test_prompt_of_counts_one_prompt_and_leaves_batches_and_embeddings():
    comp, chat = "/v1/completions", "/v1/chat/completions"
    assert prompt_of({"prompt": "hi"}, comp) == Prompt("text", "hi")
    assert prompt_of({"prompt": [0, 5, 7]}, comp) == Prompt("ids", [0, 5, 7])
    assert prompt_of({"prompt": ["hi"]}, comp) == Prompt("text", "hi")
    assert prompt_of({"prompt": [[0, 5]]}, comp) == Prompt("ids", [0, 5])
    for body in ({"prompt": ["a", "b"]}, {"prompt": [[1], [2]]}, {"prompt": []}, {"prompt": [1, True]}, {}):
        assert prompt_of(body, comp) is None, body
    assert prompt_of({"prompt": "x", "prompt_embeds": "AAAA"}, comp) is None
    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_of({"messages": msgs}, chat) == Prompt("chat", msgs)
    assert prompt_of({"messages": []}, chat) is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert prompt_of({"messages": parts}, chat) == Prompt("chat", parts)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert prompt_of({"messages": msgs + image}, chat) is None  # /tokenize would fetch the image


def test_tokenize_body_is_vllm_032s_request_for_the_same_prompt():
    assert tokenize_body({"model": "m", "prompt": "x", "max_tokens": 5}, Prompt("text", "x")) == {
        "model": "m",
        "prompt": "x",
    }
    assert tokenize_body({"prompt": "x", "add_special_tokens": False}, Prompt("text", "x")) == {
        "prompt": "x",
        "add_special_tokens": False,
    }
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": msgs, "chat_template_kwargs": {"a": 1}, "temperature": 0, "tools": None}
    assert tokenize_body(body, Prompt("chat", msgs)) == {
        "model": "m",
        "messages": msgs,
        "chat_template_kwargs": {"a": 1},
    }


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    return AutoTokenizer.from_pretrained(str(build_tiny_llama(dtype="bfloat16")))


@given(st.text(max_size=200))
def test_byte_bound_holds_for_a_byte_level_bpe_tokenizer(tok, text):
    """tokens <= UTF-8 bytes + SPECIAL_TOKENS, as the served model counts (BOS included)."""
    assert len(tok.encode(text)) <= text_token_bound(text)
    assert text_token_bound(text) == len(text.encode("utf-8", "surrogatepass")) + SPECIAL_TOKENS


def test_byte_bound_decides_only_text_shorter_than_the_threshold():
    p = Policy(max_local_tokens=16)
    assert short_by_bound(p, Prompt("text", "a" * (15 - SPECIAL_TOKENS)))
    assert not short_by_bound(p, Prompt("text", "a" * (16 - SPECIAL_TOKENS)))
    assert not short_by_bound(p, Prompt("text", "é" * 7))  # 14 bytes + 4
    assert not short_by_bound(p, Prompt("chat", [{"role": "user", "content": "a"}]))  # the template adds text
    assert not short_by_bound(Policy(max_local_tokens=16, tokenize_always=True), Prompt("text", "a"))
    assert not short_by_bound(Policy(max_local_tokens=0, min_cached=0.5), Prompt("text", "a"))


def test_record_matches_leading_blocks_per_decode_and_separates_seeds():
    r = PrefixRecord(block_size=4, max_blocks=100)
    a = list(range(20))  # 5 blocks
    b = a[:8] + [99] * 12  # shares 2 blocks with a
    ca, cb = r.chain(a, "m\0None"), r.chain(b, "m\0None")
    assert len(ca) == 5 and ca[:2] == cb[:2] and ca[2] != cb[2]
    assert r.chain(a[:19]) == r.chain(a)[:4] and r.chain(a, "m\0salt") != ca  # whole blocks; salt separates
    r.add(1, ca)
    assert r.held_blocks(ca, 3) == [0, 5, 0]
    assert r.held_blocks(cb, 3) == [0, 2, 0]
    r.add(0, cb[:1])
    assert r.held_blocks(ca, 3) == [1, 5, 0]
    assert r.held_blocks(r.chain([7] * 8), 3) == [0, 0, 0] and r.held_blocks([], 3) == [0, 0, 0]


def test_record_keeps_at_most_its_bound_and_evicts_chain_tails_first():
    r = PrefixRecord(block_size=2, max_blocks=6)
    old, new = r.chain(list(range(10))), r.chain(list(range(100, 108)))  # 5 and 4 blocks
    r.add(0, old)
    r.add(0, new)
    assert len(r) == 6
    assert r.held_blocks(new, 1) == [4] and r.held_blocks(old, 1) == [2]  # old kept its first 2 blocks
    for i in range(50):
        r.add(0, r.chain([i, i + 1, i + 2, i + 3]))
        assert len(r) <= 6


def test_record_memory_per_block_is_as_documented():
    """The flag's help and the docs say about 110 bytes per block hash kept."""
    r = PrefixRecord(block_size=16, max_blocks=20_000)
    prompts = [list(range(i * 1000, i * 1000 + 160)) for i in range(2000)]  # 20,000 blocks
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, p in enumerate(prompts):
        r.add(i % 3, r.chain(p))  # the hashes (Python ints) live on in the record
    per_block = (tracemalloc.get_traced_memory()[0] - before) / len(r)
    tracemalloc.stop()
    assert len(r) == 20_000
    print(f"prefix record: {per_block:.0f} bytes per block hash")
    assert 60 < per_block < 160, per_block


def test_choose_decode_prefers_the_holder_within_the_balance_slack():
    assert choose_decode([0, 0, 0], [0, 0, 0], 2) == 2  # nobody holds it: round robin
    assert choose_decode([0, 3, 1], [0, 0, 0], 0) == 1
    assert choose_decode([2, 0, 2], [0, 0, 0], 2) == 2  # a tie goes to the round-robin order
    assert choose_decode([0, 3, 0], [0, BALANCE_SLACK, 0], 0) == 1
    assert choose_decode([0, 3, 0], [0, BALANCE_SLACK + 1, 0], 0) == 0  # too busy: the least busy instead
    assert choose_decode([0, 0, 0], [9, 0, 0], 0) == 1  # round robin skips a decode beyond the slack


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--local-prefill-max-tokens", "-1"], "--local-prefill-max-tokens -1"),
        (["--local-prefill-min-cached", "1.0"], "--local-prefill-min-cached 1.0"),
        (["--local-prefill-min-cached", "-0.1"], "--local-prefill-min-cached -0.1"),
        (["--decode-block-size", "0"], "--decode-block-size 0"),
        (["--prefix-record-blocks", "0"], "--prefix-record-blocks 0"),
        (["--tokenize-timeout-s", "0"], "--tokenize-timeout-s 0"),
    ],
)
def test_bad_flags_stop_start_up_naming_the_flag(flags, named):
    with pytest.raises(SystemExit, match=f"hawk proxy: {named}"):
        policy_of(parse_args(URLS + flags))


def test_flags_make_the_policy_and_zero_turns_both_rules_off():
    p = policy_of(parse_args(URLS))
    assert p == Policy() and p.on
    p = policy_of(parse_args(URLS + ["--local-prefill-max-tokens", "0", "--local-prefill-min-cached", "0"]))
    assert not p.on
    p = policy_of(parse_args(URLS + ["--local-prefill-min-cached", "0.75", "--decode-block-size", "64"]))
    assert p.min_cached == 0.75 and p.block_size == 64
