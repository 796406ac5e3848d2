"""Disaggregated serving on this machine: a prefill vLLM, a decode vLLM, and the proxy.

    python examples/pd_local/run_demo.py [--transport mooncake-tcp|host-staged]
                                         [--mode direct|staged] [--workdir DIR]
                                         [--gn-hawk both|off|only] [--tt-device p150a|n150|n300]
                                         [--tt-kv-dtype bfloat16|bfloat8_b]
                                         [--gn-prefill-tp N] [--tt-chips N]

Builds the offline tiny Llama (float32), starts the three servers (HawkConnector moves
the KV from the prefill's cache into the decode's), sends a few streaming requests
through the proxy and prints, per request: the output, the time to first token (TTFT)
through the proxy and on a single engine (the decode server alone, cold cache), and the
KV pull (time, bytes, transport operations) from the decode's Prometheus metrics.
Everything is shut down at the end (also on Ctrl-C), and no process is left behind.

Second phase (``--gn-hawk both``, the default): GN-HAWK, the paper's configuration in
miniature: a tensor-parallel prefill (``--gn-prefill-tp``, default 2 ranks) on the CPU
engine (vLLM's paged layout, the GPU stand-in) and a decode on a mesh of emulated
Tenstorrent Blackhole chips (``--tt-chips``, default 2 x p150a, 8 DRAM banks each; the
vLLM platform plugin ``vllm_hawk.tenstorrent.emulated``), with the tiny Llama in bf16 (4 KV heads:
2 per prefill rank, 2 per chip). Each prefill rank transforms its heads of each request
into its chip's tile layout, one segment per bank, and the decode READs every chip's
segments at once into per-bank receive buffers (``--mode staged``) or straight into the
KV pages (``--mode direct``). Printed per request: TTFT next to GG-Direct's for the same
prompt, and the transfer per chip (prefill rank, bytes per bank, segments, READ
operations, intra-bank copies) and in all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_hawk.bench.local_cluster import LocalCluster, scrape_metrics  # noqa: E402
from vllm_hawk.connector.config import VLLM_PROFILE, pair_of  # noqa: E402

PROMPTS = [
    "Hi",
    "The prefill engine computes the cache blocks of every layer",
    "A decode engine on a Tenstorrent card reads the key and value tiles from eight DRAM "
    "banks, one segment per bank, in a single batch of RDMA reads. " * 2,
    "Long prompt: " + "the request buffer of the network kernel copies one page per bank; " * 12,
]
MAX_TOKENS = 16


def stream(url: str, body: dict) -> tuple[float, float, str]:
    """POST a streaming completion to server ``url``; returns (ttft_s, total_s, text)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{url}: HTTP {r.status}: {r.read()[:500]!r}")
    ttft, parts = None, []
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        text = json.loads(line[6:])["choices"][0].get("text", "")
        if text and ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(text)
    conn.close()
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, "".join(parts)


def pull_stats(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("vllm:hawk_transfer_time_seconds_count", 0)
    return {
        "pulls": int(n),
        "ms": 1e3 * d.get("vllm:hawk_transfer_time_seconds_sum", 0.0),
        "kib": d.get("vllm:hawk_transfer_bytes_sum", 0.0) / 1024,
        "ops": int(d.get("vllm:hawk_transfer_operations_sum", 0.0)),
        "segments": int(d.get("vllm:hawk_transfer_segments_sum", 0.0)),
        "failed": int(d.get("vllm:hawk_failed_transfers_total", 0.0)),
    }


def wait_for_stats(url: str, before: dict, timeout_s: float = 5.0) -> dict:
    """Stats reach /metrics with the engine's next output: poll briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = pull_stats(before, scrape_metrics(url))
        if s["pulls"] or s["failed"] or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="mooncake-tcp", choices=["mooncake-tcp", "mooncake-rdma", "host-staged"])
    ap.add_argument("--mode", default="direct", choices=["direct", "staged"])
    ap.add_argument("--workdir", default=None, help="logs and config (default: a temp folder)")
    ap.add_argument(
        "--gn-hawk",
        default="both",
        choices=["both", "off", "only"],
        help="also run GN-HAWK (decode on the emulated Tenstorrent device)",
    )
    ap.add_argument("--tt-device", default="p150a", choices=["p150a", "n150", "n300"])
    ap.add_argument("--tt-kv-dtype", default="bfloat16", choices=["bfloat16", "bfloat8_b"])
    ap.add_argument("--gn-prefill-tp", type=int, default=2, help="GN-HAWK prefill tensor-parallel ranks")
    ap.add_argument("--tt-chips", type=int, default=2, help="chips of the emulated Tenstorrent decode mesh")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hawk-pd-demo-"))
    ok, gg_ttft = True, {}
    if args.gn_hawk != "only":
        ok, gg_ttft = run_gg(args, workdir / "gg")
    if args.gn_hawk != "off" and ok is not None:
        ok = run_gn(args, workdir / "gn", gg_ttft) and ok
    return 0 if ok else 1


def _progress_printer():
    tty = sys.stdout.isatty()
    shown = {"last": -10.0}

    def progress(what: str, seconds: float) -> None:
        if tty:
            print(f"\r  starting {what} ... {seconds:4.0f} s ", end="", flush=True)
        elif seconds - shown["last"] >= 10:
            shown["last"] = seconds
            print(f"  starting {what} ... {seconds:4.0f} s", flush=True)

    return progress, tty


def run_gn(args, workdir: Path, gg_ttft: dict) -> bool:
    """GN-HAWK: CPU prefill -> emulated Tenstorrent decode (see the module doc)."""
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    model = build_tiny_llama(dtype="bfloat16")
    transport = "mooncake-tcp" if args.transport == "host-staged" else args.transport
    cluster = LocalCluster(
        model,
        workdir,
        dtype="bfloat16",
        prefill_tp=args.gn_prefill_tp,
        decode_tt={"device": args.tt_device, "kv_dtype": args.tt_kv_dtype, "chips": args.tt_chips},
        extra_config={"pair": "gn-hawk", "transport": transport, "pull_timeout_s": 60.0, "handshake_timeout_s": 30.0},
        decode_config={"mode": args.mode},  # GN-HAWK: the decode's landing; the prefill transforms into its ring
    )
    progress, tty = _progress_printer()
    t_start = time.monotonic()
    print(
        f"\n=== GN-HAWK: prefill vLLM on the CPU (TP={args.gn_prefill_tp}) -> decode vLLM on "
        f"{args.tt_chips} emulated {args.tt_device} chip(s) ({args.tt_kv_dtype} tiles), mode {args.mode}, "
        f"transport {transport} (logs in {workdir})"
    )
    ok = False
    try:
        cluster.start(progress)
        print(f"{chr(13) if tty else ''}  all up after {time.monotonic() - t_start:.0f} s")
        stream(cluster.proxy_url, {"model": "tiny", "prompt": "warm up", "max_tokens": 2})
        rows, pulls = [], []
        for i, prompt in enumerate(PROMPTS):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            ttft, _total, text = stream(cluster.proxy_url, {**body, "cache_salt": f"gn-{i}"})
            fig, n_tok = transfer_figures(cluster.proxy_url, {**body, "max_tokens": 2, "cache_salt": f"gn-stats-{i}"})
            rows.append((prompt, ttft, fig, text))
            # a Tenstorrent decode recomputes a prompt of one block or less and pulls nothing
            pulls.append(bool(fig.get("ok")) if n_tok > cluster.block_size else not fig)
        print(
            f"\n{'#':>2} {'prompt':<34} {'TTFT GN':>9} {'TTFT GG':>9} {'pull':>8} {'KiB':>6} "
            f"{'segs':>4} {'READs':>5} {'copies':>6}  bytes per bank (KiB)"
        )
        for i, (prompt, ttft, f, _text) in enumerate(rows):
            short = (prompt[:31] + "...") if len(prompt) > 34 else prompt
            gg = gg_ttft.get(i)
            per_bank = " ".join(f"{b / 1024:.0f}" for b in f.get("bytes_per_bank", []))
            per_bank = f"[{per_bank}]" if per_bank or not f.get("shares") else "per chip:"
            print(
                f"{i:>2} {short:<34} {1e3 * ttft:7.1f}ms "
                f"{(f'{1e3 * gg:7.1f}ms') if gg is not None else '      - ':>9} "
                f"{f.get('total_ms', 0):6.1f}ms {f.get('nbytes', 0) / 1024:6.0f} "
                f"{f.get('segments', 0):>4} {f.get('entries', 0):>5} {f.get('intra_bank_ops', 0):>6}  "
                f"{per_bank}"
            )
            for sh in f.get("shares", []):  # one line per chip: who fed it, what landed where
                banks = " ".join(f"{b / 1024:.0f}" for b in sh.get("bytes_per_bank", []))
                print(
                    f"{'':>2}   chip {sh['target']} <- prefill rank {sh['prefill_rank']} ({sh['heads'][1]} KV "
                    f"heads): "
                    f"{sh['nbytes'] / 1024:.0f} KiB, {sh['segments']} segs, {sh['entries']} READs, "
                    f"per bank [{banks}]"
                )
        print(
            "\nTTFT GN: through the proxy to the Tenstorrent decode; TTFT GG: GG-Direct "
            "(first phase, float32 model) for the same prompt.\npull: KVRequest -> KV in the "
            "device banks of every chip (includes the prefill's transform); segs: one per bank and chip; "
            "READs: transport operations (one batch per chip, all chips at once);\ncopies: intra-bank "
            "copies from the receive buffers into the KV pages (staged mode); no pull: a prompt of one block or "
            "less, which the Tenstorrent decode recomputes. Emulated devices: CPU figures."
        )
        for i, (_p, _t, _f, text) in enumerate(rows):
            print(f"{i:>2} output: {text!r}")
        ok = all(pulls) and any(r[2] for r in rows)
    except KeyboardInterrupt:
        print("\ninterrupted")
    finally:
        print("shutting down ...", flush=True)
        cluster.stop()
        left = cluster.leftover_processes()
        print("all processes stopped" if not left else f"WARNING: process groups left: {left}")
    return ok


def transfer_figures(url: str, body: dict) -> tuple[dict, int]:
    """A non-streamed request: the decode's per-request transfer figures
    (``kv_transfer_params.hawk_transfer``) and the prompt's token count."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
    finally:
        conn.close()
    fig = (out.get("kv_transfer_params") or {}).get("hawk_transfer") or {}
    return fig, int((out.get("usage") or {}).get("prompt_tokens") or 0)


def _gg_config(args) -> dict:
    """The connector fields of the GG run: its ``pair`` where the flags make one (GG-Direct,
    GG-Host), else the two fields as given (Mooncake with ``--mode staged``, ``host-staged``
    with ``--mode direct``)."""
    strategy = {"transport": args.transport, "mode": args.mode}
    pair = pair_of({**strategy, "device_profile": VLLM_PROFILE, "layout_fix": "prefill"})
    return {"pair": pair, "transport": args.transport} if pair else strategy


def run_gg(args, workdir: Path) -> tuple[bool, dict]:
    """GG-Direct (or GG-Host with --transport host-staged): two CPU vLLM engines."""

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    print("building the tiny float32 Llama (offline; cached after the first run) ...", flush=True)
    model = build_tiny_llama(dtype="float32")
    cluster = LocalCluster(model, workdir, extra_config=_gg_config(args))
    rows: list = []
    t_start = time.monotonic()
    progress, tty = _progress_printer()

    label = "GG-Host" if args.transport == "host-staged" else "GG-Direct"
    print(f"=== {label}: prefill vLLM on the CPU -> decode vLLM on the CPU")
    print(
        f"starting prefill vLLM, decode vLLM and the proxy (logs in {workdir}); "
        f"transport {args.transport}, mode {args.mode}"
    )
    try:
        cluster.start(progress)
        print(
            f"{chr(13) if tty else ''}  all up after {time.monotonic() - t_start:.0f} s: "
            f"prefill {cluster.prefill_url}, "
            f"decode {cluster.decode_url}, proxy {cluster.proxy_url}"
        )
        stream(cluster.proxy_url, {"model": "tiny", "prompt": "warm up", "max_tokens": 2})
        stream(cluster.decode_url, {"model": "tiny", "prompt": "warm up", "max_tokens": 2})

        for i, prompt in enumerate(PROMPTS):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            before = scrape_metrics(cluster.decode_url)
            ttft_pd, total_pd, text_pd = stream(cluster.proxy_url, {**body, "cache_salt": f"pd-{i}"})
            stats = wait_for_stats(cluster.decode_url, before)
            ttft_1, total_1, text_1 = stream(cluster.decode_url, {**body, "cache_salt": f"single-{i}"})
            rows.append((prompt, ttft_pd, ttft_1, total_pd, stats, text_pd, text_pd == text_1))

        print()
        print(
            f"{'#':>2} {'prompt':<34} {'TTFT P/D':>9} {'TTFT 1eng':>9} {'pull':>8} "
            f"{'KiB':>6} {'ops':>4} {'segs':>4} {'same':>4}  output"
        )
        for i, (prompt, t_pd, t_1, _tot, s, text, same) in enumerate(rows):
            short = (prompt[:31] + "...") if len(prompt) > 34 else prompt
            print(
                f"{i:>2} {short:<34} {1e3 * t_pd:7.1f}ms {1e3 * t_1:7.1f}ms {s['ms']:6.1f}ms "
                f"{s['kib']:6.0f} {s['ops']:>4} {s['segments']:>4} {'yes' if same else 'NO':>4}"
                f"  {text!r}"
            )
        print(
            "\nTTFT P/D: through the proxy (prefill request + KV pull + first decode step); "
            "TTFT 1eng: the same prompt on one engine.\npull: decode-side KV pull "
            "(KVRequest -> KV in place); ops: transport READs after coalescing block runs."
        )
        p = scrape_metrics(cluster.prefill_url)
        print(
            f"prefill: {int(p.get('vllm:hawk_released_total', 0))} held requests released by "
            f"the decode, {int(p.get('vllm:hawk_expired_leases_total', 0))} expired leases"
        )
        ok = all(r[6] for r in rows)
    except KeyboardInterrupt:
        print("\ninterrupted")
        ok = None
    finally:
        print("shutting down ...", flush=True)
        cluster.stop()
        left = cluster.leftover_processes()
        print("all processes stopped" if not left else f"WARNING: process groups left: {left}")
    return ok, {i: r[1] for i, r in enumerate(rows)} if ok is not None else {}


if __name__ == "__main__":
    sys.exit(main())
