"""``hawk bench serve``'s decode-first comparison (``--decode-first``, ``--local-prefill-max-tokens``,
``--local-prefill-min-cached``): the same workload, on the same cluster and in the same run,
through the cluster's P/D proxy (decode-first off) and through one more ``hawk proxy`` per
setting over the same engines, run after run in turn at each rate. Per setting, rate and
workload: TTFT (P50, P90, mean, ms), TPOT P90 and output throughput (tokens/s) with the
policy on and off, their ratios (on / off), and where the proxy had the prompts prefilled
(``hawk_proxy_prefills_total`` by ``where/reason``) with its mean ``/tokenize`` round trip.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from vllm_hawk.bench.common import print_table

#: what the on/off ratio table compares (keys of ``hawk bench serve``'s rows)
METRICS = ("p50_ttft_ms", "p90_ttft_ms", "mean_ttft_ms", "p90_tpot_ms", "output_throughput")


@dataclass(frozen=True)
class Setting:
    """One decode-first proxy: its name in the tables and its ``hawk proxy`` flags."""

    name: str
    args: tuple[str, ...]


def settings_of(defaults: bool, tokens: list[int], cached: list[float], block_size: int) -> list[Setting]:
    """The proxies to compare with P/D: ``hawk proxy``'s defaults (``defaults``), each token
    threshold alone (``local<N``) and each cached fraction alone (``cached>=F``); every one
    told the decodes' ``block_size`` (tokens)."""
    bs = ("--decode-block-size", str(block_size))
    out = [Setting("decode-first", bs)] if defaults else []
    out += [
        Setting(f"local<{n}", ("--local-prefill-max-tokens", str(n), "--local-prefill-min-cached", "0", *bs))
        for n in tokens
    ]
    out += [
        Setting(f"cached>={f:g}", ("--local-prefill-max-tokens", "0", "--local-prefill-min-cached", str(f), *bs))
        for f in cached
    ]
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"decode-first settings repeat: {names}")
    return out


def scrape_prefills(url: str) -> dict[str, float]:
    """A proxy's counters by label set: ``where/reason`` of ``hawk_proxy_prefills_total``,
    ``tokenize_fallbacks/CAUSE``, and ``tokenize_sum`` / ``tokenize_count`` (seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "hawk_proxy_prefills_total":
                out[f"{s.labels['where']}/{s.labels['reason']}"] = s.value
            elif s.name == "hawk_proxy_tokenize_fallbacks_total":
                out[f"tokenize_fallbacks/{s.labels['cause']}"] = s.value
            elif s.name in ("hawk_proxy_tokenize_seconds_sum", "hawk_proxy_tokenize_seconds_count"):
                out["tokenize_" + s.name.rsplit("_", 1)[1]] = s.value
    return out


def prefill_counts(before: dict, after: dict) -> dict:
    """What one run added to :func:`scrape_prefills`' counters (``where/reason`` counts,
    fallbacks, ``tokenize_sum`` in seconds and ``tokenize_count``)."""
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}


def ratios(rows: list[dict]) -> list[dict]:
    """Per decode-first row (``baseline`` and ``setting`` set): its metrics on and off
    (the ``baseline`` configuration's row of the same workload and rate) and on / off."""
    base = {(r["workload"], r["rate"], r["config"]): r for r in rows if "setting" not in r}
    out = []
    for r in rows:
        off = base.get((r["workload"], r["rate"], r.get("baseline")))
        if "setting" not in r or off is None:
            continue
        local = sum(v for k, v in r.get("prefills", {}).items() if k.startswith("local/"))
        total = sum(v for k, v in r.get("prefills", {}).items() if k.startswith(("local/", "remote/")))
        e = {"workload": r["workload"], "rate": r["rate"], "config": r["baseline"], "setting": r["setting"]}
        e["local_share"] = local / total if total else math.nan
        n_tok = r.get("prefills", {}).get("tokenize_count", 0.0)
        e["tokenize_mean_ms"] = 1e3 * r["prefills"]["tokenize_sum"] / n_tok if n_tok else math.nan
        for m in METRICS:
            e[f"{m}_on"], e[f"{m}_off"] = r[m], off[m]
            e[f"{m}_ratio"] = r[m] / off[m] if off[m] and not math.isnan(off[m]) else math.nan
        out.append(e)
    return out


def print_ratios(entries: list[dict]) -> None:
    """The on/off table (ms, tokens/s; ratio = on / off, same cluster and run)."""
    if not entries:
        return
    print("\n=== decode-first on / off (same cluster, same workload, runs in turn; ratio = on / off)")
    cols = [("workload", "workload", ""), ("config", "config", ""), ("setting", "setting", ""), ("rate", "req/s", "g")]
    cols += [("local_share", "local", ".2f"), ("tokenize_mean_ms", "tokenize ms", ".1f")]
    for m, h in (("p50_ttft_ms", "TTFT P50"), ("p90_ttft_ms", "TTFT P90"), ("mean_ttft_ms", "TTFT mean")):
        cols += [(f"{m}_on", f"{h} on", ".1f"), (f"{m}_off", "off", ".1f"), (f"{m}_ratio", "ratio", ".3f")]
    cols += [("p90_tpot_ms_ratio", "TPOT P90 ratio", ".3f")]
    cols += [("output_throughput_on", "out tok/s on", ".1f"), ("output_throughput_off", "off", ".1f")]
    cols += [("output_throughput_ratio", "ratio", ".3f")]
    print_table(entries, cols)
