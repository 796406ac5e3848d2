"""The ``vllm.general_plugins`` entry point makes ``"kv_connector": "HawkConnector"`` work
without ``kv_connector_module_path`` (checked in a fresh interpreter with a throw-away
distribution that declares the entry point, as ``pip install`` of vllm-hawk would)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent("""
    from vllm_hawk.vllm_launcher import ensure_vllm_dist
    ensure_vllm_dist()
    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    vllm.plugins.load_general_plugins()
    import vllm_hawk.connector as hc
    hc.register()  # again: must be a no-op
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="HawkConnector", kv_role="kv_producer"))
    by_path = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="HawkConnector", kv_role="kv_producer",
                         kv_connector_module_path="vllm_hawk.connector"))
    assert cls is by_path, (cls, by_path)
    print("OK", cls.__module__, cls.__name__)
""")


def test_entry_point_registers_the_connector_by_name(tmp_path: Path):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    dist = tmp_path / "hawk_plugin_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hawk-plugin-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nhawk_connector = vllm_hawk.connector:register\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]), VLLM_PLUGINS="hawk_connector")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK vllm_hawk.connector.connector HawkConnector" in out.stdout
