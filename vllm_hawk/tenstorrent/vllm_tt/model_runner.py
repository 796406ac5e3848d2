"""vllm-tt-plugin's model runner with the KV connector's worker-side hooks.

Each step, around the plugin's own ``execute_model`` (what vLLM's GPU and CPU runners do in
``KVConnectorModelRunnerMixin``): bind the scheduler's connector metadata, ``start_load_kv``
(pulls of remote-prefill requests begin on the connector's threads), run the step, then
``wait_for_save``, collect what finished (:func:`vllm_hawk.connector.vllm_compat.transfer_output`:
finished sends and receives, failed receives, stats, worker metadata) and clear the
metadata. The collected ``KVConnectorOutput`` rides on the step's ``ModelRunnerOutput``;
the plugin defers sampling to ``sample_tokens``, so a step that returns None hands it to
the matching ``sample_tokens`` call (FIFO, as the plugin's own pending samples). Steps that
schedule no token still run the hooks: pulls start and finish while their requests wait.

Loads are asynchronous only (a request is scheduled once its pull finished), so the model
never waits on a layer; the forward context vLLM's mixin passes to ``start_load_kv`` does not
exist here (the plugin's models are not vLLM modules) and None is passed.
"""

from __future__ import annotations

import copy
from collections import deque

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm_tt_plugin.model_runner import TTModelRunner

from vllm_hawk.connector.vllm_compat import transfer_output

__all__ = ["HawkTTModelRunner"]


def _with_output(out, kvo: KVConnectorOutput | None):
    """``out`` carrying ``kvo`` (a copy: the plugin returns vLLM's shared empty output)."""
    if kvo is None or kvo.is_empty():
        return out
    if isinstance(out, ModelRunnerOutput):
        out = copy.copy(out)
        out.kv_connector_output = kvo
        return out
    inner_get = out.get_output  # an async decode output: attach when it resolves

    def get_output():
        return _with_output(inner_get(), kvo)

    out.get_output = get_output
    return out


class HawkTTModelRunner(TTModelRunner):
    """TTModelRunner + the connector's worker-side hooks (see module doc)."""

    _hawk_pending: deque | None = None

    @classmethod
    def adopt(cls, runner: TTModelRunner) -> HawkTTModelRunner:
        """Turn the plugin's runner (built by its worker) into this class in place."""
        runner.__class__ = cls
        runner._hawk_pending = deque()
        return runner  # type: ignore[return-value]

    def execute_model(self, scheduler_output):
        if not has_kv_transfer_group():
            return super().execute_model(scheduler_output)
        connector = get_kv_transfer_group()
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv(None)
        try:
            out = super().execute_model(scheduler_output)
        finally:
            connector.wait_for_save()
            kvo = transfer_output(connector, scheduler_output.finished_req_ids)
            connector.clear_connector_metadata()
        if out is None:  # sampling deferred to sample_tokens
            self._hawk_pending.append(kvo)
            return None
        return _with_output(out, kvo)

    def sample_tokens(self, grammar_output):
        out = super().sample_tokens(grammar_output)
        kvo = self._hawk_pending.popleft() if self._hawk_pending else None
        return out if out is None else _with_output(out, kvo)
