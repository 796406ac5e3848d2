"""The pair and field tables of ``docs/configuration.md``, rendered from
:data:`~vllm_hawk.connector.config.PAIRS` and :class:`HawkConfig`'s field declarations
(:func:`vllm_hawk.connector.config.setting`).

``python -m vllm_hawk.connector.config_doc`` prints the tables; ``--write [PATH]``
(``make config-doc``) replaces the part of ``docs/configuration.md`` between
:data:`BEGIN` and :data:`END` with it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import MISSING
from pathlib import Path

from vllm_hawk.connector.config import FIELDS, PAIRS, TENSTORRENT

BEGIN = "<!-- fields: generated from vllm_hawk/connector/config.py by `make config-doc`; do not edit here -->"
END = "<!-- end of fields -->"
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _default(f) -> str:
    """A field's default as the table shows it: its ``unset`` expression, else its value."""
    if f.metadata["unset"]:
        return f"`{f.metadata['unset']}`"
    value = f.default
    if value is MISSING or value is None:
        return "`None`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value >> 20} MiB`"
    return f"`{value}`"


def _markdown(doc: str) -> str:
    """reST inline literals (````x````) as Markdown ones."""
    return re.sub(r"``(.+?)``", r"`\1`", doc)


def _implied(pair: str, name: str) -> str:
    allowed = PAIRS[pair].get(name, ())
    if allowed is TENSTORRENT:
        return "a Tenstorrent profile, given"
    if not allowed:
        return "the decode's (`direct`, `staged`); none on the prefill"
    return " or ".join(f"`{v}`" for v in allowed)


def render() -> str:
    """What each pair sets, then one row per field in declaration order."""
    strategy = ("transport", "mode", "device_profile", "layout_fix")
    rows = ["| `pair` | " + " | ".join(f"`{n}`" for n in strategy) + " |", "|---" * (1 + len(strategy)) + "|"]
    rows += [f"| `{p}` | " + " | ".join(_implied(p, n) for n in strategy) + " |" for p in PAIRS]
    rows += ["", "| field | default | limits | read by | meaning |", "|---|---|---|---|---|"]
    for name, f in FIELDS.items():
        m = f.metadata
        rows.append(f"| `{name}` | {_default(f)} | {m['limits']} | {m['side']} | {_markdown(m['doc'])} |")
    return "\n".join(rows) + "\n"


def splice(text: str) -> str:
    """``text`` (the page) with the part between the markers replaced by :func:`render`."""
    head, sep, rest = text.partition(BEGIN + "\n")
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the page lacks the markers {BEGIN!r} ... {END!r}")
    return head + sep + render() + sep2 + tail


def main(argv: list[str]) -> int:
    if not argv:
        sys.stdout.write(render())
        return 0
    if argv[0] != "--write" or len(argv) > 2:
        sys.stderr.write("usage: python -m vllm_hawk.connector.config_doc [--write [PATH]]\n")
        return 2
    path = Path(argv[1]) if len(argv) == 2 else DOC_PATH
    path.write_text(splice(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
