"""The folders tell the data flow: layout -> transform -> kvflow -> transport / protocol,
with integrity (the checksum both ends take) beside them,
with connector, tenstorrent and proxy as adapters on top. No module imports a layer above
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
    "integrity": set(),
    "kvflow": {"layout", "transform", "npu", "transport", "protocol", "integrity"},
    # the engine integrations: they read the connector's configuration, the connector finds
    # their cache through tenstorrent.registry
    "tenstorrent": {"layout", "npu", "protocol", "connector", "cpu_amx"},
}
#: the two Tenstorrent engine integrations (vllm_hawk/tenstorrent/<name>), siblings
TT_ENGINE_INTEGRATIONS = ("emulated", "vllm_tt")


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


def _imported_modules(path: Path) -> set[str]:
    """Full dotted names of the vllm_hawk modules ``path`` imports (lazy imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm_hawk."):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("vllm_hawk.")}
    return out


def test_neither_tenstorrent_engine_integration_imports_the_other():
    bad = []
    for pkg in TT_ENGINE_INTEGRATIONS:
        for other in set(TT_ENGINE_INTEGRATIONS) - {pkg}:
            prefix = f"vllm_hawk.tenstorrent.{other}"
            for f in sorted((PKG / "tenstorrent" / pkg).rglob("*.py")):
                hits = sorted(m for m in _imported_modules(f) if m == prefix or m.startswith(prefix + "."))
                bad += [f"{f.relative_to(PKG.parent)} imports {m}" for m in hits]
    assert not bad, "\n".join(bad)


def test_leaf_modules_import_nothing_of_vllm_hawk():
    for leaf in ("envs.py", "security.py"):
        assert not _imports(PKG / leaf), f"vllm_hawk/{leaf} must stay a leaf (every layer imports it)"


def test_no_module_of_the_package_imports_test_only_code():
    """Code only tests use lives under tests/ (imported there by its bare module name, or as
    ``tests.<folder>.<module>``): no module of vllm_hawk imports it, even lazily, and there
    is no ``vllm_hawk.testing`` package to hold such code."""
    tests = PKG.parent / "tests"
    test_only = {"tests"} | {f.stem for f in tests.rglob("*.py")}
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{f.relative_to(PKG.parent)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in test_only]
    assert not bad, "modules of vllm_hawk import test-only code:\n" + "\n".join(bad)
    assert not (PKG / "testing").exists(), "vllm_hawk/testing: code only tests use goes under tests/"


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
    """kvflow/ledger.py only decides (the endpoint carries its decisions out): neither it nor
    the records it keeps (kvflow/lifecycle.py, kvflow/early.py) import transport, socket,
    ring, exposure, server or thread machinery."""
    names = set()
    for path in (PKG / "kvflow" / f for f in ("ledger.py", "lifecycle.py", "early.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
    banned = ("threading", "concurrent", "socket", "zmq", "vllm_hawk.transport", "vllm_hawk.kvflow.ring")
    banned += ("vllm_hawk.kvflow.exposure", "vllm_hawk.kvflow.prefill", "vllm_hawk.protocol.server")
    bad = sorted(n for n in names if any(n == b or n.startswith(b + ".") or n.startswith(b + "_") for b in banned))
    assert not bad, f"the ledger (kvflow/ledger.py, lifecycle.py, early.py) imports {bad}"
    assert "vllm_hawk.protocol" not in names, "import the messages from vllm_hawk.protocol.messages"
