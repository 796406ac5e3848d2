"""``hawk proxy``: OpenAI-compatible disaggregation proxy (prefill -> decode).

    hawk proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Several ``--prefill`` / ``--decode`` URLs are served round robin. See
:mod:`vllm_hawk.proxy.server` for the request flow, :mod:`vllm_hawk.proxy.decide` for
decode-first serving (short or cached prompts prefilled on the decode).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

__all__ = ["limits_of", "main", "parse_args", "policy_of", "releaser_of"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hawk proxy", description=__doc__.split("\n")[0])
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill vLLM server base URL(s), e.g. http://127.0.0.1:8100",
    )
    p.add_argument(
        "--decode", nargs="+", action="extend", required=True, metavar="URL", help="decode vLLM server base URL(s)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    from vllm_hawk.proxy.server import Limits

    d = Limits()
    p.add_argument("--connect-timeout-s", type=float, default=d.connect_s, help="TCP connect to an upstream")
    p.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=d.first_byte_s,
        help="upstream request sent -> its response headers: the prefill's queue and compute, a streaming "
        "decode's headers (default: measured prefill x margin, docs/configuration.md#proxy-timeouts; raise it "
        "for long prompts on slow prefills)",
    )
    p.add_argument(
        "--generate-timeout-s",
        type=float,
        default=d.generate_s,
        help="a non-streaming decode's whole answer (vLLM sends its headers after the last token)",
    )
    p.add_argument(
        "--idle-timeout-s",
        type=float,
        default=d.idle_s,
        help="longest gap between two chunks of an upstream body (no total cap)",
    )
    p.add_argument(
        "--header-timeout-s", type=float, default=d.header_s, help="a client must send its request headers within this"
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_s,
        help="a client must send its whole request body within this of its headers, else 408 and closed",
    )
    p.add_argument(
        "--write-timeout-s",
        type=float,
        default=d.write_s,
        help="a client must accept each streamed chunk within this, else it is dropped",
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_nbytes, help="largest request body")
    p.add_argument(
        "--max-json-tokens",
        type=int,
        default=d.max_json_tokens,
        help="most JSON structural characters ([ { , :) in a request body",
    )
    p.add_argument(
        "--shared-secret-file",
        default=None,
        metavar="PATH",
        help="the connectors' shared secret (default: HAWK_SHARED_SECRET / HAWK_SHARED_SECRET_FILE): "
        "lets the proxy release the prefill's KV of a request the decode refused",
    )
    p.add_argument(
        "--side-channel-auth",
        choices=("curve", "hmac", "none"),
        default=None,
        help="the connectors' auth (default: curve with a secret, else none)",
    )
    _add_policy_args(p)
    p.add_argument("--renew-interval-s", type=float, default=None, help=argparse.SUPPRESS)  # removed
    p.add_argument("--timeout-s", type=float, default=None, help=argparse.SUPPRESS)  # renamed
    return p.parse_args(argv)


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    """Decode-first serving's flags (:class:`~vllm_hawk.proxy.decide.Policy`)."""
    from vllm_hawk.proxy.decide import Policy

    d = Policy()
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=d.max_local_tokens,
        metavar="N",
        help="a prompt of fewer than N tokens goes straight to a decode, which prefills it (0: off; default "
        "%(default)s, measured: docs/configuration.md#decode-first-serving)",
    )
    p.add_argument(
        "--local-prefill-min-cached",
        type=float,
        default=d.min_cached,
        metavar="F",
        help="a prompt whose prefix the proxy has seen the chosen decode take covers at least this fraction of it "
        "goes straight to that decode (0: off; default %(default)s)",
    )
    p.add_argument(
        "--decode-block-size",
        type=int,
        default=d.block_size,
        help="the decodes' KV block size in tokens (default %(default)s)",
    )
    p.add_argument(
        "--prefix-record-blocks",
        type=int,
        default=d.record_blocks,
        help="block hashes the proxy's prefix record keeps over all decodes (default %(default)s; about 110 bytes "
        "each: 7 MiB)",
    )
    p.add_argument(
        "--tokenize-timeout-s",
        type=float,
        default=d.tokenize_timeout_s,
        help="a decode's /tokenize round trip (default %(default)s s); beyond it, or on an error, the request goes P/D",
    )
    p.add_argument(
        "--tokenize-always",
        action="store_true",
        help="count every text prompt with /tokenize (the byte bound assumes a tokenizer that never makes more "
        "tokens than UTF-8 bytes + 4: no normalizer that lengthens text, such as NFKC)",
    )


def policy_of(args: argparse.Namespace):
    """The proxy's :class:`~vllm_hawk.proxy.decide.Policy`; a bad flag exits naming it."""
    from vllm_hawk.proxy.decide import Policy

    try:
        return Policy(
            max_local_tokens=args.local_prefill_max_tokens,
            min_cached=args.local_prefill_min_cached,
            block_size=args.decode_block_size,
            record_blocks=args.prefix_record_blocks,
            tokenize_timeout_s=args.tokenize_timeout_s,
            tokenize_always=args.tokenize_always,
        )
    except ValueError as e:
        raise SystemExit(f"hawk proxy: {e}") from None


def limits_of(args: argparse.Namespace):
    from vllm_hawk.proxy.server import Limits

    if args.timeout_s is not None:
        raise SystemExit(
            "hawk proxy: --timeout-s was replaced by --first-byte-timeout-s and --idle-timeout-s "
            "(a total cap cut long healthy streams)"
        )
    return Limits(
        connect_s=args.connect_timeout_s,
        first_byte_s=args.first_byte_timeout_s,
        generate_s=args.generate_timeout_s,
        idle_s=args.idle_timeout_s,
        header_s=args.header_timeout_s,
        body_s=args.body_timeout_s,
        write_s=args.write_timeout_s,
        max_body_nbytes=args.max_body_bytes,
        max_json_tokens=args.max_json_tokens,
    )


def releaser_of(args: argparse.Namespace):
    """The proxy's :class:`~vllm_hawk.proxy.release.PrefillReleaser` (secret from
    ``--shared-secret-file`` or the environment)."""
    from vllm_hawk import envs
    from vllm_hawk.proxy.release import PrefillReleaser

    path = args.shared_secret_file or envs.shared_secret_file()
    secret = None
    if path:
        with open(path, "rb") as f:
            secret = f.read(4097).rstrip(b"\r\n")
    elif envs.shared_secret():
        secret = envs.shared_secret().encode()
    if secret is not None and len(secret) < 16:
        raise SystemExit("hawk proxy: the shared secret must be at least 16 bytes")
    auth = args.side_channel_auth
    if auth == "none":
        secret = None
    elif auth is not None and secret is None:
        logging.getLogger("hawk.proxy").warning(
            "hawk proxy: --side-channel-auth %s without a shared secret: requests the decode refuses keep their "
            "prefill KV until the lease ends",
            auth,
        )
        return None
    if args.renew_interval_s is not None:
        raise SystemExit(
            "hawk proxy: --renew-interval-s is gone: the prefills hold a request through its hand-over "
            "by themselves (kv_connector_extra_config.handover_s), whatever front forwards it"
        )
    return PrefillReleaser(secret, auth)


def _raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one: each client connection costs one fd."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hawk-proxy %(message)s")
    from vllm_hawk.proxy.server import Proxy, serve

    limits, policy = limits_of(args), policy_of(args)
    _raise_fd_limit()

    async def run() -> None:
        proxy = Proxy(args.prefill, args.decode, limits=limits, releaser=releaser_of(args), policy=policy)
        runner = await serve(proxy, args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"hawk proxy on http://{args.host}:{args.port}  prefill={args.prefill} decode={args.decode}  "
            f"local prefill: < {policy.max_local_tokens} tokens or >= {policy.min_cached:g} cached (0: off)",
            flush=True,
        )
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
