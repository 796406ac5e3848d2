"""Two "hosts" on one machine: network namespaces joined by veth pairs (root, iproute2).

Used by tests/twohost. Topology (addresses from 198.18.0.0/15, the benchmarking range;
the third octets depend on the creating process, so concurrent runs do not collide)::

    host (proxy, test) ──veth── P: prefill vLLM          P ══kv link══ D
         └────────────────veth── D: decode vLLM          (side channel + Mooncake)

The prefill's side channel and both transfer engines bind the kv link's addresses, which
only P and D can reach: the host has no route there (and forwards nothing), so KV bytes
cross a real (virtual) NIC pair, never loopback. :meth:`TwoHosts.cut` takes the kv link
down (``ip link set down``), :meth:`TwoHosts.mend` brings it back.

    with TwoHosts() as net, NetnsCluster(model, work, net=net, ...) as c:
        ...  # c.proxy_url on 127.0.0.1, prefill/decode in their namespaces

Setting up and tearing down take well under a second (0.2 s measured).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from vllm_hawk.bench.local_cluster import LocalCluster, Server


def _ip(*args: str, ns: str | None = None) -> str:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout


def netns_unavailable() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    return None


@dataclass
class TwoHosts:
    """Namespaces P (prefill) and D (decode), a kv link between them and a link from the
    host to each. Addresses: ``kv_p``/``kv_d`` on the kv link, ``p_addr``/``d_addr`` where
    the host reaches P and D."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    created: list[str] = field(default_factory=list)
    host_links: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = (os.getpid() % 80) * 3  # three /30 subnets per run: 198.18.n.0, n+1, n+2
        self.ns_p, self.ns_d = f"hawk-p-{self.tag}", f"hawk-d-{self.tag}"
        self.kv_if_p, self.kv_if_d = f"hk{self.tag}kp", f"hk{self.tag}kd"
        self.kv_p, self.kv_d = f"198.18.{n}.1", f"198.18.{n}.2"
        self.host_p, self.p_addr = f"198.18.{n + 1}.1", f"198.18.{n + 1}.2"
        self.host_d, self.d_addr = f"198.18.{n + 2}.1", f"198.18.{n + 2}.2"

    def start(self) -> TwoHosts:
        try:
            for ns in (self.ns_p, self.ns_d):
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)  # vLLM's own processes talk over loopback
            # the kv link, P <-> D
            _ip("link", "add", self.kv_if_p, "type", "veth", "peer", "name", self.kv_if_d)
            for ifname, ns, addr in ((self.kv_if_p, self.ns_p, self.kv_p), (self.kv_if_d, self.ns_d, self.kv_d)):
                _ip("link", "set", ifname, "netns", ns)
                _ip("addr", "add", f"{addr}/30", "dev", ifname, ns=ns)
                _ip("link", "set", ifname, "up", ns=ns)
            # host <-> P and host <-> D, for HTTP (proxy, health, metrics)
            for side, ns, host_addr, ns_addr in (
                ("p", self.ns_p, self.host_p, self.p_addr),
                ("d", self.ns_d, self.host_d, self.d_addr),
            ):
                h, inner = f"hk{self.tag}h{side}", f"hk{self.tag}n{side}"
                _ip("link", "add", h, "type", "veth", "peer", "name", inner)
                self.host_links.append(h)
                _ip("link", "set", inner, "netns", ns)
                _ip("addr", "add", f"{host_addr}/30", "dev", h)
                _ip("link", "set", h, "up")
                _ip("addr", "add", f"{ns_addr}/30", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)
        except BaseException:
            self.stop()
            raise
        return self

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def cut(self) -> None:
        """Take the kv link down on the prefill's side (the decode sees no carrier either)."""
        _ip("link", "set", self.kv_if_p, "down", ns=self.ns_p)

    def mend(self) -> None:
        _ip("link", "set", self.kv_if_p, "up", ns=self.ns_p)

    def listening(self, ns: str) -> str:
        """``ss -ltn`` inside ``ns``: the TCP sockets listening there."""
        return subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True).stdout

    def stop(self) -> None:
        # deleting a namespace deletes the veth ends in it, and with them their peers
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.created.clear()
        for h in self.host_links:
            subprocess.run(["ip", "link", "delete", h], capture_output=True)  # normally gone already
        self.host_links.clear()

    def leftovers(self) -> list[str]:
        """Namespaces or host links of this run that still exist (empty after stop)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [ns for ns in (self.ns_p, self.ns_d) if ns in names] + [
            f"link {i}" for i in (f"hk{self.tag}hp", f"hk{self.tag}hd") if i in links
        ]

    def __enter__(self) -> TwoHosts:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class NetnsCluster(LocalCluster):
    """:class:`LocalCluster` with the prefill server in namespace P and the decode server
    in D (``ip netns exec``), each listening on all its addresses; the proxy stays on the
    host. The connector's ``side_channel_host`` is each side's kv-link address.
    Authentication is :class:`LocalCluster`'s: ``auth`` (default ``curve``) and a fresh
    0600 ``shared_secret_file`` in the work folder, read inside both namespaces."""

    net: TwoHosts | None = None

    def __post_init__(self) -> None:
        if self.net is None:
            raise ValueError("NetnsCluster needs net=TwoHosts(...)")
        self.prefill_config = {"side_channel_host": self.net.kv_p, **self.prefill_config}
        self.decode_config = {"side_channel_host": self.net.kv_d, **self.decode_config}

    def _vllm(self, role: str, kv_role: str, config: dict, cpu: str | None, name: str = "") -> Server:
        s = super()._vllm(role, kv_role, config, cpu, name)
        ns, addr = (self.net.ns_p, self.net.p_addr) if role == "prefill" else (self.net.ns_d, self.net.d_addr)
        i = s.argv.index("--host")
        s.argv[i + 1] = "0.0.0.0"
        s.argv = self.net.exec_prefix(ns) + s.argv
        s.url = s.url.replace("127.0.0.1", addr)
        return s
