"""Where device profiles and model shapes are found: the YAML files shipped in this package.

Two kinds of file, each in its own folder of this package, read with
:mod:`importlib.resources` (so they work from a wheel, an editable install or a checkout):

``devices/<name>.yaml``  Tenstorrent DRAM organisation (:mod:`vllm_hawk.layout.device_profiles`)
``models/<name>.yaml``   a model's KV shapes (:mod:`vllm_hawk.layout.model_shapes`)

``HAWK_CONFIG_DIR`` names user folders (several separated by ``os.pathsep``), each laid
out the same way (``<dir>/devices/*.yaml``, ``<dir>/models/*.yaml``). They are searched
first, in order, so a user file adds a profile or replaces a shipped one of the same name.
A path to a YAML file is always accepted instead of a name.
"""

from __future__ import annotations

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from vllm_hawk import envs

ENV_CONFIG_DIR = "HAWK_CONFIG_DIR"
KINDS = ("devices", "models")


def user_dirs() -> list[Path]:
    """The folders named by ``HAWK_CONFIG_DIR``, in search order (empty when unset)."""
    return envs.config_dirs()


def builtin(kind: str) -> Traversable:
    """The package folder of shipped files of ``kind`` (``devices`` or ``models``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown profile kind {kind!r}; expected one of {KINDS}")
    return files(__name__) / kind


def search_path(kind: str) -> list[Traversable]:
    """Folders searched for ``kind``, first match wins: user folders, then the package."""
    return [d / kind for d in user_dirs()] + [builtin(kind)]


def _yaml_files(folder: Traversable) -> dict[str, Traversable]:
    if not folder.is_dir():
        return {}
    return {Path(f.name).stem: f for f in folder.iterdir() if f.is_file() and f.name.endswith((".yaml", ".yml"))}


def available(kind: str) -> list[str]:
    """Every name of ``kind`` found on the search path, sorted."""
    names: set[str] = set()
    for folder in search_path(kind):
        names.update(_yaml_files(folder))
    return sorted(names)


def is_name(name_or_path: str | os.PathLike) -> bool:
    """True for a bare name (``p150a``), False for something that looks like a file path."""
    s = os.fspath(name_or_path)
    return Path(s).suffix not in (".yaml", ".yml") and "/" not in s and os.sep not in s


def find(kind: str, name: str) -> Traversable:
    """The file of ``kind`` called ``name``; ValueError listing what exists when none is."""
    for folder in search_path(kind):
        hit = _yaml_files(folder).get(name)
        if hit is not None:
            return hit
    where = ", ".join(str(f) for f in search_path(kind))
    singular = {"devices": "device profile", "models": "model"}[kind]
    raise ValueError(f"unknown {singular} {name!r}; available in {where}: {available(kind)}")


def read(kind: str, name_or_path: str | os.PathLike) -> tuple[str, str]:
    """``(where, text)`` of a name looked up with :func:`find`, or of a YAML path as given."""
    if is_name(name_or_path):
        f = find(kind, os.fspath(name_or_path))
        return str(f), f.read_text(encoding="utf-8")
    path = Path(name_or_path)
    return str(path), path.read_text(encoding="utf-8")
