"""kv_connector_extra_config validation: defaults, and errors that name the field."""

from __future__ import annotations

import pytest

from vllm_hawk.connector.config import HawkConfig, HawkConfigError, parse_config
from vllm_hawk.kvflow.decode import AUTO_LAYER_GROUPS

SECRET = "0123456789abcdef-secret"


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch):
    monkeypatch.delenv("HAWK_SHARED_SECRET", raising=False)
    monkeypatch.delenv("HAWK_SHARED_SECRET_FILE", raising=False)


def test_defaults_are_documented_and_valid():
    cfg = parse_config({"shared_secret": SECRET})
    assert cfg == HawkConfig(shared_secret=SECRET) and cfg.auth == "curve" and cfg.secret_bytes == SECRET.encode()
    assert SECRET not in repr(cfg)
    import vllm_hawk.connector.config as mod

    for name in HawkConfig.__dataclass_fields__:
        if name != "secret_bytes":
            assert f"``{name}``" in mod.__doc__, f"field {name} is not documented"


def test_authentication_is_on_by_default():
    """No secret and no explicit opt-out: start-up fails, naming the fields and the way out."""
    with pytest.raises(HawkConfigError) as e:
        parse_config(None)
    for needle in ("shared_secret", "shared_secret_file", "HAWK_SHARED_SECRET", '"auth": "none"'):
        assert needle in str(e.value)
    assert parse_config({"auth": "none"}).secret_bytes is None
    with pytest.raises(HawkConfigError, match="auth='none'.*remove it"):
        parse_config({"auth": "none", "shared_secret": SECRET})
    with pytest.raises(HawkConfigError, match="auth='tls'"):
        parse_config({"auth": "tls", "shared_secret": SECRET})
    assert parse_config({"auth": "hmac", "shared_secret": SECRET}).auth == "hmac"


def test_secret_file_is_as_good_as_inline(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_bytes(SECRET.encode() + b"\n")
    f.chmod(0o600)
    assert parse_config({"shared_secret_file": str(f)}).secret_bytes == SECRET.encode()
    monkeypatch.setenv("HAWK_SHARED_SECRET_FILE", str(f))
    assert parse_config({}).secret_bytes == SECRET.encode()
    monkeypatch.setenv("HAWK_SHARED_SECRET", SECRET)
    from vllm_hawk.envs import HawkEnvError

    with pytest.raises(HawkEnvError, match="both set"):
        parse_config({})
    monkeypatch.delenv("HAWK_SHARED_SECRET_FILE")
    with pytest.raises(HawkConfigError, match="not both"):
        parse_config({"shared_secret": SECRET, "shared_secret_file": str(f)})
    with pytest.raises(HawkConfigError, match=r"shared_secret_file=.*missing.*cannot be read"):
        parse_config({"shared_secret_file": str(tmp_path / "missing")})
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    with pytest.raises(HawkConfigError, match="shared_secret_file.*at least 16 bytes") as e:
        parse_config({"shared_secret_file": str(short)})
    assert "tiny" not in str(e.value)


@pytest.mark.parametrize(
    "field,value,needle",
    [
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
        ("layer_groups", 0, "layer_groups"),
        ("layer_groups", 65, "layer_groups"),
        ("layer_groups", "fast", "'auto'"),
        ("layout_fix", "both", "'prefill', 'decode'"),
        ("layout_fix", "decode", "Tenstorrent"),  # with device_profile 'vllm'
        ("renew_interval_s", 31.0, "30.0"),  # at most lease_s / 2
        ("renew_interval_s", 0, "renew_interval_s"),
        ("max_hold_s", 10.0, ">= 60.0"),  # at least lease_s
        ("handover_s", 0, "handover_s"),
    ],
)
def test_bad_field_is_named(field, value, needle):
    with pytest.raises(HawkConfigError) as e:
        parse_config({"shared_secret": SECRET, field: value})
    assert field in str(e.value) and needle in str(e.value)


def test_unknown_field_lists_known_ones():
    with pytest.raises(HawkConfigError, match="unknown field.*'lease_secs'.*lease_s"):
        parse_config({"lease_secs": 3})


def test_secret_from_environment_and_hidden_in_errors(monkeypatch):
    monkeypatch.setenv("HAWK_SHARED_SECRET", SECRET)
    assert parse_config({}).secret_bytes == b"0123456789abcdef-secret"
    monkeypatch.setenv("HAWK_SHARED_SECRET", "tiny")
    with pytest.raises(HawkConfigError) as e:
        parse_config({})
    assert "tiny" not in str(e.value)


def test_transport_arguments_and_dp_port_offset(monkeypatch):
    monkeypatch.setenv("HAWK_SHARED_SECRET", SECRET)
    kind, opts = parse_config({"transport": "host-staged"}).transport_kind_and_options()
    assert kind == "host_staged" and opts["secret"] == SECRET.encode()
    kind, opts = parse_config({"transport": "mooncake-rdma", "rdma_device": "mlx5_1"}).transport_kind_and_options()
    assert kind == "mooncake" and opts["protocol"] == "rdma" and opts["device_name"] == "mlx5_1"
    assert parse_config({"side_channel_port": 18000}, dp_rank=2).side_channel_port == 18002
    assert parse_config({"device_profile": "p150a"}).device_profile == "p150a"
    cfg = parse_config({"layer_groups": 2, "auth": "hmac"})  # main's layer groups next to sec's auth
    assert cfg.layer_groups == 2 and cfg.auth == "hmac" and cfg.secret_bytes is not None
    assert parse_config({}).layer_groups == parse_config({"layer_groups": "auto"}).layer_groups == AUTO_LAYER_GROUPS


def test_gn_host_needs_a_tenstorrent_decode_and_whole_pulls():
    cfg = parse_config(
        {
            "shared_secret": SECRET,
            "transport": "host-staged",
            "mode": "staged",
            "device_profile": "p150a",
            "layout_fix": "decode",
        }
    )
    assert cfg.layout_fix == "decode" and parse_config({"shared_secret": SECRET}).layout_fix == "prefill"
    assert cfg.layer_groups == AUTO_LAYER_GROUPS  # auto: a GN-Host sink always pulls whole requests
    with pytest.raises(HawkConfigError, match="layer_groups=2.*layout_fix='decode'"):
        parse_config({"shared_secret": SECRET, "device_profile": "p150a", "layout_fix": "decode", "layer_groups": 2})
    with pytest.raises(HawkConfigError, match="layout_fix='decode'.*device_profile"):
        parse_config({"shared_secret": SECRET, "layout_fix": "decode"})


def test_heartbeat_and_hold_follow_the_lease_when_unset():
    cfg = parse_config({"shared_secret": SECRET, "lease_s": 2.0})
    assert cfg.renew_interval_s == 0.5 and cfg.max_hold_s == 600.0
    cfg = parse_config({"shared_secret": SECRET, "lease_s": 1000.0})
    assert cfg.renew_interval_s == 1.0 and cfg.max_hold_s == 1000.0
    with pytest.raises(HawkConfigError, match="renew_interval_s=1.5.*1.0"):
        parse_config({"shared_secret": SECRET, "lease_s": 2.0, "renew_interval_s": 1.5})


def test_handover_hold_follows_the_lease_and_stays_inside_the_hold_bound():
    assert parse_config({"shared_secret": SECRET, "lease_s": 8.0}).handover_s == 8.0
    cfg = parse_config({"shared_secret": SECRET, "lease_s": 8.0, "handover_s": 900.0})
    assert cfg.handover_s == 900.0 and cfg.max_hold_s == 900.0  # the bound grows with it when unset
    with pytest.raises(HawkConfigError, match=r"max_hold_s=100.0.*>= 900.0"):
        parse_config({"shared_secret": SECRET, "handover_s": 900.0, "max_hold_s": 100.0})


def test_prefill_tp_pairing_is_checked_at_start_up():
    from vllm_hawk.connector.strategies import check_pairing

    check_pairing(4, 2, 2, [0], 2, chips=False)  # GG 2 -> 2
    check_pairing(4, 2, 1, [0], 4, chips=False)  # GG 2 -> 1: two prefill ranks into one cache
    check_pairing(8, 4, 4, range(4), 2, chips=True)  # the paper: TP 4 -> 4 chips
    check_pairing(4, 1, 2, range(2), 2, chips=True)  # one rank, a G' per chip
    with pytest.raises(HawkConfigError, match=r"prefill_tp=3 .*\(1 TP ranks, 4 KV heads\).*prefill TP 3"):
        check_pairing(4, 3, 1, [0], 4, chips=False)
    with pytest.raises(HawkConfigError, match=r"prefill_tp=4 .*2 chips.*whole head shards"):
        check_pairing(4, 4, 2, range(2), 2, chips=True)
    assert parse_config({"prefill_tp": 2, "auth": "none"}).prefill_tp == 2
    with pytest.raises(HawkConfigError, match="prefill_tp"):
        parse_config({"prefill_tp": -1, "auth": "none"})
