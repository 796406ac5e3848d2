"""kv_connector_extra_config validation: defaults, and errors that name the field."""
from __future__ import annotations

import pytest

from vllm_hawk.connector.config import HawkConfig, HawkConfigError, parse_config


def test_defaults_are_documented_and_valid(monkeypatch):
    monkeypatch.delenv("HAWK_SHARED_SECRET", raising=False)
    cfg = parse_config(None)
    assert cfg == HawkConfig()
    import vllm_hawk.connector.config as mod
    for name in HawkConfig.__dataclass_fields__:
        assert f"``{name}``" in mod.__doc__, f"field {name} is not documented"


@pytest.mark.parametrize("field,value,needle", [
    ("transport", "rdma", "mooncake-tcp"),
    ("mode", "push", "direct"),
    ("side_channel_port", 0, "side_channel_port"),
    ("side_channel_port", "17600", "integer"),
    ("lease_s", -1, "lease_s"),
    ("pull_timeout_s", True, "number"),
    ("device_profile", "h100", "device_profile"),
    ("shared_secret", "short", "shared_secret"),
    ("rdma_device", "mlx5_0", "mooncake-rdma"),
    ("max_pulls", 0, "max_pulls"),
])
def test_bad_field_is_named(field, value, needle):
    with pytest.raises(HawkConfigError) as e:
        parse_config({field: value})
    assert field in str(e.value) and needle in str(e.value)


def test_unknown_field_lists_known_ones():
    with pytest.raises(HawkConfigError, match="unknown field.*'lease_secs'.*lease_s"):
        parse_config({"lease_secs": 3})


def test_secret_from_environment_and_hidden_in_errors(monkeypatch):
    monkeypatch.setenv("HAWK_SHARED_SECRET", "0123456789abcdef-secret")
    assert parse_config({}).secret_bytes == b"0123456789abcdef-secret"
    monkeypatch.setenv("HAWK_SHARED_SECRET", "tiny")
    with pytest.raises(HawkConfigError) as e:
        parse_config({})
    assert "tiny" not in str(e.value)


def test_transport_arguments_and_dp_port_offset():
    assert parse_config({"transport": "host-staged"}).transport_kind_and_options()[0] == "host_staged"
    kind, opts = parse_config({"transport": "mooncake-rdma", "rdma_device": "mlx5_1"}
                              ).transport_kind_and_options()
    assert kind == "mooncake" and opts["protocol"] == "rdma" and opts["device_name"] == "mlx5_1"
    assert parse_config({"side_channel_port": 18000}, dp_rank=2).side_channel_port == 18002
    assert parse_config({"device_profile": "p150a"}).device_profile == "p150a"
