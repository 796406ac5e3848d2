"""FAKE faults inside real engine processes, for tests/e2e/test_integrity.py.

Python's ``site`` imports ``sitecustomize`` at start-up from anywhere on ``sys.path``; the
e2e test puts this folder on one server's PYTHONPATH. Inert unless ``HAWK_TEST_FAULT`` is
set (every Python process of that server inherits it, the engine core and its workers too):

* ``flip`` (a decode): every READ batch the connector's transport lands gets one bit
  flipped (:class:`faulty_transport.FaultyTransport`, wrapped around what
  ``vllm_hawk.connector.strategies.make_transport_for`` builds);
* ``reuse`` (a prefill): after the prefill took a KVReady's checksums and before it sends
  it, 64 bytes of the first segment are overwritten, as when a block is freed and reused
  by another request before the decode's READ (``Producer._produce`` wrapped); with
  ``HAWK_TEST_FAULT_TOKENS`` (comma-separated) only for KVRequests of those ``num_tokens``.

The patches go in when those modules are first imported (a ``sys.meta_path`` hook), never
earlier: vLLM must start as it always does.
"""

import importlib.abc
import importlib.util
import os
import sys

FAULT = os.environ.get("HAWK_TEST_FAULT", "")
HERE = os.path.dirname(os.path.abspath(__file__))


def _flip(module) -> None:
    sys.path.insert(0, os.path.dirname(HERE))  # tests/integrity: faulty_transport
    from faulty_transport import FaultyTransport

    make = module.make_transport_for
    module.make_transport_for = lambda cfg: FaultyTransport(make(cfg), "flip", once=False)


def _reuse(module) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from faulty_transport import corrupt

    produce = module.Producer._produce
    only = {int(t) for t in os.environ.get("HAWK_TEST_FAULT_TOKENS", "").split(",") if t}

    def produce_then_reuse(self, msg, req, rec):
        out = produce(self, msg, req, rec)  # the KVReady, its checksums taken
        if not only or msg.num_tokens in only:
            ep, s = self.ep, out.segments[0]
            in_ring = ep.ring is not None and ep.source.uses_ring
            at = (
                ep.ring.view(s.offset_bytes, s.nbytes)
                if in_ring
                else ep.source.export_view(ep.export_base + s.offset_bytes, s.nbytes)
            )
            corrupt(at.data_ptr(), min(64, s.nbytes))  # host memory (the CPU engines here)
        return out

    module.Producer._produce = produce_then_reuse


PATCHES = {"flip": ("vllm_hawk.connector.strategies", _flip), "reuse": ("vllm_hawk.kvflow.prefill_serve", _reuse)}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if FAULT:
    if FAULT not in PATCHES:
        raise SystemExit(f"HAWK_TEST_FAULT={FAULT!r}: choose one of {sorted(PATCHES)}")
    sys.meta_path.insert(0, _PatchOnImport(*PATCHES[FAULT]))
