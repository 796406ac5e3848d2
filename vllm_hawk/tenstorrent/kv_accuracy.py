"""The accuracy contract of the KV tile formats a Tenstorrent decode keeps its cache in.

Measured by ``hawk bench accuracy`` (docs/benchmarks.md) on the shipped test models, the
tiny random Llama of ``vllm_hawk.bench.tiny_model`` with bf16 and with float32 weights:

* per layer, the Pearson correlation (PCC, as tt-metal's ``comp_pcc``) of the decode's
  attention output from KV landed in the format against the same from bf16-landed KV,
  teacher-forced; the gate is :data:`PCC_GATE` per layer, tt-metal's ``comp_pcc`` default;
* greedy-token agreement with bf16 end to end, on the float32 model (whose logits resolve
  it; the bf16 model's top-2 gaps are whole bf16 steps, ties at most): the prompts whose
  tokens leave bf16's at a position where bf16's top-2 logprob gap exceeds the tie margin.

A format is flagged when it misses the PCC gate on a shipped model, or changes greedy
tokens beyond the tie margin there: :func:`kv_dtype_warning` then says so, and each decode
logs it once, when its KV cache is made (the emulated platform's worker for
``HAWK_TT_KV_DTYPE``, the vllm-tt-plugin worker for the cache its model allocated). Pure:
no torch, numpy or vLLM import (the Tenstorrent decode environment imports it too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["MEASURED", "PCC_GATE", "FormatAccuracy", "kv_dtype_warning", "log_kv_dtype"]

#: per-layer PCC a format must reach (tt-metal's ``comp_pcc`` default)
PCC_GATE = 0.99
DOC = "docs/tenstorrent.md#kv-accuracy"


@dataclass(frozen=True)
class FormatAccuracy:
    """One tile format on the shipped test models (the bench's prompt set)."""

    min_layer_pcc: float  # lowest per-layer attention-output PCC against bf16, both models
    worst_prompt_pcc: float  # lowest per-layer PCC of a single prompt, both models
    prompts_changed: int  # float32 model: prompts whose greedy tokens leave bf16's at a non-tie
    prompts: int

    def shortfalls(self) -> list[str]:
        """What the format misses of the contract, in words (empty: it meets it)."""
        out = []
        if self.min_layer_pcc < PCC_GATE:
            out.append(f"its per-layer attention PCC against bf16 falls to {self.min_layer_pcc:.4f} (gate {PCC_GATE})")
        if self.prompts_changed:
            out.append(
                f"greedy decoding leaves bf16's tokens at a position that is no top-2 tie in {self.prompts_changed} "
                f"of {self.prompts} prompts (its per-layer PCC: {self.min_layer_pcc:.4f}, gate {PCC_GATE})"
            )
        return out


#: ``hawk bench accuracy`` on the shipped test models (see the module doc)
MEASURED_BY = "hawk bench accuracy, 2026-12-06: tiny Llama, bf16 and float32 weights, 16 prompts, 32 tokens"
MEASURED: dict[str, FormatAccuracy] = {
    "bfloat16": FormatAccuracy(1.0, 1.0, 0, 16),
    "bfloat8_b": FormatAccuracy(0.999968, 0.999961, 0, 16),
    "bfloat4_b": FormatAccuracy(0.993731, 0.990062, 6, 16),
}


def kv_dtype_warning(dtype: str, source: str) -> str | None:
    """The warning for a KV cache in tile format ``dtype`` (``source``: what chose it), or
    None when the format meets the contract (bfloat16 always does)."""
    acc = MEASURED.get(dtype)
    if acc is None:
        return f"KV tile format {dtype} ({source}): its accuracy was never measured ({DOC})"
    short = acc.shortfalls()
    if not short:
        return None
    return (
        f"KV tile format {dtype} ({source}) is lossy beyond the accuracy contract: on the shipped test models "
        f"{'; '.join(short)} ({MEASURED_BY}; {DOC}). Use bfloat8_b or bfloat16 where outputs must match bf16's."
    )


def log_kv_dtype(logger: logging.Logger, dtype: str, source: str) -> str | None:
    """Log :func:`kv_dtype_warning` at WARNING when there is one; returns it."""
    msg = kv_dtype_warning(dtype, source)
    if msg is not None:
        logger.warning("%s", msg)
    return msg
