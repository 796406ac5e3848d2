"""Tenstorrent and vLLM KV layouts: tiles, block-float formats, device profiles, DRAM
bank interleaving, the Tenstorrent paged KV cache, and source (vLLM) KV layouts.

Everything here is pure logic, torch/numpy only; the only files read are the device
profiles and model shapes shipped in :mod:`vllm_hawk.layout.profiles`. The Tenstorrent
facts reproduced here, with their sources: ``docs/tenstorrent-layout.md``; vLLM's:
``docs/vllm-cpu.md``.
"""
