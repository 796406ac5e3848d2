"""KV shapes of a model, per device after tensor parallelism.

Model files are shipped in the package, ``vllm_hawk/layout/profiles/models/<name>.yaml``
(fields num_layers, num_kv_heads, head_dim; ``HAWK_CONFIG_DIR`` adds user folders, see
:mod:`vllm_hawk.layout.profiles`). With TP ranks > KV heads, vLLM replicates KV heads:
each rank holds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_hawk.layout import profiles


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_heads_per_rank(self, tp: int) -> int:
        if tp <= 0:
            raise ValueError(f"tensor parallel size must be positive, got {tp}")
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            raise ValueError(f"{self.name}: {self.num_kv_heads} KV heads do not split over TP={tp}")
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int, elem_nbytes: float = 2) -> float:
        """Bytes of K+V per token on one rank (all layers), at elem_nbytes per element."""
        return self.num_layers * 2 * self.kv_heads_per_rank(tp) * self.head_dim * elem_nbytes


def available_models() -> list[str]:
    """Names of every model shape: shipped ones and those in ``HAWK_CONFIG_DIR``."""
    return profiles.available("models")


def load_model_shape(name_or_path: str) -> ModelShape:
    """Load a model's KV shapes by name (``llama-3.1-70b``) or by YAML path."""
    path, text = profiles.read("models", name_or_path)
    raw = yaml.safe_load(text) or {}
    for field in ("num_layers", "num_kv_heads", "head_dim"):
        if not isinstance(raw.get(field), int) or raw[field] <= 0:
            raise ValueError(f"{path}: field {field!r} must be a positive integer, got {raw.get(field)!r}")
    return ModelShape(str(raw.get("name", Path(path).stem)), raw["num_layers"], raw["num_kv_heads"], raw["head_dim"])
