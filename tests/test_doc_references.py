"""Every ``docs/*.md`` that code, tests, scripts or the README point at exists, nothing
points at a design document outside this repository, every relative markdown link in the
README and ``docs/*.md`` resolves, and the README stays short."""

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


README_MAX_LINES = 250
# [text](target) with an optional "title"; images too. Targets with a scheme, mail links and
# pure #anchors are not files.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def markdown_files():
    yield REPO / "README.md"
    yield from sorted((REPO / "docs").glob("*.md"))


def relative_links(text: str, with_anchor: bool = False):
    """Relative link targets of markdown ``text``, without their #anchor (or as
    ``(path, anchor)`` pairs); code blocks and inline code are skipped (they show syntax,
    not links)."""
    text = _FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s)://, mailto:, ... and anchors within the page
        path, _, anchor = target.partition("#")
        if path:
            yield (path, anchor) if with_anchor else path


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of markdown ``text``: lower case, punctuation
    dropped, spaces to hyphens."""
    text = _FENCE.sub("", text)
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    broken = []
    for md in markdown_files():
        for path, anchor in relative_links(md.read_text(), with_anchor=True):
            target = md.parent / path
            if not target.exists():
                broken.append(f"{md.relative_to(REPO)}: {path}")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{md.relative_to(REPO)}: {path}#{anchor} (no such heading)")
    assert not broken, broken


def test_link_parser():
    text = (
        "[a](sub/x.md) [b](y.md#part) [c](https://e.org/z.md) [d](#here) [e](mailto:a@b.c)\n"
        '![img](pic.png "title") `[f](not/a/link.md)`\n```\n[g](fenced.md)\n```\n'
    )
    assert list(relative_links(text)) == ["sub/x.md", "y.md", "pic.png"]
    assert list(relative_links(text, with_anchor=True))[1] == ("y.md", "part")
    assert anchors("# Top\n## Docker compose: two nodes\n### The `emulated` profile\n```\n# not\n```\n") == {
        "top",
        "docker-compose-two-nodes",
        "the-emulated-profile",
    }


def test_readme_is_short():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/ (at most {README_MAX_LINES})"
