"""``hawk doctor``: check that a node has what HAWK needs for its role.

prefill (GPU) needs: an RDMA NIC, nvidia-peermem, Mooncake.
decode (Tenstorrent) needs: an RDMA NIC, tt-kmd >= 2.10.0, a Blackhole device whose BAR4
holds one 4 GiB window per DRAM bank, a way to register NPU memory with the NIC (the
tt_peermem module for Mooncake, or pyverbs for dma-buf MRs), Mooncake.

Every role also gets two security lines (WARN, never MISSING): the transfer engine's
listeners — Mooncake binds its handshake port on 0.0.0.0 and its TCP data port on every
interface, whatever address HAWK gives it, and authenticates nobody; measured on
0.3.13.post1: neither ``MC_TCP_BIND_ADDRESS`` nor ``MC_LEGACY_RPC_PORT_BINDING`` changes
that, only ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` choose the ports, so firewall that range
to the peer nodes — and whether a shared secret is configured in the environment.

Reads only /sys, /dev, /proc (``--root`` points them at another tree, e.g. a fake one in
tests) and tries two imports. Exit code 0 when no required check is MISSING, else 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_hawk.npu.tt_kmd import sysfs
from vllm_hawk.npu.tt_kmd.registration import PYVERBS_INSTALL_HINT, TT_PEERMEM_MODULE_NAME, soft_rdma_devices
from vllm_hawk.npu.tt_kmd.topology import (
    BLACKHOLE_NUM_DRAM_CHANNELS,
    BLACKHOLE_TLB_4G_WINDOW_BYTES,
    PCI_DEVICE_ID_BLACKHOLE,
    PCI_DEVICE_ID_WORMHOLE,
    bar4_window_count,
)

OK, WARN, MISSING = "OK", "WARN", "MISSING"
ROLES = ("prefill", "decode", "all")
NVIDIA_PEERMEM_MODULE = "nvidia_peermem"
MIN_KERNEL_FOR_DMABUF_EXPORT = (5, 8)
#: DRAM banks by card type (sysfs tt_card_type); p100 has one DRAM channel harvested.
_BANKS_BY_CARD = {"p100": 7, "p100a": 7, "n150": 12, "n300": 12}


@dataclass
class Check:
    """One line of the report. ``required`` says whether MISSING fails the requested role."""

    name: str
    status: str
    detail: str
    fix: str = ""
    required: bool = True


def _rdma_check(root: Path) -> Check:
    base = root / "sys/class/infiniband"
    devices = sorted(p.name for p in base.iterdir()) if base.is_dir() else []
    if not devices:
        return Check(
            "rdma devices",
            MISSING,
            f"nothing in {base}",
            "install a RoCE/InfiniBand NIC and its driver (mlx5_ib, bnxt_re, irdma); "
            "`apt-get install rdma-core ibverbs-utils`, then `ibv_devices`",
        )
    states = []
    active = False
    for dev in devices:
        for port in sorted((base / dev / "ports").glob("*")):
            state = (port / "state").read_text().strip() if (port / "state").exists() else "?"
            states.append(f"{dev}/{port.name}:{state.split(':')[-1].strip()}")
            active |= "ACTIVE" in state
    detail = ", ".join(states) or ", ".join(devices)
    soft = soft_rdma_devices(str(root))
    if soft and set(soft) == set(devices):
        # rxe/siw move real RDMA verbs (Mooncake rdma works over them) but at tens of MB/s,
        # and they cannot import dma-bufs: never a deployment's NIC
        what = "; ".join(f"{d} is {k}" for d, k in soft.items())
        return Check(
            "rdma devices",
            WARN,
            f"{detail}: {what}: software RDMA, for testing only (no dma-buf MRs: "
            "ibv_reg_dmabuf_mr fails with EOPNOTSUPP, errno 95)",
            "install a RoCE/InfiniBand NIC (mlx5_ib, bnxt_re, irdma) for real transfers",
        )
    if soft:
        detail += " (" + "; ".join(f"{d} is {k}, for testing only" for d, k in soft.items()) + ")"
    if not active:
        return Check("rdma devices", WARN, f"no ACTIVE port: {detail}", "bring a port up (cable, `ip link set up`)")
    return Check("rdma devices", OK, detail)


def _module_check(name: str, modules: set[str], fix: str, required: bool, label: str) -> Check:
    if name in modules:
        return Check(label, OK, f"{name} loaded", required=required)
    return Check(label, MISSING, f"{name} not in /proc/modules", fix, required=required)


def _import_check(label: str, statement: str, fix: str, required: bool) -> Check:
    module, _, attr = statement.partition(":")
    try:
        obj = importlib.import_module(module)
        if attr:
            getattr(obj, attr)
    except Exception as exc:  # ImportError, or a broken native extension
        return Check(
            label,
            MISSING,
            f"{module}{'.' + attr if attr else ''}: {type(exc).__name__}: {exc}"[:200],
            fix,
            required=required,
        )
    return Check(label, OK, f"{module}.{attr}" if attr else module, required=required)


def _kernel_release(root: Path) -> tuple[int, int] | None:
    try:
        text = (root / "proc/sys/kernel/osrelease").read_text().strip()
        major, minor = text.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
    except (OSError, ValueError):
        return None


def _tenstorrent_checks(root: Path) -> tuple[list[Check], int]:
    """Checks for tt-kmd and each device; also returns the number of usable Blackholes."""
    checks = []
    version = sysfs.kmd_version(root)
    parsed = sysfs.parse_version(version) if version else None
    kmd_fix = "install tt-kmd >= 2.10.0 (https://github.com/tenstorrent/tt-kmd, dkms) and `modprobe tenstorrent`"
    if version is None:
        checks.append(Check("tt-kmd", MISSING, "/sys/module/tenstorrent/version absent (driver not loaded)", kmd_fix))
    elif parsed is None or parsed < sysfs.MIN_KMD_VERSION_FOR_DMABUF:
        checks.append(Check("tt-kmd", MISSING, f"version {version}: EXPORT_TLB_DMABUF needs >= 2.10.0", kmd_fix))
    else:
        checks.append(Check("tt-kmd", OK, f"version {version}"))
    kernel = _kernel_release(root)
    if kernel is not None and kernel < MIN_KERNEL_FOR_DMABUF_EXPORT:
        checks.append(
            Check(
                "kernel",
                MISSING,
                f"Linux {kernel[0]}.{kernel[1]}: tt-kmd exports dma-bufs from 5.8",
                "boot a Linux >= 5.8 kernel",
            )
        )

    ordinals = sysfs.device_ordinals(root)
    if not ordinals:
        checks.append(
            Check(
                "tenstorrent devices",
                MISSING,
                f"nothing in {root / sysfs.DEV_TENSTORRENT}",
                "install a Blackhole card; with tt-kmd loaded /dev/tenstorrent/N appears",
            )
        )
        return checks, 0
    usable = 0
    for n in ordinals:
        fn = sysfs.pci_function(n, root)
        card = fn.card_type or "?"
        label = f"tenstorrent/{n}"
        where = f"{fn.pci_address or '?'} {card}"
        if fn.device_id == PCI_DEVICE_ID_WORMHOLE:
            checks.append(
                Check(
                    label,
                    WARN,
                    f"{where}: Wormhole, 12 banks, no 4 GiB BAR4 windows",
                    "HAWK's direct RDMA path needs a Blackhole; Wormhole can only use host staging",
                    required=False,
                )
            )
            continue
        if fn.device_id != PCI_DEVICE_ID_BLACKHOLE:
            checks.append(Check(label, WARN, f"{where}: unknown device id {fn.device_id}", required=False))
            continue
        banks = _BANKS_BY_CARD.get(card, BLACKHOLE_NUM_DRAM_CHANNELS)
        windows = bar4_window_count(fn.bar4_bytes)
        detail = (
            f"{where}: Blackhole, {banks} DRAM banks, BAR4 {fn.bar4_bytes / (1 << 30):.0f} GiB "
            f"= {windows} x 4 GiB windows"
        )
        if windows < banks:
            need = banks * BLACKHOLE_TLB_4G_WINDOW_BYTES >> 30
            checks.append(
                Check(
                    label,
                    MISSING,
                    detail + f" (< {banks} banks)",
                    f"BAR4 must be >= {need} GiB: enable 'Above 4G decoding' and "
                    "'Resizable BAR' in the BIOS, and check `lspci -vv -d 1e52:`",
                )
            )
        else:
            usable += 1
            checks.append(Check(label, OK, detail))
    if usable == 0 and not any(c.name.startswith("tenstorrent/") and c.status == MISSING for c in checks):
        checks.append(
            Check("tenstorrent devices", MISSING, "no Blackhole device", "HAWK decode needs a Blackhole (p150/p100)")
        )
    return checks, usable


MOONCAKE_PORTS = "MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (default 15000-17000)"


def _security_checks() -> list[Check]:
    from vllm_hawk import envs

    mc = Check(
        "mooncake listeners",
        WARN,
        "the transfer engine listens on ALL interfaces (handshake port on 0.0.0.0, TCP data port on *), "
        "unauthenticated; Mooncake has no setting to bind one address (MC_TCP_BIND_ADDRESS and "
        "MC_LEGACY_RPC_PORT_BINDING measured without effect on 0.3.13); HAWK registers only the memory of "
        "transfers in flight",
        f"firewall {MOONCAKE_PORTS} so that only the prefill and decode nodes reach it "
        "(e.g. nft/iptables accept from the peers' addresses, drop the rest)",
        required=False,
    )
    try:
        has = bool(envs.shared_secret() or envs.shared_secret_file())
        detail = (
            "HAWK_SHARED_SECRET(_FILE) set"
            if has
            else "neither HAWK_SHARED_SECRET nor HAWK_SHARED_SECRET_FILE is set: the connector needs shared_secret "
            "or shared_secret_file in kv_connector_extra_config, or it refuses to start (unless auth 'none')"
        )
        secret = Check(
            "shared secret",
            OK if has else WARN,
            detail,
            ""
            if has
            else "put a >= 16-byte secret in a 0600 file and set HAWK_SHARED_SECRET_FILE "
            "(configs/hawk-node.env.example)",
            required=False,
        )
    except ValueError as e:
        secret = Check("shared secret", WARN, str(e), "set one of the two variables", required=False)
    return [mc, secret]


def run_checks(role: str, root: Path) -> list[Check]:
    """All checks for ``role`` (prefill, decode or all) with /sys, /dev, /proc under ``root``."""
    checks = [_rdma_check(root)]
    modules = sysfs.loaded_modules(root)
    if role in ("prefill", "all"):
        checks.append(
            _module_check(
                NVIDIA_PEERMEM_MODULE,
                modules,
                "`modprobe nvidia-peermem` (ships with the NVIDIA driver; MOFED/DOCA-OFED "
                "or a kernel with peer-memory support)",
                True,
                "gpu peer memory",
            )
        )
    if role in ("decode", "all"):
        tt_checks, _ = _tenstorrent_checks(root)
        checks += tt_checks
        pyverbs = _import_check("pyverbs", "pyverbs.mr:DmaBufMR", PYVERBS_INSTALL_HINT, required=False)
        peermem = _module_check(
            TT_PEERMEM_MODULE_NAME,
            modules,
            "build and load the tt_peermem module from kernel_driver/tt_peermem (needs "
            "MOFED's peer-memory API), or use the dma-buf MR path (pyverbs)",
            False,
            "npu peer memory",
        )
        if peermem.status != OK and pyverbs.status != OK:
            peermem.required = True  # one of the two registration paths is needed
            peermem.detail += "; pyverbs also missing: no way to register NPU memory with the NIC"
        elif peermem.status != OK:
            peermem.status, peermem.detail = WARN, peermem.detail + "; the dma-buf MR path (pyverbs) remains"
        checks += [peermem, pyverbs]
    checks.append(
        _import_check(
            "mooncake",
            "mooncake.engine:TransferEngine",
            "pip install the project's extra: `pip install -e .[cpu]` (TCP) or, for torch's CUDA, "
            "`.[cu13]` / `.[cu12]` (RDMA)",
            required=True,
        )
    )
    return checks + _security_checks()


def render_table(checks: list[Check]) -> str:
    """The human-readable report: check, status, detail, what to fix."""
    rows = [("CHECK", "STATUS", "DETAIL", "FIX")] + [
        (c.name, c.status if c.required or c.status == OK else f"{c.status}*", c.detail, c.fix) for c in checks
    ]
    widths = [min(max(len(r[i]) for r in rows), 60) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]
    if any(not c.required and c.status != OK for c in checks):
        lines.append("* optional for this role")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hawk doctor``. Returns 0 if the node is ready for ``--role``, else 1."""
    parser = argparse.ArgumentParser(prog="hawk doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=ROLES, default="all", help="node role to check for (default: all)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--root", default="/", type=Path, help="read sys/, dev/, proc/ under this directory instead of / (for tests)"
    )
    args = parser.parse_args(argv)
    checks = run_checks(args.role, args.root)
    ready = not any(c.required and c.status == MISSING for c in checks)
    if args.json:
        print(json.dumps({"role": args.role, "ready": ready, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render_table(checks))
        print(f"\n{'READY' if ready else 'NOT READY'} for role {args.role}")
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
