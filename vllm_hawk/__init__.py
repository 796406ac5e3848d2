"""vllm-hawk: HAWK KV transfer between GPU prefill and Tenstorrent decode for vLLM."""

__version__ = "0.1.0"
