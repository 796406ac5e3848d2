"""Kernel module stage: tt_peermem and its test provider, built for Debian's 6.12 kernel,
loaded in a QEMU TCG guest and driven over real udmabuf dma-bufs (shmem 4 KiB pages and
hugetlb 2 MiB pages). One guest boot runs every case (tests/guest/kmod_guest.py); each
case is one test here. The whole stage fails on any WARN/BUG/Oops line in the guest's
dmesg, a W/D taint, or debugfs counters that do not balance before the clean unload.
(Debian's kernel has no lockdep: a lockdep splat cannot appear, the scan would catch one.)
"""

from __future__ import annotations

import pytest
from guest_helpers import REPO, build_modules, case_lines, images, run

CASES = [
    "load_modules",
    "disallowed_exporter",
    "lifecycle_shmem_4k",
    "lifecycle_hugetlb_2m",
    "shmem_needs_4k_pages",
    "sub_ranges",
    "out_of_range",
    "revocation",
    "two_processes",
    "exit_with_ranges_registered",
    "unload_refused_while_in_use_then_clean",
    "no_kernel_splat",
]


@pytest.fixture(scope="module")
def guest_run(tmp_path_factory):
    imgs = images()
    mods = build_modules(imgs.kver, tmp_path_factory.mktemp("kmod"))
    script = f"PYTHONPATH={REPO} /usr/bin/python3 {REPO}/tests/guest/kmod_guest.py {mods}\n"
    res = run("kernel module stage", script, shares=[str(REPO), str(mods)], net=False, timeout_s=240, mem_mib=1024)
    return res, case_lines(res.output)


@pytest.mark.parametrize("name", CASES)
def test_case(guest_run, name):
    res, cases = guest_run
    assert name in cases, f"case {name} did not run:\n" + "\n".join(res.output.splitlines()[-30:])
    ok, detail = cases[name]
    assert ok, detail


def test_guest_job_passed_and_dmesg_clean(guest_run):
    res, cases = guest_run
    assert set(cases) == set(CASES)
    assert res.rc == 0, res.output[-3000:]
    from kmod_guest import SPLAT  # the same patterns, applied to the full log on the host side

    bad = [line for line in res.dmesg.splitlines() if SPLAT.search(line)]
    assert not bad, "\n".join(bad)
    assert "registered peer-memory client tt_peermem" in res.dmesg
