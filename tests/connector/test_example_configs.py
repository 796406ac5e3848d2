"""The example files under configs/ and examples/compose/config/ stay valid: each connector
JSON passes the connector's own validation on its side and names its ``pair`` (no warning),
prefill/decode pairs agree, and the env file names variables the code reads."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from connector_helpers import config_log  # noqa: F401  (autouse)

from vllm_hawk.connector.config import HawkConfigError, parse_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
COMPOSE_CONFIGS = REPO / "examples" / "compose" / "config"
PAIRS = ["gg-direct", "gn-hawk", "gn-host"]


def load(name: str) -> dict:
    return json.loads((CONFIGS / "connector" / f"{name}.json").read_text())


def test_every_example_is_a_listed_pair():
    found = sorted(p.stem for p in (CONFIGS / "connector").glob("*.json"))
    assert found == sorted(f"{p}-{side}" for p in PAIRS for side in ("prefill", "decode"))


@pytest.mark.parametrize("pair", PAIRS)
def test_pair_is_valid_and_consistent(pair, monkeypatch, caplog):
    monkeypatch.delenv("HAWK_CONFIG_DIR", raising=False)
    monkeypatch.delenv("HAWK_SHARED_SECRET", raising=False)
    monkeypatch.delenv("HAWK_SHARED_SECRET_FILE", raising=False)
    pre, dec = load(f"{pair}-prefill"), load(f"{pair}-decode")
    with pytest.raises(HawkConfigError, match="needs a shared secret"):  # secure by default
        parse_config(pre["kv_connector_extra_config"])
    monkeypatch.setenv("HAWK_SHARED_SECRET", "0123456789abcdef")
    assert (pre["kv_connector"], pre["kv_role"]) == ("HawkConnector", "kv_producer")
    assert (dec["kv_connector"], dec["kv_role"]) == ("HawkConnector", "kv_consumer")
    assert dec.get("kv_load_failure_policy", "fail") in ("fail", "recompute")
    p = parse_config(pre["kv_connector_extra_config"], side="prefill")
    d = parse_config(dec["kv_connector_extra_config"], side="decode")
    assert p.pair == d.pair == pair and "set pair" not in caplog.text
    assert p.device_profile == d.device_profile and p.transport == d.transport
    assert p.auth == d.auth == "curve" and p.secret_bytes == b"0123456789abcdef"
    assert (p.device_profile == "vllm") == (pair == "gg-direct")
    assert p.layout_fix == d.layout_fix == ("decode" if pair == "gn-host" else "prefill")


@pytest.mark.parametrize("setup", ["emulated", "hardware"])
def test_compose_configs_name_gn_hawk(setup, monkeypatch, caplog):
    monkeypatch.setenv("HAWK_SHARED_SECRET", "0123456789abcdef")
    monkeypatch.setenv("HAWK_NODE_IP", "192.0.2.10")
    monkeypatch.setenv("HAWK_RDMA_DEVICE", "mlx5_0")
    for side in ("prefill", "decode"):
        text = os.path.expandvars((COMPOSE_CONFIGS / f"{setup}-{side}.json").read_text())
        cfg = parse_config(json.loads(text)["kv_connector_extra_config"], side=side)
        assert cfg.pair == "gn-hawk" and cfg.device_profile == "p150a"
    assert "set pair" not in caplog.text


def test_env_example_names_variables_the_code_reads():
    text = (CONFIGS / "hawk-node.env.example").read_text()
    names = re.findall(r"^#?([A-Z][A-Z0-9_]+)=", text, flags=re.M)
    assert "HAWK_SHARED_SECRET_FILE" in names and "HAWK_TT_PLATFORM" in names
    source = "\n".join(p.read_text() for p in (REPO / "vllm_hawk").rglob("*.py"))
    for name in names:
        if name.startswith("HAWK_"):
            assert f'"{name}"' in source, f"{name} in the env example is read nowhere in vllm_hawk"
