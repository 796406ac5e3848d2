"""Shared by the security tests: an attacker that floods a TCP endpoint with idle
connections and keeps the flood up as the target drops them."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class RawFlood:
    """``n`` idle TCP connections to ``host:port``, reopened as the target drops them, from
    ``source`` (another host's address: not the legitimate peers' 127.0.0.1, which the
    side channel's accept gate would otherwise block along with the flood)."""

    def __init__(self, endpoint: str, n: int, zmtp_null: bool = False, source: str = "127.0.0.2") -> None:
        host, _, port = endpoint.replace("tcp://", "").rpartition(":")
        self.addr, self.n, self.zmtp_null, self.source = (host, int(port)), n, zmtp_null, source
        self.sel = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.reopened = 0
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        s = socket.socket()
        s.bind((self.source, 0))
        s.setblocking(False)
        s.connect_ex(self.addr)
        if self.zmtp_null:  # ZMTP 3.0 greeting, NULL mechanism: what a ZMQ socket without keys sends
            greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
            with contextlib.suppress(OSError):
                s.send(greeting)
        self.sel.register(s, selectors.EVENT_READ)

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ev in self.sel.select(0.05):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # dropped by the target: reopen (sustained flood)
                    self.sel.unregister(s)
                    s.close()
                    self.reopened += 1
                    self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
