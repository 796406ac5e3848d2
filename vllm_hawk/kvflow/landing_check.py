"""D7: a landing's bytes checked against the prefill's checksums (:mod:`vllm_hawk.integrity`).

The decode asks for checksums in its KVRequest; once a READ batch has landed (and, where
the bytes reach the KV pages only after the sink's copy-in, once that ran) it composes
each segment's checksum from the pieces where they landed, with the format it asked for,
and compares. A KVReady without the checksums, a segment that did not land whole, or one
whose checksum differs fails the fetch with :class:`~vllm_hawk.kvflow.errors.IntegrityError`
naming the request, chip, segment and bank: the KV is never used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hawk.integrity import check_segments
from vllm_hawk.kvflow.errors import IntegrityError
from vllm_hawk.protocol import KVReady

#: mismatching segments named in the error (the count names them all)
NAMED = 4


@dataclass(frozen=True)
class Landed:
    """One READ batch that landed: its ``ready`` (segments and checksums) and ``entries``
    ``(local_addr, remote_addr, nbytes)``."""

    ready: KVReady
    entries: Sequence[tuple[int, int, int]]
    label: str = ""  # which batch of the fetch (a layer group: "layers 2..3")


def verify_landed(req_id: str, chip: int, fmt: str, remote_base: int, landed: Sequence[Landed]) -> None:
    """Raise IntegrityError unless every segment of every batch in ``landed`` verifies for
    format ``fmt`` (the one the decode asked for)."""
    bad = []
    for b in landed:
        if len(b.ready.checksums) != len(b.ready.segments):
            raise IntegrityError(
                f"request {req_id} (chip {chip}): the prefill's KVReady carries no checksums although the "
                "KVRequest asked for them; the KV is not used (is the prefill an older vllm-hawk?)",
                req_id,
                chip,
            )
        try:
            found = check_segments(b.ready.segments, b.ready.checksums, fmt, remote_base, b.entries)
        except ValueError as e:
            msg = f"request {req_id} (chip {chip}): its landing cannot be verified: {e}"
            raise IntegrityError(msg, req_id, chip) from None
        bad += [(b.label, m) for m in found]
    if bad:
        total = sum(len(b.ready.segments) for b in landed)
        named = "; ".join(f"{label + ' ' if label else ''}{m.describe()}" for label, m in bad[:NAMED])
        named += "; ..." if len(bad) > NAMED else ""
        raise IntegrityError(
            f"request {req_id} (chip {chip}): {len(bad)} of {total} segments failed the integrity check "
            f"(format {fmt}): {named}. The KV is not used",
            req_id,
            chip,
            [m for _label, m in bad],
        )
