"""``docs/architecture.md`` names only code that exists, so the page cannot drift silently.

Checked, parsing ``vllm_hawk/`` with ``ast`` (nothing is imported):

* every backticked ``vllm_hawk/...`` path exists (a module or a folder);
* every backticked name written right after a module path (only spaces, commas, "or", "and"
  between: `` `vllm_hawk/kvflow/prefill.py` `PrefillEndpoint.on_kv_request`, `add_request` ``) is
  defined in that module: a function, class or module-level name, or ``Class.member``;
* every backticked ``Class.member`` anywhere on the page is a member of a class of that
  name somewhere in ``vllm_hawk/`` (a method, a class-level field, or an attribute its
  methods set on ``self``), and every backticked class-like name is a class there;
* both life cycles carry all of Algorithm 1's step names (P1-P9, D1-D8).
"""

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PKG = REPO / "vllm_hawk"

#: Classes the page names that live outside this repository.
EXTERNAL = {"ThreadAuthenticator", "KVConnectorModelRunnerMixin"}

_PATH = re.compile(r"`(vllm_hawk/[\w/.]*)`")
_AFTER_PATH = re.compile(r"`(vllm_hawk/[\w/]+\.py)`((?:(?:[ \t\n,]|\bor\b|\band\b)*`[\w.]+`)*)")
_TICKED = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"_?[A-Z]\w*\.\w+")
_CLASSLIKE = re.compile(r"_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def _members(cls: ast.ClassDef) -> set[str]:
    out = _self_attrs(cls)
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


@cache
def module_names(rel: str) -> frozenset[str]:
    """What module ``rel`` defines: top-level names and ``Class.member``."""
    tree = ast.parse((REPO / rel).read_text(), rel)
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out.add(node.name)
            out.update(f"{node.name}.{m}" for m in _members(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(out)


@cache
def classes() -> dict[str, set[str]]:
    """Every class in ``vllm_hawk/`` (by name, merged over modules) and its members."""
    out: dict[str, set[str]] = defaultdict(set)
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ClassDef):
                out[node.name] |= _members(node)
    return out


def doc() -> str:
    return DOC.read_text()


def test_paths_exist():
    paths = set(_PATH.findall(doc()))
    assert len(paths) >= 30, f"the page names only {len(paths)} modules: is the parser still right?"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_names_next_to_paths_exist():
    checked, missing = 0, []
    for rel, tail in _AFTER_PATH.findall(doc()):
        if not (REPO / rel).is_file():
            continue  # test_paths_exist names it
        for name in _TICKED.findall(tail):
            checked += 1
            if name not in module_names(rel):
                missing.append(f"{rel} {name}")
    assert checked >= 30, f"only {checked} names next to paths: is the parser still right?"
    assert not missing, f"docs/architecture.md names what these modules do not define: {missing}"


def test_class_members_exist():
    known = classes()
    missing = []
    for tok in set(_TICKED.findall(doc())):
        if _DOTTED.fullmatch(tok):
            cls, member = tok.split(".", 1)
            if cls not in EXTERNAL and member not in known.get(cls, ()):
                missing.append(tok)
        elif _CLASSLIKE.fullmatch(tok) and tok not in EXTERNAL and tok not in known:
            missing.append(tok)
    assert not missing, f"docs/architecture.md names classes or members not in vllm_hawk/: {sorted(missing)}"


def test_algorithm_1_steps_named():
    text = doc()
    prefill, _, decode = text.partition("## Decode side")
    want_p = [f"P{i}" for i in range(1, 10)]
    want_d = [f"D{i}" for i in range(1, 9)]

    def named(part: str, step: str) -> bool:
        """``step`` alone or inside a range such as P4-P6 or P4+P6."""
        letter, n = step[0], int(step[1:])
        found = re.findall(rf"\b{letter}(\d)(?:[-+]{letter}(\d))?\b", part)
        return any(int(a) <= n <= int(b or a) for a, b in found)

    assert [s for s in want_p if not named(prefill, s)] == []
    assert [s for s in want_d if not named(decode, s)] == []


def test_parser_catches_a_wrong_name():
    """The checks above would fail on a renamed method (the page cannot drift silently)."""
    rel = "vllm_hawk/kvflow/prefill.py"
    assert "PrefillEndpoint.on_kv_request" in module_names(rel)
    assert "PrefillEndpoint.no_such_method" not in module_names(rel)
    found = _AFTER_PATH.findall(f"see `{rel}` `PrefillEndpoint.add_request`, `engine_step` or `x`: `y`")
    assert [(r, _TICKED.findall(t)) for r, t in found] == [(rel, ["PrefillEndpoint.add_request", "engine_step", "x"])]
