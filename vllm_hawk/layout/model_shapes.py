"""KV shapes of a model, per device after tensor parallelism.

Model files live in ``configs/models/<name>.yaml`` (fields num_layers, num_kv_heads,
head_dim). With TP ranks > KV heads, vLLM replicates KV heads: each rank holds one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_hawk.layout.device_profiles import config_dir


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


def load_model_shape(name_or_path: str) -> ModelShape:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and "/" not in str(name_or_path):
        path = config_dir() / "models" / f"{name_or_path}.yaml"
        if not path.exists():
            have = sorted(p.stem for p in (config_dir() / "models").glob("*.yaml"))
            raise ValueError(f"unknown model {name_or_path!r}; available in {path.parent}: {have}")
    raw = yaml.safe_load(path.read_text()) or {}
    for field in ("num_layers", "num_kv_heads", "head_dim"):
        if not isinstance(raw.get(field), int) or raw[field] <= 0:
            raise ValueError(f"{path}: field {field!r} must be a positive integer, got {raw.get(field)!r}")
    return ModelShape(str(raw.get("name", path.stem)), raw["num_layers"], raw["num_kv_heads"], raw["head_dim"])
