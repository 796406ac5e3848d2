"""The emulated compose profile end to end (examples/compose/, scripts/compose_demo.sh).

``scripts/compose_demo.sh test`` installs what is missing (docker.io, docker-compose,
debootstrap; root and apt), starts its own dockerd with data under $HAWK_CACHE/docker,
builds (or reuses) the base image, the wheelhouse and the three images, brings up the
prefill, decode (emulated p150a) and proxy containers on a user-defined network, runs the
client container (outputs vs the prefill engine alone modulo top-2 ties; KV bytes in the
decode's banks exact vs tilize_pack), tears everything down and checks that no
container, network or volume of the project, no dockerd, no mount is left and that
ip_forward and the FORWARD policy are unchanged. Needs root: skips locally without it,
fails under CI=true.

Cold (nothing cached, Debian packages installed): 12 min on this shared 2-core machine,
most of it the debootstrap, the pip layer of the CPU image and the engines' start-up;
warm: 3-6 min, mostly `compose up` (docs/deployment.md has the measured times).
The other tests here only read files and run `docker-compose config` when it is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "examples" / "compose"
IN_CI = os.environ.get("CI", "").lower() == "true"


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"compose test cannot run under CI: {reason}")
    pytest.skip(reason)


@pytest.mark.compose
def test_emulated_profile_end_to_end():
    if os.geteuid() != 0:
        _unavailable("needs root (dockerd, apt)")
    if shutil.which("apt-get") is None and shutil.which("dockerd") is None:
        _unavailable("no dockerd and no apt-get to install it")
    t0 = time.monotonic()
    # the script's progress and step times go to the terminal as they come (make test: -s)
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "compose_demo.sh"), "test"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    rc = proc.wait()
    log = "".join(lines)
    print(f"[compose] whole run {time.monotonic() - t0:.0f} s")
    assert rc == 0, log[-4000:]
    assert "[compose] RESULT: ok" in log
    assert re.search(r"^PASS: \d+ requests", log, re.M), "the client did not pass"
    assert "all exact" in log


def _lock(name: str = "requirements-cpu.lock") -> dict[str, str]:
    pins = {}
    for line in (COMPOSE / name).read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_lock_agrees_with_requirements():
    """Every pin of requirements/cpu.txt that a node needs has the same version in the lock,
    the router's in the router image's own lock (regenerate both with
    `scripts/compose_demo.sh lock` after changing requirements/cpu.txt)."""
    lock = {**_lock(), "vllm-router": _lock("requirements-router.lock")["vllm-router"]}
    test_tools = {"pytest", "hypothesis", "matplotlib", "ruff"}
    for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" not in line:
            continue
        name, _, version = line.partition("==")
        name = re.sub(r"[-_.]+", "-", name).lower()
        if name in test_tools:
            continue
        assert name in lock, f"{name} missing from requirements-cpu.lock"
        assert lock[name].split("+")[0] == version.split("+")[0], f"{name}: lock {lock[name]}, cpu.txt {version}"


def test_images_hold_nothing_secret():
    """Dockerfiles: ARG BASE first, no secrets, no registry host names, nothing copied
    but what .dockerignore lets through."""
    files = sorted(COMPOSE.glob("Dockerfile.*"))
    assert {f.name for f in files} >= {
        "Dockerfile.prefill-cpu",
        "Dockerfile.prefill-cuda",
        "Dockerfile.decode-tt",
        "Dockerfile.proxy",
        "Dockerfile.router",
    }
    for f in files:
        text = f.read_text()
        code = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert code[0].startswith("ARG BASE=") and code[1] == "FROM ${BASE}", f.name
        lowered = text.lower()
        for bad in ("secret=", "hawk_shared_secret", "password", "token=", "ca-certificates.crt"):
            assert bad not in lowered, f"{f.name} mentions {bad!r}"
        # image references are Docker Hub short names: no "host.name/" or "host:port/" prefix
        base = code[0].split("=", 1)[1]
        assert not re.match(r"^[\w-]+(\.[\w-]+)+(:\d+)?/", base), f"{f.name}: registry host in {base}"
        assert not re.search(r"https?://", "\n".join(code)), f"{f.name}: a URL in an instruction"
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1 :] and "!examples/compose/hawk.env" not in ignore


def test_compose_file_profiles_and_config():
    """Both profiles are valid for docker-compose 1.29 (when it is installed); the emulated
    one has init, health checks and health-conditioned depends_on; no inline secret or
    inline connector JSON."""
    import yaml

    doc = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    assert doc["version"] == "3.8"
    svcs = doc["services"]
    emulated = {n for n, s in svcs.items() if "emulated" in s.get("profiles", [])}
    hardware = {n for n, s in svcs.items() if "hardware" in s.get("profiles", [])}
    assert emulated == {"model", "prefill", "decode", "proxy", "router", "client"}
    assert hardware == {"prefill-gpu", "decode-tt", "proxy-hw"}
    for n in emulated | hardware:
        assert svcs[n].get("init") is True, f"{n}: init: true"
    for n in ("prefill", "decode", "proxy", "router", "prefill-gpu", "decode-tt", "proxy-hw"):
        assert "healthcheck" in svcs[n], n
    assert svcs["proxy"]["depends_on"] == {
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    assert svcs["router"]["depends_on"] == svcs["proxy"]["depends_on"]
    assert svcs["client"]["depends_on"] == {
        "proxy": {"condition": "service_healthy"},
        "router": {"condition": "service_healthy"},
    }
    assert "/dev/tenstorrent:/dev/tenstorrent" in svcs["decode-tt"]["devices"]
    assert svcs["decode-tt"]["environment"]["HAWK_DOCTOR_ROLE"] == "decode"
    assert svcs["prefill-gpu"]["environment"]["HAWK_DOCTOR_ROLE"] == "prefill"
    text = (COMPOSE / "docker-compose.yml").read_text()
    assert "kv_connector" not in text and "HAWK_SHARED_SECRET=" not in text
    import json

    for f in (COMPOSE / "config").glob("*.json"):
        cfg = json.loads(f.read_text())
        assert "shared_secret" not in cfg["kv_connector_extra_config"], f.name
        assert cfg["kv_connector_extra_config"]["auth"] == "curve", f.name  # the secret comes from the env file
        want = "mooncake-rdma" if f.name.startswith("hardware") else "mooncake-tcp"
        assert cfg["kv_connector_extra_config"].get("transport", "mooncake-tcp") == want, f.name
    if shutil.which("docker-compose") is None:
        return  # the compose stage (test_emulated_profile_end_to_end) installs it and runs `config` too
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAWK_")}
    env_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"hawk-compose-config-{os.getpid()}.env"
    env_file.write_text("HAWK_SHARED_SECRET=only-for-docker-compose-config\n")
    try:
        env.update(HAWK_ENV_FILE=str(env_file), DOCKER_HOST="unix:///nonexistent.sock")
        for profile, extra in (
            ("emulated", {}),
            (
                "hardware",
                {"HAWK_NODE_IP": "192.0.2.10", "HAWK_PREFILL_ADDR": "192.0.2.10", "HAWK_DECODE_ADDR": "192.0.2.20"},
            ),
        ):
            out = subprocess.run(
                ["docker-compose", "-f", str(COMPOSE / "docker-compose.yml"), "--profile", profile, "config"],
                capture_output=True,
                text=True,
                env={**env, **extra},
            )
            assert out.returncode == 0, f"{profile}: {out.stderr}"
    finally:
        env_file.unlink(missing_ok=True)


def test_hawk_node_expands_the_connector_config(tmp_path):
    """hawk-node's config step: ${VAR}s expanded, HAWK_NODE_IP defaulted only when unset,
    an empty one and an inline shared_secret refused."""
    cfg = tmp_path / "kv.json"
    cfg.write_text(
        '{"kv_connector": "HawkConnector", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"side_channel_host": "${HAWK_NODE_IP}"}}'
    )
    script = COMPOSE / "hawk-node.sh"
    base = {"PATH": os.environ["PATH"], "HAWK_KV_CONFIG_FILE": str(cfg)}
    probe = [
        "sh",
        "-c",
        f'. /dev/null; sed -n "/^kv_config()/,/^}}/p" {script} > {tmp_path}/f.sh; '
        f'die() {{ echo "$*" >&2; exit 2; }}; . {tmp_path}/f.sh; kv_config',
    ]
    out = subprocess.run(probe, capture_output=True, text=True, env={**base, "HAWK_NODE_IP": "10.1.2.3"})
    assert out.returncode == 0, out.stderr
    assert '"side_channel_host": "10.1.2.3"' in out.stdout
    out = subprocess.run(probe, capture_output=True, text=True, env=base)
    assert out.returncode == 0 and '"side_channel_host": "' in out.stdout  # this host's address
    out = subprocess.run(probe, capture_output=True, text=True, env={**base, "HAWK_NODE_IP": ""})
    assert out.returncode != 0 and "HAWK_NODE_IP" in out.stderr
    cfg.write_text('{"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_secret": "x"}}')
    out = subprocess.run(probe, capture_output=True, text=True, env={**base, "HAWK_NODE_IP": "10.1.2.3"})
    assert out.returncode != 0 and "HAWK_SHARED_SECRET" in out.stderr
