"""Greedy-token agreement of the KV tile formats, end to end on real engines.

Per format, the GN-HAWK cluster of ``make demo`` / ``hawk bench serve``
(``LocalCluster.configured("GN-HAWK")``: a vLLM CPU prefill, HawkConnector over Mooncake
TCP, a vLLM decode on the emulated Tenstorrent platform with its KV cache in that tile
format, ``hawk proxy`` in front; vLLM's ``kv_cache_dtype`` stays ``auto``) serves the same
prompts, greedy, ``max_tokens`` each, EOS ignored, one at a time. The decode takes the
prompt's KV from the prefill up to the last block boundary before its last token, landed
in that format, and writes the rest, and every generated token's KV, in that format too.
The bf16 run also asks for the top-2 logprobs of every position (:func:`top2_gaps`).

:func:`agreement` compares a format's tokens with bf16's, per prompt and in total:

* ``prefix``: the tokens equal before the first divergence, over ``max_tokens``;
* ``overall``: the positions whose tokens are equal, over ``max_tokens`` (after a
  divergence the two runs continue from different contexts);
* ``decisive``: over the positions up to and including the first divergence (where both
  runs saw the same context) whose bf16 top-2 logprob gap exceeds the tie margin, the
  share that agree. Tiny random-weight models have exact top-2 ties (docs/vllm-cpu.md), at
  which any perturbation may pick the other token; this share leaves them out.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from vllm_hawk.bench.local_cluster import LocalCluster

__all__ = ["TIE_MARGINS", "agreement", "complete", "run_prompts", "serve_format", "top2_gaps"]

#: top-2 logprob gaps at or below which the bf16 reference counts as a tie, by model dtype: a bf16
#: ulp or two of a logit for bf16 weights (the GN end-to-end tests' margin), 1e-3 for float32
TIE_MARGINS = {"bfloat16": 2.0**-6, "float32": 1e-3}


def complete(url: str, prompt: list[int], max_tokens: int, logprobs: int = 0, timeout_s: float = 300.0) -> dict:
    """One greedy ``/v1/completions`` request (token ids in and out, EOS ignored): the
    first choice, with ``logprobs`` top logprobs per position when asked for."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **({"logprobs": logprobs, "return_tokens_as_token_ids": True} if logprobs else {}),
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["choices"][0]


def top2_gaps(choice: dict) -> list[float]:
    """Per generated position, the gap between its two highest logprobs (inf when one)."""
    out = []
    for top in choice["logprobs"]["top_logprobs"]:
        v = sorted(top.values(), reverse=True)
        out.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return out


def run_prompts(url: str, prompts: list[list[int]], max_tokens: int, *, logprobs: bool = False) -> list[dict]:
    """Send every prompt to ``url`` (a proxy, one request at a time): per prompt
    ``{"tokens": [...], "gaps": [...] or None}`` (gaps with ``logprobs``)."""
    out = []
    for p in prompts:
        c = complete(url, p, max_tokens, 2 if logprobs else 0)
        out.append({"tokens": c["token_ids"], "gaps": top2_gaps(c) if logprobs else None})
    return out


def serve_format(
    model: str | Path,
    workdir: str | Path,
    kv_dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    dtype: str = "bfloat16",
    logprobs: bool = False,
) -> list[dict]:
    """Start the GN-HAWK cluster with a decode in ``kv_dtype`` tiles (model weights in
    ``dtype``), :func:`run_prompts` through its proxy, stop it."""
    cluster = LocalCluster.configured(
        "GN-HAWK",
        model,
        Path(workdir) / kv_dtype,
        kv_dtype=kv_dtype,
        dtype=dtype,
        max_model_len=1024,
        extra_args=["--no-enable-prefix-caching"],
    )
    with cluster:
        return run_prompts(cluster.proxy_url, prompts, max_tokens, logprobs=logprobs)


def _one(ref: dict, got: list[int], margin: float) -> dict:
    """:func:`agreement`'s figures for one prompt."""
    want, n = ref["tokens"], len(ref["tokens"])
    div = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    shared = n if div is None else div + 1  # positions both runs reached from the same context
    decisive = [i for i in range(shared) if ref["gaps"][i] > margin]
    return {
        "prefix": n if div is None else div,
        "equal": sum(a == b for a, b in zip(got, want, strict=True)),
        "tokens": n,
        "first_divergence": div,
        "gap_at_divergence": None if div is None else ref["gaps"][div],
        "decisive": len(decisive),
        "decisive_equal": sum(got[i] == want[i] for i in decisive),
    }


def agreement(ref: list[dict], got: list[dict], margin: float) -> dict:
    """A format's greedy tokens ``got`` against the bf16 run ``ref`` (see the module doc):
    per prompt and in total; ``ref`` carries the top-2 gaps, ``margin`` is the tie margin."""
    per = [_one(r, g["tokens"], margin) for r, g in zip(ref, got, strict=True)]
    tokens = sum(p["tokens"] for p in per)
    decisive = sum(p["decisive"] for p in per)
    return {
        "per_prompt": per,
        "prefix": sum(p["prefix"] for p in per) / tokens,
        "overall": sum(p["equal"] for p in per) / tokens,
        "decisive": sum(p["decisive_equal"] for p in per) / decisive if decisive else 1.0,
        "prompts_equal": sum(p["first_divergence"] is None for p in per),
        "divergences_at_ties": sum(p["first_divergence"] is not None and p["gap_at_divergence"] <= margin for p in per),
        "tie_margin": margin,
    }
