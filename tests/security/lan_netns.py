"""Three "hosts" on one L2 segment: namespaces P (prefill) and S (a stranger without the
secret), and the test's own (host) namespace as D (decode), joined by a bridge that lives
in a fourth namespace (root, iproute2)::

    P 198.19.n.1 ─┐
    D 198.19.n.2 ─┼─ br0 (namespace W)
    S 198.19.n.3 ─┘

S reaches every port of P and D that a firewall lets through, as a stranger on the KV
network would. ``n`` depends on the creating process, so concurrent runs do not collide.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")


@dataclass
class Lan:
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = os.getpid() % 250
        self.ns_w, self.ns_p, self.ns_s = f"hawk-w-{self.tag}", f"hawk-lp-{self.tag}", f"hawk-ls-{self.tag}"
        self.p, self.d, self.s = f"198.19.{n}.1", f"198.19.{n}.2", f"198.19.{n}.3"
        self.d_if = f"hl{self.tag}d"

    def start(self) -> Lan:
        try:
            for ns in (self.ns_w, self.ns_p, self.ns_s):
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", "br0", "type", "bridge", ns=self.ns_w)
            _ip("link", "set", "br0", "up", ns=self.ns_w)
            for side, ns, addr in (("p", self.ns_p, self.p), ("d", None, self.d), ("s", self.ns_s, self.s)):
                inner, port = f"hl{self.tag}{side}", f"hl{self.tag}{side}b"
                _ip("link", "add", inner, "type", "veth", "peer", "name", port)
                _ip("link", "set", port, "netns", self.ns_w)
                _ip("link", "set", port, "master", "br0", ns=self.ns_w)
                _ip("link", "set", port, "up", ns=self.ns_w)
                if ns is not None:
                    _ip("link", "set", inner, "netns", ns)
                _ip("addr", "add", f"{addr}/24", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)
        except BaseException:
            self.stop()
            raise
        return self

    def prefix(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)

    def stop(self) -> None:
        for ns in reversed(self.created):  # deleting W deletes the bridge ports and their peers
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.created.clear()
        subprocess.run(["ip", "link", "delete", self.d_if], capture_output=True)

    def __enter__(self) -> Lan:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
