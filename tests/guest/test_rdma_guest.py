"""RDMA stage: real verbs on soft-RoCE (rdma_rxe on the guest's virtio-net eth0) in a QEMU
TCG guest, running the project's own Python and Mooncake from the cached venv (mounted
read-only over 9p at the host paths; nothing is installed in the guest).

One guest boot runs, with Mooncake ``protocol=rdma, device_name=rxe0``:
  * Algorithm 1 between two processes (tests/kvflow/test_kvflow_two_process.py, a cut-down
    case: four bf16 requests, staged and direct, alone and two at once, byte-exact; reads
    outside the ring refused). ``import torch`` takes about two minutes under TCG: the
    prefill child is forked from the test process (one import, not two), and the import
    runs while the transport checks below run; its tests start once those are done;
  * the transport tests that exercise real verbs: batched READ and WRITE, remote out of
    range refused, dead peer (tests/transport/test_transports.py);
  * the rxe packet counters, read around every test (tests/guest/rxe_counters.py): each
    test that moves data must have moved at least its bytes / 4096 packets;
  * a WRITE/READ throughput run with verified bytes (figures printed at the end);
  * which protocol the engine really uses: bare engine protocol="tcp" with an HCA present,
    and our transport for tcp / rdma (the latter after a tcp engine in the same process);
  * pyverbs DmaBufMR over a udmabuf on rxe0: refused with EOPNOTSUPP (errno 95), and
    ``hawk doctor`` names rxe0 as soft-RoCE, for testing only.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from guest_helpers import REPO, TIMES, case_lines, images, require, run

VENV_PY = Path(sys.executable)
# no firewall table: the guest is a VM of its own whose engines reach only each other, and its
# bare rootfs has no nftables (admission is tested in network namespaces, tests/security)
OPTIONS = {"protocol": "rdma", "device_name": "rxe0", "local_host": "10.0.2.15", "firewall": "open-to-network"}
BENCH_MIB, BENCH_REPS = 8, 2
KV2 = "tests/kvflow/test_kvflow_two_process.py::"
TR = "tests/transport/test_transports.py::"
#: node id -> bytes it moves over the transport (at most 4 KiB a RoCE packet, so at least
#: bytes / 4096 packets each way); None: a refusal or a failure, counters only reported
KVFLOW_TESTS = {
    KV2 + "test_few_requests_staged_and_direct_bf16_exact_bytes": 2080 * 1024,  # FEW_NBYTES there
    KV2 + "test_reads_outside_the_ring_are_refused": None,
}
TRANSPORT_TESTS = {
    TR + "test_batched_read_random_ranges[mooncake]": 3842750,  # the test's seeded ranges
    TR + "test_batched_write_random_ranges[mooncake]": 4068584,
    TR + "test_remote_out_of_range_is_refused[mooncake]": None,
    TR + "test_dead_peer_fails_fast[mooncake]": None,
}  # (not the hanging peer: that is the TCP handshake, the same under either protocol)

JOB = r"""
set -u
R=@REPO@; VPY=@VPY@
export PYTHONPATH=$R:$R/tests/guest:/tmp/pv GLOG_minloglevel=1 HAWK_TEST_MOONCAKE_OPTIONS='@OPTIONS@'
export HAWK_RXE_COUNTERS=/sys/class/infiniband/rxe0/ports/1/hw_counters
mkdir -p /tmp/pv && ln -sf /usr/lib/python3/dist-packages/pyverbs /tmp/pv/
up() { cut -d' ' -f1 /proc/uptime; }
if modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0; then
    echo "CASE rxe_up PASS $(rdma link show rxe0/1) $(ibv_devinfo -d rxe0 | grep -o 'active_mtu:.*')"
else
    echo "CASE rxe_up FAIL modprobe rdma_rxe / rdma link add failed"; exit 1
fi
cd $R
# no conftest, no plugin autoload (hypothesis alone imports for ~15 s under TCG); rxe counters per test
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PT="$VPY -m pytest -q -p no:cacheprovider --noconftest -p rxe_counters --durations=0"
pytest_stage() {  # NAME LOG T0 RC: the summary, the time, PASS/FAIL
    local name=$1 log=$2 t0=$3 rc=$4 dt
    dt=$(echo "$(up) $t0" | awk '{printf "%.1f", $1-$2}')
    echo "TIME $name $dt"
    grep -E "rxe_counters:|^[0-9.]+s (setup|call|teardown) " $log | head -12
    local summary=$(grep -E "(passed|failed|error)" $log | tail -1)
    if [ $rc = 0 ]; then echo "CASE $name PASS $summary"
    else echo "CASE $name FAIL rc=$rc: $summary"; grep -vE "^[IWE][0-9]{4} " $log | tail -60; fi
}
# Algorithm 1: collection (import torch) overlaps the transport checks; its tests wait for them
t_kv=$(up)
HAWK_TEST_MP_START=fork HAWK_TEST_START_TIMEOUT_S=300 HAWK_TRANSFORM_IMPL=torch HAWK_RXE_WAIT_FOR=/tmp/others.done \
    HAWK_RXE_REPORT=/hawk/out/rxe_kvflow.json $PT @KVFLOW_TESTS@ > /tmp/kvflow.log 2>&1 &
kv=$!
t0=$(up)
# peers fork from one server that imported Mooncake (a spawn is ~15 s under TCG)
export HAWK_TEST_MP_START=forkserver
HAWK_RXE_REPORT=/hawk/out/rxe_transport.json $PT @TRANSPORT_TESTS@ > /tmp/transport.log 2>&1
pytest_stage transport_tests /tmp/transport.log $t0 $?
$VPY tests/guest/rdma_guest.py all @BENCH_MIB@ @BENCH_REPS@ 2>&1 | grep -E "^(CASE|RESULT|TIME) "
$VPY -m vllm_hawk.doctor --json --role decode > /hawk/out/doctor.json 2>/dev/null
touch /tmp/others.done
echo "TIME checks_beside_kvflow $(echo "$(up) $t0" | awk '{printf "%.1f", $1-$2}')"
wait $kv
pytest_stage kvflow_two_process /tmp/kvflow.log $t_kv $?
echo "DONE"
"""

CASES = [
    "rxe_up",
    "transport_tests",
    "kvflow_two_process",
    "rdma_bench",
    "engine_tcp_unforced",
    "transport_tcp_really_tcp",
    "transport_rdma_really_rdma_after_a_tcp_engine",
    "dmabuf_mr_refused",
]


def _job() -> str:
    return (
        JOB.replace("@REPO@", str(REPO))
        .replace("@VPY@", str(VENV_PY))
        .replace("@OPTIONS@", json.dumps(OPTIONS))
        .replace("@BENCH_MIB@", str(BENCH_MIB))
        .replace("@BENCH_REPS@", str(BENCH_REPS))
        .replace("@KVFLOW_TESTS@", " ".join(KVFLOW_TESTS))
        .replace("@TRANSPORT_TESTS@", " ".join(TRANSPORT_TESTS))
    )


def _shares() -> list[str]:
    base = Path(os.path.realpath(VENV_PY)).parent.parent  # the interpreter's own prefix (pyenv)
    return [str(REPO), sys.prefix, str(base)]


@pytest.fixture(scope="module")
def guest_run():
    images()
    try:
        import mooncake.engine  # noqa: F401

        ok = True
    except Exception:  # noqa: BLE001
        ok = False
    require(ok, "mooncake is not importable in this venv")
    res = run("RDMA stage", _job(), shares=_shares(), timeout_s=720, mem_mib=3072)
    for m in re.finditer(r"^TIME (\S+) (\S+)", res.output, re.M):
        TIMES.append(f"  RDMA stage / {m.group(1)}: {m.group(2)} s in the guest")
    for m in re.finditer(r"^rxe_counters: (.*)$", res.output, re.M):
        TIMES.append(f"  RDMA stage / Algorithm 1 {m.group(1)}")
    for f in ("rxe_transport.json", "rxe_kvflow.json"):
        for nodeid, r in json.loads(res.files.get(f, "{}")).items():
            TIMES.append(
                f"  rxe0 {r.get('sent_pkts')}/{r.get('rcvd_pkts')} pkts sent/rcvd, {r.get('s')} s: "
                f"{nodeid.split('::')[-1]}"
            )
    for m in re.finditer(r"^RESULT bench (.*)$", res.output, re.M):
        b = json.loads(m.group(1))
        TIMES.append(
            f"  rxe0 Mooncake rdma {b['reps']} x {b['mib']} MiB: WRITE {b['write_MBps']} MB/s, "
            f"READ {b['read_MBps']} MB/s (medians {b['write_median_MBps']} / "
            f"{b['read_median_MBps']}), rxe packets {b['rxe_pkts']}"
        )
    return res, case_lines(res.output)


@pytest.mark.parametrize("name", CASES)
def test_case(guest_run, name):
    res, cases = guest_run
    assert name in cases, f"case {name} did not run:\n" + "\n".join(res.output.splitlines()[-40:])
    ok, detail = cases[name]
    assert ok, detail


@pytest.mark.parametrize("nodeid", [*KVFLOW_TESTS, *TRANSPORT_TESTS], ids=lambda n: n.split("::")[-1])
def test_rdma_carried_the_bytes(guest_run, nodeid):
    """Every selected test ran and passed in the guest, and one that moves data moved at
    least its bytes / 4096 packets through rxe0 each way (TCP would leave them at 0)."""
    res, _ = guest_run
    kv = nodeid in KVFLOW_TESTS
    report = json.loads(res.files.get("rxe_kvflow.json" if kv else "rxe_transport.json", "{}"))
    assert nodeid in report, f"{nodeid} did not run:\n" + "\n".join(res.output.splitlines()[-40:])
    r = report[nodeid]
    assert r.get("outcome") == "passed", r
    nbytes = (KVFLOW_TESTS if kv else TRANSPORT_TESTS)[nodeid]
    if nbytes:
        assert min(r["sent_pkts"], r["rcvd_pkts"]) >= nbytes // 4096, (r, nbytes)


def test_transport_protocol_checks_found_the_silent_rdma(guest_run):
    """Mooncake's protocol argument alone does not pick the wire: a bare engine asked for
    "tcp" uses RDMA when an HCA exists. Our transport pins the protocol it is asked for."""
    res, _ = guest_run
    m = re.search(r"^RESULT raw_tcp_unforced (.*)$", res.output, re.M)
    assert m, res.output[-2000:]
    assert json.loads(m.group(1))["used"] == "rdma"


def test_doctor_names_soft_roce_for_testing(guest_run):
    res, _ = guest_run
    doctor = json.loads(res.files["doctor.json"])
    rdma = {c["name"]: c for c in doctor["checks"]}["rdma devices"]
    assert rdma["status"] == "WARN", rdma
    assert "rxe0 is soft-RoCE (rdma_rxe) on eth0: software RDMA, for testing only" in rdma["detail"]
    assert "EOPNOTSUPP, errno 95" in rdma["detail"]


def test_guest_dmesg_clean(guest_run):
    res, _ = guest_run
    from kmod_guest import SPLAT

    bad = [line for line in res.dmesg.splitlines() if SPLAT.search(line)]
    assert not bad, "\n".join(bad)
