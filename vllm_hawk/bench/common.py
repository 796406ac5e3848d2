"""Shared benchmark helpers: timing, progress, tables and JSON output."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def progress(i: int, n: int, label: str) -> None:
    """One-line progress bar on stderr."""
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<50}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[format(r[k], f) if f else str(r[k]) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=False)))


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path
