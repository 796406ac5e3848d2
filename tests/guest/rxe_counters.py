"""pytest plugin for the RDMA guest stage (``-p rxe_counters``, tests/guest on PYTHONPATH):
the soft-RoCE packet counters of $HAWK_RXE_COUNTERS (an ``hw_counters`` folder) read
around every test (setup, call and teardown), written as JSON to $HAWK_RXE_REPORT
(``{nodeid: {"sent_pkts": n, "rcvd_pkts": n, "s": seconds, "outcome": ...}}``) so that
the host side can check, test by test, that RDMA carried the bytes.

$HAWK_RXE_WAIT_FOR (a file): after collection, wait until it exists. The guest stage
collects the Algorithm 1 tests (``import torch``: about two minutes under TCG) while the
transport tests run, and runs them once those are done, so no other traffic is counted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

KEYS = ("sent_pkts", "rcvd_pkts")
_report: dict[str, dict] = {}


def _read() -> dict[str, int]:
    d = Path(os.environ["HAWK_RXE_COUNTERS"])
    return {k: int((d / k).read_text()) for k in KEYS}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, t0 = _read(), time.monotonic()
    yield
    c1 = _read()
    _report.setdefault(item.nodeid, {}).update({k: c1[k] - c0[k] for k in KEYS}, s=round(time.monotonic() - t0, 1))


def pytest_collection_finish(session):
    flag = os.environ.get("HAWK_RXE_WAIT_FOR")
    if not flag:
        return
    t0 = time.monotonic()
    while not Path(flag).exists() and time.monotonic() - t0 < 900:
        time.sleep(0.5)
    print(
        f"\nrxe_counters: collected at uptime {_uptime()} s, waited {time.monotonic() - t0:.1f} s for {flag}",
        flush=True,
    )


def _uptime() -> str:
    return Path("/proc/uptime").read_text().split()[0]


def pytest_runtest_logreport(report):
    r = _report.setdefault(report.nodeid, {})
    if (report.when == "call" or report.outcome != "passed") and r.get("outcome", "passed") == "passed":
        r["outcome"] = report.outcome


def pytest_sessionfinish(session):
    out = os.environ.get("HAWK_RXE_REPORT")
    if out:
        Path(out).write_text(json.dumps(_report, indent=1))
