"""``scripts/gpu_check.py --suite full``: the matrix, speed, checksum, capture and replay sections
in order, each written to ``<out_dir>/<section>.json`` as soon as it finishes and
printed as a table; ``summary.json`` last. Sizes follow the device: the GPU sizes of the
issue on CUDA, small ones on the CPU (CI). A section, or the rest of one, that would
start after the budget is skipped and named in ``skipped``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from vllm_hawk.bench import gpu_capture, gpu_checksum, gpu_matrix, gpu_speed

__all__ = ["run_full"]


def _triton_ready(device: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton not importable: no Triton rows"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False, "triton on the CPU needs TRITON_INTERPRET=1: no Triton rows"
    return True, ""


class _Out:
    """Writes each section's JSON when it is done, keeps the summary."""

    def __init__(self, out_dir: Path, device: torch.device, budget_s: float) -> None:
        self.dir, self.t0 = out_dir, time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.deadline = self.t0 + budget_s
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.summary = {"device": name, "torch": torch.__version__, "sections": {}, "skipped": [], "notes": []}

    def write(self, section: str, data: dict, ok: bool, t_start: float) -> None:
        data = {"device": self.summary["device"], "seconds": time.monotonic() - t_start, "ok": ok, **data}
        (self.dir / f"{section}.json").write_text(json.dumps(data, indent=1))
        self.summary["sections"][section] = {"ok": ok, "seconds": data["seconds"]}
        print(f"== {section}: {'ok' if ok else 'FAILED'} in {data['seconds']:.1f} s -> {self.dir / section}.json")

    def over(self) -> bool:
        return time.monotonic() > self.deadline


def _matrix(out: _Out, device: torch.device) -> None:
    t = time.monotonic()
    cuda = device.type == "cuda"
    geo = gpu_matrix.MatrixGeo(3, 4, 64, 165, 1) if cuda else gpu_matrix.MatrixGeo(2, 2, 64, 100, 1)
    runs = [("torch", geo, gpu_matrix.cases())]
    ok_triton, why = _triton_ready(device)
    if ok_triton:  # under the interpreter about 25 ms a program: one layout, tiny shapes
        tiny = (
            (geo, gpu_matrix.cases())
            if cuda
            else (gpu_matrix.MatrixGeo(2, 2, 32, 40, 1), gpu_matrix.cases(["LBNHC"], dst_sizes=(32,)))
        )
        runs.insert(0, ("triton", *tiny))
    else:
        out.summary["notes"].append(f"matrix: {why}")
    rows, left = [], 0
    for impl, g, cs in runs:
        r, n_left = gpu_matrix.matrix_rows(device, impl, g, cs, out.deadline)
        rows += r
        left += n_left
    if left:
        out.summary["skipped"].append(f"matrix: {left} cases over the time budget")
    per = {}
    for r in rows:
        c = per.setdefault(r["impl"], [0, 0])
        c[0] += 1
        c[1] += r["bytes_equal"]
    print(
        f"{'impl':<8} {'cases':>6} {'equal':>6}   (references on the CPU: numba, regrouped if not tile-aligned; torch)"
    )
    for impl, (n, eq) in per.items():
        print(f"{impl:<8} {n:>6} {eq:>6}")
    for r in rows:
        if not r["bytes_equal"]:
            print(f"DIFF {r}")
    ok = all(r["bytes_equal"] for r in rows)
    out.write("matrix", {"per_impl": per, "not_run": left, "rows": rows}, ok, t)


def _speed(out: _Out, device: torch.device, repeats: int) -> None:
    t = time.monotonic()
    cuda = device.type == "cuda"
    impls = ["torch"]
    if cuda:
        if _triton_ready(device)[0]:
            impls.insert(0, "triton")
    else:
        impls.insert(0, "cpu_kernel")
    workloads = gpu_speed.gpu_workloads() if cuda else gpu_speed.cpu_workloads()
    rows, skipped = gpu_speed.speed_rows(device, workloads, gpu_matrix.DTYPES, impls, repeats, out.deadline)
    out.summary["skipped"] += [f"speed: {s}" for s in skipped]
    hdr = f"{'workload':<28} {'order':<10} {'dtype':<10} {'impl':<10} {'copy GB/s':>9} {'GB/s':>8} {'ratio':>6}"
    print(hdr + f" {'host ms':>8} {'kernels':>7} {'copies':>6} {'peak MB':>8} {'same':>5}")
    for r in rows:
        k = "n/a" if r["kernels"] is None else r["kernels"]
        c = "n/a" if r["copies"] is None else r["copies"]
        p = "n/a" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}"
        print(
            f"{r['workload']:<28} {r['order']:<10} {r['dtype']:<10} {r['impl']:<10} {r['copy_gbps']:9.2f} "
            f"{r['transform_gbps']:8.2f} {r['ratio']:6.2f} {r['host_ms']:8.2f} {k:>7} {c:>6} {p:>8} "
            f"{'yes' if r['bytes_equal_torch'] else 'NO':>5}"
        )
    print(f"timer: {rows[0]['timer'] if rows else '-'}; ratio: copy time / transform time (1 = copy speed)")
    ok = all(r["bytes_equal_torch"] for r in rows)
    out.write("speed", {"rows": rows, "skipped": skipped}, ok, t)


def _checksum(out: _Out, device: torch.device, repeats: int) -> None:
    t = time.monotonic()
    sizes = [1 << 20, 20 << 20, 160 << 20] if device.type == "cuda" else [1 << 16, 4 << 20]
    rows = gpu_checksum.checksum_rows(device, sizes, repeats)
    print(f"{'bytes':>11} {'impl':<7} {'equal':>5} {'GB/s':>8} {'copy GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['nbytes']:>11,} {r['impl']:<7} {'yes' if r['equal_host'] else 'NO':>5} "
            f"{r['checksum_gbps']:8.2f} {r['copy_gbps']:9.2f} {r['ratio']:6.2f}"
        )
    print("integrity checksum (wsum64) on the device vs the host kernel; ratio: copy time / checksum time")
    out.write("checksum", {"rows": rows}, all(r["equal_host"] for r in rows), t)


def _sizes(device: torch.device) -> dict:
    """The capture/replay geometry: Llama-3.1-8B TP1 16 -> 64 at 1,024 tokens on CUDA."""
    if device.type == "cuda":
        return dict(layers=32, heads=8, head_dim=128, src_block_size=16, dst_block_size=64, tokens=1024, step_dim=4096)
    return dict(layers=2, heads=2, head_dim=64, src_block_size=16, dst_block_size=64, tokens=100, step_dim=64)


def _capture(out: _Out, device: torch.device) -> None:
    t = time.monotonic()
    g = _sizes(device)
    n_src = -(-g["tokens"] // g["src_block_size"])
    src, _host = gpu_matrix.random_sources(
        "LBNHC", g["layers"], n_src + 4, g["heads"], g["src_block_size"], g["head_dim"], device, seed=7
    )
    step = gpu_capture.ModelStep(src.caches, [n_src, n_src + 1], g["step_dim"])
    res = gpu_capture.capture_section(src, g["src_block_size"], g["heads"], g["head_dim"], "p150a", 64 << 20, step)
    caps = res["captures"]
    print(
        f"make_prefill {res['make_prefill_ms']:.0f} ms, warm-up done {res['warm_done_ms']:.0f} ms, warm thread "
        f"running at capture: {res['warm_running_at_capture']}; captures ok {res['captures_ok']}/{len(caps)}"
    )
    for c in caps:
        if not c["ok"]:
            print(f"capture {c['i']}: {c['error']}")
    if "skipped" in res:
        out.summary["skipped"].append(f"capture: {res['skipped']}")
    out.write("capture", res, res["captures_ok"] == len(caps), t)


def _replay(out: _Out, device: torch.device) -> None:
    t = time.monotonic()
    geo = dict(_sizes(device), dtype="bfloat8_b", profile="p150a")
    res = gpu_capture.replay_section(geo, device, 20, out.deadline)
    out.summary["skipped"] += [f"replay: {s}" for s in res["skipped"]]
    print(f"{'phase':<6} {'bytes':>6} {'p50 ms':>8} {'p95 ms':>8}  load")
    for phase in ("idle", "load"):
        if phase in res:
            r = res[phase]
            load = f"{r.get('kind', '-')} ({r.get('load_runs', 0)} runs)" if phase == "load" else "-"
            same = "equal" if r["bytes_equal"] else "DIFF"
            print(f"{phase:<6} {same:>6} {r['kvready_ms_p50']:8.2f} {r['kvready_ms_p95']:8.2f}  {load}")
    print(
        "KVReady ms: KVRequest sent to KVReady received over the side channel; "
        "bytes: against an endpoint over a host copy"
    )
    ok = all(res[p]["bytes_equal"] for p in ("idle", "load") if p in res)
    out.write("replay", res, ok, t)


def run_full(device, out_dir: Path, budget_s: float, repeats: int) -> bool:
    """Run every section (module doc); True when all passed."""
    device = torch.device(device)
    out = _Out(Path(out_dir), device, budget_s)
    sections = (
        ("matrix", lambda: _matrix(out, device)),
        ("speed", lambda: _speed(out, device, repeats)),
        ("checksum", lambda: _checksum(out, device, repeats)),
        ("capture", lambda: _capture(out, device)),
        ("replay", lambda: _replay(out, device)),
    )
    for name, fn in sections:
        if out.over():
            out.summary["skipped"].append(f"{name}: over the time budget")
            continue
        fn()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for line in out.summary["skipped"] + out.summary["notes"]:
        print(f"note: {line}")
    ok = all(s["ok"] for s in out.summary["sections"].values())
    out.summary.update(ok=ok, seconds=time.monotonic() - out.t0)
    (out.dir / "summary.json").write_text(json.dumps(out.summary, indent=1))
    print(f"wrote {out.dir}/summary.json ({out.summary['seconds']:.1f} s)")
    return ok
