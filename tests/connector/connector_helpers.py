"""Shared by tests/connector: the config parser's warnings, seen by caplog in any test order."""

import logging

import pytest


@pytest.fixture(autouse=True)
def config_log(caplog):
    """vLLM's logging config (once any test imported vllm) stops "vllm.*" records from
    propagating to the root logger, where caplog listens: listen on the logger itself."""
    log = logging.getLogger("vllm.hawk.config")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.hawk.config"):
            yield
    finally:
        log.removeHandler(caplog.handler)
