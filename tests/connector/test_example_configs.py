"""The example files under configs/ stay valid: each connector JSON passes the connector's
own validation, prefill/decode pairs agree, and the env file names variables the code reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_hawk.connector.config import HawkConfigError, parse_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
PAIRS = ["gg-direct", "gn-hawk", "gn-host"]


def load(name: str) -> dict:
    return json.loads((CONFIGS / "connector" / f"{name}.json").read_text())


def test_every_example_is_a_listed_pair():
    found = sorted(p.stem for p in (CONFIGS / "connector").glob("*.json"))
    assert found == sorted(f"{p}-{side}" for p in PAIRS for side in ("prefill", "decode"))


@pytest.mark.parametrize("pair", PAIRS)
def test_pair_is_valid_and_consistent(pair, monkeypatch):
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
    p, d = parse_config(pre["kv_connector_extra_config"]), parse_config(dec["kv_connector_extra_config"])
    assert p.device_profile == d.device_profile and p.transport == d.transport
    assert p.auth == d.auth == "curve" and p.secret_bytes == b"0123456789abcdef"
    assert (p.device_profile == "vllm") == (pair == "gg-direct")
    assert p.layout_fix == d.layout_fix == ("decode" if pair == "gn-host" else "prefill")


def test_env_example_names_variables_the_code_reads():
    text = (CONFIGS / "hawk-node.env.example").read_text()
    names = re.findall(r"^#?([A-Z][A-Z0-9_]+)=", text, flags=re.M)
    assert "HAWK_SHARED_SECRET_FILE" in names and "HAWK_TT_PLATFORM" in names
    source = "\n".join(p.read_text() for p in (REPO / "vllm_hawk").rglob("*.py"))
    for name in names:
        if name.startswith("HAWK_"):
            assert f'"{name}"' in source, f"{name} in the env example is read nowhere in vllm_hawk"
