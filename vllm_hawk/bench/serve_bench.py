"""``hawk bench serve``: serving under load, the paper's SLO experiments (section 5.3).

For each serving configuration (:data:`vllm_hawk.bench.local_cluster.CONFIGURATIONS`:
GG-Host, GG-Direct, GN-HAWK, and any added there) it starts a prefill vLLM, a decode vLLM
and the proxy on this machine (the cluster of ``make demo``; tiny bf16 Llama, prefix
caching off), or uses ``--url NAME=URL``. vLLM's own load generator (``vllm bench serve``,
called in this process) sends each workload (:mod:`~vllm_hawk.bench.serve_workloads`) with
Poisson arrivals at every rate of the sweep. ``collocated`` is one vLLM engine serving
alone (the first GG cluster's decode server, on one core, requests without
``kv_transfer_params``): the reference line.

Reported per configuration and rate: P50/P90/P99 TTFT, TPOT, E2E (ms); SLO attainment for
the paper's pairs and for pairs scaled to this machine (stated in the output); goodput
(requests/s meeting each pair); output throughput (tokens/s); the rate at which each
configuration falls below 90% attainment; GN-HAWK / GG-Direct ratios of P90 TTFT, P90 TPOT
and throughput at 90% attainment; and the mean TTFT breakdown per request (ms):

* ``prefill``: the proxy's prefill request (queue + compute), ``hawk_proxy_prefill_seconds``;
* ``decode_queue``: the decode's queue time less the pull (waiting to be scheduled, before
  the KVRequest and after the KV landed), ``vllm:request_queue_time_seconds`` minus
  ``vllm:hawk_transfer_time_seconds``;
* ``kv_ready``: KVRequest -> KVReady (the prefill's produce step), ``vllm:hawk_kv_ready_seconds``;
* ``pull``: the READs and copies, ``vllm:hawk_kv_read_seconds``;
* ``first_step``: scheduled -> first token on the decode, ``vllm:request_prefill_time_seconds``;
* ``proxy_http``: the rest of the proxy's TTFT (``hawk_proxy_ttft_seconds``): HTTP, the
  API servers, the proxy itself;

and the decode's mean prompt tokens per request (``vllm:request_prompt_tokens``) and KiB per
pull (``vllm:hawk_transfer_bytes``): the blocks it took, so the tokens it recomputed.
``kv_ready`` and ``pull`` are means per pull; the pull time taken from the queue time is
spread over every decode request, some of which pull nothing (a Tenstorrent decode
recomputes a prompt of one block or less). ``pulls`` counts the pulls, ``requests`` the
proxy's requests.

Decode-first serving (``--decode-first``: ``hawk proxy``'s defaults; ``--local-prefill-max-tokens
N...`` and ``--local-prefill-min-cached F...``: one setting per value, each rule alone): one
more proxy per setting over the same cluster's engines, the same workloads and rates, run
after run in turn with the P/D proxy; their rows are named ``CONFIG SETTING`` and the on/off
ratios of TTFT (P50, P90, mean), TPOT P90 and throughput are tabled
(:mod:`~vllm_hawk.bench.decode_first`). ``--prefix-caching`` runs the engines with prefix
caching on and empties every engine's cache before each run (vLLM's dev-mode
``/reset_prefix_cache``), so that each run starts with the same caches.

Output: a progress bar, tables, ``results/bench_serve*.json`` and a PNG next to it.
``--quick``: GG-Direct, GN-HAWK and collocated, one workload, two rates (< 5 min here).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_hawk.bench import decode_first as df
from vllm_hawk.bench import serve_workloads as wl
from vllm_hawk.bench.common import print_table, progress, write_json
from vllm_hawk.bench.local_cluster import CONFIGURATIONS, LocalCluster, http_get, scrape_metrics

COLLOCATED = "collocated"
STAGES = ("prefill", "decode_queue", "kv_ready", "pull", "first_step", "proxy_http")
QUICK = {"configs": ["GG-Direct", "GN-HAWK"], "workloads": ["sharegpt"], "rates": [2.0, 6.0], "num_prompts": 12}
FULL = {
    "configs": list(CONFIGURATIONS),
    "workloads": ["sharegpt", "longbench"],
    "rates": [1.0, 2.0, 4.0, 8.0, 16.0],
    "num_prompts": 40,
}


# ---------------------------------------------------------------- one load run
def run_load(base_url: str, model: str, dataset: str, num: int, rate: float, seed: int, log: io.TextIOBase) -> dict:
    """``vllm bench serve`` against ``base_url`` (completions, streamed, greedy, ignore_eos);
    its per-request results. Its console output goes to ``log``."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            base_url,
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--served-model-name",
            "tiny",
            "--tokenizer",
            model,
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            dataset,
            "--num-prompts",
            str(num),
            "--request-rate",
            str(rate),
            "--burstiness",
            "1.0",
            "--seed",
            str(seed),
            "--ignore-eos",
            "--temperature",
            "0",
            "--disable-tqdm",
            "--num-warmups",
            "0",
            "--save-detailed",
            "--ready-check-timeout-sec",
            "0",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
        ]
    )
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return bench_main(args)


# ---------------------------------------------------------------- TTFT breakdown
def _mean(before: dict, after: dict, name: str) -> tuple[float, int]:
    """Mean of histogram ``name`` between two scrapes, and its count."""
    n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    s = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return (s / n if n else math.nan), int(n)


def _mean_ms(before: dict, after: dict, name: str) -> tuple[float, int]:
    mean, n = _mean(before, after, name)
    return 1e3 * mean, n


def breakdown(proxy: tuple[dict, dict], decode: tuple[dict, dict]) -> dict:
    """Mean ms per request of each stage in :data:`STAGES`, from two scrapes (before,
    after) of the proxy's and the decode's ``/metrics``."""
    m = {}
    m["prefill"], n = _mean_ms(*proxy, "hawk_proxy_prefill_seconds")
    ttft, _ = _mean_ms(*proxy, "hawk_proxy_ttft_seconds")
    queue, _ = _mean_ms(*decode, "vllm:request_queue_time_seconds")
    total_pull, pulls = _mean_ms(*decode, "vllm:hawk_transfer_time_seconds")
    _, decoded = _mean(*decode, "vllm:request_prompt_tokens")
    m["kv_ready"], _ = _mean_ms(*decode, "vllm:hawk_kv_ready_seconds")
    m["pull"], _ = _mean_ms(*decode, "vllm:hawk_kv_read_seconds")
    m["first_step"], _ = _mean_ms(*decode, "vllm:request_prefill_time_seconds")
    pull_per_request = total_pull * pulls / decoded if pulls and decoded else 0.0
    m["decode_queue"] = max(0.0, queue - pull_per_request)
    m["proxy_http"] = max(0.0, ttft - m["prefill"] - queue - m["first_step"])
    out = {k: m[k] for k in STAGES}
    out.update(
        requests=n,
        pulls=pulls,
        proxy_ttft_ms=ttft,
        decode_prompt_tokens=_mean(*decode, "vllm:request_prompt_tokens")[0],
        pull_kib=_mean(*decode, "vllm:hawk_transfer_bytes")[0] / 1024,
        dominant=max(STAGES, key=lambda k: -1 if math.isnan(m[k]) else m[k]),
    )
    return out


def _scrape_after(proxy_url: str, decode_url: str, before_d: dict, expect: int, timeout_s: float = 6.0) -> dict:
    """The decode's metrics once the stats of its ``expect`` finished requests have
    arrived, or after ``timeout_s``. A request's pull is reported in an engine step before
    the one it finishes in, so its pull stats are in by then too. (Not every request pulls:
    a Tenstorrent decode recomputes a prompt of one block or less, see
    ``HawkConnectorScheduler.matched_end``.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        d = scrape_metrics(decode_url)
        key = "vllm:request_prompt_tokens_count"
        got = d.get(key, 0) - before_d.get(key, 0)
        if got >= expect or time.monotonic() > deadline:
            return d
        time.sleep(0.25)


# ---------------------------------------------------------------- targets
class Target:
    """What one configuration is served by: a base URL, and the decode's URL (P/D) for
    the breakdown (None: a single engine). A decode-first proxy names the configuration it
    is compared with (``baseline``) and its setting; ``engines``: URLs whose prefix caches
    are emptied before each run (``--prefix-caching``)."""

    def __init__(
        self,
        name: str,
        url: str,
        decode_url: str | None,
        baseline: str | None = None,
        setting: str | None = None,
        engines: tuple[str, ...] = (),
    ) -> None:
        self.name, self.url, self.decode_url = name, url, decode_url
        self.baseline, self.setting, self.engines = baseline, setting, engines

    @classmethod
    def from_url(cls, name: str, url: str) -> Target:
        """A given URL: a proxy (its ``/health`` names the decode servers) or one engine."""
        url = url.rstrip("/")
        decode = None
        try:
            code, body = http_get(url + "/health")
            if code == 200 and body.strip().startswith(b"{"):
                decode = (json.loads(body).get("decode") or [None])[0]
        except (OSError, ValueError):
            pass
        return cls(name, url, decode)


def sweep(
    targets: list[Target],
    model: str,
    datasets: dict,
    rates: list[float],
    num: int,
    seed: int,
    log,
    tick,
    rounds: int = 1,
) -> list[dict]:
    """Every workload at every rate against each of ``targets`` in turn, ``rounds`` times
    (A B A B ...: a load that drifts during the sweep falls on each target alike; round
    ``r`` serves ``datasets[workload][rate][r]``), one point per target, workload and rate
    with the rounds' requests together (raw per-request results; metrics are computed
    later, when the scaled SLOs are known)."""
    points = []
    for wname, paths in datasets.items():
        for i, rate in enumerate(rates):
            runs: dict[str, list[dict]] = {}
            for r in range(rounds):
                for target in targets:
                    tick(f"{target.name} {wname} {rate:g} req/s" + (f" ({r + 1}/{rounds})" if rounds > 1 else ""))
                    point = _run_point(target, model, wname, paths[i][r], rate, num, seed + i, log)
                    runs.setdefault(target.name, []).append(point)
            points += [merge_rounds(ps) for ps in runs.values()]
    return points


def merge_rounds(points: list[dict]) -> dict:
    """One point from several runs of one target, workload and rate: their requests and
    counts together, durations added (so throughput is over all of them), breakdown stages
    averaged over the runs (weighted by requests) and prefill counts added."""
    out = dict(points[0])
    if len(points) == 1:
        return out
    for k in ("duration_s", "wall_s", "completed", "failed", "output_tokens"):
        out[k] = sum(p[k] for p in points)
    out["requests"] = [r for p in points for r in p["requests"]]
    out["errors"] = sorted({e for p in points for e in p["errors"]})[:3]
    out["rounds"] = len(points)
    if "breakdown" in out:
        bds = [p["breakdown"] for p in points]
        n = sum(b["requests"] for b in bds) or 1
        merged = {k: sum(b[k] * b["requests"] for b in bds) / n for k in (*STAGES, "proxy_ttft_ms")}
        merged.update(requests=sum(b["requests"] for b in bds), pulls=sum(b["pulls"] for b in bds))
        for k in ("decode_prompt_tokens", "pull_kib"):
            merged[k] = sum(b[k] * b["requests"] for b in bds) / n
        merged["dominant"] = max(STAGES, key=lambda k: -1 if math.isnan(merged[k]) else merged[k])
        out["breakdown"] = merged
    if "prefills" in out:
        keys = dict.fromkeys(k for p in points for k in p["prefills"])  # a reason may appear in one round only
        out["prefills"] = {k: sum(p["prefills"].get(k, 0.0) for p in points) for k in keys}
    return out


def _run_point(target: Target, model: str, wname: str, path: str, rate: float, num: int, seed: int, log) -> dict:
    """One run of ``num`` requests of ``path`` at ``rate`` req/s against ``target``: its
    point, with the TTFT breakdown (P/D) or the proxy's prefill counts (decode-first)."""
    reset_prefix_caches(target.engines)
    pd = target.decode_url is not None and target.setting is None
    before = (scrape_metrics(target.url), scrape_metrics(target.decode_url)) if pd else None
    counts = df.scrape_prefills(target.url) if target.setting else None
    t0 = time.monotonic()
    res = run_load(target.url, model, path, num, rate, seed, log)
    reqs = wl.per_request(res)
    point = {
        "config": target.name,
        "workload": wname,
        "rate": rate,
        "duration_s": res["duration"],
        "wall_s": time.monotonic() - t0,
        "completed": res["completed"],
        "failed": res["failed"],
        "output_tokens": res["total_output_tokens"],
        "requests": reqs,
        "errors": sorted({e for e in res["errors"] if e})[:3],
    }
    if pd:
        ok = sum(r["ok"] for r in reqs)
        d_after = _scrape_after(target.url, target.decode_url, before[1], ok)
        point["breakdown"] = breakdown((before[0], scrape_metrics(target.url)), (before[1], d_after))
    if target.setting:
        point.update(baseline=target.baseline, setting=target.setting)
        point["prefills"] = df.prefill_counts(counts, df.scrape_prefills(target.url))
    return point


def reset_prefix_caches(engines: tuple[str, ...], timeout_s: float = 30.0) -> None:
    """Empty the prefix cache of every engine in ``engines`` (vLLM's ``POST
    /reset_prefix_cache``, served with ``VLLM_SERVER_DEV_MODE=1``), trying again while an
    engine still holds blocks (a prefill's hand-over), up to ``timeout_s``."""
    for url in engines:
        deadline = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read() or b"{}").get("success", True):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/reset_prefix_cache: still failing after {timeout_s:g} s (blocks held)")
            time.sleep(0.5)


def warm_up(target: Target, model: str, warm_path: str, log) -> None:
    run_load(target.url, model, warm_path, 2, math.inf, 0, log)


# ---------------------------------------------------------------- analysis
def slo_pairs(points: list[dict], reference: str) -> list[dict]:
    """The paper's pairs and the scaled ones: multiples of ``reference``'s P50 TTFT and
    TPOT at its lowest rate (per workload)."""
    pairs = [{"name": f"paper {t:.0f}/{p:.0f}", "ttft_ms": t, "tpot_ms": p, "workload": None} for t, p in wl.PAPER_SLOS]
    for w in sorted({p["workload"] for p in points}):
        ref = [p for p in points if p["workload"] == w and p["config"] == reference]
        if not ref:
            continue
        low = wl.latency_stats(min(ref, key=lambda p: p["rate"])["requests"])
        for mt, mp in wl.SCALED_SLO_MULTIPLES:
            t, p = mt * low["p50_ttft_ms"], mp * low["p50_tpot_ms"]
            pairs.append(
                {
                    "name": f"scaled {mt:g}x/{mp:g}x",
                    "ttft_ms": t,
                    "tpot_ms": p,
                    "workload": w,
                    "basis": f"{mt:g} x {reference} P50 TTFT ({low['p50_ttft_ms']:.1f} ms) and {mp:g} x its "
                    f"P50 TPOT ({low['p50_tpot_ms']:.2f} ms) at {min(r['rate'] for r in ref):g} req/s",
                }
            )
    return pairs


def analyse(points: list[dict], pairs: list[dict]) -> list[dict]:
    rows = []
    for p in points:
        reqs = p["requests"]
        row = {k: p[k] for k in ("config", "workload", "rate", "completed", "failed", "duration_s")}
        row.update(wl.latency_stats(reqs))
        row["output_throughput"] = p["output_tokens"] / p["duration_s"] if p["duration_s"] else 0.0
        for i, s in enumerate(q for q in pairs if q["workload"] in (None, p["workload"])):
            att, good = wl.attainment(reqs, s["ttft_ms"], s["tpot_ms"])
            row[f"slo{i}"], row[f"goodput{i}"] = att, good / p["duration_s"] if p["duration_s"] else 0.0
        row.update({k: p[k] for k in ("breakdown", "baseline", "setting", "prefills") if k in p})
        rows.append(row)
    return rows


def summarise(rows: list[dict], pairs: list[dict]) -> dict:
    """Per workload and configuration: the knee of each SLO pair; GN-HAWK / GG-Direct ratios;
    the dominant TTFT stage at the lowest rate and at the knee."""
    out: dict = {}
    for w in sorted({r["workload"] for r in rows}):
        wpairs = [q for q in pairs if q["workload"] in (None, w)]
        by_cfg: dict = {}
        for c in dict.fromkeys(r["config"] for r in rows if r["workload"] == w):
            pts = sorted((r for r in rows if r["workload"] == w and r["config"] == c), key=lambda r: r["rate"])
            k = {q["name"]: wl.knee(pts, f"slo{i}") for i, q in enumerate(wpairs)}
            entry = {"knees": k}
            if "breakdown" in pts[0]:
                # the knee: where the first SLO pair (in :func:`slo_pairs` order) that falls does
                knee_pair = next((n for n, v in k.items() if v["rate_below"] is not None), None)
                at_knee = next((r for r in pts if knee_pair and r["rate"] == k[knee_pair]["rate_below"]), pts[-1])
                entry["dominant_low"] = (pts[0]["rate"], pts[0]["breakdown"]["dominant"])
                entry["dominant_knee"] = (
                    at_knee["rate"],
                    at_knee["breakdown"]["dominant"],
                    knee_pair or "none falls: highest rate",
                )
            by_cfg[c] = entry
        ratios = {}
        gn = {r["rate"]: r for r in rows if r["workload"] == w and r["config"] == "GN-HAWK"}
        gd = {r["rate"]: r for r in rows if r["workload"] == w and r["config"] == "GG-Direct"}
        for rate in sorted(set(gn) & set(gd)):
            ratios[f"{rate:g}"] = {
                m: _ratio(gn[rate][m], gd[rate][m]) for m in ("p90_ttft_ms", "p90_tpot_ms", "output_throughput")
            }
        if "GN-HAWK" in by_cfg and "GG-Direct" in by_cfg:
            ratios["throughput_at_90"] = {
                q["name"]: _ratio(
                    by_cfg["GN-HAWK"]["knees"][q["name"]]["throughput_at"],
                    by_cfg["GG-Direct"]["knees"][q["name"]]["throughput_at"],
                )
                for q in wpairs
            }
        out[w] = {"configs": by_cfg, "gn_hawk_over_gg_direct": ratios}
    return out


def _ratio(a, b):
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else None


# ---------------------------------------------------------------- output
def print_results(rows: list[dict], pairs: list[dict], summary: dict) -> None:
    for w in summary:
        wpairs = [q for q in pairs if q["workload"] in (None, w)]
        print(f"\n=== workload {w}")
        cols = [("config", "config", ""), ("rate", "req/s", "g"), ("completed", "done", "d"), ("failed", "fail", "d")]
        for m in ("ttft", "tpot", "e2e"):
            cols += [(f"p{p}_{m}_ms", f"{m.upper()} P{p}", ".1f") for p in (50, 90, 99)]
        cols += [("output_throughput", "out tok/s", ".1f")]
        cols += [(f"slo{i}", f"att{i}", ".2f") for i in range(len(wpairs))]
        cols += [(f"goodput{i}", f"good{i}", ".2f") for i in range(len(wpairs))]
        print_table([r for r in rows if r["workload"] == w], cols)
        for i, q in enumerate(wpairs):
            print(
                f"  att{i}/good{i}: {q['name']}: TTFT <= {q['ttft_ms']:.1f} ms and TPOT <= {q['tpot_ms']:.2f} ms"
                + (f" (scaled: {q['basis']})" if q.get("basis") else "")
                + "; goodput in req/s"
            )
        bd = [
            dict(
                config=r["config"],
                rate=r["rate"],
                **{k: r["breakdown"][k] for k in STAGES},
                ttft=r["breakdown"]["proxy_ttft_ms"],
                prompt=r["breakdown"]["decode_prompt_tokens"],
                pull_kib=r["breakdown"]["pull_kib"],
                dominant=r["breakdown"]["dominant"],
            )
            for r in rows
            if r["workload"] == w and "breakdown" in r
        ]
        if bd:
            print("\n  TTFT breakdown, mean ms per request (proxy -> prefill -> KV ready -> pull -> first step):")
            print_table(
                bd,
                [("config", "config", ""), ("rate", "req/s", "g"), ("ttft", "TTFT", ".1f")]
                + [(k, k, ".1f") for k in STAGES]
                + [("prompt", "prompt tok", ".1f"), ("pull_kib", "KiB/pull", ".1f")]
                + [("dominant", "dominant", "")],
            )
        s = summary[w]
        print("\n  falls below 90% attainment at (req/s; '-' never in the sweep) / output tok/s at 90%:")
        for c, e in s["configs"].items():
            knees = "; ".join(
                f"{n}: {_fmt(v['rate_below'])} / {_fmt(v['throughput_at'], '.1f')}" for n, v in e["knees"].items()
            )
            print(f"    {c:<11} {knees}")
            if "dominant_low" in e:
                print(
                    f"    {'':<11} TTFT dominated by {e['dominant_low'][1]} at {e['dominant_low'][0]:g} req/s "
                    f"(low load), by {e['dominant_knee'][1]} at {e['dominant_knee'][0]:g} req/s (knee of "
                    f"{e['dominant_knee'][2]})"
                )
        r = s["gn_hawk_over_gg_direct"]
        if r:
            print("  GN-HAWK / GG-Direct (same run):")
            for k, v in r.items():
                print(f"    {k}: " + ", ".join(f"{m} {_fmt(x, '.3f')}" for m, x in v.items()))


def _fmt(v, spec: str = "g") -> str:
    return "-" if v is None else format(v, spec)


def plot(rows: list[dict], pairs: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(len(works), 4, figsize=(18, 4 * len(works)), squeeze=False)
    for wi, w in enumerate(works):
        wpairs = [q for q in pairs if q["workload"] in (None, w)]
        for c in dict.fromkeys(r["config"] for r in rows):
            pts = sorted((r for r in rows if r["workload"] == w and r["config"] == c), key=lambda r: r["rate"])
            if not pts:
                continue
            style = {"ls": "--", "color": "k"} if c == COLLOCATED else {"marker": "o"}
            x = [p["rate"] for p in pts]
            axes[wi][0].plot(x, [p["p90_ttft_ms"] for p in pts], label=c, **style)
            axes[wi][1].plot(x, [p["p90_tpot_ms"] for p in pts], label=c, **style)
            for j, ax in ((0, axes[wi][2]), (len(wpairs) - 1, axes[wi][3])):
                ax.plot(x, [p[f"slo{j}"] for p in pts], label=c, **style)
        titles = [
            "P90 TTFT (ms)",
            "P90 TPOT (ms)",
            f"attainment: {wpairs[0]['name']}",
            f"attainment: {wpairs[-1]['name']}",
        ]
        for ax, t in zip(axes[wi], titles, strict=False):
            ax.set_title(f"{w}: {t}", fontsize=9)
            ax.set_xlabel("request rate (req/s, Poisson)")
            ax.set_xscale("log", base=2)
        for ax in axes[wi][2:]:
            ax.axhline(0.9, color="grey", lw=0.8)
            ax.set_ylim(0, 1.05)
        axes[wi][0].set_yscale("log")
        axes[wi][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------- main
def _parse_urls(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items:
        name, sep, url = it.partition("=")
        if not sep or not url.startswith("http"):
            raise SystemExit(f"--url {it!r}: expected NAME=http://HOST:PORT")
        out[name] = url
    return out


def _parser() -> argparse.ArgumentParser:
    """``hawk bench serve``'s command line (rates in requests/s, ``--max-model-len`` in tokens)."""
    ap = argparse.ArgumentParser(prog="hawk bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"smoke sweep: {QUICK}")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help=f"serving configurations (default: all of {list(CONFIGURATIONS)}; quick: {QUICK['configs']})",
    )
    ap.add_argument("--no-collocated", action="store_true", help="skip the single-engine reference line")
    ap.add_argument(
        "--url",
        nargs="+",
        default=[],
        metavar="NAME=URL",
        help="serve NAME with a running proxy or engine at URL instead of a local cluster",
    )
    ap.add_argument(
        "--decode-first", action="store_true", help="also serve through a proxy with hawk proxy's decode-first defaults"
    )
    ap.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also serve through a proxy per N: prompts under N tokens prefilled on the decode (the token rule alone)",
    )
    ap.add_argument(
        "--local-prefill-min-cached",
        type=float,
        nargs="+",
        default=[],
        metavar="F",
        help="also serve through a proxy per F: prompts whose prefix the decode holds for F of them prefilled there "
        "(the cached rule alone; with --prefix-caching)",
    )
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="engines with prefix caching on, every engine's cache emptied before each run (default: off)",
    )
    ap.add_argument("--workloads", nargs="+", default=None, choices=list(wl.WORKLOADS))
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="Poisson request rates (req/s)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per rate and workload")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each workload and rate this many times per target, targets in turn (A B A B ...), requests "
        "pooled: on a shared machine a drifting load then falls on every target alike",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model folder (default: the tiny bf16 Llama, built offline)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--workdir", default=None, help="cluster logs, workloads, vllm bench output (default: temp)")
    ap.add_argument("--out", default=None, help="JSON path (default: results/bench_serve[_quick].json)")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png; '' for none)")
    return ap


@dataclasses.dataclass
class _Plan:
    """What one invocation serves: configurations, workloads, rates (requests/s), requests per
    rate and workload, the given URLs, the work folder and the output paths."""

    configs: list[str]
    workloads: list[str]
    rates: list[float]
    num: int
    urls: dict[str, str]
    work: Path
    out: str
    plot_path: str
    settings: list = dataclasses.field(default_factory=list)  # decode_first.Setting per extra proxy
    prefix_caching: bool = False
    rounds: int = 1


def _plan(ap: argparse.ArgumentParser, a: argparse.Namespace) -> _Plan:
    """The sweep ``a`` asks for, defaults from ``--quick`` or the full sweep; exits through
    ``ap.error`` on an unknown configuration or a non-positive count or rate. Creates the
    work folder."""
    base = QUICK if a.quick else FULL
    configs = a.configs or (list(_parse_urls(a.url)) if a.url else base["configs"])
    unknown = [c for c in configs if c not in CONFIGURATIONS and c not in _parse_urls(a.url) and c != COLLOCATED]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {list(CONFIGURATIONS)} (or give --url NAME=URL)")
    workloads, rates = a.workloads or base["workloads"], sorted(a.rates or base["rates"])
    num = a.num_prompts or base["num_prompts"]
    if num < 1 or any(r <= 0 for r in rates):
        ap.error("--num-prompts and --rates must be positive")
    out = a.out or f"results/bench_serve{'_quick' if a.quick else ''}.json"
    plot_path = os.path.splitext(out)[0] + ".png" if a.plot is None else a.plot
    settings = _settings(ap, a, configs)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="hawk-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    return _Plan(
        configs, workloads, rates, num, _parse_urls(a.url), work, out, plot_path, settings, a.prefix_caching, a.rounds
    )


def _settings(ap: argparse.ArgumentParser, a: argparse.Namespace, configs: list[str]) -> list:
    """The decode-first proxies ``a`` asks for; ``ap.error`` names the flag at fault."""
    if any(n < 1 for n in a.local_prefill_max_tokens):
        ap.error("--local-prefill-max-tokens: each N must be >= 1 (the P/D rows are the rule off)")
    if any(not 0 < f < 1 for f in a.local_prefill_min_cached):
        ap.error("--local-prefill-min-cached: each F must be above 0 and below 1 (the P/D rows are the rule off)")
    try:
        settings = df.settings_of(
            a.decode_first, a.local_prefill_max_tokens, a.local_prefill_min_cached, LocalCluster.block_size
        )
    except ValueError as e:
        ap.error(f"--local-prefill-max-tokens / --local-prefill-min-cached: {e}")
    if settings and (a.url or not set(configs) & set(CONFIGURATIONS)):
        ap.error("--decode-first and its sweeps need a local P/D cluster (--configs from the configurations, no --url)")
    return settings


def _make_datasets(plan: _Plan, tok, seed: int, max_model_len: int) -> tuple[dict, list[dict], str]:
    """Per workload, per rate ``i`` and per round ``r`` one dataset file (seed ``seed + 1000 *
    i + 100_000 * r``: every target of a round serves the same prompts, each round new ones,
    so that nothing a proxy or an engine remembers of a round meets the same prompt again),
    their descriptions, and a two-request warm-up dataset's path."""
    datasets, described = {}, []
    for w in plan.workloads:
        datasets[w] = []
        for i in range(len(plan.rates)):
            datasets[w].append([])
            for r in range(plan.rounds):
                path = plan.work / (f"{w}_{i}.json" if r == 0 else f"{w}_{i}_round{r}.json")
                d = wl.make_workload(
                    w, tok, plan.num, seed + 1000 * i + 100_000 * r, path, max_model_len, LocalCluster.block_size
                )
                datasets[w][i].append(d["path"])
                described.append({**d, "rate": plan.rates[i], **({"round": r} if plan.rounds > 1 else {})})
    warm = wl.make_workload("sharegpt", tok, 2, 12345, plan.work / "warmup.json", max_model_len)["path"]
    return datasets, described, warm


class _Sweeper:
    """Runs the warm-up and then the sweep (:func:`sweep`) against one target after another,
    advancing one progress bar over all ``steps`` (one per target, workload and rate)."""

    def __init__(self, model: str, datasets: dict, warm: str, plan: _Plan, seed: int, log, steps: int) -> None:
        self.model, self.datasets, self.warm, self.plan, self.seed = model, datasets, warm, plan, seed
        self.log, self.steps, self.done = log, steps, 0

    def tick(self, label: str) -> None:
        progress(self.done, self.steps, label)
        self.done += 1

    def targets(self, ts: list[Target]) -> list[dict]:
        """Warm each of ``ts`` up, then sweep them in turn (:func:`sweep`)."""
        for t in ts:
            warm_up(t, self.model, self.warm, self.log)
        plan = self.plan
        return sweep(ts, self.model, self.datasets, plan.rates, plan.num, self.seed, self.log, self.tick, plan.rounds)


def _sweep_local(sw: _Sweeper, c: str, max_model_len: int, collocated: bool) -> tuple[list[dict], bool]:
    """Configuration ``c`` on a local cluster, started and stopped here, through its P/D
    proxy and one proxy per decode-first setting of the plan (in turn); with ``collocated``
    and a GPU decode, also its decode server alone as the collocated reference. Its points,
    and whether the reference was served."""
    caching = sw.plan.prefix_caching
    cluster = LocalCluster.configured(
        c,
        sw.model,
        sw.plan.work / c,
        dtype="bfloat16",
        max_model_len=max_model_len,
        extra_args=[] if caching else ["--no-enable-prefix-caching"],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"} if caching else {},  # /reset_prefix_cache
    )
    progress(sw.done, sw.steps, f"starting {c} ...")
    points: list[dict] = []
    try:
        cluster.start()
        engines = tuple(cluster.prefill_urls + cluster.decode_urls) if caching else ()
        targets = [Target(c, cluster.proxy_url, cluster.decode_url, engines=engines)]
        for st in sw.plan.settings:
            url = cluster.add_proxy(st.name.replace("<", "lt").replace(">=", "ge"), list(st.args))
            targets.append(Target(f"{c} {st.name}", url, cluster.decode_url, c, st.name, engines))
        points += sw.targets(targets)
        single = collocated and not CONFIGURATIONS[c].get("tt")
        if single:
            points += sw.targets([Target(COLLOCATED, cluster.decode_url, None, engines=engines)])
    finally:
        cluster.stop()
    return points, single


def _serve_all(a: argparse.Namespace, plan: _Plan, model: str, datasets: dict, warm: str, t_start: float) -> list[dict]:
    """Every configuration's sweep (and the collocated reference once, unless
    ``--no-collocated``); the points, raw per request. ``t_start``: ``time.monotonic`` seconds."""
    configs, urls = plan.configs, plan.urls
    collocated = not a.no_collocated and COLLOCATED not in configs
    steps = (len(configs) * (1 + len(plan.settings)) + collocated) * len(plan.workloads) * len(plan.rates) * plan.rounds
    log = open(plan.work / "vllm_bench_serve.log", "a")  # noqa: SIM115 - closed after the sweep
    sw = _Sweeper(model, datasets, warm, plan, a.seed, log, steps)
    points: list[dict] = []
    print(
        f"hawk bench serve: configs {configs}{' + collocated' if collocated else ''}"
        f"{', decode-first ' + str([st.name for st in plan.settings]) if plan.settings else ''}, workloads "
        f"{plan.workloads}, rates {plan.rates} req/s, {plan.num} requests each; logs in {plan.work}",
        flush=True,
    )
    given = [Target.from_url(c, urls[c]) for c in configs if c in urls]
    if given:  # in turn, as the proxies of one local cluster
        points += sw.targets(given)
    for c in (c for c in configs if c not in urls):
        got, served_collocated = _sweep_local(sw, c, a.max_model_len, collocated)
        points += got
        collocated = collocated and not served_collocated
    progress(steps, steps, f"done in {time.monotonic() - t_start:.0f} s")
    log.close()
    return points


def _report(
    a: argparse.Namespace, plan: _Plan, model: str, described: list[dict], points: list[dict], t_start: float
) -> None:
    """The analysis of ``points``: tables, the JSON at ``plan.out`` (wall time in seconds) and the plot."""
    reference = COLLOCATED if any(p["config"] == COLLOCATED for p in points) else points[0]["config"]
    pairs = slo_pairs(points, reference)
    rows = analyse(points, pairs)
    summary = summarise(rows, pairs)
    print_results(rows, pairs, summary)
    on_off = df.ratios(rows)
    df.print_ratios(on_off)
    result = {
        "bench": "serve",
        "args": vars(a),
        "wall_s": time.monotonic() - t_start,
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "model": model,
        "workloads": described,
        "slo_pairs": pairs,
        "slo_note": "attainment: share of sent requests with TTFT and TPOT within the pair (failed: missed); "
        "scaled pairs are multiples of the reference's unloaded P50 (see basis)",
        "breakdown_stages": STAGES,
        "rows": rows,
        "summary": summary,
        "decode_first": on_off,
        "points": [{k: v for k, v in p.items() if k != "requests"} for p in points],
    }
    path = write_json(plan.out, result)
    print(f"\nwrote {path} (wall {result['wall_s']:.0f} s)")
    if plan.plot_path:
        try:
            print(f"wrote {plot(rows, pairs, plan.plot_path)}")
        except Exception as e:  # noqa: BLE001 - the measurements are written already
            print(f"no plot ({type(e).__name__}: {e})")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    plan = _plan(ap, a)
    t_start = time.monotonic()

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    model = str(a.model or build_tiny_llama(dtype="bfloat16"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    datasets, described, warm = _make_datasets(plan, tok, a.seed, a.max_model_len)
    points = _serve_all(a, plan, model, datasets, warm, t_start)
    write_json(plan.work / "points.json", {"points": points})  # raw, per request: kept if the analysis fails
    _report(a, plan, model, described, points, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
