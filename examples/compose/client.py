"""The emulated compose profile's client: requests through the proxy and vLLM's router, checked.

    python client.py --proxy http://proxy:8000 --router http://router:8000 \
                     --prefill http://prefill:8000 --decode http://decode:8000 --debug-dir /debug [--json OUT]

Runs in the prefill image (torch and vllm_hawk are there), on the compose network. For
each prompt (token ids across block boundaries, block 32) it sends

* a streaming request through the proxy: TTFT;
* a plain request through the proxy: tokens and the decode's transfer figures
  (``kv_transfer_params.hawk_transfer``: pull time, bytes per bank, READs, copies);
* the same plain request through vLLM's router (``vllm-router --vllm-pd-disaggregation``):
  tokens and figures again;
* the same prompt to the prefill engine alone with ``logprobs=2``: the single-engine
  reference (the stock CPU engine, bf16 KV).

Checks, as tests/e2e/test_gn_hawk.py does for one machine: outputs equal the reference
token for token except where the reference's top-2 logprob gap at the first difference is
below TIE_MARGIN (a tie: the CPU attention and the plugin's tile attention round bf16
differently), through either front; a prompt longer than one block moves KV once, a shorter
one not at all (the Tenstorrent decode recomputes it); every transfer's bytes in the
decode's banks equal ``tilize_pack`` of the prefill's K/V (both engines dump them under
HAWK_DEBUG_DIR, a shared volume); the figures name 8 banks (p150a). Prints the same
per-request table as ``make demo`` and exits 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import random
import sys
import time
import urllib.parse
from pathlib import Path

TIE_MARGIN = 2.0**-6
MAX_TOKENS = 10
BLOCK = 32
BANKS = 8  # p150a
LENGTHS = (5, 32, 33, 100, 257)


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[0] + [rng.randrange(2, 1024) for _ in range(n - 1)] for n in LENGTHS]


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {raw[:500]}")
        return json.loads(raw)
    finally:
        conn.close()


def ttft(url: str, body: dict, timeout: float = 300.0) -> float:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {r.read()[:500]!r}")
        first = None
        for line in r:
            line = line.strip()
            if (
                first is None
                and line.startswith(b"data: ")
                and line != b"data: [DONE]"
                and json.loads(line[6:])["choices"][0].get("text")
            ):
                first = time.perf_counter() - t0
        return first if first is not None else time.perf_counter() - t0
    finally:
        conn.close()


def divergence(got: list[int], ref: dict) -> tuple[int, float] | None:
    """None if equal, else (first differing position, the reference's top-2 gap there)."""
    want = ref["token_ids"]
    if got == want:
        return None
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    top = sorted(ref["logprobs"]["top_logprobs"][i].values(), reverse=True)
    return i, (top[0] - top[1] if len(top) > 1 else float("inf"))


def check_dumps(debug: Path, done: set[str]) -> list[str]:
    """Transfers not checked yet: decode bank bytes == tilize_pack(prefill K/V). Returns keys."""
    import torch

    from vllm_hawk.layout.formats import tilize_pack

    new = []
    for dp in sorted(glob.glob(str(debug / "decode-*.pt"))):
        key = Path(dp).name.removeprefix("decode-")
        if key in done:
            continue
        pp = debug / f"prefill-{key}"
        if not pp.exists():
            raise AssertionError(f"no prefill dump for {key}")
        d, p = torch.load(dp), torch.load(pp)
        assert d["dst_blocks"] == p["dst_blocks"], f"{key}: block lists differ"
        assert len(d["bytes"]) == len(p["kv"]), f"{key}: layer counts differ"
        for layer, ((k, v), (kb, vb)) in enumerate(zip(p["kv"], d["bytes"], strict=False)):
            for name, x, got in (("K", k, kb), ("V", v, vb)):
                want = tilize_pack(x.to(torch.float32), d["dtype"]).reshape(got.shape)
                assert torch.equal(want, got), f"{key}: layer {layer} {name} bytes differ"
        done.add(key)
        new.append(key)
    return new


def transfer_problems(what: str, p: list[int], fig: dict, new: list[str]) -> list[str]:
    """One new checked transfer with figures naming the banks; none for a prompt of one block
    or less (the Tenstorrent decode recomputes it: it resumes only at a block boundary)."""
    want = 1 if (len(p) - 1) // BLOCK else 0
    problems = []
    if len(new) != want:
        problems.append(f"{what} ({len(p)} tokens): {len(new)} checked transfers, expected {want}")
    if want and (not fig.get("ok") or fig.get("banks") != BANKS):
        problems.append(f"{what}: transfer figures {fig}")
    if not want and fig:
        problems.append(f"{what}: a prompt of one block or less moved KV: {fig}")
    return problems


def check_routed(i: int, p: list[int], out: dict, ref: dict, new: list[str], ties: list) -> list[str]:
    """The problems of prompt ``i``'s answer through the router: its transfer
    (:func:`transfer_problems`), tokens equal to the reference's up to a tie."""
    fig = (out.get("kv_transfer_params") or {}).get("hawk_transfer") or {}
    problems = transfer_problems(f"router, prompt {i}", p, fig, new)
    div = divergence(out["choices"][0]["token_ids"], ref)
    if div is not None and div[1] < TIE_MARGIN:
        ties.append((f"router {len(p)}", *div))
    elif div is not None:
        problems.append(f"router, prompt {i} ({len(p)} tokens): output differs at {div[0]} (top-2 gap {div[1]:.4f})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--router", help="vLLM's router in PD mode over the same prefill and decode")
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--debug-dir", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    post(args.proxy, {"model": "tiny", "prompt": "warm up", "max_tokens": 2})
    done: set[str] = set(p.name.removeprefix("decode-") for p in args.debug_dir.glob("decode-*.pt"))
    rows, ties, problems = [], [], []
    for i, p in enumerate(prompts()):
        body = {
            "model": "tiny",
            "prompt": p,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        t_first = ttft(args.proxy, body)
        check_dumps(args.debug_dir, done)  # the streamed request's transfer
        out = post(args.proxy, body)
        choice = out["choices"][0]
        fig = (out.get("kv_transfer_params") or {}).get("hawk_transfer") or {}
        new = check_dumps(args.debug_dir, done)
        problems += transfer_problems(f"prompt {i}", p, fig, new)
        ref = post(args.prefill, {**body, "logprobs": 2, "return_tokens_as_token_ids": True})["choices"][0]
        div = divergence(choice["token_ids"], ref)
        if div is not None and div[1] < TIE_MARGIN:
            ties.append((len(p), *div))
        elif div is not None:
            problems.append(f"prompt {i} ({len(p)} tokens): output differs at {div[0]} (top-2 gap {div[1]:.4f})")
        routed = None
        if args.router:
            routed = post(args.router, body)
            problems += check_routed(i, p, routed, ref, check_dumps(args.debug_dir, done), ties)
        rows.append(
            {
                "prompt_len": len(p),
                "ttft_ms": 1e3 * t_first,
                "pull_ms": fig.get("total_ms", 0.0),
                "nbytes": fig.get("nbytes", 0),
                "segments": fig.get("segments", 0),
                "reads": fig.get("entries", 0),
                "copies": fig.get("intra_bank_ops", 0),
                "bytes_per_bank": fig.get("bytes_per_bank", []),
                "tokens": choice["token_ids"],
                "same": div is None,
                "router_tokens": routed["choices"][0]["token_ids"] if routed else None,
            }
        )

    print(
        f"\n{'#':>2} {'prompt':>10} {'TTFT':>9} {'pull':>8} {'KiB':>6} {'segs':>4} {'READs':>5} "
        f"{'copies':>6} {'same':>4}  bytes per bank (KiB)"
    )
    for i, r in enumerate(rows):
        per_bank = " ".join(f"{b / 1024:.0f}" for b in r["bytes_per_bank"])
        print(
            f"{i:>2} {str(r['prompt_len']) + ' tok':>10} {r['ttft_ms']:7.1f}ms {r['pull_ms']:6.1f}ms "
            f"{r['nbytes'] / 1024:6.0f} {r['segments']:>4} {r['reads']:>5} {r['copies']:>6} "
            f"{'yes' if r['same'] else 'tie':>4}  [{per_bank}]"
        )
    print(
        "\nTTFT: through the proxy (prefill container -> KV pull over the compose network -> first "
        "decode step);\npull: KVRequest -> KV in the emulated p150a's banks; segs: one per bank; "
        "READs: transport operations;\ncopies: intra-bank copies (staged mode). same: output equals "
        "the prefill engine alone (tie: differs only at a top-2 tie)."
    )
    if args.router:
        print(f"vLLM's router ({args.router}): the same checks for every prompt, passed unless listed below")
    print(f"KV bytes checked against tilize_pack(prefill K/V): {len(done)} transfers, all exact")
    if ties:
        print(f"top-2 ties (prompt_len, position, gap): {ties}")
    ok = not problems
    print(("PASS" if ok else "FAIL") + f": {len(rows)} requests in {time.monotonic() - t0:.1f} s")
    for p in problems:
        print("  " + str(p))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"ok": ok, "rows": rows, "ties": ties, "problems": problems, "transfers_checked": len(done)}, indent=1
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
