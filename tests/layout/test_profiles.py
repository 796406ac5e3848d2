"""Device profiles and model shapes ship inside the package; HAWK_CONFIG_DIR adds user folders."""

import os
from importlib.resources import files

import pytest

from vllm_hawk.layout import profiles
from vllm_hawk.layout.device_profiles import available_profiles, load_profile
from vllm_hawk.layout.model_shapes import available_models, load_model_shape

P150A = (
    "name: {name}\narch: blackhole\nnum_banks: 8\nbank_size_bytes: 4096\n"
    "dram_alignment_bytes: 64\nbank_offsets: [0, 0, 0, 0, 0, 0, 0, 0]\n"
    "bank_channels: [0, 1, 2, 3, 4, 5, 6, 7]\ndram_unreserved_base: 0\n"
)


@pytest.fixture(autouse=True)
def _no_user_dir(monkeypatch):
    monkeypatch.delenv(profiles.ENV_CONFIG_DIR, raising=False)


def test_shipped_files_are_package_resources():
    root = files("vllm_hawk.layout.profiles")
    devices = sorted(f.name for f in (root / "devices").iterdir() if f.name.endswith(".yaml"))
    assert devices == ["n150.yaml", "n300.yaml", "p100.yaml", "p150.yaml", "p150a.yaml"]
    assert available_profiles() == [d.removesuffix(".yaml") for d in devices]
    assert available_models() == ["llama-3.1-70b", "llama-3.1-8b"]
    m = load_model_shape("llama-3.1-70b")
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (80, 8, 128)


def test_unknown_names_list_what_exists():
    with pytest.raises(ValueError, match=r"unknown device profile 'p999'.*p150a"):
        load_profile("p999")
    with pytest.raises(ValueError, match=r"unknown model 'gpt-9'.*llama-3.1-8b"):
        load_model_shape("gpt-9")


def test_user_dir_adds_and_overrides(tmp_path, monkeypatch):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "mine.yaml").write_text(P150A.format(name="mine"))
    (tmp_path / "devices" / "p150a.yaml").write_text(P150A.format(name="p150a-small"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.yaml").write_text("num_layers: 2\nnum_kv_heads: 1\nhead_dim: 32\n")
    other = tmp_path / "other"  # a second folder, later on the path: searched after the first
    (other / "devices").mkdir(parents=True)
    (other / "devices" / "mine.yaml").write_text("not: used\n")
    monkeypatch.setenv(profiles.ENV_CONFIG_DIR, os.pathsep.join([str(tmp_path), str(other)]))
    assert "mine" in available_profiles() and "n150" in available_profiles()
    assert load_profile("mine").bank_size_bytes == 4096
    assert load_profile("p150a").name == "p150a-small"  # the user's file wins
    assert load_profile("n150").num_banks == 12  # shipped files still found
    assert load_model_shape("tiny").name == "tiny" and "tiny" in available_models()


def test_load_by_path(tmp_path):
    f = tmp_path / "custom.yml"
    f.write_text(P150A.format(name="custom"))
    assert load_profile(f).name == "custom" and load_profile(str(f)).name == "custom"
    m = tmp_path / "m.yaml"
    m.write_text("num_layers: 3\nnum_kv_heads: 2\nhead_dim: 64\n")
    assert load_model_shape(str(m)).name == "m"


def test_chips_field(tmp_path):
    f = tmp_path / "group.yaml"
    f.write_text(P150A.format(name="group") + "chips: 4\n")
    assert load_profile(f).chips == 4 and load_profile("p150a").chips == 1 and load_profile("n300").chips == 2
    f.write_text(P150A.format(name="group") + "chips: 0\n")
    with pytest.raises(ValueError, match="'chips' must be a positive int"):
        load_profile(f)
