"""The tt-kmd backend imports with the standard library alone: the QEMU guest runs it
(tests/guest/kmod_guest.py) with the rootfs's bare /usr/bin/python3, which has neither
PyYAML nor numpy."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import sys
for m in ("yaml", "numpy", "torch", "msgspec", "zmq"):
    sys.modules[m] = None  # importing one raises ImportError, as in the guest
import vllm_hawk.npu.tt_kmd
from vllm_hawk.npu.tt_kmd.registration import TtPeermemDevice, TtPeermemRegister
print("ok")
"""


def test_the_tt_kmd_backend_needs_no_third_party_module():
    r = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
