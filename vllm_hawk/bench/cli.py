"""``hawk bench NAME``: run one benchmark."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "transform": "vllm_hawk.bench.transform_bench",
    "transfer": "vllm_hawk.bench.transfer_bench",
    "serve": "vllm_hawk.bench.serve_bench",
    "entries": "vllm_hawk.bench.entries_bench",
    "accuracy": "vllm_hawk.bench.accuracy_bench",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: hawk bench {{{','.join(BENCHES)}}} [ARGS...]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)
