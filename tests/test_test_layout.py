"""Tests share code through helper modules (``tests/vllm_fixtures.py``, and per folder a
``*_helpers.py`` such as ``tests/kvflow/kvflow_helpers.py``), never by importing another
test module: a test module imported by another runs its module-level code (skips, marks,
fixtures) in a second place, and moving or renaming a test would break unrelated files.

Checked on the source of every ``tests/**/*.py`` (so an import inside a function counts
too), including ``importlib.import_module``/``__import__``/``spec_from_file_location``
calls that name a test module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: calls that load a module named by a string argument
LOADERS = {
    "import_module",
    "__import__",
    "spec_from_file_location",
    "SourceFileLoader",
    "run_module",
    "run_path",
    "importorskip",
}


def _is_test_module(name: str) -> bool:
    """``name`` (dotted module name or file path) names a module whose file starts with test_."""
    last = name.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
    return any(part.startswith("test_") for part in last.split("."))


def _is_tests_package(module: str) -> bool:
    """``module`` is ``tests`` or a folder under it (importable as a namespace package)."""
    first = module.split(".")[0]
    return first == "tests" or (TESTS / module.replace(".", "/")).is_dir()


def imports_of_test_modules(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, what) for every import of a test module in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.module and _is_test_module(node.module):
                out.append((node.lineno, f"from {module} import ..."))
            elif node.level or _is_tests_package(node.module):  # from . import test_x, from e2e import test_x
                out += [
                    (node.lineno, f"from {module} import {a.name}") for a in node.names if a.name.startswith("test_")
                ]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in LOADERS:
                out += [
                    (node.lineno, f"{name}({arg.value!r})")
                    for arg in node.args
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_test_module(arg.value)
                ]
    return out


def test_no_test_module_imports_another_test_module():
    bad = []
    for f in sorted(TESTS.rglob("*.py")):
        for line, what in imports_of_test_modules(f.read_text(), str(f)):
            bad.append(f"{f.relative_to(TESTS.parent)}:{line}: {what}")
    assert not bad, "move shared code into the folder's *_helpers.py module:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "from test_kvflow_inprocess import BS",
        "import test_gn_hawk",
        "import tests.e2e.test_pd_serving as pd",
        "from tests.e2e.test_pd_serving import greedy_divergence",
        "from tests.security import test_idle_floods",
        "from . import test_idle_floods",
        "from e2e import test_pd_serving",
        "def f():\n    from test_idle_floods import RawFlood\n",
        "import importlib\nm = importlib.import_module('test_gn_hawk')",
        "m = __import__('test_gn_hawk')",
        "import importlib.util\ns = importlib.util.spec_from_file_location('x', 'tests/e2e/test_tp.py')",
    ],
)
def test_the_check_sees_every_kind_of_test_module_import(source):
    assert imports_of_test_modules(source), source


@pytest.mark.parametrize(
    "source",
    [
        "from kvflow_helpers import BS, endpoints",
        "import vllm_fixtures",
        "from vllm_hawk.bench.local_cluster import scrape_metrics",
        "from vllm_hawk.bench import endpoints",
        "import importlib.util\nimportlib.util.find_spec('mooncake.engine')",
    ],
)
def test_the_check_allows_helper_and_package_imports(source):
    assert not imports_of_test_modules(source), source
