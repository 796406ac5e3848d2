"""kv_connector_extra_config validation: defaults, and errors that name the field."""

from __future__ import annotations

import pytest
from connector_helpers import config_log  # noqa: F401  (autouse)

from vllm_hawk.connector.config import FIELDS, HawkConfig, HawkConfigError, parse_config
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
    for name, f in FIELDS.items():
        assert f.metadata["doc"], f"field {name} is not documented"


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


def _tt(pair: str) -> dict:
    return {"device_profile": "p150a"} if pair.startswith("gn-") else {}


@pytest.mark.parametrize(
    "pair,transport,mode,profile,fix",
    [
        ("gg-direct", "mooncake-tcp", "direct", "vllm", "prefill"),
        ("gg-host", "host-staged", "staged", "vllm", "prefill"),
        ("gn-host", "host-staged", "staged", "p150a", "decode"),
        ("gn-hawk", "mooncake-tcp", "direct", "p150a", "prefill"),
    ],
)
def test_each_pair_expands_to_its_fields(pair, transport, mode, profile, fix, caplog):
    for side in ("prefill", "decode", None):
        cfg = parse_config({"auth": "none", "pair": pair, **_tt(pair)}, side=side)
        assert (cfg.pair, cfg.transport, cfg.mode, cfg.device_profile, cfg.layout_fix) == (
            pair,
            transport,
            mode,
            profile,
            fix,
        )
    spelled = {"transport": transport, "mode": mode, "device_profile": profile, "layout_fix": fix}
    assert parse_config({"auth": "none", "pair": pair, **spelled}, side="decode").pair == pair  # consistent: fine
    assert "set pair" not in caplog.text


def test_rdma_fits_the_mooncake_pairs():
    for pair in ("gg-direct", "gn-hawk"):
        cfg = parse_config({"auth": "none", "pair": pair, "transport": "mooncake-rdma", **_tt(pair)})
        assert cfg.transport == "mooncake-rdma"


@pytest.mark.parametrize(
    "pair,name,value",
    [
        ("gg-direct", "transport", "host-staged"),
        ("gg-direct", "mode", "staged"),
        ("gg-direct", "device_profile", "p150a"),
        ("gg-host", "transport", "mooncake-tcp"),
        ("gg-host", "mode", "direct"),
        ("gg-host", "layout_fix", "decode"),
        ("gn-host", "transport", "mooncake-rdma"),
        ("gn-host", "mode", "direct"),
        ("gn-host", "layout_fix", "prefill"),
        ("gn-host", "device_profile", "vllm"),
        ("gn-hawk", "transport", "host-staged"),
        ("gn-hawk", "layout_fix", "decode"),
        ("gn-hawk", "device_profile", "vllm"),
    ],
)
def test_a_field_that_contradicts_the_pair_is_refused_naming_both(pair, name, value):
    extra = {"auth": "none", "pair": pair, **_tt(pair), name: value}
    with pytest.raises(HawkConfigError) as e:
        parse_config(extra)
    assert f"pair={pair!r}" in str(e.value) and f"{name}={value!r}" in str(e.value)


def test_a_gn_hawk_prefill_refuses_a_mode_its_decode_takes_one():
    extra = {"auth": "none", "pair": "gn-hawk", "device_profile": "p150a", "mode": "staged"}
    with pytest.raises(HawkConfigError) as e:
        parse_config(extra, side="prefill")
    assert "pair='gn-hawk'" in str(e.value) and "mode='staged'" in str(e.value)
    assert parse_config(extra, side="decode").mode == "staged"


def test_a_gn_pair_needs_the_tenstorrent_device():
    with pytest.raises(HawkConfigError, match="pair='gn-host'.*device_profile"):
        parse_config({"auth": "none", "pair": "gn-host"})
    with pytest.raises(HawkConfigError, match="pair='gg-ring'.*gg-direct"):
        parse_config({"auth": "none", "pair": "gg-ring"})
    with pytest.raises(HawkConfigError, match="pair=\\['gg-host'\\]"):
        parse_config({"auth": "none", "pair": ["gg-host"]})


@pytest.mark.parametrize(
    "extra,pair",
    [
        ({"transport": "host-staged", "mode": "staged"}, "gg-host"),
        ({"transport": "mooncake-rdma", "mode": "direct", "device_profile": "vllm"}, "gg-direct"),
        ({"transport": "host-staged", "mode": "staged", "device_profile": "p150a", "layout_fix": "decode"}, "gn-host"),
        ({"transport": "mooncake-tcp", "device_profile": "p150a"}, "gn-hawk"),
    ],
)
def test_old_keys_parse_as_before_and_warn_naming_pair(extra, pair, caplog):
    cfg = parse_config({"auth": "none", **extra})
    assert cfg.pair is None and all(getattr(cfg, k) == v for k, v in extra.items())
    assert f"set pair={pair!r}" in caplog.text


def test_old_keys_that_make_no_pair_parse_without_a_warning(caplog):
    assert parse_config({"auth": "none", "transport": "host-staged"}).mode == "direct"  # GG over host-staged, direct
    assert parse_config({"auth": "none"}).transport == "mooncake-tcp"
    assert "set pair" not in caplog.text


def test_an_old_gn_hawk_prefill_warns_that_it_ignores_mode(caplog):
    cfg = parse_config({"auth": "none", "device_profile": "p150a", "mode": "staged"}, side="prefill")
    assert cfg.mode == "staged" and "set pair='gn-hawk'" in caplog.text and "ignores mode" in caplog.text


def test_transfer_engine_host_defaults_to_the_side_channel_host():
    cfg = parse_config({"auth": "none", "side_channel_host": "10.0.0.10"})
    assert cfg.transfer_engine_host == "10.0.0.10"
    assert cfg.transport_kind_and_options()[1]["local_host"] == "10.0.0.10"
    cfg = parse_config({"auth": "none", "side_channel_host": "10.0.0.10", "transfer_engine_host": "192.168.7.2"})
    assert cfg.side_channel_host == "10.0.0.10" and cfg.transfer_engine_host == "192.168.7.2"
    assert cfg.transport_kind_and_options()[1]["local_host"] == "192.168.7.2"
    cfg = parse_config({"auth": "none", "transport": "host-staged", "transfer_engine_host": "192.168.7.2"})
    assert cfg.transport_kind_and_options()[1]["bind_host"] == "192.168.7.2"
    with pytest.raises(HawkConfigError, match="transfer_engine_host=''"):
        parse_config({"auth": "none", "transfer_engine_host": ""})
