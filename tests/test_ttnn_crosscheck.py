"""Byte-for-byte cross-check of our tile and block-float formats against ttnn 0.81.1.

ttnn only ships CPython 3.10/3.12 wheels, so it lives in a side environment built by
``scripts/ensure_env.sh ttnn``. One session fixture builds (or reuses) it, writes the test
cases below to a temporary directory, and runs ``tests/ttnn/ttnn_dump.py`` there once; that
script tilizes every case with ttnn's host tilizer and saves the raw host buffer and what
ttnn decodes from it. The tests then compare, in this (3.11) environment:

* ``tilize_pack(case, dtype)``             vs ttnn's host buffer bytes,
* ``unpack_untilize(ttnn bytes, dtype)``    vs ttnn's own decode (``Tensor.to_numpy``),
* ``unpack_untilize`` of every (shared exponent, code) pair vs ttnn's decode of the same
  bytes loaded back with ``ttnn.load_tensor``.

Without the side environment the tests skip locally, but fail under CI (env ``CI`` set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.ttnn

REPO = Path(__file__).resolve().parents[1]
DUMPER = REPO / "tests" / "ttnn" / "ttnn_dump.py"
CLUSTER_DESC = REPO / "tests" / "ttnn" / "mock_cluster_blackhole_p150.yaml"
TTNN_VERSION = "0.81.1"

DTYPES = ("bfloat16", "float32", "bfloat8_b", "bfloat4_b")
TILE_NBYTES = {"bfloat16": 2048, "float32": 4096, "bfloat8_b": 1088, "bfloat4_b": 576}
MANTISSA_BITS = {"bfloat8_b": 7, "bfloat4_b": 3}
SEED = 20240611


# --------------------------------------------------------------------------- cases


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _face_rows_to_2d(rows: np.ndarray) -> np.ndarray:
    """[R, 16] face rows -> [R/2, 32] (each tensor row holds two face rows)."""
    rows = np.asarray(rows)
    if len(rows) % 2:
        rows = np.concatenate([rows, np.zeros((1, 16), rows.dtype)])
    return rows.reshape(-1, 32)


def _bfp_tie_rows(rng: np.random.Generator, mbits: int) -> np.ndarray:
    """Face rows whose non-leading values sit exactly on a rounding tie after alignment to
    the row's shared exponent, for ``mbits`` magnitude bits.

    Each row: element 0 fixes the shared exponent (raw 127 + k); the other 15 values have
    exponent (shared - d) and a 24-bit mantissa that, shifted right by d, ends in exactly
    "guard bit, then 1 followed by zeros" (a tie), with the guard bit 0 or 1 (round down /
    up to even) and, when ``sticky``, nonzero bits that the alignment shift drops (ttnn
    drops them before rounding, so these still round as ties). d runs until the hidden bit
    itself is the tie bit (the value is exactly half the smallest code).
    """
    shift = 24 - mbits  # bits rounded away after alignment
    rows = []
    for k in (0, -3, 5):
        for d in range(0, 24 - shift + 1):
            h = 23 - d  # hidden bit position after alignment
            row = np.zeros(16, np.uint32)
            row[0] = ((127 + k) << 23) | int(rng.integers(0, 1 << 23))
            for j in range(1, 16):
                guard, sticky, sign = j & 1, (j >> 1) & 1, (j >> 2) & 1
                m_shifted = 1 << h
                if h > shift:
                    mid = int(rng.integers(0, 1 << 23)) & ((1 << h) - 1) & ~((1 << (shift + 1)) - 1)
                    m_shifted |= mid | (guard << shift)
                if h >= shift:
                    m_shifted |= 1 << (shift - 1)
                m = m_shifted << d
                if sticky and d:
                    m |= int(rng.integers(1, 1 << d))
                assert m >> 23 == 1
                row[j] = (sign << 31) | ((127 + k - d) << 23) | (m & 0x7FFFFF)
            rows.append(row)
    # Rounding carries out of the magnitude: must saturate (1.11..1 and 1.11..1 + tie).
    sat = np.zeros(16, np.uint32)
    sat[:] = 0x3FFFFFFF  # 1.99999988 -> rounds up past the top code
    sat[1] = 0x3FFF0000 | (1 << (shift - 1))
    sat[2] = 0xBFFFFFFF
    sat[3] = 0x3F800000 | ((1 << 23) - (1 << (shift - 1)))  # exactly on the top tie
    rows.append(sat)
    return _f32(_face_rows_to_2d(np.stack(rows)))


def _bf16_ties() -> np.ndarray:
    base = []
    for hi in (0x3F80, 0x3F81, 0x4049, 0x4048, 0xC2F6, 0xC2F7, 0x0080, 0x0081, 0x7F7E, 0x7F7F):
        for lo in (0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF):
            base.append((hi << 16) | lo)
    base = np.array(base, np.uint32)
    out = np.zeros(64 * 32, np.uint32)
    out[: len(base)] = base
    out[len(base) : 2 * len(base)] = base ^ 0x80000000
    return _f32(out.reshape(64, 32))


def _zeros_signed() -> np.ndarray:
    z = np.zeros((64, 64), np.float32)
    z[0, :] = -0.0  # whole tensor row of -0.0 (four face rows)
    z[1, :16] = -0.0
    z[1, 16:32] = 1.5
    z[2, ::2] = -0.0
    z[2, 1::2] = -(2.0**-20)
    z[3, 5] = -0.0
    z[3, 6] = 3.0
    z[32:, 32:] = -0.0  # one whole tile of -0.0
    z[4, :] = np.float32(-1e-30)
    return z


def _subnormals(rng: np.random.Generator) -> np.ndarray:
    s = np.zeros((64, 32), np.uint32)
    s[0] = rng.integers(1, 1 << 23, 32)  # positive subnormals only
    s[1] = s[0] | 0x80000000  # negative subnormals only
    s[2, :16] = rng.integers(1, 1 << 23, 16)
    s[2, 16:] = 0x00800000  # min normal beside subnormals
    s[3] = s[0]
    s[3, 7] = 0x3F800000  # one normal among subnormals
    s[4] = 0x00800000 + rng.integers(0, 1 << 23, 32)  # exponent 1 (smallest normals)
    s[5] = ((rng.integers(1, 9, 32)) << 23) | rng.integers(0, 1 << 23, 32)  # tiny exps 1..8
    s[6, :16] = (8 << 23) | rng.integers(0, 1 << 23, 16)  # shared exp 8, values down to exp 1
    s[6, 16:] = ((rng.integers(1, 9, 16)) << 23) | rng.integers(0, 1 << 23, 16)
    s[7] = 0x00000001
    s[8] = 0x807FFFFF
    s[9] = np.where(rng.random(32) < 0.5, s[0], 0x80000000 | (rng.integers(1, 4, 32) << 23))
    s[10:] = (rng.integers(1, 6, (54, 32)) << 23) | rng.integers(0, 1 << 23, (54, 32))
    s[10:] |= (rng.random((54, 32)) < 0.5).astype(np.uint32) << 31
    return _f32(s)


def _saturate_large() -> np.ndarray:
    vals = _f32(
        [
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F7F8000,
            0x7F7F7FFF,
            0x7F000000,
            0x3FFFFFFF,
            0xBFFFFFFF,
            0x3FFF8000,
            0x477FE000,
            0x47800000,
            0x3F7FFFFF,
            0x4B7FFFFF,
            0x7E800000,
            0x7F7F0001,
            0x3FFFFFFE,
            0x3FF80000,
        ]
    )
    out = np.tile(vals, (32, 2)).copy()
    out[16:] = np.roll(out[16:], 5, axis=1)
    return out


def _all_equal() -> np.ndarray:
    vals = np.array(
        [
            1.0,
            -3.5,
            0.1,
            1e-3,
            65504.0,
            2.0**-120,
            -7.25,
            1.0 / 3.0,
            2.0**100,
            -(2.0**-126),
            0.0,
            -0.0,
            123456.789,
            0.5,
            -1.0,
            1e-8,
        ],
        np.float32,
    )
    return np.repeat(vals, 64).reshape(32, 32)


def _wide_exponents(rng: np.random.Generator) -> np.ndarray:
    shape = (64, 96)
    mag = rng.uniform(1.0, 2.0, shape) * np.exp2(rng.integers(-60, 61, shape).astype(np.float64))
    x = (np.where(rng.random(shape) < 0.5, -1.0, 1.0) * mag).astype(np.float32)
    # Exact powers of two and alignment shifts of 22..40 within one face row.
    x[0, :16] = np.exp2(-np.arange(16.0) * 3).astype(np.float32)
    x[1, :16] = np.float32(2.0**100)
    x[1, 1:16] = np.exp2(100.0 - np.arange(20, 35)).astype(np.float32)
    x[2, :16] = np.float32(1.0)
    x[2, 1:16] = np.exp2(-np.arange(22.0, 37.0)).astype(np.float32) * 1.75
    return x


def _inf_nan() -> np.ndarray:
    special = _f32(
        [
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0xFFC00000,
            0x7F800001,
            0x7FFFFFFF,
            0x7FC00001,
            0xFF80FFFF,
            0x3F800000,
            0x40000000,
            0xBF800000,
            0x00000000,
            0x80000000,
            0x3F808000,
            0x00000001,
            0x7F7FFFFF,
        ]
    )
    out = np.zeros((32, 64), np.float32)
    out[:, :16] = special  # each face row has every special
    out[:, 16:32] = np.roll(special, 3)
    out[::2, 32:48] = 1.25  # rows without specials stay finite
    out[1::2, 32:48] = np.where(np.arange(16) == 9, np.float32(np.inf), np.float32(0.75))
    out[:, 48:] = np.where(np.arange(16) == 4, _f32(0x7FC00000), np.float32(-3.0))
    return out


def make_cases(seed: int = SEED) -> dict[str, np.ndarray]:
    """All cross-check inputs, float32, deterministic for ``seed``."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    kv = normal(4, 2, 64, 128) * np.float32(0.5)
    kv[:, :, :, 7] *= np.float32(300.0)  # outlier channels, as in real K caches
    kv[:, 1, :, 64:] *= np.float32(1e-3)
    bulk = normal(8, 96, 64) * np.exp2(rng.integers(-20, 21, (8, 96, 1))).astype(np.float32)
    return {
        "lead_dims_2x3x64x96": normal(2, 3, 64, 96),
        "pad_3x50x70": normal(3, 50, 70) * np.float32(3.0),
        "pad_5x17": normal(5, 17),
        "pad_1x33x31": normal(1, 33, 31),
        "pad_2x1x40x65": normal(2, 1, 40, 65),
        "kv_4x2x64x128": kv,
        "bulk_rowscaled_8x96x64": bulk,
        "wide_exponents": _wide_exponents(rng),
        "ties_bfloat16": _bf16_ties(),
        "ties_bfloat8_b": _bfp_tie_rows(rng, MANTISSA_BITS["bfloat8_b"]),
        "ties_bfloat4_b": _bfp_tie_rows(rng, MANTISSA_BITS["bfloat4_b"]),
        "zeros_signed": _zeros_signed(),
        "subnormals": _subnormals(rng),
        "saturate_large": _saturate_large(),
        "all_equal_rows": _all_equal(),
        "inf_nan": _inf_nan(),
    }


def _decode_sweep(dtype: str) -> tuple[np.ndarray, tuple[int, int]]:
    """Tiles holding every (shared exponent, code) pair of a block-float format."""
    mbits = MANTISSA_BITS[dtype]
    ncodes = 1 << (mbits + 1)
    rows_per_exp = ncodes // 16 if ncodes >= 16 else 1
    nrows = 256 * rows_per_exp
    ntiles = nrows // 64
    exps = np.repeat(np.arange(256), rows_per_exp).astype(np.uint8)
    codes = np.tile(np.arange(ncodes), 256).astype(np.uint8).reshape(ntiles, 1024)
    if mbits == 3:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    buf = np.concatenate([exps.reshape(ntiles, 64), codes], axis=1)
    assert buf.shape[1] == TILE_NBYTES[dtype]
    return np.ascontiguousarray(buf), (ntiles * 32, 32)


CASES = make_cases()


# --------------------------------------------------------------------------- fixtures


def _fail_or_skip(msg: str):
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def ttnn_python() -> str:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "ensure_env.sh"), "ttnn"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _fail_or_skip(f"scripts/ensure_env.sh ttnn could not run: {exc}")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        _fail_or_skip(
            f"scripts/ensure_env.sh ttnn failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    print(f"[ttnn] side env ready in {time.monotonic() - t0:.1f}s: {lines[-1]}", file=sys.stderr)
    return lines[-1]


@pytest.fixture(scope="session")
def ttnn_dump(ttnn_python, tmp_path_factory) -> Path:
    """Write every case, run ttnn_dump.py once, return the directory with its outputs."""
    d = tmp_path_factory.mktemp("ttnn_cases")
    entries = []
    for i, (name, arr) in enumerate(CASES.items()):
        np.save(d / f"case_{i}.npy", arr)
        entries.append({"name": name, "file": f"case_{i}.npy", "dtypes": list(DTYPES)})
    raws = []
    for dtype in MANTISSA_BITS:
        buf, shape = _decode_sweep(dtype)
        buf.tofile(d / f"sweep_{dtype}.bin")
        raws.append({"file": f"sweep_{dtype}.bin", "dtype": dtype, "shape": list(shape)})
    (d / "cases.json").write_text(json.dumps({"cases": entries, "raw": raws}, indent=1))
    env = dict(os.environ, TT_METAL_MOCK_CLUSTER_DESC_PATH=str(CLUSTER_DESC))
    t0 = time.monotonic()
    proc = subprocess.run([ttnn_python, str(DUMPER), str(d)], capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        pytest.fail(
            f"tests/ttnn/ttnn_dump.py failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    print(f"[ttnn] ttnn_dump.py ran in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return d


# --------------------------------------------------------------------------- reporting


def _case_file(name: str) -> str:
    return f"case_{list(CASES).index(name)}"


def _tile_coords(shape, tile: int, elem: int):
    """Tensor index of element ``elem`` (face order) of tile ``tile``; None in padding."""
    *lead, h, w = shape
    th, tw = -(-h // 32), -(-w // 32)
    lead_i, rest = divmod(tile, th * tw)
    tr, tc = divmod(rest, tw)
    f, k = divmod(elem, 256)
    r = tr * 32 + (f // 2) * 16 + k // 16
    c = tc * 32 + (f % 2) * 16 + k % 16
    idx = tuple(int(v) for v in np.unravel_index(lead_i, lead)) if lead else ()
    return idx + (r, c) if r < h and c < w else None


def _face_row_values(x: np.ndarray, tile: int, face_row: int) -> str:
    """The 16 input values (hex float32) of one face row of one tile."""
    f, r = divmod(face_row, 16)
    vals = []
    for j in range(16):
        at = _tile_coords(x.shape, tile, f * 256 + r * 16 + j)
        vals.append("pad" if at is None else f"{int(x[at].view(np.uint32)):08x}")
    return " ".join(vals)


def _describe_byte_mismatch(x: np.ndarray, dtype: str, ours: np.ndarray, ref: np.ndarray) -> str:
    diff = np.argwhere(ours != ref)
    t, b = (int(v) for v in diff[0])
    msg = [
        f"{len(diff)} differing bytes in {len(np.unique(diff[:, 0]))} tiles of {ref.shape[0]}; "
        f"first at tile {t} byte {b}: ours 0x{ours[t, b]:02x}, ttnn 0x{ref[t, b]:02x}"
    ]
    if dtype in MANTISSA_BITS:
        if b < 64:
            msg.append(f"  shared exponent of face row {b} (face {b // 16}, row {b % 16})")
            face_row = b
        else:
            per_byte = 1 if dtype == "bfloat8_b" else 2
            elem = (b - 64) * per_byte
            face_row = elem // 16
            msg.append(
                f"  element(s) {elem}..{elem + per_byte - 1} of the tile, at tensor index "
                f"{_tile_coords(x.shape, t, elem)}; shared exp ours {ours[t, face_row]} "
                f"ttnn {ref[t, face_row]}"
            )
        row_nbytes = 16 if dtype == "bfloat8_b" else 8
        row_bytes = slice(64 + face_row * row_nbytes, 64 + (face_row + 1) * row_nbytes)
        msg.append(f"  input face row: {_face_row_values(x, t, face_row)}")
        msg.append(f"  ours face row bytes: {ours[t, row_bytes].tobytes().hex(' ')}")
        msg.append(f"  ttnn face row bytes: {ref[t, row_bytes].tobytes().hex(' ')}")
    else:
        width = 2 if dtype == "bfloat16" else 4
        elem = b // width
        at = _tile_coords(x.shape, t, elem)
        word = slice(elem * width, (elem + 1) * width)
        inp = "padding" if at is None else f"{int(x[at].view(np.uint32)):08x}"
        msg.append(
            f"  element {elem} at tensor index {at}: input {inp}, ours "
            f"{ours[t, word][::-1].tobytes().hex()}, ttnn {ref[t, word][::-1].tobytes().hex()}"
        )
    return "\n".join(msg)


def _describe_value_mismatch(ours: np.ndarray, ref: np.ndarray, inp: np.ndarray | None = None) -> str:
    bad = np.argwhere(ours.view(np.uint32) != ref.view(np.uint32))
    at = tuple(int(v) for v in bad[0])
    msg = (
        f"{len(bad)} of {ref.size} values differ; first at {at}: ours {ours[at]!r} "
        f"(0x{int(ours.view(np.uint32)[at]):08x}), ttnn {ref[at]!r} (0x{int(ref.view(np.uint32)[at]):08x})"
    )
    if inp is not None:
        msg += f", input 0x{int(inp.view(np.uint32)[at]):08x}"
    return msg


# --------------------------------------------------------------------------- tests


def test_side_env_is_ttnn_0_81_1(ttnn_dump):
    manifest = json.loads((ttnn_dump / "ttnn_manifest.json").read_text())
    assert manifest["ttnn_version"] == TTNN_VERSION


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_tilize_pack_matches_ttnn(ttnn_dump, case, dtype):
    from vllm_hawk.layout.formats import tilize_pack

    x = CASES[case]
    ref = np.fromfile(ttnn_dump / f"{_case_file(case)}.{dtype}.bin", dtype=np.uint8)
    ref = ref.reshape(-1, TILE_NBYTES[dtype])
    ours = tilize_pack(torch.from_numpy(x.copy()), dtype)
    assert ours.dtype == torch.uint8
    ours = ours.numpy()
    assert ours.shape == ref.shape, f"ours {ours.shape} vs ttnn {ref.shape}"
    if not np.array_equal(ours, ref):
        pytest.fail(f"{case} {dtype}: " + _describe_byte_mismatch(x, dtype, ours, ref), pytrace=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_unpack_untilize_matches_ttnn_decode(ttnn_dump, case, dtype):
    from vllm_hawk.layout.formats import unpack_untilize

    x = CASES[case]
    stem = f"{_case_file(case)}.{dtype}"
    buf = np.fromfile(ttnn_dump / f"{stem}.bin", dtype=np.uint8).reshape(-1, TILE_NBYTES[dtype])
    ref = np.load(ttnn_dump / f"{stem}.decoded.npy")
    ours = unpack_untilize(torch.from_numpy(buf), dtype, x.shape)
    assert ours.dtype == torch.float32
    ours = np.ascontiguousarray(ours.numpy())
    assert ours.shape == ref.shape
    if not np.array_equal(ours.view(np.uint32), ref.view(np.uint32)):
        pytest.fail(f"{case} {dtype}: " + _describe_value_mismatch(ours, ref, x), pytrace=False)


@pytest.mark.parametrize("dtype", list(MANTISSA_BITS))
def test_unpack_every_code_matches_ttnn(ttnn_dump, dtype):
    """All 256 shared exponents x all codes, decoded by ttnn from raw bytes."""
    from vllm_hawk.layout.formats import unpack_untilize

    buf, shape = _decode_sweep(dtype)
    ref = np.load(ttnn_dump / f"sweep_{dtype}.decoded.npy")
    ours = np.ascontiguousarray(unpack_untilize(torch.from_numpy(buf), dtype, shape).numpy())
    if not np.array_equal(ours.view(np.uint32), ref.view(np.uint32)):
        bad = np.argwhere(ours.view(np.uint32) != ref.view(np.uint32))
        r, c = (int(v) for v in bad[0])
        # Row r, col c of the [N, 32] sweep -> tile, face, face row -> shared exp and code.
        t, (rr, cc) = r // 32, (r % 32, c)
        f = (rr // 16) * 2 + cc // 16
        elem = f * 256 + (rr % 16) * 16 + cc % 16
        exp = int(buf[t, elem // 16])
        body = buf[t, 64:]
        code = int(body[elem]) if dtype == "bfloat8_b" else (int(body[elem // 2]) >> (4 * (elem % 2))) & 0xF
        pytest.fail(
            f"{dtype}: shared exp {exp} code 0x{code:02x}: " + _describe_value_mismatch(ours, ref),
            pytrace=False,
        )
