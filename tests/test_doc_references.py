"""Every ``docs/*.md`` that code, tests, scripts or the README point at exists, and nothing
points at a design document outside this repository."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["vllm_hawk", "tests", "scripts", "requirements", "examples", "configs", "docs"]


def files():
    yield REPO / "README.md"
    for top in SOURCES:
        for p in (REPO / top).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".sh", ".txt", ".md", ".json", ".example", ".toml"):
                yield p


def test_doc_references_resolve():
    missing, external = [], []
    for p in files():
        text = p.read_text(errors="replace")
        for ref in re.findall(r"\bdocs/[\w.-]+\.md", text):
            if not (REPO / ref).is_file():
                missing.append(f"{p.relative_to(REPO)}: {ref}")
        if p != Path(__file__) and re.search(r"\bDESIGN(\.md)?\b", text):
            external.append(str(p.relative_to(REPO)))
    assert not missing, missing
    assert not external, f"refer to docs/ instead of DESIGN.md: {external}"
