"""``hawk bench accuracy``: what the lossy KV tile formats cost in accuracy (the contract of
docs/tenstorrent.md, "KV accuracy").

For each shipped test model (the tiny Llama of :mod:`~vllm_hawk.bench.tiny_model`, bf16 and
float32 weights) and each tile format (bfloat16, bfloat8_b, bfloat4_b), on one fixed prompt
set (:func:`~vllm_hawk.bench.accuracy_layers.prompt_set`):

1. per layer, the Pearson correlation (tt-metal's ``comp_pcc``) of the decode's attention
   output from KV landed in the format against the bf16-landed one, teacher-forced
   (:mod:`~vllm_hawk.bench.accuracy_layers`: the prefill's transform and the emulated
   decode's read path and attention; no engine); the gate is 0.99 per layer;
2. greedy-token agreement with bf16, end to end: one GN-HAWK cluster per format (real vLLM
   engines, the decode on the emulated Tenstorrent platform), the same requests
   (:mod:`~vllm_hawk.bench.accuracy_greedy`); ``--no-greedy`` skips it.

Output: a progress bar, the tables, ``results/bench_accuracy.json`` and a PNG next to it
(1 - PCC per layer, log scale, with the gate).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from pathlib import Path

from vllm_hawk.bench import accuracy_greedy as greedy
from vllm_hawk.bench import accuracy_layers as layers
from vllm_hawk.bench.common import print_table, progress, write_json
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES
from vllm_hawk.tenstorrent.kv_accuracy import PCC_GATE

MODEL_DTYPES = ("bfloat16", "float32")


def pcc_rows(model_dtype: str, prompts: list[list[int]], formats) -> list[dict]:
    """Part 1 for one shipped model: a row per format (per-layer PCC, min, worst prompt)."""
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    caps = layers.capture(build_tiny_llama(dtype=model_dtype), prompts)
    rows = []
    for r in layers.layer_pcc(caps, formats):
        below = [i for i, p in enumerate(r.per_layer) if p < PCC_GATE]
        rows.append(
            {
                "model": model_dtype,
                "dtype": r.dtype,
                "per_layer": r.per_layer,
                "min": r.min,
                "worst_prompt": r.worst_prompt,
                "worst_prompt_min": min(r.worst_prompt),
                "below_gate": below,
            }
        )
    return rows


def greedy_rows(model_dtype: str, prompts, formats, max_tokens: int, work: Path, tick) -> list[dict]:
    """Part 2 for one shipped model: one cluster per format, each format's agreement with bf16."""
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    model = build_tiny_llama(dtype=model_dtype)
    runs = {}
    for f in ["bfloat16", *(f for f in formats if f != "bfloat16")]:
        tick(f"{model_dtype} model: starting the GN-HAWK cluster, decode in {f}")
        runs[f] = greedy.serve_format(
            model, work / model_dtype, f, prompts, max_tokens, dtype=model_dtype, logprobs=f == "bfloat16"
        )
    margin = greedy.TIE_MARGINS[model_dtype]
    rows = []
    for f in formats:
        agr = greedy.agreement(runs["bfloat16"], runs[f], margin)
        rows.append({"model": model_dtype, "dtype": f, **agr, "tokens": runs[f]})
    return rows


def print_pcc(rows: list[dict]) -> None:
    n = len(rows[0]["per_layer"])
    table = [
        {
            **r,
            **{f"l{i}": r["per_layer"][i] for i in range(n)},
            "below": ",".join(map(str, r["below_gate"])) or "none",
        }
        for r in rows
    ]
    cols = [("model", "model", ""), ("dtype", "KV format", "")]
    cols += [(f"l{i}", f"layer {i}", ".6f") for i in range(n)]
    cols += [("min", "min", ".6f"), ("worst_prompt_min", "worst prompt", ".6f"), ("below", f"< {PCC_GATE}", "")]
    print(f"\nper-layer attention-output PCC against bf16-landed KV (gate {PCC_GATE} per layer)")
    print_table(table, cols)


def print_greedy(rows: list[dict]) -> None:
    print("\ngreedy-token agreement with the bf16 run (shares of tokens; decisive: bf16 top-2 gap > margin)")
    print_table(
        [{**r, "div_ties": f"{r['divergences_at_ties']}/{len(r['per_prompt']) - r['prompts_equal']}"} for r in rows],
        [
            ("model", "model", ""),
            ("dtype", "KV format", ""),
            ("prefix", "to 1st divergence", ".4f"),
            ("overall", "overall", ".4f"),
            ("decisive", "decisive", ".4f"),
            ("prompts_equal", "prompts equal", ""),
            ("div_ties", "divergences at ties", ""),
            ("tie_margin", "tie margin", ".2e"),
        ],
    )


def plot(rows: list[dict], path: str) -> str:
    """1 - PCC per layer (log scale), one line per model and format, and the gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["dtype"] == "bfloat16":
            continue  # 1 - PCC is 0
        xs = range(len(r["per_layer"]))
        ax.plot(xs, [1 - p for p in r["per_layer"]], marker="o", label=f"{r['dtype']}, {r['model']} model")
    ax.axhline(1 - PCC_GATE, color="red", linestyle="--", label=f"gate (PCC {PCC_GATE})")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows[0]["per_layer"])))
    ax.set_xlabel("layer")
    ax.set_ylabel("1 - PCC against bf16")
    ax.set_title("attention output from landed KV, tiny Llama (hawk bench accuracy)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hawk bench accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_DTYPES), choices=MODEL_DTYPES)
    ap.add_argument("--formats", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    ap.add_argument("--prompts", type=int, default=16, help="prompts in the fixed set (default 16)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument("--no-greedy", action="store_true", help="the per-layer PCC only (no engine)")
    ap.add_argument("--workdir", default=None, help="cluster logs (default: a temporary folder)")
    ap.add_argument("--out", default="results/bench_accuracy.json")
    a = ap.parse_args(argv)
    formats = ["bfloat16", *(f for f in a.formats if f != "bfloat16")]
    prompts = layers.prompt_set(a.prompts)
    steps = len(a.models) * (1 + (0 if a.no_greedy else len(formats)))
    done = [0]

    def tick(label: str) -> None:
        progress(min(done[0], steps), steps, label)
        done[0] += 1

    t0 = time.monotonic()
    pcc, agr = [], []
    work = Path(a.workdir or tempfile.mkdtemp(prefix="hawk-bench-accuracy-"))
    for m in a.models:
        tick(f"{m} model: per-layer PCC")
        pcc += pcc_rows(m, prompts, formats)
        if not a.no_greedy:
            agr += greedy_rows(m, prompts, formats, a.max_tokens, work, tick)
    progress(steps, steps, f"done in {time.monotonic() - t0:.0f} s")
    print(
        f"hawk bench accuracy: tiny Llama ({', '.join(a.models)} weights), {len(prompts)} prompts of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {a.max_tokens} greedy tokens each; "
        f"logs in {work}"
    )
    print_pcc(pcc)
    if agr:
        print_greedy(agr)
    result = {
        "bench": "accuracy",
        "args": vars(a),
        "date": datetime.date.today().isoformat(),
        "wall_s": time.monotonic() - t0,
        "load_average": os.getloadavg(),
        "prompt_lengths": [len(p) for p in prompts],
        "pcc_gate": PCC_GATE,
        "pcc": pcc,
        "greedy": agr,
    }
    print(f"\nwrote {write_json(a.out, result)}")
    print(f"wrote {plot(pcc, str(Path(a.out).with_suffix('.png')))}")
    return 0
