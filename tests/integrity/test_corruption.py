"""Corruption on purpose, on every pair it applies to (GG-Direct, GG-Host, GN-Host, GN-HAWK
staged, direct and by layer groups), over real transports (Mooncake TCP, host-staged):

* a bit flipped in flight (after the READ, in the landed bytes);
* a prefill that frees and reuses the memory a KVReady names before the READ (another
  request's bytes written into the ring range or the block served in place);
* a dtype mismatch between what the decode asked for and what it got.

In every case the pull fails (the connector turns that into vLLM's load failure:
recompute or fail, ``tests/e2e/test_integrity.py``), names the request, segment and bank,
lands nothing in a destination that staged landings protect, frees what it took, and
Releases the prefill's request; the next request of the same pair verifies and lands."""

from __future__ import annotations

import msgspec
import pytest
import torch
from integrity_helpers import DST_BLOCKS, NUM_TOKENS, PAIRS, SRC_BLOCKS, pair

from vllm_hawk.kvflow import IntegrityError, PeerFailed

#: pairs whose READs land in receive memory first: a failed check leaves the destination untouched
STAGED_LANDINGS = ("gg-host", "gn-host", "gn-hawk-staged")


def _pull_fails(p, req_id: str, error=IntegrityError) -> PeerFailed:
    before = p.landed()
    p.pre.add_request(req_id, SRC_BLOCKS, NUM_TOKENS)
    with pytest.raises(error) as ei:
        p.fetch(req_id)
    if p.name in STAGED_LANDINGS:
        assert p.landed() == before, "a failed check must not reach the destination blocks"
    assert p.receive_idle(), "a failed pull must free its receive memory"
    return ei.value


def _recovers(p, req_id: str = "next") -> None:
    """The pair still works: a clean request verifies and lands."""
    p.pre.add_request(req_id, SRC_BLOCKS, NUM_TOKENS)
    res = p.fetch(req_id)
    assert res.extra["check_s"] >= 0
    assert (req_id, True) in p.finished


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_clean_pull_is_checked_and_lands(name):
    with pair(name) as p:
        _recovers(p, "clean")
        assert p.landed() != bytes(len(p.landed()))


@pytest.mark.parametrize("fault", ["flip", "reuse"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_a_corrupted_pull_fails_names_the_segment_and_is_never_landed(name, fault):
    with pair(name, fault) as p:
        e = _pull_fails(p, "bad")
        assert p.transport.fired, "the fault must have fired"
        text = str(e)
        assert "request bad" in text and "failed the integrity check" in text, text
        m = e.mismatches[0]
        assert f"segment {m.index} (bank {m.bank}" in text and m.got != m.want
        assert ("bad", False) in p.finished, "the prefill must hear the failed Release"
        _recovers(p)


@pytest.mark.parametrize("name", ["gg-direct", "gg-host", "gn-host"])
def test_bytes_of_another_dtype_of_the_same_size_never_verify(name):
    """The prefill's cache holds float16 while its layout claims bfloat16, what the decode
    asks for: the sizes agree, only the checksum's format seed tells them apart."""

    def lying(src):
        src.layout = msgspec.structs.replace(src.layout, dtype="bfloat16")
        return src

    with pair(name, cache_dtype=torch.float16, source=lying) as p:
        e = _pull_fails(p, "fp16")
        assert "format vllm-blocks/bfloat16" in str(e) and len(e.mismatches) == len(e.mismatches[:])
        assert ("fp16", False) in p.finished


@pytest.mark.parametrize("name", ["gn-hawk-staged", "gn-hawk-direct"])
def test_tiles_of_another_dtype_are_refused_before_any_read(name):
    """The decode asks for bfloat8_b tiles; a prefill that transforms into bfloat16 anyway
    announces segments of another size, refused against the decode's plan."""

    def wrong_tiles(src):
        prepare = src.prepare

        def bf16(msg, *args):
            d = msgspec.structs.replace(msg.dst_layout, dtype="bfloat16", tile_nbytes=2048, page_nbytes=2048)
            return prepare(msgspec.structs.replace(msg, dst_layout=d), *args)

        src.prepare = bf16
        return src

    with pair(name, tile_dtype="bfloat8_b", source=wrong_tiles) as p:
        e = _pull_fails(p, "bf16", PeerFailed)
        assert "do not match the transfer plan" in str(e)
        assert ("bf16", False) in p.finished


def test_with_integrity_off_a_flipped_bit_lands_silently():
    """What ``integrity: false`` gives up (the warning next to the field): the same flip
    lands and the pull succeeds."""
    with pair("gn-hawk-staged", "flip", integrity=False) as p:
        p.pre.add_request("r", SRC_BLOCKS, NUM_TOKENS)
        res = p.fetch("r")
        assert p.transport.fired and "check_s" not in res.extra
        assert len(DST_BLOCKS) == 4
