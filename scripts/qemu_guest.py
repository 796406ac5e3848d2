#!/usr/bin/env python3
"""Boot Debian's 6.12 kernel in a QEMU (TCG) guest, run one job script, power off.

    scripts/qemu_guest.py build                     build/cache the images, print the times
    scripts/qemu_guest.py run [opts] -- CMD ARGS    boot, run CMD in the guest, print its output
    scripts/qemu_guest.py smoke                     build + boot `uname -r` (cold and warm times)

Images are cached under $HAWK_CACHE/qemu (default ~/.cache/vllm-hawk/qemu), one folder per
content hash, built under a lock, so a change builds a NEW folder and concurrent users
never see a half-built one (the same scheme as scripts/ensure_env.sh):

  kernel-<kver>/vmlinux        uncompressed kernel extracted from /boot/vmlinuz-<kver>
  initramfs-<hash>.cpio.gz     busybox + the 9p modules; mounts the rootfs and the shares
  rootfs-<hash>/               debootstrap minbase bookworm + the RDMA userland

The guest mounts the rootfs read-only over virtio-9p (tmpfs on /tmp, /run, /var/tmp, mounted
before the shares, so a share may live under /tmp),
the host's /lib/modules/<kver> read-only (modprobe works), and each share the caller
names at the same path it has on the host. The job runs as PID 1's child under
`timeout`; its output goes to the serial console, which this script reads. The guest
always powers itself off (sysrq o) when the job ends; the host kills QEMU if it does
not within the timeout, and says so.

Needs (Debian 12): qemu-system-x86, debootstrap, busybox-static, cpio, zstd and the
kernel image package linux-image-<kver> (scripts/kernel_deps.sh installs them). KVM is
not used: TCG (`-accel tcg,thread=multi -cpu max`), see docs/qemu-guest.md.

Python API (stdlib only): ``ensure_images()``, ``run_job(script, shares=..., timeout_s=...)``
returning a :class:`GuestResult`.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import gzip
import hashlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REV = "1"  # bump to rebuild every image when the steps below change
SUITE = "bookworm"
MIRROR = os.environ.get("HAWK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
ROOTFS_PACKAGES = (
    "rdma-core",
    "ibverbs-utils",
    "ibverbs-providers",
    "perftest",
    "python3",
    "iproute2",
    "kmod",
    "libnuma1",
    "libcurl4",
    "python3-pyverbs",
    "procps",
)
INITRAMFS_MODULES = ("netfs", "9pnet", "9pnet_virtio", "9p")  # load order
GUEST_IP = "10.0.2.15"
JOB_START = "HAWK-GUEST: job start"
JOB_RC = "HAWK-GUEST: job rc="
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[qemu-guest] {msg}", file=sys.stderr, flush=True)


class GuestError(RuntimeError):
    """The images could not be built or the guest could not run."""


def cache_root() -> Path:
    return Path(os.environ.get("HAWK_CACHE", Path.home() / ".cache/vllm-hawk")) / "qemu"


def guest_kernel_release() -> str:
    """The kernel the guest boots: $HAWK_GUEST_KVER, else the newest installed Debian 6.12
    amd64 image that also has its modules and headers (the modules are built against them)."""
    if os.environ.get("HAWK_GUEST_KVER"):
        return os.environ["HAWK_GUEST_KVER"]
    found = []
    for vmlinuz in glob.glob("/boot/vmlinuz-6.12.*-amd64"):
        kver = vmlinuz.removeprefix("/boot/vmlinuz-")
        if Path(f"/lib/modules/{kver}/modules.dep").is_file():
            found.append(kver)
    if not found:
        raise GuestError(
            "no /boot/vmlinuz-6.12.*-amd64 with /lib/modules: run scripts/kernel_deps.sh "
            "(installs linux-image-6.12.*-amd64 with the headers)"
        )
    return sorted(found, key=lambda k: [int(x) if x.isdigit() else x for x in re.split(r"[.+-]", k)])[-1]


def missing_host_tools() -> list[str]:
    need = {"qemu-system-x86_64": "qemu-system-x86", "debootstrap": "debootstrap", "cpio": "cpio", "zstd": "zstd"}
    out = [pkg for tool, pkg in need.items() if shutil.which(tool) is None]
    if not Path("/bin/busybox").exists() or "static" not in _file_kind("/bin/busybox"):
        out.append("busybox-static")
    return out


def _file_kind(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        # a static binary has no PT_INTERP: cheap check, no `file` needed
        return "dynamic" if b"/lib64/ld-linux" in head or b"ld-linux-x86-64" in head else "static"
    except OSError:
        return "missing"


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()[:12]


# ------------------------------------------------------------------------------- kernel
def ensure_kernel(kver: str) -> tuple[Path, float]:
    """vmlinux for kver (QEMU's -kernel needs an ELF or a bzImage; the ELF boots faster
    under TCG because nothing is decompressed in the guest). Returns (path, build seconds)."""
    out = cache_root() / f"kernel-{kver}" / "vmlinux"
    if out.is_file():
        return out, 0.0
    src = Path(f"/boot/vmlinuz-{kver}")
    if not src.is_file():
        raise GuestError(f"{src} missing: apt-get install linux-image-{kver}")
    t0 = time.monotonic()
    with _locked(out.parent.with_name(out.parent.name + ".lock")):
        if out.is_file():
            return out, 0.0
        data = src.read_bytes()
        # the same search as the kernel's scripts/extract-vmlinux
        for magic, cmd in (
            (b"\x28\xb5\x2f\xfd", ["zstd", "-dcq"]),
            (b"\xfd7zXZ\x00", ["xz", "-dcq"]),
            (b"\x1f\x8b\x08", ["gzip", "-dcq"]),
        ):
            pos = data.find(magic)
            while pos >= 0:
                p = subprocess.run(cmd, input=data[pos:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                if p.stdout[:4] == b"\x7fELF":
                    out.parent.mkdir(parents=True, exist_ok=True)
                    tmp = out.with_suffix(".tmp")
                    tmp.write_bytes(p.stdout)
                    tmp.rename(out)
                    return out, time.monotonic() - t0
                pos = data.find(magic, pos + 1)
        raise GuestError(f"no compressed ELF found in {src}")


# ------------------------------------------------------------------------------- rootfs
def ensure_rootfs() -> tuple[Path, float]:
    """debootstrap minbase + ROOTFS_PACKAGES (about 45 s and 300 MB). Returns (dir, seconds)."""
    key = _digest(REV, SUITE, MIRROR, ROOTFS_PACKAGES)
    root = cache_root() / f"rootfs-{key}"
    ready = root / ".hawk-ready"
    if ready.is_file():
        return root, 0.0
    if os.geteuid() != 0:
        raise GuestError("building the guest rootfs needs root (debootstrap)")
    with _locked(root.with_suffix(".lock")):
        if ready.is_file():
            return root, 0.0
        t0 = time.monotonic()
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        log(
            f"building rootfs {root.name}: debootstrap --variant=minbase {SUITE} + "
            f"{' '.join(ROOTFS_PACKAGES)} (first time: about a minute)"
        )
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}", SUITE, str(tmp), MIRROR]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            tail = "\n".join(p.stdout.splitlines()[-25:])
            log_file = tmp / "debootstrap/debootstrap.log"
            extra = log_file.read_text()[-3000:] if log_file.is_file() else ""
            raise GuestError(f"debootstrap failed ({p.returncode}):\n{tail}\n{extra}")
        shutil.rmtree(tmp / "var/cache/apt/archives", ignore_errors=True)
        (tmp / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp / "var/lib/apt/lists", ignore_errors=True)
        (tmp / "var/lib/apt/lists").mkdir(parents=True, exist_ok=True)
        (tmp / "hawk").mkdir(exist_ok=True)
        (tmp / "etc/hostname").write_text("hawk-guest\n")
        (tmp / "etc/hosts").write_text(f"127.0.0.1 localhost\n{GUEST_IP} hawk-guest\n")
        (tmp / ".hawk-ready").write_text(f"{' '.join(cmd)}\n")
        tmp.rename(root)
        dt = time.monotonic() - t0
        log(f"rootfs built in {dt:.0f} s ({_du_mib(root)} MiB)")
        _prune("rootfs-", root)
        return root, dt


def _du_mib(path: Path) -> int:
    p = subprocess.run(["du", "-sm", str(path)], stdout=subprocess.PIPE, text=True)
    return int(p.stdout.split()[0]) if p.returncode == 0 and p.stdout else -1


def _prune(prefix: str, keep: Path, days: float = 3) -> None:
    """Remove other builds of this kind unused for `days` (like ensure_env.sh)."""
    for old in cache_root().glob(prefix + "*"):
        if old == keep or old.suffix in (".lock", ".tmp"):
            continue
        try:
            if time.time() - old.stat().st_mtime > days * 86400:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
                log(f"pruned unused {old}")
        except OSError:
            pass


# ---------------------------------------------------------------------------- initramfs
INIT = r"""#!/bin/busybox sh
# PID 1 of the initramfs: load 9p, mount the rootfs and the shares, hand over to stage 2.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "HAWK-GUEST: initramfs: $*"; echo "HAWK-GUEST: job rc=254"; echo o > /proc/sysrq-trigger; sleep 10; }
for m in @MODULES@; do insmod /lib/hawk/$m.ko || fail "insmod $m"; done
mkdir -p /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro hawkroot /newroot || fail "mount rootfs"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 hawkjob /newroot/hawk || fail "mount job"
grep -q hawk_trace /proc/cmdline && set -x
for d in /tmp /run /var/tmp; do mount -t tmpfs -o size=1g tmpfs /newroot$d || fail "tmpfs $d"; done
# shares: "TAG GUESTPATH ro|rw" lines
while read tag path mode; do
    [ -n "$tag" ] || continue
    mkdir -p /newroot$path 2>/dev/null
    c=; [ "$mode" = ro ] && c=,cache=loose  # read-only shares may be cached
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144$c,$mode $tag /newroot$path || fail "mount $tag at $path"
done < /newroot/hawk/shares
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash /hawk/stage2.sh
"""

STAGE2 = r"""#!/bin/bash
# Stage 2, PID 1 in the rootfs: set up, run the job, record its status, power off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp/home LANG=C.UTF-8
mount -t proc proc /proc; mount -t sysfs sys /sys
grep -q hawk_trace /proc/cmdline && { PS4='+ $(read u _ < /proc/uptime; echo $u) '; set -x; }
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mkdir -p /dev/hugepages; mount -t hugetlbfs hugetlbfs /dev/hugepages
mkdir -p $HOME; hostname hawk-guest
ip link set lo up
if [ -e /sys/class/net/eth0 ] || modprobe virtio_net 2>/dev/null; then
    for i in 1 2 3 4 5 6 7 8 9 10; do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
    [ -e /sys/class/net/eth0 ] && ip link set eth0 up && ip addr add @GUEST_IP@/24 dev eth0
fi
. /hawk/env
echo "@JOB_START@ uptime=$(cut -d' ' -f1 /proc/uptime)"
cd "${HAWK_JOB_CWD:-/}"
timeout -k 5 "$HAWK_JOB_TIMEOUT" /bin/bash /hawk/job.sh < /dev/null 2>&1
rc=$?
[ $rc = 124 ] && echo "HAWK-GUEST: the job hit its in-guest timeout (${HAWK_JOB_TIMEOUT} s)"
dmesg > /hawk/out/dmesg 2>/dev/null
echo $rc > /hawk/out/rc
sync
echo "@JOB_RC@$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
echo o > /proc/sysrq-trigger
sleep 30
"""


def ensure_initramfs(kver: str) -> tuple[Path, float]:
    mods = []
    dep = Path(f"/lib/modules/{kver}")
    for name in INITRAMFS_MODULES:
        hits = list(dep.rglob(f"{name}.ko*"))
        if not hits:
            raise GuestError(f"module {name} not found under {dep}")
        mods.append(hits[0])
    busybox = Path("/bin/busybox")
    key = _digest(REV, INIT, kver, [m.stat().st_size for m in mods], busybox.stat().st_size)
    out = cache_root() / f"initramfs-{key}.cpio.gz"
    if out.is_file():
        return out, 0.0
    t0 = time.monotonic()
    with _locked(out.with_suffix(".lock")), tempfile.TemporaryDirectory() as td:
        if out.is_file():
            return out, 0.0
        d = Path(td)
        for sub in ("bin", "dev", "proc", "sys", "lib/hawk", "newroot"):
            (d / sub).mkdir(parents=True)
        shutil.copy2(busybox, d / "bin/busybox")
        os.mknod(d / "dev/console", 0o600 | 0o020000, os.makedev(5, 1))  # before devtmpfs is up
        for name, m in zip(INITRAMFS_MODULES, mods, strict=False):
            raw = m.read_bytes()
            if m.name.endswith(".xz"):
                raw = subprocess.run(["xz", "-dc"], input=raw, stdout=subprocess.PIPE, check=True).stdout
            elif m.name.endswith(".zst"):
                raw = subprocess.run(["zstd", "-dc"], input=raw, stdout=subprocess.PIPE, check=True).stdout
            (d / f"lib/hawk/{name}.ko").write_bytes(raw)
        init = d / "init"
        init.write_text(INIT.replace("@MODULES@", " ".join(INITRAMFS_MODULES)))
        init.chmod(0o755)
        files = subprocess.run("find . | LC_ALL=C sort", shell=True, cwd=d, stdout=subprocess.PIPE, check=True).stdout
        cpio = subprocess.run(
            ["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"], cwd=d, input=files, stdout=subprocess.PIPE, check=True
        ).stdout
        tmp = out.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(tmp, "wb", compresslevel=6) as f:
            f.write(cpio)
        tmp.rename(out)
    return out, time.monotonic() - t0


@dataclass
class Images:
    kver: str
    vmlinux: Path
    initramfs: Path
    rootfs: Path
    build_s: dict[str, float]

    @property
    def cold(self) -> bool:
        return any(v > 0 for v in self.build_s.values())


def ensure_images() -> Images:
    """Build (once) and return the kernel, initramfs and rootfs for the guest."""
    missing = missing_host_tools()
    if missing:
        raise GuestError(f"missing host packages: {' '.join(missing)} (run scripts/kernel_deps.sh)")
    kver = guest_kernel_release()
    vmlinux, tk = ensure_kernel(kver)
    initrd, ti = ensure_initramfs(kver)
    rootfs, tr = ensure_rootfs()
    return Images(kver, vmlinux, initrd, rootfs, {"kernel": tk, "initramfs": ti, "rootfs": tr})


# --------------------------------------------------------------------------------- run
@dataclass
class GuestResult:
    rc: int | None  # the job's exit status; None if the guest never reported one
    output: str  # the serial console (job output, boot messages at loglevel<=3)
    dmesg: str  # the guest's full kernel log when the job ended
    boot_s: float  # QEMU start -> job start
    job_s: float  # job start -> job end
    total_s: float  # QEMU start -> QEMU exit
    timed_out: bool = False
    out_dir: Path | None = None  # the guest's /hawk/out (kept only with keep_out=True)
    files: dict[str, str] = field(default_factory=dict)  # small text files the job left in /hawk/out

    def summary(self) -> str:
        return (
            f"guest rc={self.rc} boot {self.boot_s:.1f} s, job {self.job_s:.1f} s, "
            f"total {self.total_s:.1f} s{' (TIMED OUT)' if self.timed_out else ''}"
        )


def _share_tags(shares) -> list[tuple[str, str, str, bool]]:
    out = []
    for i, s in enumerate(shares):
        host, guest, ro = (s + (True,))[:3] if isinstance(s, tuple) else (s, s, True)
        out.append((f"hawks{i}", str(Path(host).resolve()), str(guest), bool(ro)))
    return out


def _panicked_before_the_job(res: GuestResult) -> bool:
    """The guest kernel died during its own boot (``Kernel panic`` on the console, no job
    start): under multi-threaded TCG the stock kernel's boot-time code patching (int3,
    ``text_poke``) now and then faults on the other vCPU. Nothing of the job ran, so one
    more boot is a fresh try of the same job; a panic after the job started is the job's."""
    return res.rc is None and not res.timed_out and JOB_START not in res.output and "Kernel panic" in res.output


def run_job(
    script: str,
    *,
    shares=(),
    env: dict[str, str] | None = None,
    cwd: str = "/",
    timeout_s: float = 300,
    mem_mib: int = 3072,
    smp: int = 2,
    net: bool = True,
    images: Images | None = None,
    echo: bool = False,
    keep_out: bool = False,
) -> GuestResult:
    """Boot the guest, run ``script`` (bash) in it, power it off.

    shares: host paths (or (host, guest, read_only) tuples) mounted over 9p, by default
    read-only at the same path. env: variables exported to the job. timeout_s: the whole
    guest run, boot included; past it QEMU is killed and ``timed_out`` is set (a job
    timeout is enforced in the guest too, 15 s earlier, so its output and dmesg come back).
    The job's /hawk/out folder is writable; small text files left there come back in
    ``files``. echo: copy the console to stderr as it arrives.
    """
    images = images or ensure_images()
    tags = _share_tags(shares)
    for _tag, host, guest, _ro in tags:
        if not Path(host).exists():
            raise GuestError(f"share {host} does not exist")
        # the rootfs is read-only in the guest: create the mount point here (harmless,
        # idempotent); /tmp, /run and /var/tmp are tmpfs there, the guest creates those
        if not guest.startswith(("/tmp/", "/run/", "/var/tmp/")):
            (images.rootfs / guest.lstrip("/")).mkdir(parents=True, exist_ok=True)
    moddir = f"/lib/modules/{images.kver}"
    tags.append(("hawkmods", moddir, moddir, True))
    (images.rootfs / moddir.lstrip("/")).mkdir(parents=True, exist_ok=True)

    jobdir = Path(tempfile.mkdtemp(prefix="hawk-guest-"))
    try:
        (jobdir / "out").mkdir()
        (jobdir / "job.sh").write_text(script)
        (jobdir / "stage2.sh").write_text(
            STAGE2.replace("@GUEST_IP@", GUEST_IP).replace("@JOB_START@", JOB_START).replace("@JOB_RC@", JOB_RC)
        )
        (jobdir / "shares").write_text("".join(f"{t} {g} {'ro' if ro else 'rw'}\n" for t, _h, g, ro in tags))
        job_timeout = max(5, int(timeout_s) - 15)
        envs = dict(
            env or {},
            HAWK_JOB_TIMEOUT=str(job_timeout),
            HAWK_JOB_CWD=cwd,
            HAWK_GUEST_IP=GUEST_IP,
            PYTHONDONTWRITEBYTECODE="1",
        )
        (jobdir / "env").write_text("".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in envs.items()))
        cmd = [
            "qemu-system-x86_64",
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            os.environ.get("HAWK_GUEST_CPU", "max"),
            "-smp",
            str(smp),
            "-m",
            f"{mem_mib}M",
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-monitor",
            "none",
            "-serial",
            "stdio",
            "-kernel",
            str(images.vmlinux),
            "-initrd",
            str(images.initramfs),
            "-append",
            "console=ttyS0 loglevel=3 panic=-1 oops=panic rdinit=/init "
            "tsc=reliable no_timer_check nokaslr mitigations=off " + os.environ.get("HAWK_GUEST_APPEND", ""),
            "-device",
            "virtio-rng-pci",
        ]
        fs = [("hawkroot", str(images.rootfs), True), ("hawkjob", str(jobdir), False)]
        fs += [(t, h, ro) for t, h, _g, ro in tags]
        for i, (tag, host, ro) in enumerate(fs):
            cmd += [
                "-fsdev",
                f"local,id=fs{i},path={host},security_model=none{',readonly=on' if ro else ''}",
                "-device",
                f"virtio-9p-pci,fsdev=fs{i},mount_tag={tag}",
            ]
        if net:
            cmd += ["-netdev", "user,id=n0,restrict=on", "-device", "virtio-net-pci,netdev=n0"]
        res = _boot(cmd, jobdir, timeout_s, echo, keep_out)
        if _panicked_before_the_job(res):
            log("guest kernel panicked while booting, before the job started (TCG; docs/qemu-guest.md): booting again")
            res = _boot(cmd, jobdir, timeout_s, echo, keep_out)
        return res
    finally:
        if not keep_out:
            shutil.rmtree(jobdir, ignore_errors=True)


def _die_with_parent() -> None:
    """In the QEMU child: SIGKILL when the process that started it dies, however it dies
    (a killed pytest must not leave a guest running)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Console:
    """The guest's serial console as QEMU prints it: every line, and the ``time.monotonic``
    seconds of the job's start and end marks with the exit status the end mark carries."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.lines: list[str] = []
        self.marks: dict[str, float] = {}
        self.rc_seen: list[int] = []

    def read(self, stream) -> None:
        """Read ``stream`` (QEMU's stdout, bytes) to its end; run in a thread of its own."""
        buf = io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=None)
        for line in buf:
            self.add(line.rstrip("\r\n"))

    def add(self, line: str) -> None:
        """One console line: kept, echoed to stderr if asked, and checked for the job's marks."""
        self.lines.append(line)
        if self.echo:
            print(line, file=sys.stderr, flush=True)
        if line.startswith(JOB_START) and "start" not in self.marks:
            self.marks["start"] = time.monotonic()
        elif line.startswith(JOB_RC) and "end" not in self.marks:
            self.marks["end"] = time.monotonic()
            m = re.match(re.escape(JOB_RC) + r"(-?\d+)", line)
            if m:
                self.rc_seen.append(int(m.group(1)))


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for QEMU to exit; whether it timed out. A QEMU still
    running then (or after an interrupt) gets SIGTERM, and SIGKILL 5 s later: no guest is
    left running."""
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None:  # never leave a guest running
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return timed_out


def _job_files(out: Path) -> tuple[dict[str, str], str]:
    """The text of the job's output files under ``out`` (each under 4 MiB), and the guest's dmesg."""
    files = {}
    for f in sorted(out.iterdir()) if out.is_dir() else []:
        if f.is_file() and f.stat().st_size < 4 * MiB and f.name != "dmesg":
            files[f.name] = f.read_text(errors="replace")
    dmesg = (out / "dmesg").read_text(errors="replace") if (out / "dmesg").is_file() else ""
    return files, dmesg


def _boot(cmd: list[str], jobdir: Path, timeout_s: float, echo: bool, keep_out: bool) -> GuestResult:
    """Run QEMU (``cmd``) until it exits or ``timeout_s`` seconds pass; the job's result with
    its boot, job and total times in seconds."""
    t0 = time.monotonic()
    console = _Console(echo)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    assert proc.stdout is not None
    th = threading.Thread(target=console.read, args=(proc.stdout,), daemon=True)
    th.start()
    try:
        timed_out = _wait_or_kill(proc, timeout_s)
    finally:
        th.join(timeout=5)
    t_end = time.monotonic()
    out = jobdir / "out"
    files, dmesg = _job_files(out)
    lines, marks = console.lines, console.marks
    rc = console.rc_seen[0] if console.rc_seen else None
    start = marks.get("start", t_end)
    res = GuestResult(
        rc,
        "\n".join(lines),
        dmesg,
        start - t0,
        marks.get("end", t_end) - start,
        t_end - t0,
        timed_out,
        out if keep_out else None,
        files,
    )
    if timed_out:
        log(
            f"guest timed out after {timeout_s:.0f} s and was killed "
            f"({'job never started' if 'start' not in marks else 'job still running'}); last output:\n"
            + "\n".join(lines[-15:])
        )
    elif rc is None:
        log(
            f"guest exited (QEMU rc {proc.returncode}) without reporting a job status; last output:\n"
            + "\n".join(lines[-25:])
        )
    return res


# --------------------------------------------------------------------------------- CLI
def _print_build(images: Images, t_build: float) -> None:
    parts = ", ".join(f"{k} {'cached' if v == 0 else f'{v:.1f} s'}" for k, v in images.build_s.items())
    print(
        f"guest images ({images.kver}): {parts}; "
        f"{'cold build' if images.cold else 'warm (all cached)'} {t_build:.1f} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build/cache the images and print the times")
    sub.add_parser("smoke", help="build, then boot `uname -r` and print cold/warm times")
    r = sub.add_parser("run", help="boot and run a command (after --) in the guest")
    r.add_argument("--timeout", type=float, default=300)
    r.add_argument(
        "--share",
        action="append",
        default=[],
        help="host path to mount read-only at the same path (repeatable); PATH:rw for writable",
    )
    r.add_argument("--cwd", default="/")
    r.add_argument("--mem", type=int, default=3072, help="MiB")
    r.add_argument("--no-net", action="store_true")
    r.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    try:
        t0 = time.monotonic()
        images = ensure_images()
        _print_build(images, time.monotonic() - t0)
        if a.cmd == "build":
            return 0
        if a.cmd == "smoke":
            res = run_job("uname -r; grep -c . /proc/modules || true", images=images, timeout_s=120)
            print(f"boot: {res.summary()}\n{res.output.splitlines()[-3:]}", flush=True)
            return 0 if res.rc == 0 else 1
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not command:
            ap.error("run needs a command after --")
        shares = []
        for s in a.share:
            host, _, mode = s.partition(":")
            shares.append((host, host, mode != "rw"))
        res = run_job(
            shlex.join(command),
            shares=shares,
            cwd=a.cwd,
            timeout_s=a.timeout,
            mem_mib=a.mem,
            net=not a.no_net,
            images=images,
            echo=True,
        )
        print(res.summary(), file=sys.stderr, flush=True)
        return res.rc if res.rc is not None else 125
    except GuestError as e:
        log(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
