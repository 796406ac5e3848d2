"""Shared pytest configuration: hypothesis profiles sized for 2-core CI machines, the
markers of whole folders (``make test-fast`` deselects them), and the time each group of
tests took, printed at the end of the run (where CI time goes)."""
import collections
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HAWK_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# Folders whose every test needs something heavy: an engine, the simulator, apt, a guest.
FOLDER_MARKS = {"security": "security",
                "e2e": "vllm", "tt_plugin": "vllm", "ttsim": "ttsim", "kernel_driver": "kernel", "guest": "guest"}
TESTS = Path(__file__).parent
_group_s: collections.Counter = collections.Counter()


def _group(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 else parts[-1].removesuffix(".py")


def pytest_runtest_logreport(report):
    _group_s[_group(report.nodeid)] += report.duration


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
