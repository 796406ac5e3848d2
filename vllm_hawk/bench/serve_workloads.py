"""Offline workloads and SLO metrics of ``hawk bench serve`` (pure: no engine, no network).

Workloads are ShareGPT-format JSON files (``[{"conversations": [{"value": prompt},
{"value": completion}]}, ...]``) that ``vllm bench serve --dataset-name sharegpt`` reads;
the completion's token count is the request's output length. Lengths (tokens of the
served model's tokenizer) are drawn from seeded lognormals, clipped, and capped so that
prompt + output fits ``max_model_len``:

* ``sharegpt``: short chat-like prompts and longer answers (ShareGPT's shape: median
  prompt shorter than the answer, heavy right tail);
* ``longbench``: long prompts, short answers (LongBench's shape), scaled down to the tiny
  model's context;
* ``block-edge`` and ``block-edge+1``: ShareGPT's draws (same seed, same lengths before
  snapping), each prompt snapped to ``block_size * k`` tokens, ``k >= 2`` the nearest whole
  number of blocks, plus ``snap`` (0 or 1) tokens, counted as the server counts them (BOS
  included). A Tenstorrent decode, which resumes a transferred prompt at the last block
  boundary before its last token, recomputes a whole block of a ``block-edge`` prompt and
  one token of a ``block-edge+1`` prompt (what a vLLM decode recomputes of either);
  ``k >= 2`` so that every prompt transfers at least one block;
* ``multiturn``: chat sessions of ``turns`` turns, each turn's prompt the previous turn's
  prompt, its answer and a new message (ShareGPT's lengths for the first message, the
  answers and the new messages), so that a session's prompts share their prefixes: what a
  decode's prefix cache holds between turns.

Metrics follow the paper (section 5.3): a request meets an SLO pair (TTFT ms, TPOT ms)
when both hold; failed requests miss it. Attainment = requests meeting it / requests sent.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np

#: name -> lognormal parameters in tokens: median, sigma (of ln), clip [lo, hi].
WORKLOADS: dict[str, dict] = {
    "sharegpt": {
        "shape": "ShareGPT-like: short chat prompts, longer answers",
        "prompt": {"median": 48, "sigma": 0.9, "lo": 8, "hi": 512},
        "output": {"median": 40, "sigma": 0.6, "lo": 8, "hi": 160},
    },
    "longbench": {
        "shape": "LongBench-like: long documents, short answers (scaled to max_model_len)",
        "prompt": {"median": 640, "sigma": 0.25, "lo": 256, "hi": 900},
        "output": {"median": 16, "sigma": 0.5, "lo": 8, "hi": 64},
    },
    "block-edge": {
        "shape": "ShareGPT-like, prompts of a whole number (>= 2) of blocks: a Tenstorrent decode recomputes a block",
        "prompt": {"median": 48, "sigma": 0.9, "lo": 8, "hi": 512},
        "output": {"median": 40, "sigma": 0.6, "lo": 8, "hi": 160},
        "snap": 0,
    },
    "multiturn": {
        "shape": "chat sessions of 4 turns: each prompt extends the previous turn's prompt and answer",
        "prompt": {"median": 48, "sigma": 0.9, "lo": 8, "hi": 256},
        "output": {"median": 40, "sigma": 0.6, "lo": 8, "hi": 160},
        "turns": 4,
    },
    "block-edge+1": {
        "shape": "ShareGPT-like, prompts of a whole number (>= 2) of blocks plus a token: every decode recomputes one",
        "prompt": {"median": 48, "sigma": 0.9, "lo": 8, "hi": 512},
        "output": {"median": 40, "sigma": 0.6, "lo": 8, "hi": 160},
        "snap": 1,
    },
}

#: The paper's SLO pairs (TTFT ms, TPOT ms).
PAPER_SLOS = ((2000.0, 200.0), (15000.0, 200.0))
#: Scaled pairs: multiples of the reference's unloaded P50 TTFT and TPOT (the paper's
#: 2000:15000 TTFT ratio kept; TPOT 5x its unloaded value).
SCALED_SLO_MULTIPLES = ((5.0, 5.0), (37.5, 5.0))

_WORDS = (
    "the cache block layer token bank device request decode prefill tile segment ring lease "
    "read write page model answer question context document section value key head batch"
).split()


def _lengths(rng: np.random.Generator, p: dict, n: int) -> list[int]:
    x = rng.lognormal(math.log(p["median"]), p["sigma"], n)
    return [int(v) for v in np.clip(np.round(x), p["lo"], p["hi"])]


def _text(tokenizer, n: int, rnd: random.Random) -> tuple[str, int]:
    """Text of about ``n`` tokens and its token count (without special tokens)."""
    words = " ".join(rnd.choice(_WORDS) for _ in range(n + 8))
    ids = tokenizer.encode(words, add_special_tokens=False)[:n]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def _served_text(tokenizer, n: int, rnd: random.Random) -> str:
    """Text that the served model sees as exactly ``n`` prompt tokens (``tokenizer.encode``
    with special tokens, as vLLM's completions endpoint and ``vllm bench serve`` count)."""
    want = n - len(tokenizer.encode(""))
    for _ in range(8):
        text, _ = _text(tokenizer, want, rnd)
        got = len(tokenizer.encode(text))
        if got == n:
            return text
        want += n - got
    raise ValueError(f"tokenizer {tokenizer.name_or_path!r}: no text of exactly {n} served tokens found")


def _next_turn(tokenizer, history: str, n: int, out_len: int, max_model_len: int, rnd) -> tuple[str, int, str]:
    """A session's next prompt: ``history`` (the earlier turns' prompt and answer) and a new
    message of about ``n`` tokens, cut so that it and ``out_len`` output tokens fit
    ``max_model_len``; (prompt, its tokens without special tokens, the history after this
    turn's answer of ``out_len`` tokens)."""
    room = max_model_len - out_len - 16  # BOS and re-tokenisation drift
    have = len(tokenizer.encode(history, add_special_tokens=False)) if history else 0
    if have + 8 > room:  # the session is full: start a new one
        history, have = "", 0
    msg, _ = _text(tokenizer, max(1, min(n, room - have)), rnd)
    prompt = f"{history} {msg}" if history else msg
    pn = len(tokenizer.encode(prompt, add_special_tokens=False))
    answer, _ = _text(tokenizer, out_len, rnd)
    return prompt, pn, f"{prompt} {answer}"


def snapped_prompt_len(drawn: int, snap: int, block_size: int, room: int) -> int:
    """A drawn prompt length (tokens) snapped to ``block_size * k + snap`` served tokens:
    ``k`` the nearest whole number of blocks, at least 2, at most what fits in ``room``
    tokens (prompt and BOS)."""
    if block_size < 1 or snap not in (0, 1):
        raise ValueError(f"block_size must be >= 1 and snap 0 or 1 (got {block_size}, {snap})")
    k = min(max(2, round(drawn / block_size)), (room - snap) // block_size)
    if k < 2:
        raise ValueError(
            f"room for the prompt {room} tokens: two blocks of {block_size} need {2 * block_size + snap}; "
            "raise --max-model-len"
        )
    return k * block_size + snap


def make_workload(
    name: str,
    tokenizer,
    num: int,
    seed: int,
    path: str | Path,
    max_model_len: int = 1024,
    block_size: int = 32,
) -> dict:
    """Write ``num`` requests of workload ``name`` to ``path``; return its description
    (parameters, seed, the lengths' mean/P50/P90 as written, and each prompt's token count
    as the server counts it, BOS included: ``served_prompt_tokens``, in file order).
    ``block_size`` (tokens): the cluster's, for the snapped workloads (``snap`` in
    :data:`WORKLOADS`)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} unknown; known: {sorted(WORKLOADS)}")
    if num < 1:
        raise ValueError(f"num_prompts must be >= 1 (got {num})")
    w = WORKLOADS[name]
    rng, rnd = np.random.default_rng(seed), random.Random(seed)
    prompts, outputs = _lengths(rng, w["prompt"], num), _lengths(rng, w["output"], num)
    rows, plens, olens, served, served_lens = [], [], [], set(), []
    history = ""  # multiturn: the session so far (prompt and answers)
    for i, (pl, ol) in enumerate(zip(prompts, outputs, strict=False)):
        ol = min(ol, max_model_len // 4)
        if "turns" in w:
            prompt, pn, history = _next_turn(tokenizer, history if i % w["turns"] else "", pl, ol, max_model_len, rnd)
        elif "snap" in w:
            room = max_model_len - ol - 8  # the completion's BOS and re-tokenisation drift
            prompt = _served_text(tokenizer, snapped_prompt_len(pl, w["snap"], block_size, room), rnd)
            pn = len(tokenizer.encode(prompt, add_special_tokens=False))
            served.add(len(tokenizer.encode(prompt)) % block_size)
        else:
            pl = min(pl, max_model_len - ol - 16)  # room for BOS and re-tokenisation drift
            prompt, pn = _text(tokenizer, pl, rnd)
        completion, on = _text(tokenizer, ol, rnd)
        rows.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": completion}]})
        served_lens.append(len(tokenizer.encode(prompt)))
        plens.append(pn)
        olens.append(on)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rows))

    def summary(v: list[int]) -> dict:
        return {
            "mean": float(np.mean(v)),
            "p50": float(np.percentile(v, 50)),
            "p90": float(np.percentile(v, 90)),
            "max": int(max(v)),
        }

    snapped = {"block_size": block_size, "snap": w["snap"], "served_mod_block": sorted(served)} if "snap" in w else {}
    return {
        "name": name,
        "shape": w["shape"],
        **snapped,
        "seed": seed,
        "num_prompts": num,
        "max_model_len": max_model_len,
        "distribution": "lognormal(ln(median), sigma), rounded, clipped to [lo, hi] tokens",
        "prompt_params": w["prompt"],
        "output_params": w["output"],
        "prompt_tokens": summary(plens),
        "served_prompt_tokens": served_lens,
        "output_tokens": summary(olens),
        "path": str(path),
    }


def per_request(result: dict) -> list[dict]:
    """``vllm bench serve``'s per-request lists -> [{ok, ttft_ms, tpot_ms, e2e_ms, out}]."""
    out = []
    for ttft, lat, n, err in zip(
        result["ttfts"], result["latencies"], result["output_lens"], result["errors"], strict=False
    ):
        ok = not err and n > 0
        tpot = (lat - ttft) / (n - 1) if ok and n > 1 else 0.0
        out.append(
            {
                "ok": ok,
                "ttft_ms": 1e3 * ttft if ok else math.inf,
                "tpot_ms": 1e3 * tpot if ok else math.inf,
                "e2e_ms": 1e3 * lat if ok else math.inf,
                "out": n if ok else 0,
            }
        )
    return out


def latency_stats(reqs: list[dict]) -> dict:
    """P50/P90/P99 and mean of TTFT, TPOT and E2E (ms) over the completed requests."""
    ok = [r for r in reqs if r["ok"]]
    out: dict = {}
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        vals = [r[key] for r in ok]
        for p in (50, 90, 99):
            out[f"p{p}_{key}"] = float(np.percentile(vals, p)) if vals else math.nan
        out[f"mean_{key}"] = float(np.mean(vals)) if vals else math.nan
    return out


def attainment(reqs: list[dict], ttft_ms: float, tpot_ms: float) -> tuple[float, int]:
    """(share of requests meeting both, count meeting both); failed requests miss."""
    good = sum(1 for r in reqs if r["ok"] and r["ttft_ms"] <= ttft_ms and r["tpot_ms"] <= tpot_ms)
    return (good / len(reqs) if reqs else math.nan), good


def knee(points: list[dict], key: str, threshold: float = 0.9) -> dict:
    """Over ``points`` (ascending rate; each with ``rate``, ``key`` and
    ``output_throughput``): the first rate below ``threshold`` (None: never), and the
    output throughput at the highest rate still at or above it (None: not even the first)."""
    below = next((p["rate"] for p in points if not p[key] >= threshold), None)
    held = [p for p in points if p[key] >= threshold and (below is None or p["rate"] < below)]
    return {
        "rate_below": below,
        "throughput_at": held[-1]["output_throughput"] if held else None,
        "rate_at": held[-1]["rate"] if held else None,
    }
