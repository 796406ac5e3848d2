"""`hawk doctor` run as a subprocess: on this machine (no RDMA, no Tenstorrent device) and
against FAKE sysfs/dev/proc trees built under tmp_path with --root."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def run_doctor(*args: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hawk.doctor", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stderr == "" or "Warning" in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout


def by_name(stdout: str) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def mooncake_importable() -> bool:
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except ModuleNotFoundError:
        return False


def test_this_machine_has_no_rdma_and_no_tenstorrent_device() -> None:
    if Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()):
        pytest.skip("this machine has an RDMA device")
    if Path("/dev/tenstorrent").exists():
        pytest.skip("this machine has a Tenstorrent device")
    rc, out = run_doctor("--json", "--role", "decode")
    assert rc == 1
    checks = by_name(out)
    assert checks["rdma devices"]["status"] == "MISSING"
    assert checks["tenstorrent devices"]["status"] == "MISSING"
    assert "/dev/tenstorrent" in checks["tenstorrent devices"]["detail"]
    assert json.loads(out)["ready"] is False
    rc, table = run_doctor()
    assert rc == 1
    assert table.splitlines()[0].split() == ["CHECK", "STATUS", "DETAIL", "FIX"]
    assert "NOT READY for role all" in table


def make_fake_node(
    root: Path,
    *,
    device_id: str = "0xb140",
    card: str = "p150a",
    bar4: int = 32 * GiB,
    kmd: str | None = "2.10.1-pre",
    modules: tuple[str, ...] = ("nvidia_peermem", "tt_peermem"),
    port_state: str = "4: ACTIVE",
) -> Path:
    """A FAKE /sys, /dev, /proc tree of a node with one NIC and one Tenstorrent card."""
    port = root / "sys/class/infiniband/mlx5_0/ports/1"
    port.mkdir(parents=True)
    (port / "state").write_text(port_state + "\n")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text("6.12.48+deb13-amd64\n")
    (root / "proc/modules").write_text("".join(f"{m} 16384 0 - Live 0x0000000000000000\n" for m in modules))
    if kmd is not None:
        (root / "sys/module/tenstorrent").mkdir(parents=True)
        (root / "sys/module/tenstorrent/version").write_text(kmd + "\n")
    (root / "dev/tenstorrent").mkdir(parents=True)
    (root / "dev/tenstorrent/0").touch()
    pci = root / "sys/bus/pci/devices/0000:03:00.0"
    pci.mkdir(parents=True)
    (pci / "vendor").write_text("0x1e52\n")
    (pci / "device").write_text(device_id + "\n")
    bars = [(0x9000_0000, 512 << 20), (0, 0), (0xA000_0000, 1 << 20), (0, 0), (0x20_0000_0000, bar4)]
    (pci / "resource").write_text(
        "".join(f"0x{s:016x} 0x{(s + n - 1) if n else 0:016x} 0x0000000000040200\n" for s, n in bars)
    )
    cls = root / "sys/class/tenstorrent/tenstorrent!0"
    cls.mkdir(parents=True)
    (cls / "tt_card_type").write_text(card + "\n")
    (cls / "device").symlink_to(pci)
    return root


def test_fake_ready_blackhole_decode_node(tmp_path: Path) -> None:
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(make_fake_node(tmp_path)))
    checks = by_name(out)
    for name in ("rdma devices", "tt-kmd", "tenstorrent/0", "npu peer memory"):
        assert checks[name]["status"] == "OK", checks[name]
    assert "mlx5_0/1:ACTIVE" in checks["rdma devices"]["detail"]
    want = "0000:03:00.0 p150a: Blackhole, 8 DRAM banks, BAR4 32 GiB = 8 x 4 GiB windows"
    assert want in checks["tenstorrent/0"]["detail"]
    assert checks["pyverbs"]["required"] is False  # tt_peermem is loaded
    assert rc == (0 if mooncake_importable() else 1)
    assert json.loads(out)["ready"] is (rc == 0)


def test_fake_prefill_node_needs_nvidia_peermem(tmp_path: Path) -> None:
    root = make_fake_node(tmp_path, modules=("mlx5_ib",))
    rc, out = run_doctor("--json", "--role", "prefill", "--root", str(root))
    checks = by_name(out)
    assert rc == 1
    assert checks["gpu peer memory"]["status"] == "MISSING"
    assert "tt-kmd" not in checks  # not needed on a GPU node


def test_fake_small_bar4_old_kmd_and_down_port(tmp_path: Path) -> None:
    root = make_fake_node(tmp_path, bar4=8 * GiB, kmd="2.9.0", port_state="1: DOWN")
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(root))
    checks = by_name(out)
    assert rc == 1
    assert checks["rdma devices"]["status"] == "WARN"
    assert checks["tt-kmd"]["status"] == "MISSING" and ">= 2.10.0" in checks["tt-kmd"]["detail"]
    dev = checks["tenstorrent/0"]
    assert dev["status"] == "MISSING" and "2 x 4 GiB windows" in dev["detail"] and "Resizable BAR" in dev["fix"]


def test_fake_wormhole_is_named_and_not_ready(tmp_path: Path) -> None:
    root = make_fake_node(tmp_path, device_id="0x401e", card="n150", bar4=0)
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(root))
    checks = by_name(out)
    assert rc == 1
    assert checks["tenstorrent/0"]["status"] == "WARN" and "Wormhole" in checks["tenstorrent/0"]["detail"]
    assert checks["tenstorrent devices"]["status"] == "MISSING"


def test_fake_p100_has_seven_banks_and_no_tt_peermem_falls_back_to_pyverbs(tmp_path: Path) -> None:
    root = make_fake_node(tmp_path, card="p100", bar4=28 * GiB, modules=())
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(root))
    checks = by_name(out)
    assert checks["tenstorrent/0"]["status"] == "OK" and "7 DRAM banks" in checks["tenstorrent/0"]["detail"]
    has_pyverbs = checks["pyverbs"]["status"] == "OK"
    assert checks["npu peer memory"]["status"] == ("WARN" if has_pyverbs else "MISSING")
    assert checks["npu peer memory"]["required"] is (not has_pyverbs)


def test_security_lines_say_mooncake_binds_every_interface(tmp_path: Path) -> None:
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(make_fake_node(tmp_path)))
    checks = by_name(out)
    mc = checks["mooncake listeners"]
    assert mc["status"] == "WARN" and "ALL interfaces" in mc["detail"] and "MC_MIN_RPC_PORT" in mc["fix"]
    assert checks["shared secret"]["status"] in ("OK", "WARN")
    assert rc == 0  # warnings never fail the role


def _add_rxe(root: Path, name: str = "rxe0") -> None:
    """A FAKE soft-RoCE device as rdma_rxe shows it in sysfs (checked in the QEMU guest)."""
    dev = root / "sys/class/infiniband" / name
    (dev / "ports/1").mkdir(parents=True)
    (dev / "ports/1/state").write_text("4: ACTIVE\n")
    (dev / "parent").write_text("eth0\n")
    (dev / "node_desc").write_text("rxe\n")


def test_fake_soft_roce_only_is_named_and_for_testing(tmp_path: Path) -> None:
    root = make_fake_node(tmp_path)
    import shutil

    shutil.rmtree(root / "sys/class/infiniband/mlx5_0")
    _add_rxe(root)
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(root))
    rdma = by_name(out)["rdma devices"]
    assert rdma["status"] == "WARN", rdma
    assert "rxe0 is soft-RoCE (rdma_rxe) on eth0: software RDMA, for testing only" in rdma["detail"]
    assert "EOPNOTSUPP, errno 95" in rdma["detail"] and "mlx5_ib" in rdma["fix"]


def test_fake_soft_roce_next_to_a_real_nic_is_noted(tmp_path: Path) -> None:
    root = make_fake_node(tmp_path)
    _add_rxe(root)
    rc, out = run_doctor("--json", "--role", "decode", "--root", str(root))
    rdma = by_name(out)["rdma devices"]
    assert rdma["status"] == "OK" and "rxe0 is soft-RoCE (rdma_rxe) on eth0, for testing only" in rdma["detail"]
