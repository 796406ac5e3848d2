"""``hawk vllm``'s leading ``--tt-*`` flags (vllm_hawk.tenstorrent.launcher): they set the
``HAWK_TT_*`` variables and are checked before vLLM starts, naming what is wrong."""

from __future__ import annotations

import pytest

from vllm_hawk.tenstorrent.emulated.config import TTPluginConfigError
from vllm_hawk.tenstorrent.launcher import apply_tt_flags, has_tt_flags, split_tt_flags


@pytest.fixture
def clean_tt_env(monkeypatch):
    for var in ("HAWK_TT_PLATFORM", "HAWK_TT_DEVICE", "HAWK_TT_CHIPS", "HAWK_TT_KV_DTYPE"):
        monkeypatch.setenv(var, "")  # restored after the test, whatever the flags set


def test_only_leading_tt_flags_are_the_launchers():
    assert has_tt_flags(["--tt-chips=2", "serve"]) and not has_tt_flags(["serve", "--tt-chips", "2"])
    assert split_tt_flags(["serve", "m"]) == ({}, ["serve", "m"])
    with pytest.raises(SystemExit, match="--tt-device needs a value"):
        split_tt_flags(["--tt-device"])


def test_a_device_without_a_platform_is_refused(clean_tt_env):
    with pytest.raises(SystemExit, match="no Tenstorrent backend chosen: pass --tt-platform"):
        apply_tt_flags(["--tt-device", "n150", "serve", "m"])


def test_an_invalid_flag_value_names_its_variable(clean_tt_env):
    with pytest.raises(TTPluginConfigError, match="HAWK_TT_KV_DTYPE='fp8'"):
        apply_tt_flags(["--tt-platform", "emulated", "--tt-kv-dtype", "fp8", "serve", "m"])
