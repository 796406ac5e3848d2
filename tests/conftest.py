"""Shared pytest configuration: hypothesis profiles sized for 2-core CI machines."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HAWK_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    """Run tests that build an in-process vLLM engine first (stable order otherwise).

    vLLM 0.32's CPU worker scans every loaded module when it registers its kernel
    overrides and fails on an llvmlite object once numba has been imported (our CPU
    transform kernel imports it). In production the engine is up before any transform
    runs; in one pytest process the engines must come first too."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("inprocess_engine") else 1)
