"""A wheel install works: build the wheel, install it into a fresh venv, run ``hawk`` from
outside the checkout, and find the entry points vLLM loads.

No network: the wheel is built with ``pip wheel --no-build-isolation --no-index`` (setuptools
from this interpreter's environment) from a copy of the sources, so nothing is written into
the checkout. The fresh venv gets the dependencies by reusing this interpreter's
site-packages through a ``.pth`` file (``import site; site.addsitedir(...)``, so their own
``.pth`` files run too); its own site-packages comes first on ``sys.path`` and holds only
the wheel, installed with ``--no-deps``. Commands run in a temporary directory with
``PYTHONPATH`` unset, so the checkout is not importable.

When it cannot run (no setuptools, pip or vLLM here) it skips, except under ``CI``, where it
fails: CI must exercise the wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED_YAML = {
    "vllm_hawk/layout/profiles/devices/p150a.yaml",
    "vllm_hawk/layout/profiles/devices/n150.yaml",
    "vllm_hawk/layout/profiles/models/llama-3.1-70b.yaml",
}


def cannot_run(reason: str):
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"wheel test cannot run under CI: {reason}")
    pytest.skip(reason)


def has_module(name: str) -> bool:
    r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, timeout=120)
    return r.returncode == 0


def site_dirs() -> list[str]:
    """Where this interpreter finds its dependencies (never the checkout)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    out: list[str] = []
    for d in dirs:
        if d not in out and Path(d).is_dir() and Path(d).resolve() != REPO:
            out.append(d)
    return out


def clean_env(venv: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PYTHONPATH",
            "PYTHONHOME",
            "PYTHONSTARTUP",
            "VIRTUAL_ENV",
            "VLLM_PLUGINS",
            "HAWK_CONFIG_DIR",
            "HAWK_TT_PLATFORM",
            "VLLM_TARGET_DEVICE",
        )
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(argv: list, *, cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, wheel, outside-dir): the wheel built from this checkout, installed alone in a venv."""
    for mod in ("setuptools", "pip", "yaml"):
        if not has_module(mod):
            cannot_run(f"{mod} is not importable by {sys.executable}")
    t0 = time.monotonic()
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        REPO / "vllm_hawk", src / "vllm_hawk", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    )
    outside = base / "elsewhere"
    outside.mkdir()
    venv = base / "venv"
    env = clean_env(venv)

    r = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "--wheel-dir",
            base / "dist",
            src,
        ],
        cwd=outside,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (base / "dist").glob("vllm_hawk-*.whl")

    r = run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=outside, env=env)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    purelib = run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=outside, env=env
    ).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in site_dirs()]
    (Path(purelib) / "_hawk_reuse_deps.pth").write_text("\n".join(lines) + "\n")
    # pip itself comes from the reused site-packages; it installs into the venv it runs in
    r = run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=outside, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"wheel built and installed in {time.monotonic() - t0:.1f} s")
    return venv, wheel, outside


def test_wheel_ships_the_profiles_and_entry_points(installed):
    _, wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        eps = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert names >= SHIPPED_YAML, sorted(n for n in names if n.endswith(".yaml"))
    assert not any(n.startswith(("tests/", "configs/", "examples/", "vllm_hawk/testing/")) for n in names)
    assert "vllm_hawk/bench/local_cluster.py" in names  # what hawk bench serve runs on
    assert "hawk = vllm_hawk.cli:main" in eps
    assert "hawk_connector = vllm_hawk.connector:register" in eps
    assert "hawk_tt = vllm_hawk.tenstorrent.emulated:register" in eps


def test_hawk_layout_and_doctor_run_outside_the_checkout(installed):
    venv, _, outside = installed
    env = clean_env(venv)
    hawk = venv / "bin" / "hawk"
    assert hawk.is_file(), "the console script was not installed"

    r = run([hawk, "layout", "--tokens", "1024", "--json"], cwd=outside, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["num_banks"] == 8 and rep["blocks"] == 16  # p150a, llama-3.1-70b: shipped YAML
    r = run(
        [hawk, "layout", "--model", "llama-3.1-8b", "--prefill-tp", "1", "--device", "n150", "--tokens", "256"],
        cwd=outside,
        env=env,
    )
    assert r.returncode == 0 and "n150 (12 DRAM banks)" in r.stdout, r.stdout + r.stderr

    r = run([hawk, "doctor", "--json"], cwd=outside, env=env)
    # exit 1 on a machine without RDMA or Tenstorrent devices (CI), 0 on a ready node
    assert r.returncode in (0, 1), r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["role"] == "all" and report["checks"]
    assert r.returncode == (0 if report["ready"] else 1)
    assert {"rdma devices", "mooncake"} <= {c["name"] for c in report["checks"]}, report


PROBE = textwrap.dedent("""
    import importlib.metadata as md, json, os, sys
    out = {}
    import vllm_hawk
    from vllm_hawk.layout import profiles
    out["package"] = vllm_hawk.__file__
    out["profiles"] = str(profiles.find("devices", "p150a"))
    dist = md.distribution("vllm-hawk")
    out["dist"] = str(dist.locate_file(""))
    out["own"] = sorted(f"{ep.group}:{ep.name}={ep.value}" for ep in dist.entry_points)
    out["visible"] = {g: sorted(ep.name for ep in md.entry_points(group=g))
                      for g in ("console_scripts", "vllm.general_plugins", "vllm.platform_plugins")}
    from vllm_hawk.vllm_launcher import ensure_vllm_dist
    ensure_vllm_dist()
    import vllm.plugins
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    vllm.plugins.load_general_plugins()
    out["registered"] = "HawkConnector" in KVConnectorFactory._registry
    platforms = vllm.plugins.load_plugins_by_group("vllm.platform_plugins")
    out["platform_plugins"] = sorted(platforms)
    out["hawk_tt"] = platforms["hawk_tt"]() if "hawk_tt" in platforms else "absent"
    print("PROBE " + json.dumps(out))
""")


def test_entry_points_are_visible_and_load(installed):
    venv, _, outside = installed
    env = clean_env(venv)
    py = venv / "bin" / "python"
    if importlib.util.find_spec("vllm") is None:
        cannot_run("vLLM is not installed in the reused site-packages")
    r = run([py, "-c", PROBE], cwd=outside, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("PROBE ", 1)[1])
    root = str(venv)
    # the wheel, not the checkout, is what runs
    assert out["package"].startswith(root) and out["profiles"].startswith(root), out
    assert out["dist"].startswith(root), out
    assert out["own"] == [
        "console_scripts:hawk=vllm_hawk.cli:main",
        "vllm.general_plugins:hawk_connector=vllm_hawk.connector:register",
        "vllm.platform_plugins:hawk_tt=vllm_hawk.tenstorrent.emulated:register",
    ]
    assert "hawk" in out["visible"]["console_scripts"]
    assert "hawk_connector" in out["visible"]["vllm.general_plugins"]
    assert "hawk_tt" in out["visible"]["vllm.platform_plugins"]
    assert out["registered"] is True  # vLLM's own loader ran our general plugin
    assert "hawk_tt" in out["platform_plugins"] and out["hawk_tt"] is None  # off: HAWK_TT_PLATFORM unset
