"""The ctypes mirror in vllm_hawk/npu/tt_kmd/ioctl.py matches kernel_driver/uapi/tenstorrent_ioctl.h.

gcc compiles a program against the header that prints sizeof/offsetof of every struct and
(nested) field and every request number; each must equal what ctypes computes. The
header's struct and field names are also parsed so neither side can hold a field the
other lacks.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_hawk.npu.tt_kmd import ioctl as abi

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "kernel_driver" / "uapi" / "tenstorrent_ioctl.h"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")


def _field_paths(struct: type[ctypes.Structure], prefix: str = "") -> list[tuple[str, int, int]]:
    """(C member path, offset, size) of every field, recursing into nested structs."""
    out = []
    for name, ctype in struct._fields_:
        desc = getattr(struct, name)
        path = prefix + abi.c_field_name(name)
        out.append((path, desc.offset, desc.size))
        if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            out += [(p, desc.offset + o, s) for p, o, s in _field_paths(ctype, path + ".")]
    return out


def _c_program() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{HEADER}"', "int main(void) {"]
    for cname, struct in abi.STRUCTS.items():
        lines.append(f'  printf("size {cname} %zu\\n", sizeof(struct {cname}));')
        for path, _, _ in _field_paths(struct):
            lines.append(
                f'  printf("field {cname} {path} %zu %zu\\n", offsetof(struct {cname}, {path}), '
                f"sizeof(((struct {cname} *)0)->{path}));"
            )
    for name in abi.IOCTL_NUMBERS:
        lines.append(f'  printf("ioctl {name} %lu\\n", (unsigned long){name});')
    lines.append('  printf("magic %d\\n", TENSTORRENT_IOCTL_MAGIC);')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, ...]]:
    tmp = tmp_path_factory.mktemp("abi")
    src, exe = tmp / "abi.c", tmp / "abi"
    src.write_text(_c_program())
    subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout: dict[str, tuple[int, ...]] = {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "field":
            layout[f"field {rest[0]} {rest[1]}"] = (int(rest[2]), int(rest[3]))
        else:
            layout[f"{kind} {' '.join(rest[:-1])}".strip()] = (int(rest[-1]),)
    return layout


@pytest.mark.parametrize("cname", list(abi.STRUCTS))
def test_struct_sizes_and_offsets_match(cname: str, c_layout: dict[str, tuple[int, ...]]) -> None:
    struct = abi.STRUCTS[cname]
    assert c_layout[f"size {cname}"] == (ctypes.sizeof(struct),)
    for path, offset, size in _field_paths(struct):
        assert c_layout[f"field {cname} {path}"] == (offset, size), path


def test_ioctl_numbers_match(c_layout: dict[str, tuple[int, ...]]) -> None:
    assert c_layout["magic"] == (abi.TENSTORRENT_IOCTL_MAGIC,) == (0xFA,)
    for name, number in abi.IOCTL_NUMBERS.items():
        assert c_layout[f"ioctl {name}"] == (number,), name
    # _IO(0xFA, n) carries neither size nor direction.
    assert abi.TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF == 0xFA10
    assert abi.TENSTORRENT_IOCTL_GET_DEVICE_INFO == 0xFA00


def _header_structs() -> dict[str, list[str]]:
    """struct name -> top-level member names, parsed from the header."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    structs = {}
    for m in re.finditer(r"struct\s+(\w+)\s*\{(.*?)\};", text, flags=re.S):
        members = []
        for decl in m.group(2).split(";"):
            decl = decl.strip()
            if decl:
                members.append(re.sub(r"\[.*\]", "", decl).split()[-1])
        structs[m.group(1)] = members
    return structs


def test_header_and_mirror_have_the_same_structs_and_fields() -> None:
    header = _header_structs()
    assert set(header) == set(abi.STRUCTS)
    for cname, members in header.items():
        assert members == [abi.c_field_name(n) for n, _ in abi.STRUCTS[cname]._fields_], cname


def test_header_records_the_tt_kmd_version_read() -> None:
    text = HEADER.read_text()
    assert "4af71921ac021e24859ae15d8438997a44dbbf58" in text
    assert "ttkmd-2.10.0" in text


PEERMEM_HEADER = ROOT / "kernel_driver" / "tt_peermem" / "tt_peermem_uapi.h"


@pytest.mark.skipif(not PEERMEM_HEADER.exists(), reason="tt_peermem uapi header not in the tree")
def test_tt_peermem_mirror_matches_its_uapi_header(tmp_path: Path) -> None:
    from vllm_hawk.npu.tt_kmd import registration as reg

    structs = {"tt_peermem_register": reg.TtPeermemRegister, "tt_peermem_unregister": reg.TtPeermemUnregister}
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{PEERMEM_HEADER}"', "int main(void) {"]
    for cname, struct in structs.items():
        lines.append(f'  printf("size {cname} %zu\\n", sizeof(struct {cname}));')
        for name, _ in struct._fields_:
            lines.append(f'  printf("field {cname} {name} %zu\\n", offsetof(struct {cname}, {name}));')
    for name in ("TT_PEERMEM_IOCTL_REGISTER", "TT_PEERMEM_IOCTL_UNREGISTER", "TT_PEERMEM_IOC_MAGIC"):
        lines.append(f'  printf("const {name} %lu\\n", (unsigned long){name});')
    lines.append('  printf("name %s\\n", TT_PEERMEM_DEVICE_NAME);')
    lines += ["  return 0;", "}"]
    src, exe = tmp_path / "pm.c", tmp_path / "pm"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True, capture_output=True, text=True
    )
    got = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    )
    for cname, struct in structs.items():
        assert int(got[f"size {cname}"]) == ctypes.sizeof(struct)
        assert {n for n, _ in struct._fields_} == set(_header_members(PEERMEM_HEADER, cname))
        for name, _ in struct._fields_:
            assert int(got[f"field {cname} {name}"]) == getattr(struct, name).offset, name
    assert int(got["const TT_PEERMEM_IOCTL_REGISTER"]) == reg.TT_PEERMEM_IOCTL_REGISTER
    assert int(got["const TT_PEERMEM_IOCTL_UNREGISTER"]) == reg.TT_PEERMEM_IOCTL_UNREGISTER
    assert int(got["const TT_PEERMEM_IOC_MAGIC"]) == reg.TT_PEERMEM_IOC_MAGIC
    assert "/dev/" + got["name"] == reg.TT_PEERMEM_DEVICE_PATH


def _header_members(header: Path, cname: str) -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    body = re.search(rf"struct\s+{cname}\s*\{{(.*?)\}};", text, flags=re.S)
    assert body, cname
    return [re.sub(r"\[.*\]", "", d.strip()).split()[-1] for d in body.group(1).split(";") if d.strip()]
