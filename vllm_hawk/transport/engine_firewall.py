"""A firewall the node manages itself for Mooncake's ports (docs/security.md).

Mooncake 0.3.13 listens on every interface, its handshake (RPC) port and its TCP data port
alike, and answers anyone (docs/mooncake.md). :class:`EngineFirewall` owns one nftables
table in this process's network namespace, ``inet hawk_<pid>_<n>``, that lets through to
exactly those ports only loopback and the addresses in its sets (IPv4 and IPv6)::

    iif lo accept
    tcp dport { RPC, DATA } ct mark CT_MARK accept
    tcp dport { RPC, DATA } ip saddr @peers4 ct mark set CT_MARK accept
    tcp dport { RPC, DATA } ip6 saddr @peers6 ct mark set CT_MARK accept
    tcp dport { RPC, DATA } reject with tcp reset

A connection an admitted address opened carries :data:`CT_MARK` (conntrack) and keeps
passing after :meth:`revoke`: Mooncake pools its connections, and a reset one fails the
peer's next transfer (``writeHeader failed``), so revoking closes the ports to *new*
connections of that address only. Connections anyone else opened (no mark) are reset on
their next packet. A prefill admits (:meth:`EngineFirewall.admit`) a decode's address when it accepts that decode's
authenticated KVRequest and revokes it when the decode's last request is gone; a decode
admits no one (nobody connects to it). Elements carry a kernel timeout (``ttl_s``) so a
process that dies cannot leave a peer open; its table is removed by the next start in the
same namespace (tables of dead pids).

Commands go through libnftables in-process (ctypes; 0.145 ms per admit + revoke measured,
against 16 ms for two ``nft`` subprocesses), or the ``nft`` CLI where the library is
missing. Needs ``CAP_NET_ADMIN`` in the namespace: :func:`open_firewall` says why not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import itertools
import logging
import os
import re
import shutil
import subprocess
import threading
import time

from vllm_hawk.transport.base import TransportError

logger = logging.getLogger(__name__)

_SEQ = itertools.count()
#: conntrack mark of the connections an admitted peer opened ("HAWK"; only on our ports' flows)
CT_MARK = 0x4841574B
_TABLE_RE = re.compile(r"^table inet (hawk_(\d+)_\d+)", re.M)


class FirewallUnavailable(TransportError):
    """The table cannot be made here (no ``CAP_NET_ADMIN``, or no nftables)."""


class _Nft:
    """One nftables context: libnftables.so.1 if loadable, else the ``nft`` CLI."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ctx = None
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            lib = None
        if lib is not None:
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint]
            for f in ("nft_ctx_buffer_output", "nft_ctx_buffer_error", "nft_ctx_free"):
                getattr(lib, f).argtypes = [ctypes.c_void_p]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            for f in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
                getattr(lib, f).argtypes = [ctypes.c_void_p]
                getattr(lib, f).restype = ctypes.c_char_p
            self._lib, self._ctx = lib, lib.nft_ctx_new(0)
            lib.nft_ctx_buffer_output(self._ctx)
            lib.nft_ctx_buffer_error(self._ctx)
            self.how = "libnftables"
        elif shutil.which("nft"):
            self.how = "nft CLI"
        else:
            raise FirewallUnavailable(
                "nftables is not installed (no libnftables.so.1, no `nft`): apt-get install nftables"
            )

    def run(self, cmd: str) -> tuple[bool, str, str]:
        """Run nft commands ``cmd``; returns (ok, output, error text)."""
        with self._lock:
            if self._ctx is not None:
                rc = self._lib.nft_run_cmd_from_buffer(self._ctx, cmd.encode())
                out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode(errors="replace")
                err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode(errors="replace")
                return rc == 0, out, err.strip()
        p = subprocess.run(["nft", "-f", "-"], input=cmd, capture_output=True, text=True)
        return p.returncode == 0, p.stdout, p.stderr.strip()

    def close(self) -> None:
        if self._ctx is not None:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None


def _family(addr: str) -> str:
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError as e:
        raise ValueError(f"firewall peer {addr!r} is not an IP address literal") from e
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return "4"  # a v4-mapped peer arrives as IPv4 on the wire
    return str(ip.version)


def _plain(addr: str) -> str:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    return str(ip.ipv4_mapped) if ip.version == 6 and ip.ipv4_mapped is not None else str(ip)


class EngineFirewall:
    """The table guarding ``ports`` (TCP) of this process's engine. ``ttl_s``: kernel
    timeout of an admitted address (0 = none), refreshed by each :meth:`admit`."""

    def __init__(self, ports, *, ttl_s: float = 3600.0) -> None:
        self.ports = sorted({int(p) for p in ports})
        if not self.ports:
            raise ValueError("EngineFirewall needs at least one port")
        self.ttl_s = ttl_s
        self.table = f"hawk_{os.getpid()}_{next(_SEQ)}"
        self._nft = _Nft()
        self._admitted: dict[str, float] = {}  # address -> monotonic time of its last (re)admission
        self._lock = threading.Lock()
        _remove_dead_tables(self._nft)
        ports_s = ", ".join(map(str, self.ports))
        rule, mark = f"add rule inet {self.table} input tcp dport {{ {ports_s} }}", f"{CT_MARK:#x}"
        ok, _, err = self._nft.run(
            f"add table inet {self.table}\n"
            f"add set inet {self.table} peers4 {{ type ipv4_addr; flags timeout; }}\n"
            f"add set inet {self.table} peers6 {{ type ipv6_addr; flags timeout; }}\n"
            f"add chain inet {self.table} input {{ type filter hook input priority filter; policy accept; }}\n"
            f"add rule inet {self.table} input iif lo accept\n"
            f"{rule} ct mark {mark} accept\n"
            f"{rule} ip saddr @peers4 ct mark set {mark} accept\n"
            f"{rule} ip6 saddr @peers6 ct mark set {mark} accept\n"
            f"{rule} reject with tcp reset\n"
        )
        if not ok:
            self._nft.run(f"delete table inet {self.table}")
            self._nft.close()
            raise FirewallUnavailable(f"nftables refused table inet {self.table} ({self._nft.how}): {err}")
        logger.info("engine firewall: table inet %s guards TCP ports %s (%s)", self.table, ports_s, self._nft.how)

    def admit(self, addr: str) -> None:
        """Let ``addr`` (an IP literal) reach the ports; restarts its timeout when a quarter
        of it has passed (so a busy peer costs no nft call per request)."""
        fam, ip = _family(addr), _plain(addr)
        t = f" timeout {max(1, int(self.ttl_s))}s" if self.ttl_s > 0 else ""
        with self._lock:
            last = self._admitted.get(ip)
            if last is not None and (not t or time.monotonic() - last < self.ttl_s / 4):
                return
            # delete + add in one batch: the element (re)starts its timeout; a first add's
            # delete of a missing element is skipped by "add" first (idempotent)
            ok, _, err = self._nft.run(
                f"add element inet {self.table} peers{fam} {{ {ip} }}\n"
                f"delete element inet {self.table} peers{fam} {{ {ip} }}\n"
                f"add element inet {self.table} peers{fam} {{ {ip}{t} }}\n"
            )
            if not ok:
                raise FirewallUnavailable(f"engine firewall {self.table}: admitting {ip} failed: {err}")
            self._admitted[ip] = time.monotonic()

    def revoke(self, addr: str) -> None:
        """``addr`` may open no new connection to the ports (those it opened while admitted
        keep working: module doc)."""
        ip = _plain(addr)
        with self._lock:
            if ip not in self._admitted:
                return
            del self._admitted[ip]
            ok, _, err = self._nft.run(f"delete element inet {self.table} peers{_family(ip)} {{ {ip} }}")
        if not ok and "No such file" not in err:  # an element that timed out is gone already
            logger.warning("engine firewall %s: revoking %s failed: %s", self.table, ip, err)

    def admitted(self) -> set[str]:
        with self._lock:
            return set(self._admitted)

    def close(self) -> None:
        """Delete the table (the ports are closed with the engine)."""
        if self._nft is None:
            return
        ok, _, err = self._nft.run(f"delete table inet {self.table}")
        if not ok:
            logger.warning("engine firewall: deleting table inet %s failed: %s", self.table, err)
        self._nft.close()
        self._nft = None


def _remove_dead_tables(nft: _Nft) -> None:
    """Delete ``hawk_<pid>_*`` tables whose process is gone (a crashed engine's)."""
    ok, out, _ = nft.run("list tables inet")
    for name, pid in _TABLE_RE.findall(out) if ok else ():
        if not os.path.exists(f"/proc/{pid}"):
            nft.run(f"delete table inet {name}")
            logger.info("engine firewall: removed table inet %s of dead process %s", name, pid)


def non_loopback_interfaces() -> list[str]:
    """Interfaces of this network namespace that are up, other than loopback."""
    out = []
    for name in sorted(os.listdir("/sys/class/net")):
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                flags = int(f.read().strip(), 16)
        except OSError:
            continue
        if flags & 0x1 and not flags & 0x8:  # IFF_UP, not IFF_LOOPBACK
            out.append(name)
    return out


def listening_ports(pid: int | str = "self") -> set[int]:
    """TCP ports that sockets of process ``pid`` listen on (IPv4 and IPv6)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


#: ``engine_firewall`` values: the default, and the opt-in that accepts the risk
REQUIRE, OPEN = "require", "open-to-network"
FIREWALL_MODES = (REQUIRE, OPEN)


def open_firewall(ports, mode: str, what: str, *, ttl_s: float = 3600.0) -> EngineFirewall | None:
    """The firewall for engine ``what`` listening on ``ports``, per ``mode``.

    ``require``: the table, or None where this namespace has no interface up but loopback
    (nothing else can reach the ports); without ``CAP_NET_ADMIN`` (or nftables) on a
    namespace with other interfaces up, refuses (:class:`FirewallUnavailable`) naming
    the privilege, ``host-staged`` and the opt-in. ``open-to-network``: no table, and a
    WARNING at every start."""
    if mode not in FIREWALL_MODES:
        raise ValueError(f"engine_firewall={mode!r} is invalid: expected one of {FIREWALL_MODES}")
    ports_s = ", ".join(map(str, sorted(ports)))
    ifaces = non_loopback_interfaces()
    if mode == OPEN:
        logger.warning(
            "engine_firewall=%r: Mooncake engine %s listens on TCP ports %s, reachable by anyone on %s, "
            "unauthenticated: anyone there can read and write every registered KV range",
            OPEN,
            what,
            ports_s,
            ", ".join(ifaces) or "loopback only",
        )
        return None
    try:
        return EngineFirewall(ports, ttl_s=ttl_s)
    except FirewallUnavailable as e:
        if not ifaces:
            logger.info("Mooncake engine %s: no firewall (%s); only loopback is up in this netns", what, e)
            return None
        raise FirewallUnavailable(
            f"Mooncake engine {what} refuses to start: it listens on every interface (TCP ports {ports_s}; "
            f"up here: {', '.join(ifaces)}) and admits only authenticated peers through a firewall it "
            f"manages itself, which failed: {e}. Grant CAP_NET_ADMIN in the node's network namespace "
            "(compose `cap_add: [NET_ADMIN]`, Kubernetes `securityContext.capabilities.add: [NET_ADMIN]`, "
            'systemd `AmbientCapabilities=CAP_NET_ADMIN`), or use `"transport": "host-staged"` (authenticated, '
            f'needs no privilege), or accept the risk with kv_connector_extra_config `"engine_firewall": "{OPEN}"` '
            "(docs/security.md)"
        ) from e
