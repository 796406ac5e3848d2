"""tests/tt_decode fixtures: the simulator runtime of the tt environment and the main
environment's interpreter (the vLLM 0.32 prefill); see tt_decode_helpers.py."""

from __future__ import annotations

import pytest
from tt_decode_helpers import main_python, ttsim_manifest


@pytest.fixture(scope="session")
def manifest() -> dict:
    return ttsim_manifest()


@pytest.fixture(scope="session")
def prefill_python() -> str:
    return main_python()
