"""Activation of the Tenstorrent platform plugin: explicit only, loud on bad settings."""

from __future__ import annotations

import importlib.metadata as md

import pytest

import vllm_hawk.tenstorrent.emulated as tt
from vllm_hawk.tenstorrent.emulated.config import TTPluginConfig, TTPluginConfigError, kv_dtype_for
from vllm_hawk.tenstorrent.launcher import split_tt_flags


def test_plugin_is_off_unless_asked(monkeypatch):
    for k in ("HAWK_TT_PLATFORM", "HAWK_TT_DEVICE", "HAWK_TT_KV_DTYPE"):
        monkeypatch.delenv(k, raising=False)
    assert tt.register() is None
    monkeypatch.setenv("HAWK_TT_PLATFORM", "off")
    assert tt.register() is None
    monkeypatch.setenv("HAWK_TT_PLATFORM", "emulated")
    assert tt.register() == "vllm_hawk.tenstorrent.emulated.platform.TTEmulatedPlatform"
    # a Tenstorrent device is reached through vllm-tt-plugin and vllm_hawk.tenstorrent.vllm_tt only
    monkeypatch.setenv("HAWK_TT_PLATFORM", "ttnn")
    assert tt.register().endswith("TTPlatformMisconfigured")


def test_bad_settings_select_a_platform_that_fails_loudly(monkeypatch):
    monkeypatch.setenv("HAWK_TT_PLATFORM", "emulatd")
    assert tt.register().endswith("TTPlatformMisconfigured")
    with pytest.raises(TTPluginConfigError, match="HAWK_TT_PLATFORM"):
        TTPluginConfig.from_env()


def test_config_parsing_and_kv_dtype_choice():
    cfg = TTPluginConfig.from_env(
        {
            "HAWK_TT_PLATFORM": "emulated",
            "HAWK_TT_DEVICE": "n150",
            "HAWK_TT_KV_DTYPE": "bfloat8_b",
            "HAWK_TT_BANK_MIB": "64",
        }
    )
    assert (cfg.backend, cfg.device, cfg.kv_dtype, cfg.bank_size_bytes) == ("emulated", "n150", "bfloat8_b", 64 << 20)
    assert kv_dtype_for("auto", cfg) == "bfloat8_b"
    with pytest.raises(TTPluginConfigError, match="fp8"):
        kv_dtype_for("fp8", cfg)
    with pytest.raises(TTPluginConfigError, match="HAWK_TT_KV_DTYPE"):
        TTPluginConfig.from_env({"HAWK_TT_KV_DTYPE": "float8"})


def test_entry_point_is_visible_to_vllms_loader():
    tt.ensure_entry_point()
    eps = md.entry_points(group=tt.ENTRY_POINT_GROUP)
    assert any(ep.name == tt.ENTRY_POINT_NAME and ep.load() is tt.register for ep in eps)
    assert tt.ensure_entry_point() is False  # idempotent


def test_launcher_flags():
    env, rest = split_tt_flags(
        ["--tt-platform", "emulated", "--tt-device=n150", "--tt-chips", "2", "serve", "m", "--tt-x"]
    )
    assert env == {"HAWK_TT_PLATFORM": "emulated", "HAWK_TT_DEVICE": "n150", "HAWK_TT_CHIPS": "2"}
    assert rest == ["serve", "m", "--tt-x"]


def test_device_adapter_is_import_guarded():
    from vllm_hawk.npu import ttnn_chip as device

    try:
        device.import_ttnn()
    except device.TTNNUnavailable as e:
        assert "ensure_env.sh tt" in str(e)  # expected here: no tt-metal install
    else:  # pragma: no cover - only where ttnn is installed
        pytest.skip("ttnn installed; the main environment has none")
