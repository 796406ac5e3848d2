"""The folders tell the data flow: layout -> transform -> kvflow -> transport / protocol,
with connector, tt_plugin and proxy as adapters on top. No module imports a layer above
its own (checked on the source, so a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vllm_hawk"
# Each package may import only these (besides itself).
ALLOWED = {
    "layout": set(),
    "transform": {"layout"},
    "npu": {"layout"},
    "transport": set(),
    "protocol": set(),
    "kvflow": {"layout", "transform", "npu", "transport", "protocol"},
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm_hawk."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("vllm_hawk.")}
    return out


def test_no_import_runs_upward():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sorted((PKG / pkg).rglob("*.py")):
            for target in _imports(f) - allowed - {pkg, "envs", "security"}:
                bad.append(f"{f.relative_to(PKG.parent)} imports vllm_hawk.{target}")
    assert not bad, "\n".join(bad)


def test_leaf_modules_import_nothing_of_vllm_hawk():
    for leaf in ("envs.py", "security.py"):
        assert not _imports(PKG / leaf), f"vllm_hawk/{leaf} must stay a leaf (every layer imports it)"


def test_runtime_modules_do_not_import_the_testing_package():
    bad = [
        str(f.relative_to(PKG.parent))
        for f in sorted(PKG.rglob("*.py"))
        if "testing" not in f.relative_to(PKG).parts[:1] and f.parent.name != "bench" and "testing" in _imports(f)
    ]
    assert not bad, f"runtime modules import vllm_hawk.testing: {bad}"


def test_every_hawk_variable_is_read_in_envs():
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "envs.py":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if "environ" in line and '"HAWK_' in line or 'getenv("HAWK_' in line:
                bad.append(f"{f.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert not bad, "read HAWK_* variables through vllm_hawk.envs:\n" + "\n".join(bad)


def test_the_prefill_ledger_decides_without_transport_ring_or_threads():
    """kvflow/ledger.py only decides (the endpoint carries its decisions out): it imports no
    transport, socket, ring, exposure, server or thread machinery."""
    path = PKG / "kvflow" / "ledger.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    banned = ("threading", "concurrent", "socket", "zmq", "vllm_hawk.transport", "vllm_hawk.kvflow.ring")
    banned += ("vllm_hawk.kvflow.exposure", "vllm_hawk.kvflow.prefill", "vllm_hawk.protocol.server")
    bad = sorted(n for n in names if any(n == b or n.startswith(b + ".") or n.startswith(b + "_") for b in banned))
    assert not bad, f"vllm_hawk/kvflow/ledger.py imports {bad}"
    assert "vllm_hawk.protocol" not in names, "import the messages from vllm_hawk.protocol.messages"
