"""Whether Mooncake reaches CUDA memory is asked of the engine, not read off the wheel's
name (vllm_hawk/transport/mooncake_cuda.py). Real Mooncake (the -non-cuda wheel) over TCP
on this CPU-only host; the probe's device half needs a GPU and is not run here."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from vllm_hawk.transport.mooncake_cuda import (
    EXTRAS,
    NON_CUDA,
    WHEELS,
    cuda_unreachable,
    loopback_check,
    wheel_for_torch,
)

mooncake = pytest.importorskip("mooncake.engine")
REPO = Path(__file__).resolve().parents[2]
CU12, CU13 = WHEELS["12"], WHEELS["13"]


def ask_a_transport() -> dict:
    """What a new Mooncake transport says about cuda:0, and the refusal's text."""
    from vllm_hawk.transport import RegionError
    from vllm_hawk.transport.mooncake import MooncakeTransport
    from vllm_hawk.transport.mooncake_cuda import installed_wheels

    t = MooncakeTransport()
    buf = ctypes.create_string_buffer(4096)
    try:
        accepts, error = t.accepts_memory("cuda:0"), None
        try:
            t.register(ctypes.addressof(buf), 4096, "cuda:0")
        except RegionError as e:
            error = str(e)
        t.register(ctypes.addressof(buf), 4096)  # nothing was half-registered
        t.unregister(ctypes.addressof(buf))
    finally:
        t.close()
    return {"accepts": accepts, "error": error, "installed": installed_wheels()}


#: ``ask_a_transport`` in a fresh interpreter, as one JSON line.
IN_SUBPROCESS = (
    f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    "from test_mooncake_cuda import ask_a_transport; print(json.dumps(ask_a_transport()))"
)


def test_wheel_for_torch():
    assert wheel_for_torch(None) == NON_CUDA == "mooncake-transfer-engine-non-cuda"
    assert wheel_for_torch("12.4") == "mooncake-transfer-engine"
    assert wheel_for_torch("13.0") == "mooncake-transfer-engine-cuda13"
    with pytest.raises(ValueError, match="'11.8'.*CUDA 12.*13"):
        wheel_for_torch("11.8")


def _fake_dist(root: Path, name: str) -> None:
    """Installed metadata for ``name`` only (no files): what pip leaves for a wheel."""
    d = root / f"{name.replace('-', '_')}-0.3.13.post1.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3.13.post1\n")


def _site_without(root: Path, *, package: bool) -> Path:
    """This venv's site-packages as symlinks, less every Mooncake ``*.dist-info`` (and, with
    ``package``, less the ``mooncake`` package itself), for ``python -S``."""
    site = Path(sysconfig.get_paths()["purelib"])
    farm = root / "site"
    farm.mkdir()
    for p in site.iterdir():
        metadata = p.name.startswith("mooncake_transfer_engine") and p.name.endswith(".dist-info")
        if not (metadata or (package and p.name == "mooncake")):
            (farm / p.name).symlink_to(p)
    return farm


def _check_refusal(got: dict, installed: list[str]) -> None:
    """cuda:0 refused (no GPU here, the engine built without CUDA); the refusal names what
    is installed and the wheel for this torch."""
    assert got["installed"] == installed
    assert got["accepts"] is False
    error = got["error"]
    assert error and "'cuda:0'" in error and "torch.cuda.is_available() is False" in error
    assert f"the wheel for this torch is {wheel_for_torch(torch.version.cuda)} " in error
    assert ("no Mooncake distribution metadata" in error) is (not installed)
    for line in installed:
        assert line in error


@pytest.mark.parametrize("names", [[], [CU12], [CU13], [CU12, CU13]], ids=["non-cuda", "cu12", "cu13", "both"])
def test_detection_does_not_depend_on_the_wheel_name(tmp_path, monkeypatch, names):
    """The real -non-cuda engine, with the metadata of either CUDA wheel, or both, installed
    beside it (a new transport after each: the metadata is looked up on sys.path)."""
    for name in names:
        _fake_dist(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = [f"{n} 0.3.13.post1" for n in (NON_CUDA, CU12, CU13) if n == NON_CUDA or n in names]
    _check_refusal(ask_a_transport(), installed)


def test_detection_without_any_wheel_metadata(tmp_path):
    """No Mooncake distribution metadata at all (``python -S`` over site-packages without it):
    the same answer."""
    env = dict(os.environ, PYTHONPATH=f"{_site_without(tmp_path, package=False)}{os.pathsep}{REPO}")
    cmd = [sys.executable, "-S", "-c", IN_SUBPROCESS]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    _check_refusal(json.loads(run.stdout.strip().splitlines()[-1]), [])


class FakeTorchCuda:
    """A fake of ``torch.cuda`` (hardware boundary: no GPU here): a host with ``count`` GPUs."""

    def __init__(self, count: int) -> None:
        self.count = count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count


def test_decision_before_the_probe():
    """Only a CUDA engine on a host where torch sees the GPU gets probed (None); the real
    torch.cuda here answers no GPU."""
    assert "is_available() is False" in cuda_unreachable("cuda:0", True, torch.cuda)
    assert "is_available() is False" in cuda_unreachable("cuda:0", True, None)  # no torch
    assert "is_available() is False" in cuda_unreachable("cuda:0", True, FakeTorchCuda(0))
    assert "2 CUDA device(s), so no cuda:2" in cuda_unreachable("cuda:2", True, FakeTorchCuda(2))
    for support in (False, None):  # None: an engine that does not say
        assert f"SUPPORT_CUDA is {support}" in cuda_unreachable("cuda:0", support, FakeTorchCuda(1))
    assert cuda_unreachable("cuda:1", True, FakeTorchCuda(2)) is None
    for bad in ("cuda:x", "cuda", "npu:0"):
        assert "not a CUDA device name" in cuda_unreachable(bad, True, FakeTorchCuda(1))


def test_the_engine_says_it_has_no_cuda():
    assert mooncake.SUPPORT_CUDA is False  # the -non-cuda wheel this environment pins


@pytest.fixture()
def transport():
    from vllm_hawk.transport.mooncake import MooncakeTransport

    t = MooncakeTransport()
    yield t
    t.close()


def test_loopback_check_on_host_memory(transport):
    """The probe's READ through the engine's own endpoint, on host memory (on a GPU the
    source is a cuda:N tensor): the bytes arrive, both registrations are gone after."""
    src = (torch.arange(4096, dtype=torch.int32) * 7 + 3).remainder(251).to(torch.uint8)
    assert loopback_check(transport, src, "cpu") is None
    assert transport._regions.regions() == []
    transport.register(src.data_ptr(), 4096)  # the engine forgot it too (no overlap)
    why = loopback_check(transport, src, "cpu")  # now its source overlaps a registration
    assert why is not None and "registering 4096 bytes at 'cpu' failed" in why and "overlaps" in why
    assert [a for a, _ in transport._regions.regions()] == [src.data_ptr()]
    transport.unregister(src.data_ptr())


def test_decided_once_per_device(transport):
    assert not transport.accepts_memory("cuda:0") and not transport.accepts_memory("cuda:0")
    assert not transport.accepts_memory("cuda:1")
    assert sorted(transport._cuda._why) == ["cuda:0", "cuda:1"]
    assert not transport.accepts_memory("npu:0") and "npu:0" not in transport._cuda._why


def test_import_error_names_the_wheel_for_this_torch(tmp_path):
    """Without Mooncake installed, the error says which wheel fits this torch."""
    code = (
        "from vllm_hawk.transport.mooncake import MooncakeTransport\n"
        "try:\n    MooncakeTransport()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{_site_without(tmp_path, package=True)}{os.pathsep}{REPO}")
    cmd = [sys.executable, "-S", "-c", code]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.startswith("TransportError Mooncake is not importable (No module named 'mooncake')"), run
    wheel = wheel_for_torch(torch.version.cuda)
    assert f"pip install {wheel} (the project's [{EXTRAS[wheel]}] extra" in run.stdout
