"""``hawk proxy``: OpenAI-compatible disaggregation proxy (prefill -> decode).

    hawk proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Several ``--prefill`` / ``--decode`` URLs are served round robin. See
:mod:`vllm_hawk.proxy.server` for the request flow.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hawk proxy", description=__doc__.split("\n")[0])
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="prefill vLLM server base URL(s), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="decode vLLM server base URL(s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="upstream request timeout in seconds (default %(default)s)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hawk-proxy %(message)s")
    from vllm_hawk.proxy.server import Proxy, serve

    async def run() -> None:
        proxy = Proxy(args.prefill, args.decode, timeout_s=args.timeout_s)
        runner = await serve(proxy, args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"hawk proxy on http://{args.host}:{args.port}  prefill={args.prefill} "
              f"decode={args.decode}", flush=True)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
