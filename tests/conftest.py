"""Shared pytest configuration: hypothesis profiles sized for 2-core CI machines, the
markers of whole folders (``make test-fast`` deselects them), and what a CI log needs when
the run goes wrong: the time each group of tests took (printed at the end), every failure
printed the moment it happens (with its cluster's server log tails, if it holds one), a
timestamped line where each group starts and one for each slow test phase, and a deadline
(``HAWK_SUITE_DEADLINE``) after which the remaining tests are not started, so that a slow
or stuck machine still ends with a summary instead of being killed by CI."""

import collections
import importlib.util
import os
import time
from pathlib import Path

import pytest

# tests/tt_decode runs in the Tenstorrent decode environment (scripts/ensure_env.sh tt: Python
# 3.12, vLLM 0.25.1, vllm-tt-plugin, ttnn), every other folder in the main one (vLLM 0.32).
IN_TT_DECODE_ENV = importlib.util.find_spec("vllm_tt_plugin") is not None
if not IN_TT_DECODE_ENV:  # the tt environment has no hypothesis and no test that uses it
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HAWK_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# Folders whose every test needs something heavy: an engine, the simulator, apt, a guest.
FOLDER_MARKS = {
    "security": "security",
    "e2e": "vllm",
    "tt_plugin": "vllm",
    "ttsim": "ttsim",
    "kernel_driver": "kernel",
    "guest": "guest",
    "tt_decode": "tt_decode",
}
TESTS = Path(__file__).parent
if IN_TT_DECODE_ENV:
    collect_ignore = [p.name for p in TESTS.iterdir() if p.name not in ("tt_decode", "conftest.py", "__pycache__")]
else:
    collect_ignore = ["tt_decode"]
_group_s: collections.Counter = collections.Counter()
SLOW_PHASE_S = 120.0  # a setup, call or teardown longer than this gets its own line at once
#: Wall-clock time (epoch s) after which no further test is started (0: none). ``make test``
#: sets it under CI=true to 85 min after make started: CI kills the whole job at 90 min, and a
#: run that stops itself still prints its failures, slow tests and group times.
SUITE_DEADLINE = float(os.environ.get("HAWK_SUITE_DEADLINE") or 0)
CLUSTER_LOGS = "cluster server logs (tails)"  # the report section a failed test's cluster logs go in
_t0 = 0.0  # time.monotonic() at pytest_configure
_config = None
_last_group = ""


def pytest_configure(config):
    global _config, _t0
    _config, _t0 = config, time.monotonic()


def _group(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 else parts[-1].removesuffix(".py")


def _terminal():
    return _config.pluginmanager.get_plugin("terminalreporter") if _config else None


def pytest_runtest_logreport(report):
    _group_s[_group(report.nodeid)] += report.duration
    tr = _terminal()
    if tr is None:
        return
    at = time.monotonic() - _t0
    if report.failed:  # at once: a run that CI kills later still shows what failed
        text = report.longreprtext.splitlines()
        tr.write_line(f"\n[failed at {at:.0f} s] {report.nodeid} ({report.when}, {report.duration:.1f} s)")
        for line in text[-60:]:
            tr.write_line(f"  {line}")
        for name, content in report.sections:
            if name == CLUSTER_LOGS:
                for line in content.splitlines():
                    tr.write_line(f"  {line}")
    elif report.duration > SLOW_PHASE_S:
        tr.write_line(f"\n[slow at {at:.0f} s] {report.nodeid} {report.when}: {report.duration:.0f} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that holds a running cluster (any fixture value with ``servers`` whose
    entries have ``log_tail``, i.e. a LocalCluster) carries its servers' log tails."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    tails = []
    for value in getattr(item, "funcargs", {}).values():
        servers = getattr(value, "servers", None)
        if isinstance(servers, dict):
            tails += [
                f"--- {s.log_path} (last 25 lines) ---\n" + "\n".join(s.log_tail(20000).splitlines()[-25:])
                for s in servers.values()
                if hasattr(s, "log_tail")
            ]
    if tails:
        rep.sections.append((CLUSTER_LOGS, "\n".join(tails)))


def pytest_runtest_logstart(nodeid, location):
    """A timestamped line where a new group of tests begins (the CI log's timeline)."""
    global _last_group
    tr = _terminal()
    group = _group(nodeid)
    if tr is not None and group != _last_group:
        _last_group = group
        tr.write_line(f"\n[at {time.monotonic() - _t0:.0f} s] {group}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Past ``HAWK_SUITE_DEADLINE`` no test starts: the run stops, failed, with its summary."""
    if SUITE_DEADLINE and time.time() > SUITE_DEADLINE:
        if not item.session.shouldfail:
            item.session.shouldfail = (
                f"HAWK_SUITE_DEADLINE passed before {item.nodeid} "
                f"({time.monotonic() - _t0:.0f} s into this session): it and the tests "
                "after it were not started (the [slow] lines say where the time went)"
            )
        return True  # not run
    return None


def pytest_terminal_summary(terminalreporter):
    if not _group_s:
        return
    terminalreporter.section("time per test group (setup + call + teardown, s)")
    for name, s in _group_s.most_common():
        terminalreporter.write_line(f"{s:8.1f}  {name}")


def pytest_collection_modifyitems(config, items):
    """Run tests that build an in-process vLLM engine first (stable order otherwise).

    vLLM 0.32's CPU worker scans every loaded module when it registers its kernel
    overrides and fails on an llvmlite object once numba has been imported (our CPU
    transform kernel imports it). In production the engine is up before any transform
    runs; in one pytest process the engines must come first too."""
    for item in items:
        rel = Path(str(item.fspath)).relative_to(TESTS).parts
        if len(rel) > 1 and rel[0] in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, FOLDER_MARKS[rel[0]]))
    items.sort(key=lambda item: 0 if item.get_closest_marker("inprocess_engine") else 1)
