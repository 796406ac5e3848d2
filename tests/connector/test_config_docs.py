"""docs/configuration.md's field table is what vllm_hawk/connector/config.py declares: a
field's documentation edited in only one of the two places fails here."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_hawk.connector import config, config_doc
from vllm_hawk.connector.config import FIELDS, HawkConfig, parse_config


def committed() -> str:
    return config_doc.DOC_PATH.read_text()


def test_docs_are_generated_from_the_declarations():
    text = committed()
    assert config_doc.splice(text) == text, (
        "docs/configuration.md's field table differs from vllm_hawk/connector/config.py: "
        "edit the field's declaration there, then run `make config-doc`"
    )


def test_every_field_is_documented_with_side_and_limits():
    table = config_doc.render()
    for name, f in FIELDS.items():
        assert f.metadata["doc"] and f.metadata["side"] in ("prefill", "decode", "both"), name
        assert f"| `{name}` |" in table


def test_an_edit_in_the_docs_only_fails():
    text = committed()
    edited = text.replace("the **pull deadline**: one pull", "the **pull deadline**: one whole pull", 1)
    assert edited != text and config_doc.splice(edited) != edited


def test_an_edit_in_the_code_only_fails(monkeypatch):
    text = committed()
    f = FIELDS["pull_timeout_s"]
    edited = dataclasses.field(default=f.default, metadata=dict(f.metadata, doc="one whole pull"))
    edited.name, edited.type = f.name, f.type
    monkeypatch.setitem(FIELDS, "pull_timeout_s", edited)
    assert config_doc.splice(text) != text


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.metadata["unset"]])
def test_documented_unset_defaults_are_what_the_parser_computes(name):
    """The default column of a computed field is its expression, evaluated by the parser:
    over the declared defaults it gives the dataclass default."""
    parsed = parse_config({"auth": "none"})
    want = getattr(HawkConfig(), name)
    assert getattr(parsed, name) == want
    assert config._unset(name, {n: f.default for n, f in FIELDS.items()}) in (want, "auto")


def test_max_hold_default_follows_a_long_hand_over():
    assert parse_config({"auth": "none", "handover_s": 900.0}).max_hold_s == 900.0
    assert "`max(600.0, lease_s, handover_s)`" in config_doc.render()


def test_the_command_writes_the_committed_page(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    stale = committed().replace("the **pull deadline**", "the **deadline**", 1)
    page.write_text(stale)
    assert config_doc.main(["--write", str(page)]) == 0 and page.read_text() == committed()
    assert config_doc.main([]) == 0 and capsys.readouterr().out == config_doc.render()
    assert config_doc.main(["--check"]) == 2
