"""Code that only tests, benchmarks and the demo use; the serving path never imports it.

* :mod:`~vllm_hawk.testing.paged_cache` — a vLLM-layout paged KV cache in torch
* :mod:`~vllm_hawk.testing.local_cluster` — a prefill vLLM, a decode vLLM and the proxy
  on this machine (``make demo``, e2e tests)
* :mod:`~vllm_hawk.testing.tiny_model` — a tiny random Llama and tokenizer built offline
"""
