"""Attacker process: ``n`` ZMQ DEALERs speaking CURVE with a server key of their own (no
secret), from ``sources`` loopback addresses other than 127.0.0.1 (:func:`source`); libzmq
reconnects each ``ivl_ms`` after the prefill drops it, so every socket is a reconnect loop.

``python zmq_flood.py <endpoint> <seconds> <n> <ivl_ms> <sources>``; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import zmq


def source(i: int, sources: int) -> str:
    """The i-th socket's source address: 127.0.1+k//250.2+k%250 (never 127.0.0.1)."""
    k = i % sources
    return f"127.0.{1 + k // 250}.{2 + k % 250}"


def main(endpoint: str, secs: float, n: int, ivl_ms: int, sources: int) -> None:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, n + 16)
    pub, sec = zmq.curve_keypair()
    server_key, _ = zmq.curve_keypair()  # not the prefill's: the attacker has no secret
    socks = []
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_key
        s.reconnect_ivl = ivl_ms
        s.connect(endpoint.replace("tcp://", f"tcp://{source(i, sources)}:0;"))
        socks.append(s)
    print(json.dumps({"sockets": n, "sources": sources}), flush=True)
    time.sleep(secs)
    for s in socks:
        s.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
