"""The decode's device is named once: with HawkConnector its ``device_profile``; the
platform's ``HAWK_TT_DEVICE`` / ``--tt-device`` serves plain serving and may only agree.
And the deprecated module paths still work, saying where the code went."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest

from vllm_hawk.tenstorrent.device import DEFAULT_DEVICE, connector_device, decode_device


def engine(device_profile: str | None = None, connector: str = "HawkConnector"):
    if device_profile is None:
        return SimpleNamespace(kv_transfer_config=None)
    extra = {"device_profile": device_profile, "auth": "none"}
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra))


def test_the_connector_names_the_device():
    assert decode_device(engine("n150"), None, "HAWK_TT_DEVICE") == "n150"
    assert decode_device(engine("n150"), "n150", "HAWK_TT_DEVICE") == "n150"  # agreeing is fine


def test_without_the_connector_the_platform_names_it():
    assert decode_device(engine(), "n300", "HAWK_TT_DEVICE") == "n300"
    assert decode_device(engine(), None, "HAWK_TT_DEVICE") == DEFAULT_DEVICE
    assert connector_device(engine("n150", connector="OtherConnector")) is None


def test_a_gg_pair_on_a_tenstorrent_decode_is_refused_at_start_up():
    with pytest.raises(
        ValueError, match=r"device_profile='vllm' \(a GG pair\) on a Tenstorrent decode: set pair 'gn-hawk'"
    ):
        decode_device(engine("vllm"), None, "HAWK_TT_DEVICE")


def test_two_names_for_the_device_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"HAWK_TT_DEVICE='p150a' but kv_connector_extra_config.device_profile='n150'"):
        decode_device(engine("n150"), "p150a", "HAWK_TT_DEVICE")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("vllm_hawk.tt_plugin", "vllm_hawk.tenstorrent.emulated"),
        ("vllm_hawk.tt_decode", "vllm_hawk.tenstorrent.vllm_tt"),
    ],
)
def test_old_module_paths_warn_naming_the_new_one(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(FutureWarning, match=new):
        mod = importlib.import_module(old)
    if old == "vllm_hawk.tt_plugin":
        assert mod.register is importlib.import_module(new).register
    else:
        assert mod.WORKER_CLS == "vllm_hawk.tenstorrent.vllm_tt.worker.HawkTTWorker"
