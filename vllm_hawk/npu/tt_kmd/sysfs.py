"""Read-only discovery of Tenstorrent devices from /dev, /sys and /proc (no ioctls).

Every function takes a ``root`` (default ``/``) so tests and ``hawk doctor --root`` can
point it at a fake tree. Paths follow tt-kmd ttkmd-2.10.0 (``chardev.c``: class
``tenstorrent``, device name ``tenstorrent/<ordinal>`` which sysfs spells
``tenstorrent!<ordinal>``; ``module.c``: MODULE_VERSION; ``telemetry.c``: ``tt_card_type``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEV_TENSTORRENT = "dev/tenstorrent"
SYS_CLASS_TENSTORRENT = "sys/class/tenstorrent"
SYS_MODULE_TENSTORRENT_VERSION = "sys/module/tenstorrent/version"
SYS_PCI_DEVICES = "sys/bus/pci/devices"
#: First tt-kmd release with EXPORT_TLB_DMABUF (ioctl 16).
MIN_KMD_VERSION_FOR_DMABUF = (2, 10, 0)


def _under(root: str | os.PathLike[str], rel: str) -> Path:
    return Path(root) / rel


def device_ordinals(root: str | os.PathLike[str] = "/") -> list[int]:
    """Ordinals N of the /dev/tenstorrent/N character devices, sorted (``by-id`` links skipped)."""
    base = _under(root, DEV_TENSTORRENT)
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit())


def device_path(ordinal: int, root: str | os.PathLike[str] = "/") -> Path:
    """``/dev/tenstorrent/<ordinal>`` under ``root``."""
    return _under(root, DEV_TENSTORRENT) / str(ordinal)


def class_dir(ordinal: int, root: str | os.PathLike[str] = "/") -> Path:
    """The device's sysfs class directory, ``/sys/class/tenstorrent/tenstorrent!<ordinal>``."""
    return _under(root, SYS_CLASS_TENSTORRENT) / f"tenstorrent!{ordinal}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"2.10.1-pre"`` -> (2, 10, 1); None if it does not start with three numbers."""
    core = text.strip().split("-", 1)[0].split("+", 1)[0]
    parts = core.split(".")
    if len(parts) < 3:
        return None
    try:
        return int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        return None


def kmd_version(root: str | os.PathLike[str] = "/") -> str | None:
    """The loaded tt-kmd's version string (``/sys/module/tenstorrent/version``), or None."""
    return _read(_under(root, SYS_MODULE_TENSTORRENT_VERSION))


@dataclass(frozen=True)
class PciFunction:
    """What sysfs says about one Tenstorrent PCI function. Sizes in bytes."""

    ordinal: int
    pci_address: str | None
    vendor_id: int | None
    device_id: int | None
    card_type: str | None
    bar_bytes: tuple[int, ...]

    @property
    def bar4_bytes(self) -> int:
        """Size of BAR4 in bytes (0 if absent): Blackhole's 4 GiB TLB windows live there."""
        return self.bar_bytes[4] if len(self.bar_bytes) > 4 else 0


def parse_resource_file(text: str) -> tuple[int, ...]:
    """BAR sizes (bytes) from a PCI ``resource`` file: one ``start end flags`` hex line per BAR."""
    sizes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        start, end = int(fields[0], 16), int(fields[1], 16)
        sizes.append(end - start + 1 if end > start else 0)
    return tuple(sizes)


def _hex(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


def pci_function(ordinal: int, root: str | os.PathLike[str] = "/") -> PciFunction:
    """Read the PCI identity, card type and BAR sizes of /dev/tenstorrent/<ordinal>."""
    cdir = class_dir(ordinal, root)
    pci_dir = cdir / "device"
    address = None
    try:
        address = os.path.basename(os.path.realpath(pci_dir)) if pci_dir.exists() else None
    except OSError:
        address = None
    resource = _read(pci_dir / "resource")
    return PciFunction(
        ordinal=ordinal,
        pci_address=address,
        vendor_id=_hex(_read(pci_dir / "vendor")),
        device_id=_hex(_read(pci_dir / "device")),
        card_type=_read(cdir / "tt_card_type"),
        bar_bytes=parse_resource_file(resource) if resource else (),
    )


def loaded_modules(root: str | os.PathLike[str] = "/") -> set[str]:
    """Names of loaded kernel modules (first column of ``/proc/modules``)."""
    text = _read(_under(root, "proc/modules"))
    if not text:
        return set()
    return {line.split()[0] for line in text.splitlines() if line.strip()}


def device_holders(dev_path: str | os.PathLike[str], proc_root: str | os.PathLike[str] = "/") -> list[tuple[int, str]]:
    """``(pid, comm)`` of every process with an fd open on ``dev_path``, sorted by pid.

    Scans ``<proc_root>/proc/<pid>/fd/*`` for links to ``dev_path`` (as the kernel writes
    them: the absolute device path). Processes whose fds cannot be read (another user's,
    or gone meanwhile) are skipped, so the list may be short without root."""
    target = os.fspath(dev_path)
    holders: list[tuple[int, str]] = []
    proc = _under(proc_root, "proc")
    try:
        pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    except OSError:
        return []
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        if any(_link_target(fd_dir / name) == target for name in names):
            try:
                comm = (proc / str(pid) / "comm").read_text().strip()
            except OSError:
                comm = "?"
            holders.append((pid, comm))
    return holders


def _link_target(link: Path) -> str | None:
    """Where a /proc/<pid>/fd entry points (None if it closed meanwhile)."""
    try:
        return os.readlink(link)
    except OSError:
        return None
