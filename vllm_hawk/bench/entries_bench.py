"""``hawk bench entries``: the Mooncake TCP transport's cost per READ entry, by setting.

Two processes per setting (a target that registers a buffer of random bytes, an
initiator that READs from it through :class:`~vllm_hawk.transport.mooncake.MooncakeTransport`,
the path the connector runs), started with ``MC_TCP_LANES_PER_PEER`` (TCP connections
per peer) and the transport's ``poll_max_s`` (longest sleep between status polls) set
for that row. Workloads, each one batch per repeat (median over repeats):

* ``small``: ``--small-count`` entries of ``--small-kib`` KiB (default 1,280 x 8 KiB,
  the issue's per-entry target), remote offsets scattered over the buffer;
* ``large``: ``--large-count`` entries of ``--large-mib`` MiB (default 4 x 40 MiB).

Reports µs per small entry, the large batch's ms and GB/s, each as a ratio to the first
setting in the same run (the baseline), and the CPU time (user + sys) of both processes
per batch. Every repeat's bytes are checked against the target's. Writes JSON and a bar
plot next to it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time

import numpy as np

from vllm_hawk.bench.common import print_table, progress, write_json
from vllm_hawk.child_process import stop_pipe_process

SEED = 7


def _pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _apply_env(env: dict) -> None:
    """Before Mooncake is imported in this (spawned) process: the engine reads these at start."""
    os.environ.update({k: str(v) for k, v in env.items()})


def _target_main(env: dict, nbytes: int, conn) -> None:
    _apply_env(env)
    from vllm_hawk.transport.mooncake import MooncakeTransport

    buf = _pattern(nbytes)
    t = MooncakeTransport()
    t.register(buf.ctypes.data, nbytes)
    conn.send((t.endpoint, buf.ctypes.data))
    try:
        while conn.recv()[0] == "cpu_s":
            conn.send(_cpu_s())
    finally:
        t.close()


def _initiator_main(
    env: dict, poll_max_s: float, nbytes: int, peer: str, remote: int, workloads: dict, repeats: int, conn
) -> None:
    _apply_env(env)
    from vllm_hawk.transport.mooncake import MooncakeTransport

    want = _pattern(nbytes)
    local = np.zeros(nbytes, dtype=np.uint8)  # pre-faulted
    t = MooncakeTransport(poll_max_s=poll_max_s)
    t.register(local.ctypes.data, nbytes)
    out: dict = {}
    try:
        for name, (count, size) in workloads.items():
            slots = nbytes // size
            order = (np.arange(count, dtype=np.int64) * 97) % slots  # scattered remote offsets
            entries = [(local.ctypes.data + i * size, remote + int(r) * size, size) for i, r in enumerate(order)]
            times, cpus = [], []
            for rep in range(repeats + 1):  # the first is a warm-up (connections, page cache)
                local[: count * size] = 0
                conn.send(("cpu_s",))
                c0 = _cpu_s() + conn.recv()
                t0 = time.perf_counter()
                t.wait(t.submit("read", peer, entries), timeout_s=120)
                dt = time.perf_counter() - t0
                conn.send(("cpu_s",))
                c1 = _cpu_s() + conn.recv()
                for j in sorted({*range(min(64, count)), *range(max(0, count - 64), count)}):
                    r = int(order[j])
                    if not np.array_equal(local[j * size : (j + 1) * size], want[r * size : (r + 1) * size]):
                        raise AssertionError(f"{name}: entry {j} read the wrong bytes")
                if rep:
                    times.append(dt)
                    cpus.append(c1 - c0)
            out[name] = {
                "s": statistics.median(times),
                "cpu_s": statistics.median(cpus),
                "count": count,
                "entry_nbytes": size,
            }
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    else:
        conn.send(("result", out))
    finally:
        t.close()


def measure(lanes: int, poll_max_us: float, workloads: dict, repeats: int) -> dict:
    """One setting: a target and an initiator process; returns the initiator's figures."""
    nbytes = max(c * s for c, s in workloads.values())
    nbytes = max(nbytes, max(s for _, s in workloads.values()) * 256)  # room to scatter
    env = {"MC_TCP_LANES_PER_PEER": lanes}
    ctx = mp.get_context("spawn")
    tconn, tchild = ctx.Pipe()
    tproc = ctx.Process(target=_target_main, args=(env, nbytes, tchild), daemon=True)
    tproc.start()
    tchild.close()
    try:
        if not tconn.poll(120):
            raise RuntimeError("target process did not start")
        peer, remote = tconn.recv()
        iconn, ichild = ctx.Pipe()
        iproc = ctx.Process(
            target=_initiator_main,
            args=(env, poll_max_us * 1e-6, nbytes, peer, remote, workloads, repeats, ichild),
            daemon=True,
        )
        iproc.start()
        ichild.close()
        try:
            while True:  # relay the initiator's CPU-time questions to the target
                if not iconn.poll(600):
                    raise RuntimeError("initiator process stopped answering")
                msg = iconn.recv()
                if msg[0] == "result":
                    return msg[1]
                if msg[0] == "error":
                    raise RuntimeError(f"lanes {lanes}, poll cap {poll_max_us:g} us: {msg[1]}")
                tconn.send(msg)
                iconn.send(tconn.recv())
        finally:
            iproc.join(30)
            if iproc.is_alive():
                iproc.kill()
    finally:
        stop_pipe_process(tproc, tconn, 20)


def run(lanes=(1, 2, 4, 8), poll_max_us=(200.0,), small=(1280, 8 << 10), large=(4, 40 << 20), repeats: int = 5) -> dict:
    workloads = {"small": small, "large": large}
    settings = [(n, p) for p in poll_max_us for n in lanes]
    rows = []
    for i, (n, p) in enumerate(settings):
        progress(i, len(settings), f"lanes {n}, poll cap {p:g} us")
        r = measure(n, p, workloads, repeats)
        s, lg = r["small"], r["large"]
        rows.append(
            {
                "lanes": n,
                "poll_max_us": p,
                "small_us_per_entry": s["s"] / s["count"] * 1e6,
                "small_cpu_ms": s["cpu_s"] * 1e3,
                "large_ms": lg["s"] * 1e3,
                "large_gbps": lg["count"] * lg["entry_nbytes"] / lg["s"] / 1e9,
                "large_cpu_ms": lg["cpu_s"] * 1e3,
            }
        )
    progress(len(settings), len(settings), "done")
    base = rows[0]
    for r in rows:
        r["small_ratio"] = r["small_us_per_entry"] / base["small_us_per_entry"]
        r["large_ratio"] = r["large_ms"] / base["large_ms"]
    return {
        "bench": "entries",
        "workloads": {k: {"count": c, "entry_nbytes": s} for k, (c, s) in workloads.items()},
        "repeats": repeats,
        "baseline": {"lanes": base["lanes"], "poll_max_us": base["poll_max_us"]},
        "rows": rows,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }


TARGET_US_PER_ENTRY = 20.0  # the project's target: 1,280 x 8 KiB READs at <= 20 us per entry


def _plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    labels = [f"{r['lanes']} lanes\n{r['poll_max_us']:g} us" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].bar(labels, [r["small_us_per_entry"] for r in rows])
    w = result["workloads"]["small"]
    axes[0].set_title(f"{w['count']} x {w['entry_nbytes'] >> 10} KiB: us per entry")
    axes[1].bar(labels, [r["large_gbps"] for r in rows])
    w = result["workloads"]["large"]
    axes[1].set_title(f"{w['count']} x {w['entry_nbytes'] >> 20} MiB: GB/s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hawk bench entries", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--lanes",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="MC_TCP_LANES_PER_PEER values; the first is the baseline",
    )
    ap.add_argument(
        "--poll-max-us",
        type=float,
        nargs="+",
        default=[200.0],
        help="the transport's longest sleep between polls, microseconds",
    )
    ap.add_argument("--small-count", type=int, default=1280)
    ap.add_argument("--small-kib", type=int, default=8)
    ap.add_argument("--large-count", type=int, default=4)
    ap.add_argument("--large-mib", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/bench_entries.json", help="JSON path; the plot goes beside it")
    a = ap.parse_args(argv)
    for name in ("small_count", "small_kib", "large_count", "large_mib", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if min(a.lanes) < 1:
        ap.error(f"--lanes must be >= 1, got {a.lanes}")
    result = run(
        tuple(a.lanes),
        tuple(a.poll_max_us),
        (a.small_count, a.small_kib << 10),
        (a.large_count, a.large_mib << 20),
        a.repeats,
    )
    print_table(
        result["rows"],
        [
            ("lanes", "lanes", ""),
            ("poll_max_us", "poll cap us", "g"),
            ("small_us_per_entry", "us/entry", ".1f"),
            ("small_ratio", "x base", ".2f"),
            ("small_cpu_ms", "CPU ms", ".1f"),
            ("large_ms", "large ms", ".1f"),
            ("large_gbps", "GB/s", ".2f"),
            ("large_ratio", "x base", ".2f"),
            ("large_cpu_ms", "CPU ms", ".1f"),
        ],
    )
    if (a.small_count, a.small_kib) == (1280, 8):  # the workload the target is stated for
        for r in result["rows"]:
            met = r["small_us_per_entry"] <= TARGET_US_PER_ENTRY
            print(
                f"  [{'met ' if met else 'MISS'}] {r['lanes']} lanes, poll cap {r['poll_max_us']:g} us: "
                f"{r['small_us_per_entry']:.1f} us per entry (target <= {TARGET_US_PER_ENTRY:g})"
            )
    path = write_json(a.out, result)
    try:
        png = _plot(result, str(path.with_suffix(".png")))
    except Exception as e:  # noqa: BLE001 - the measurements are written already
        png = None
        print(f"no plot ({type(e).__name__}: {e})")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
