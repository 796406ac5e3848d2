"""``wsum64`` (vllm_hawk.integrity): the definition against Python integers, every kernel
(numba, torch operations, Triton under its interpreter) equal to it, composition from
pieces in any order, what it detects, the format seed, and the decode's composition over
READ entries (pieces spanning segments, unaligned pieces refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm_fixtures import triton_dir

from vllm_hawk.integrity import check_segments, landed_sums, of_array, seed, seeded, wire_format
from vllm_hawk.integrity import checksum as cs
from vllm_hawk.protocol import Segment, SegmentSum

ROOT = Path(__file__).resolve().parents[2]


def reference(data: bytes) -> cs.Sum:
    """The definition, in Python integers: little-endian words, zero-padded."""
    data = data + bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
    return cs.Sum(sum(words) % 2**64, sum((i + 1) * w for i, w in enumerate(words)) % 2**64)


@given(st.binary(max_size=3000), st.integers(0, 3))
def test_every_host_path_is_the_definition(data, skip):
    a = np.frombuffer(data, dtype=np.uint8)[skip:]  # unaligned starts too
    want = reference(a.tobytes())
    assert of_array(a) == want
    assert cs._torch_sum(torch.from_numpy(a.copy())) == want


def test_chunked_partials_equal_the_definition_across_chunk_boundaries():
    rng = np.random.default_rng(3)
    for n in (cs.CHUNK_WORDS * 4, cs.CHUNK_WORDS * 4 + 5, 3 * cs.CHUNK_WORDS * 4 - 2):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert cs._torch_sum(torch.from_numpy(a)) == of_array(a) == reference(a.tobytes())


def test_all_ones_words_wrap_modulo_2_64():
    a = np.full(4 * 70000, 0xFF, dtype=np.uint8)
    assert of_array(a) == reference(a.tobytes())


@given(st.binary(min_size=8, max_size=2000), st.data())
def test_a_segment_is_the_sum_of_its_pieces_in_any_order(data, draw):
    data = data[: len(data) // 4 * 4]
    cuts = sorted(draw.draw(st.sets(st.integers(1, len(data) // 4 - 1), max_size=6)))
    bounds = [0, *[4 * c for c in cuts], len(data)]
    pieces = [(lo, data[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    total = cs.ZERO
    for lo, piece in reversed(pieces):
        total = total.plus(of_array(np.frombuffer(piece, dtype=np.uint8)), lo // 4)
    assert total == reference(data)


def test_every_single_bit_flip_and_every_word_swap_is_detected():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, 256, dtype=np.uint8)
    base = of_array(a)
    for bit in range(a.size * 8):
        b = a.copy()
        b[bit // 8] ^= 1 << (bit % 8)
        assert of_array(b) != base, bit
    w = a.view(np.uint32)
    for i in range(w.size):
        for j in range(i + 1, w.size):
            if w[i] != w[j]:
                x = w.copy()
                x[i], x[j] = x[j], x[i]
                assert of_array(x.view(np.uint8)) != base, (i, j)


def test_the_seed_separates_formats():
    fmts = [wire_format(k, d) for k in ("tt-tiles", "vllm-blocks") for d in ("bfloat16", "bfloat8_b", "float16")]
    assert len({seed(f) for f in fmts}) == len(fmts)
    assert wire_format("vllm-blocks", torch.bfloat16) == "vllm-blocks/bfloat16"


def _segments_and_sums(blob: bytes, sizes, fmt):
    segs, sums, off = [], [], 64  # offsets from the export base
    for i, n in enumerate(sizes):
        segs.append(Segment(i, off, n))
        sums.append(SegmentSum(*seeded(reference(blob[off : off + n]), fmt)))
        off += n
    return segs, sums


def test_the_decode_composes_entries_that_span_segments_and_land_scattered():
    rng = np.random.default_rng(9)
    remote = rng.integers(0, 256, 64 + 3 * 4096, dtype=np.uint8)
    fmt = wire_format("tt-tiles", "bfloat8_b")
    segs, sums = _segments_and_sums(remote.tobytes(), [4096, 4096, 4096], fmt)
    base = 1 << 40  # the prefill's export base as the decode knows it
    # three READs: [0, 6144) across the first boundary, then the rest in two pieces, landed
    # at scattered local places (a local buffer, written in another order)
    local = np.zeros(3 * 4096 + 4096, dtype=np.uint8)
    plan = [(0, 6144, 8192), (6144, 2048, 0), (8192, 4096, 2048 + 64)]
    entries = []
    for rem_off, n, loc_off in plan:
        local[loc_off : loc_off + n] = remote[64 + rem_off : 64 + rem_off + n]
        entries.append((local.ctypes.data + loc_off, base + 64 + rem_off, n))
    assert check_segments(segs, sums, fmt, base, entries) == []
    # read(i): the bytes come from elsewhere (a device read); one flipped bit is named
    local[8192 + 5000] ^= 4
    bad = check_segments(segs, sums, fmt, base, entries)
    assert [m.index for m in bad] == [1] and bad[0].bank == 1
    # another format: every segment fails
    assert len(check_segments(segs, sums, wire_format("tt-tiles", "bfloat16"), base, entries)) == 3
    # a segment that did not land whole is named with its byte count
    short = check_segments(segs, sums, fmt, base, entries[:2])
    assert short[-1].landed_nbytes == 0 and "0 of its 4096 bytes landed" in short[-1].describe()


def test_a_piece_off_a_word_boundary_is_refused_not_guessed():
    local = np.zeros(64, dtype=np.uint8)
    segs = [Segment(0, 0, 64)]
    with pytest.raises(ValueError, match="not on a 4-byte word"):
        landed_sums(segs, 0, [(local.ctypes.data, 2, 8)])
    with pytest.raises(ValueError, match="inside no segment"):
        landed_sums(segs, 0, [(local.ctypes.data, 64, 8)])


def test_the_triton_kernel_under_its_interpreter_equals_the_definition():
    d = triton_dir()
    code = (
        "import json, numpy as np, torch\n"
        "from vllm_hawk.integrity import checksum as cs, triton_kernel as tk\n"
        "rng = np.random.default_rng(2)\n"
        "arrs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4, 7, 4096 * 4, 4096 * 8 + 5, 50001)]\n"
        "xs = [torch.from_numpy(a) for a in arrs] + [torch.from_numpy(arrs[-1])[1:]]\n"
        "got = tk.words_sums(xs)\n"
        "want = [cs.of_array(a) for a in arrs] + [cs.of_array(arrs[-1][1:])]\n"
        "print(json.dumps({'equal': got == want, 'n': len(got)}))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([d, str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"equal": True, "n": 7}


def test_an_unknown_checksum_is_refused_naming_both_and_a_short_list_is_bad_input():
    from vllm_hawk.kvflow.ledger import check_checksum
    from vllm_hawk.protocol import KVReady, KVRequest, LayoutDesc, ProtocolError, decode, encode

    d = LayoutDesc(
        name="x",
        dtype="bfloat16",
        block_size=32,
        num_layers=1,
        num_kv_heads=1,
        head_dim=32,
        num_banks=1,
        tile_nbytes=2048,
        page_nbytes=2048,
    )
    msg = KVRequest(req_id="r", dst_layout=d, num_tokens=32, dst_block_ids=[1], checksum="crc32c")
    err = check_checksum(msg)
    assert "'crc32c' asked for" in err and "'wsum64'" in err
    assert (
        check_checksum(msgspec.structs.replace(msg, checksum=""))
        == ""
        == check_checksum(msgspec.structs.replace(msg, checksum="wsum64"))
    )
    bad = KVReady(
        req_id="r",
        ring_offset=0,
        total_nbytes=8,
        segments=[Segment(0, 0, 4), Segment(1, 4, 4)],
        checksums=[SegmentSum(1, 2)],
    )
    with pytest.raises(ProtocolError, match="1 checksums for 2 segments"):
        decode(encode(bad))
