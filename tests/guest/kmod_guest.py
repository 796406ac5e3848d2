"""Runs INSIDE the QEMU guest, as root: load tt_peermem and its test provider and drive
them over real udmabuf dma-bufs. Stdlib + the project's TtPeermemDevice only, so the
rootfs's /usr/bin/python3 runs it (PYTHONPATH = the checkout).

    python3 kmod_guest.py MODULE_DIR

Prints one ``CASE <name> PASS|FAIL <detail>`` line per case and exits 0 only if all
passed. The host test (test_kernel_module_guest.py) turns each line into a pytest result.

The "NIC" is the provider's platform device (dma-direct, no IOMMU), so a DMA address is
the physical address: each mapped entry is checked against /proc/self/pagemap of the
pages the test itself owns.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from vllm_hawk.npu.tt_kmd.registration import TT_PEERMEM_IOCTL_REGISTER, TtPeermemDevice, TtPeermemRegister

KiB, MiB = 1 << 10, 1 << 20
MODDIR = sys.argv[1] if len(sys.argv) > 1 else "."
PROV = "/sys/kernel/debug/peermem_provider"
TPM = "/sys/kernel/debug/tt_peermem"
MAX_PAGE_SIZE = "/sys/module/tt_peermem/parameters/max_page_size"
FIXED_VA = 0x7E00_0000_0000  # an unmapped, 2 MiB aligned VA: tt_peermem never touches the VA itself

# udmabuf / memfd uapi
UDMABUF_CREATE = (1 << 30) | (24 << 16) | (ord("u") << 8) | 0x42  # _IOW('u', 0x42, 24 bytes)
MFD_ALLOW_SEALING, MFD_HUGETLB, MFD_HUGE_2MB = 2, 4, 21 << 26
F_ADD_SEALS, F_SEAL_SHRINK = 1033, 2

RESULTS: list[tuple[str, bool, str]] = []
EXPECTED_MAP_FAILURES = 0


class UdmabufCreate(ctypes.Structure):
    _fields_ = [
        ("memfd", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("offset", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
    ]


class Buf:
    """A memfd (shmem or hugetlb) mapped here and exported through /dev/udmabuf."""

    def __init__(self, kind: str, nbytes: int) -> None:
        flags = MFD_ALLOW_SEALING | (MFD_HUGETLB | MFD_HUGE_2MB if kind == "hugetlb" else 0)
        self.kind, self.nbytes = kind, nbytes
        self.memfd = os.memfd_create(f"hawk-{kind}", flags)
        os.ftruncate(self.memfd, nbytes)
        fcntl.fcntl(self.memfd, F_ADD_SEALS, F_SEAL_SHRINK)  # udmabuf requires it
        self.map = mmap.mmap(self.memfd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        for off in range(0, nbytes, 4096):  # fault every page in
            self.map[off] = 0xA5
        self.va = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        arg = UdmabufCreate(self.memfd, 1, 0, nbytes)  # UDMABUF_FLAGS_CLOEXEC
        with open("/dev/udmabuf", "rb", buffering=0) as dev:
            self.fd = fcntl.ioctl(dev.fileno(), UDMABUF_CREATE, arg)

    def phys(self, off: int) -> int:
        """Physical address of byte `off` of the buffer (through this process's mapping)."""
        va = self.va + off
        with open("/proc/self/pagemap", "rb") as f:
            f.seek((va // 4096) * 8)
            ent = int.from_bytes(f.read(8), "little")
        assert ent >> 63, f"page at {va:#x} not present"
        return (ent & ((1 << 55) - 1)) * 4096 + va % 4096

    def runs(self, off: int, nbytes: int) -> list[tuple[int, int]]:
        """The physically contiguous runs of [off, off+nbytes) of the buffer."""
        out: list[list[int]] = []
        for o in range(off, off + nbytes, 4096):
            p = self.phys(o)
            if out and out[-1][0] + out[-1][1] == p:
                out[-1][1] += 4096
            else:
                out.append([p, 4096])
        return [tuple(r) for r in out]

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.memfd)
        # the exported pointer keeps the mmap alive until the interpreter drops it; fine here


def sh(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def insmod(name: str, *params: str) -> None:
    p = sh(f"insmod {MODDIR}/{name}.ko {' '.join(params)}")
    assert p.returncode == 0, f"insmod {name}: {p.stdout}"


def stats() -> dict[str, int]:
    out = {}
    for line in Path(f"{TPM}/stats").read_text().splitlines():
        k, v = line.split()
        if k != "version":
            out[k] = int(v)
    return out


def ctl(cmd: str) -> tuple[int, str]:
    """Write a provider command; return (errno or 0, the provider's result lines)."""
    fd = os.open(f"{PROV}/control", os.O_WRONLY)
    try:
        os.write(fd, cmd.encode())
        err = 0
    except OSError as e:
        err = e.errno
    finally:
        os.close(fd)
    return err, Path(f"{PROV}/control").read_text()


def fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", text))


def sgl() -> list[tuple[int, int]]:
    out = []
    for line in Path(f"{PROV}/sgl").read_text().split("\n"):
        if line.strip():
            a, n = line.split()
            out.append((int(a, 16), int(n, 16)))
    return out


def merged(entries) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, n in entries:
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += n
        else:
            out.append([a, n])
    return [tuple(r) for r in out]


def set_max_page(n: int) -> None:
    with open(MAX_PAGE_SIZE, "w") as f:
        f.write(str(n))


def map_and_check(
    buf: Buf, reg_va: int, reg_off: int, addr: int, size: int, want_page: int | None = None
) -> dict[str, str]:
    """Map [addr, addr+size) (VA) through the provider; check every DMA entry against the
    buffer's physical pages of the page-rounded window. Leaves the MR mapped."""
    err, text = ctl(f"map {addr:x} {size}")
    assert err == 0, f"map {addr:#x} {size}: errno {err}: {text!r}"
    f = fields(text)
    assert f["acquire"] == "1" and f["get_pages"] == "0" and f["dma_map"] == "0", text
    ps = int(f["page_size"])
    if want_page is not None:
        assert ps == want_page, f"page_size {ps}, want {want_page}"
    lo, hi = addr // ps * ps, -(-(addr + size) // ps) * ps
    assert int(f["total"]) == hi - lo, f"total {f['total']} != window {hi - lo}"
    got = sgl()
    assert len(got) == int(f["nmap"]), (len(got), f["nmap"])
    want = buf.runs(reg_off + (lo - reg_va), hi - lo)
    assert merged(got) == want, f"DMA entries {got[:4]}... != pages {want[:4]}..."
    assert int(f["first_dma"], 16) == want[0][0]
    return f


def unmap() -> None:
    err, text = ctl("unmap")
    assert err == 0 and "dma_unmap=0" in text and "release=done" in text, (err, text)


def case(fn):
    name = fn.__name__.removeprefix("case_")
    t0 = time.monotonic()
    try:
        before = stats() if os.path.exists(f"{TPM}/stats") else None
        detail = fn() or ""
        if before is not None and os.path.exists(f"{TPM}/stats"):
            after = stats()
            leaks = {k: after[k] - before[k] for k in ("ranges",) if after[k] != before[k]}
            live = (after["acquires"] - after["releases"]) - (before["acquires"] - before["releases"])
            assert not leaks and live == 0, f"case leaked: ranges {leaks}, live MRs {live}"
            assert after["contract_warnings"] == before["contract_warnings"], "contract warning"
        RESULTS.append((name, True, f"{detail} ({time.monotonic() - t0:.1f} s)"))
    except Exception as e:  # noqa: BLE001 - reported
        tb = traceback.format_exc().strip().splitlines()
        RESULTS.append((name, False, f"{type(e).__name__}: {e} | {' / '.join(tb[-4:])}"))
        with contextlib.suppress(OSError):
            ctl("unmap")
    ok = RESULTS[-1][1]
    print(f"CASE {name} {'PASS' if ok else 'FAIL'} {RESULTS[-1][2]}", flush=True)
    return fn


# --------------------------------------------------------------------------------- cases
def case_load_modules():
    p = sh("echo 16 > /proc/sys/vm/nr_hugepages; cat /proc/sys/vm/nr_hugepages")
    assert int(p.stdout) >= 4, f"hugepages: {p.stdout}"
    insmod("peermem_provider")
    insmod("tt_peermem")  # default: require_exporter=tenstorrent
    clients = Path(f"{PROV}/clients").read_text()
    assert "tt_peermem 0.1.0" in clients, clients
    dmesg = sh("dmesg").stdout
    assert "registered peer-memory client tt_peermem 0.1.0" in dmesg
    return f"clients: {clients.strip()}"


def case_disallowed_exporter():
    buf = Buf("shmem", 1 * MiB)
    dev = TtPeermemDevice()
    try:
        try:
            dev.register(buf.va, buf.nbytes, buf.fd, 0)
            raise AssertionError("udmabuf accepted with require_exporter=tenstorrent")
        except OSError as e:
            assert e.errno == errno.EPERM, e
        assert "refusing dma-buf from exporter 'udmabuf' (require_exporter=tenstorrent)" in sh("dmesg").stdout
        assert stats()["ranges"] == 0
    finally:
        dev.close()
        buf.close()
    # reload accepting any exporter, with the revoke hook, for the rest
    p = sh("rmmod tt_peermem")
    assert p.returncode == 0, p.stdout
    insmod("tt_peermem", "require_exporter=", "debug_revoke=1")
    return "EPERM, then reloaded with require_exporter= debug_revoke=1"


def _lifecycle(kind: str, nbytes: int, page: int) -> str:
    set_max_page(page)
    buf = Buf(kind, nbytes)
    dev = TtPeermemDevice()
    try:
        s0 = stats()
        rid = dev.register(buf.va, nbytes, buf.fd, 0)
        ranges = Path(f"{TPM}/ranges").read_text()
        assert f"0x{buf.va:x} {nbytes} 0 udmabuf {nbytes}" in ranges, ranges
        f = map_and_check(buf, buf.va, 0, buf.va, nbytes, want_page=page)
        s1 = stats()
        for k in ("acquires", "get_pages", "maps"):
            assert s1[k] == s0[k] + 1, (k, s0, s1)
        unmap()
        s2 = stats()
        for k in ("unmaps", "put_pages", "releases"):
            assert s2[k] == s0[k] + 1, (k, s0, s2)
        dev.unregister(rid)
        assert stats()["ranges"] == s0["ranges"]
        return f"{kind} {nbytes >> 20} MiB: page_size {f['page_size']}, {f['nmap']} DMA entries"
    finally:
        dev.close()
        buf.close()


def case_lifecycle_shmem_4k():
    return _lifecycle("shmem", 4 * MiB, 4096)


def case_lifecycle_hugetlb_2m():
    return _lifecycle("hugetlb", 4 * MiB, 2 * MiB)


def case_shmem_needs_4k_pages():
    """A 2 MiB-aligned VA over shmem pages: 2 MiB pages are chosen, the exporter's 4 KiB
    entries cannot back them, dma_map fails cleanly with EINVAL (kernel_driver/README.md: max_page_size=4096)."""
    global EXPECTED_MAP_FAILURES
    set_max_page(2 * MiB)
    buf = Buf("shmem", 4 * MiB)
    dev = TtPeermemDevice()
    try:
        s0 = stats()
        dev.register(FIXED_VA, 4 * MiB, buf.fd, 0)
        err, text = ctl(f"map {FIXED_VA:x} {4 * MiB}")
        if err == 0:  # the pages happened to be 2 MiB contiguous: legal, just unlucky
            unmap()
            return "pages were physically contiguous; nothing to refuse"
        EXPECTED_MAP_FAILURES += 1
        assert err == errno.EINVAL, (err, text)
        assert "page_size=2097152 dma_map=-22" in text, text
        s1 = stats()
        assert s1["map_failures"] == s0["map_failures"] + 1
        assert s1["releases"] == s0["releases"] + 1 and s1["contract_warnings"] == s0["contract_warnings"]
        assert "not aligned to 2097152-byte pages; try max_page_size=4096" in sh("dmesg").stdout
        return "EINVAL + 'try max_page_size=4096'"
    finally:
        dev.close()
        buf.close()


def case_sub_ranges():
    set_max_page(4096)
    buf = Buf("shmem", 4 * MiB)
    dev = TtPeermemDevice()
    try:
        dev.register(buf.va, 4 * MiB, buf.fd, 0)
        # unaligned start and length: the window rounds out to whole pages
        map_and_check(buf, buf.va, 0, buf.va + MiB + 100, 5000, want_page=4096)
        unmap()
        map_and_check(buf, buf.va, 0, buf.va + 4 * MiB - 4096, 4096, want_page=4096)
        unmap()
        # a second registration: another VA backed by the dma-buf from offset 1 MiB
        dev.register(FIXED_VA, 2 * MiB, buf.fd, MiB)
        map_and_check(buf, FIXED_VA, MiB, FIXED_VA + 8192, 64 * KiB, want_page=4096)
        unmap()
        # hugetlb: a sub-range inside the second huge page, and one across both
        set_max_page(2 * MiB)
        hb = Buf("hugetlb", 4 * MiB)
        try:
            dev.register(FIXED_VA + 16 * MiB, 4 * MiB, hb.fd, 0)
            f = map_and_check(hb, FIXED_VA + 16 * MiB, 0, FIXED_VA + 18 * MiB + 4096, 8192, want_page=2 * MiB)
            assert f["nmap"] == "1", f
            unmap()
            map_and_check(hb, FIXED_VA + 16 * MiB, 0, FIXED_VA + 17 * MiB, 2 * MiB, want_page=2 * MiB)
            unmap()
        finally:
            hb.close()
        return "4 windows checked page by page against /proc/self/pagemap"
    finally:
        dev.close()
        buf.close()


def _raw_register(dev: TtPeermemDevice, va: int, nbytes: int, fd: int, off: int, argsz: int | None = None) -> int:
    arg = TtPeermemRegister(
        argsz=argsz or ctypes.sizeof(TtPeermemRegister),
        flags=0,
        dmabuf_fd=fd,
        va_start=va,
        nbytes=nbytes,
        dmabuf_offset=off,
    )
    try:
        fcntl.ioctl(dev._fd, TT_PEERMEM_IOCTL_REGISTER, arg, True)
    except OSError as e:
        return e.errno
    return 0


def case_out_of_range():
    set_max_page(4096)
    buf = Buf("shmem", 1 * MiB)
    dev = TtPeermemDevice()
    other = os.memfd_create("not-a-dmabuf")
    try:
        want = {
            "past the dma-buf end": (FIXED_VA, 2 * MiB, buf.fd, 0, errno.ERANGE),
            "offset + length past the end": (FIXED_VA, MiB, buf.fd, 4096, errno.ERANGE),
            "unaligned va": (FIXED_VA + 100, 4096, buf.fd, 0, errno.EINVAL),
            "zero length": (FIXED_VA, 0, buf.fd, 0, errno.EINVAL),
            "unaligned offset": (FIXED_VA, 4096, buf.fd, 2048, errno.EINVAL),
            "wrapping range": (2**64 - 4096, 8192, buf.fd, 0, errno.EOVERFLOW),
            "not a dma-buf": (FIXED_VA, 4096, other, 0, errno.EINVAL),
            "closed fd": (FIXED_VA, 4096, 999, 0, errno.EBADF),
        }
        got = {k: _raw_register(dev, *v[:4]) for k, v in want.items()}
        assert got == {k: v[4] for k, v in want.items()}, got
        assert _raw_register(dev, FIXED_VA, 4096, buf.fd, 0, argsz=8) == errno.EINVAL
        s0 = stats()
        assert s0["ranges"] == 0
        rid = dev.register(FIXED_VA, 512 * KiB, buf.fd, 0)
        try:
            dev.register(FIXED_VA + 256 * KiB, 512 * KiB, buf.fd, 0)
            raise AssertionError("overlap accepted")
        except OSError as e:
            assert e.errno == errno.EEXIST, e
        rid2 = dev.register(FIXED_VA + 512 * KiB, 512 * KiB, buf.fd, 512 * KiB)  # adjacent is fine
        # the provider asks for ranges nobody registered, or straddling a registration's end
        for addr, size in (
            (FIXED_VA - 4096, 4096),
            (FIXED_VA + 512 * KiB - 4096, 8192),
            (FIXED_VA + MiB - 4096, 8192),
            (0x1000, 4096),
        ):
            err, text = ctl(f"map {addr:x} {size}")
            assert err == errno.ENOENT and "acquire=0" in text, (hex(addr), size, err, text)
        assert stats()["acquire_misses"] == s0["acquire_misses"] + 4
        assert stats()["acquires"] == s0["acquires"]
        for bad in (12345, 0):
            try:
                dev.unregister(bad)
                raise AssertionError(f"unregister {bad} accepted")
            except OSError as e:
                assert e.errno == errno.ENOENT, e
        dev.unregister(rid)
        dev.unregister(rid2)
        return f"{len(want) + 2} refused registrations, 4 refused acquires"
    finally:
        os.close(other)
        dev.close()
        buf.close()


def case_revocation():
    """move_notify with an MR mapped: the client invalidates it through the core's
    callback (the provider unmaps from inside it, as MOFED does); release still works."""
    set_max_page(2 * MiB)
    buf = Buf("hugetlb", 2 * MiB)
    dev = TtPeermemDevice()
    try:
        s0 = stats()
        inv0 = int(Path(f"{PROV}/invalidations").read_text())
        rid = dev.register(buf.va, 2 * MiB, buf.fd, 0)
        with open(f"{TPM}/revoke", "w") as f:  # no MR yet: nothing to invalidate
            f.write(str(rid))
        assert stats()["invalidations"] == s0["invalidations"]
        map_and_check(buf, buf.va, 0, buf.va, 2 * MiB, want_page=2 * MiB)
        with open(f"{TPM}/revoke", "w") as f:
            f.write(str(rid))
        s1 = stats()
        assert s1["invalidations"] == s0["invalidations"] + 1, s1
        assert int(Path(f"{PROV}/invalidations").read_text()) == inv0 + 1
        assert s1["unmaps"] == s0["unmaps"] + 1 and s1["put_pages"] == s0["put_pages"] + 1, s1
        assert "invalidate dma_unmap=0 put_pages=done" in Path(f"{PROV}/control").read_text()
        assert sgl() == []
        assert f"range {rid}: dma-buf revoked, invalidating MR" in sh("dmesg").stdout
        err, text = ctl("unmap")  # ib_dereg_mr after the invalidation: release only
        assert err == 0 and "release=done" in text, (err, text)
        assert stats()["releases"] == s0["releases"] + 1
        # the registration outlives the revoked MR: a new MR maps again
        map_and_check(buf, buf.va, 0, buf.va, 2 * MiB, want_page=2 * MiB)
        unmap()
        try:
            with open(f"{TPM}/revoke", "w") as f:
                f.write("4242")
            raise AssertionError("revoke of an unknown id accepted")
        except OSError as e:
            assert e.errno == errno.ENOENT
        dev.unregister(rid)
        return "invalidated once, released, remapped"
    finally:
        dev.close()
        buf.close()


def _child_cycles(kind: str, ready_w: int, go_r: int, rounds: int) -> None:
    """In a forked child: register the SAME VA as the sibling, with its own buffer, and
    map/unmap it `rounds` times; each mapping must be this process's pages."""
    code = 1
    try:
        buf = Buf(kind, 2 * MiB)
        dev = TtPeermemDevice()
        rid = dev.register(FIXED_VA, 2 * MiB, buf.fd, 0)
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        want = buf.phys(0)
        for i in range(rounds):
            # churn the registry while the sibling maps (register/unregister are not serialised)
            extra = dev.register(FIXED_VA + (4 + i % 4) * MiB, MiB, buf.fd, MiB)
            # the provider keeps ONE result line for everyone: hold a lock from the command
            # to reading its result, so each process reads its own
            with open("/tmp/hawk-provider.lock", "w") as lk:
                fcntl.flock(lk, fcntl.LOCK_EX)
                err, text = ctl(f"cycle {FIXED_VA:x} {2 * MiB}")
            assert err == 0, (err, text)
            f = fields(text)
            assert f["acquire"] == "1" and int(f["first_dma"], 16) == want, (text, hex(want))
            dev.unregister(extra)
        dev.unregister(rid)
        dev.close()
        code = 0
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    os._exit(code)


def case_two_processes():
    set_max_page(4096)
    s0 = stats()
    kids, pipes = [], []
    for kind in ("shmem", "hugetlb"):
        rr, rw = os.pipe()
        gr, gw = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child_cycles(kind, rw, gr, 25)
        kids.append(pid)
        pipes.append((rr, gw))
    for rr, _gw in pipes:
        assert os.read(rr, 1) == b"r"
    assert stats()["ranges"] == s0["ranges"] + 2  # the same VA, two owners
    for _rr, gw in pipes:
        os.write(gw, b"g")
    codes = [os.waitpid(pid, 0)[1] for pid in kids]
    assert codes == [0, 0], codes
    s1 = stats()
    assert s1["acquires"] == s0["acquires"] + 50 and s1["releases"] == s0["releases"] + 50, s1
    return "2 processes x 25 concurrent map/unmap cycles on the same VA, each got its own pages"


def _bufinfo_count() -> int:
    text = Path("/sys/kernel/debug/dma_buf/bufinfo").read_text()
    return len(re.findall(r"\budmabuf\b", text))


def case_exit_with_ranges_registered():
    set_max_page(4096)
    s0 = stats()
    live0 = _bufinfo_count()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            dev = TtPeermemDevice()
            bufs = [Buf("shmem", MiB) for _ in range(3)]
            for i, b in enumerate(bufs):
                dev.register(FIXED_VA + i * MiB, MiB, b.fd, 0)
            # one MR left mapped too: the core (here the provider) owns it, not the process
            err, _ = ctl(f"map {FIXED_VA:x} {MiB}")
            os.write(w, b"ok" if err == 0 else b"no")
        finally:
            os._exit(0)  # no unregister, no close
    assert os.read(r, 2) == b"ok"
    os.waitpid(pid, 0)
    s1 = stats()
    assert s1["ranges"] == s0["ranges"], f"registrations of a dead process remain: {s1['ranges']}"
    assert s1["acquires"] - s1["releases"] == s0["acquires"] - s0["releases"] + 1
    assert _bufinfo_count() == live0 + 1, "only the MR's dma-buf may still be alive"
    unmap()  # the core releases the MR later: no mm needed any more
    assert _bufinfo_count() == live0, "a dma-buf leaked"
    return "3 registrations dropped at exit; the orphan MR released afterwards"


def case_unload_refused_while_in_use_then_clean():
    set_max_page(4096)
    dev = TtPeermemDevice()
    p = sh("rmmod tt_peermem")
    assert p.returncode != 0 and "in use" in p.stdout, p.stdout
    buf = Buf("shmem", MiB)
    dev.register(buf.va, MiB, buf.fd, 0)
    map_and_check(buf, buf.va, 0, buf.va, MiB)
    dev.close()  # the file is gone, the MR still holds the module
    p = sh("rmmod tt_peermem")
    assert p.returncode != 0 and "in use" in p.stdout, p.stdout
    p = sh("rmmod peermem_provider")
    assert p.returncode != 0, p.stdout  # tt_peermem links against it
    unmap()
    buf.close()
    st = stats()
    global EXPECTED_MAP_FAILURES
    problems = {
        k: (st[a], st[b])
        for k, a, b in (
            ("acquires/releases", "acquires", "releases"),
            ("get_pages/put_pages", "get_pages", "put_pages"),
            ("maps/unmaps", "maps", "unmaps"),
        )
        if st[a] != st[b]
    }
    assert not problems, f"unbalanced counters before unload: {problems}; {st}"
    assert st["ranges"] == 0 and st["contract_warnings"] == 0, st
    assert st["map_failures"] == EXPECTED_MAP_FAILURES, st
    p = sh("rmmod tt_peermem && rmmod peermem_provider")
    assert p.returncode == 0, p.stdout
    assert not os.path.exists("/sys/module/tt_peermem") and not os.path.exists(PROV)
    assert _bufinfo_count() == 0, Path("/sys/kernel/debug/dma_buf/bufinfo").read_text()
    return f"final stats {st}"


SPLAT = re.compile(
    r"WARNING:|BUG:|Oops|general protection|Call Trace|circular locking|"
    r"lockdep|UBSAN|KASAN|refcount_t|list_(add|del) corruption|INFO: task .* blocked|"
    r"kernel BUG|RIP:|stack-protector|soft lockup|hard LOCKUP"
)


def case_no_kernel_splat():
    dmesg = sh("dmesg").stdout
    bad = [line for line in dmesg.splitlines() if SPLAT.search(line)]
    assert not bad, "\n".join(bad[:20])
    tainted = int(Path("/proc/sys/kernel/tainted").read_text())
    # W (warning, 512), D (died, 128), B (bad page, 32), L (soft lockup, 16384) must be clear;
    # O/E (out-of-tree, unsigned module) are expected.
    assert tainted & (512 | 128 | 32 | 16384) == 0, f"tainted={tainted}"
    return f"tainted={tainted} (O/E only), {len(dmesg.splitlines())} dmesg lines scanned"


def main() -> int:
    for fn in (
        case_load_modules,
        case_disallowed_exporter,
        case_lifecycle_shmem_4k,
        case_lifecycle_hugetlb_2m,
        case_shmem_needs_4k_pages,
        case_sub_ranges,
        case_out_of_range,
        case_revocation,
        case_two_processes,
        case_exit_with_ranges_registered,
        case_unload_refused_while_in_use_then_clean,
        case_no_kernel_splat,
    ):
        case(fn)
        if fn is case_load_modules and not RESULTS[-1][1]:
            break
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"KMOD {len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
