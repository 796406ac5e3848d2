"""A real HAWK component in its own process, for the attacker tests.

``Target(cfg)`` runs ``python target.py '<json>'``: the child optionally lowers its
``RLIMIT_NOFILE`` (soft and hard, ``nofile``), builds what ``cfg["what"]`` names and
prints one JSON line (its endpoints), then answers JSON commands on stdin:

* ``prefill``: a :class:`~vllm_hawk.kvflow.PrefillEndpoint` (``kind`` staged | vllm |
  hawk) over a seeded paged cache, on transport ``transport`` (mooncake | host_staged |
  inprocess), with ``auth`` / ``secret``;
* ``host_staged``: a bare host-staged transport with one registered, seeded buffer;
* ``stranger``: a bare Mooncake engine on ``host``, without the secret: commands
  ``{"op": "read" | "write", "peer", "addr", "n"}`` answer ``{"ok", "got_bytes"}``.

Commands: ``{"op": "add", ...}`` (prefill: hand over a request), ``{"op": "stats"}`` (CPU
seconds, RSS, open fds, refusal counters, snapshot), ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRET = "attack-tests-shared-secret-0123456789"


_STATUS = open("/proc/self/status", "rb")  # opened now: under an fd flood open() fails  # noqa: SIM115


def _rss_mib() -> float:
    _STATUS.seek(0)
    for line in _STATUS.read().decode().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no fd left to list them with
        return -1


def _main(cfg: dict) -> None:
    if cfg.get("nofile"):
        n = int(cfg["nofile"])
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    secret = cfg["secret"].encode() if cfg.get("secret") else None
    out: dict = {}
    ep = None
    if cfg["what"] == "prefill":
        from vllm_hawk.bench.endpoints import prefill_endpoint
        from vllm_hawk.bench.paged_cache import PagedKVCache
        from vllm_hawk.protocol import make_compat
        from vllm_hawk.transport import make_transport

        cache = PagedKVCache(*cfg["shape"]).fill_random(cfg.get("seed", 0))
        opts = {"secret": secret} if cfg["transport"] == "host_staged" else {}
        t = make_transport(cfg["transport"], **opts, **cfg.get("transport_options", {}))
        compat = make_compat(*cfg["compat"])
        ep = prefill_endpoint(
            cache,
            t,
            compat,
            cfg.get("kind", "staged"),
            ring_nbytes=cfg.get("ring_nbytes", 4 << 20),
            secret=secret,
            auth=cfg.get("auth"),
            lease_s=cfg.get("lease_s", 60.0),
            bind=cfg.get("bind", "tcp://127.0.0.1:0"),
        )
        out = {
            "endpoint": ep.endpoint,
            "transfer": t.endpoint,
            "cache_addr": cache.base_addr,
            "cache_nbytes": cache.nbytes,
            "ports": sorted(getattr(t, "ports", ())),
        }
    elif cfg["what"] == "host_staged":
        import numpy as np

        from vllm_hawk.transport import make_transport

        t = make_transport("host_staged", secret=secret, max_connections=cfg.get("max_connections", 64))
        buf = np.random.default_rng(1).integers(0, 256, cfg.get("nbytes", 1 << 20), dtype=np.uint8)
        t.register(buf.ctypes.data, buf.nbytes)
        out = {"transfer": t.endpoint, "addr": buf.ctypes.data, "nbytes": buf.nbytes}
    elif cfg["what"] == "stranger":  # a Mooncake engine of its own, without the secret
        import numpy as np
        from mooncake.engine import TransferEngine

        t = TransferEngine()
        assert t.initialize(cfg["host"], "P2PHANDSHAKE", "tcp", "") == 0
        buf = np.zeros(1 << 16, dtype=np.uint8)
        assert t.register_memory(buf.ctypes.data, buf.nbytes) == 0
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op in ("read", "write"):  # stranger: one READ / WRITE of n bytes at addr
            buf[:] = 0 if op == "read" else 0xAB
            fn = t.transfer_sync_read if op == "read" else t.transfer_sync_write
            rc = fn(cmd["peer"], buf.ctypes.data, cmd["addr"], cmd.get("n", 4096))
            reply = {"ok": rc == 0, "got_bytes": int(np.count_nonzero(buf)) if op == "read" else 0}
        elif op == "add":
            ep.add_request(cmd["rid"], cmd["blocks"], cmd["tokens"])
            reply = {}
        elif op == "stats":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            reply = {"cpu_s": ru.ru_utime + ru.ru_stime, "rss_mib": _rss_mib(), "fds": _fds()}
            if ep is not None:
                reply["snapshot"] = ep.snapshot()
                reply["refusals"] = {**ep.stats.refusals.snapshot(), **ep.server.stats.refusals.snapshot()}
                reply["server"] = {"received": ep.server.stats.received, "sessions": ep.server.sessions()}
            else:
                reply["refusals"] = t.stats.snapshot()
            fw = getattr(t, "firewall", None)
            reply["admitted"] = sorted(fw.admitted()) if fw is not None else None
        else:
            break
        print(json.dumps(reply), flush=True)
    if ep is not None:
        ep.close()
    if cfg["what"] == "stranger":
        t.unregister_memory(buf.ctypes.data)
    else:
        t.close()


class Target:
    def __init__(self, cfg: dict, python: str = sys.executable, prefix: tuple[str, ...] = ()) -> None:
        """``prefix``: a command to run the child under (e.g. ``ip netns exec NS``)."""
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            MC_FORCE_TCP="1",
        )
        self.proc = subprocess.Popen(
            [*prefix, python, __file__, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise RuntimeError(f"target {cfg['what']} did not start (exit {self.proc.wait()})")
        self.info = json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stats(self) -> dict:
        return self.call(op="stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
