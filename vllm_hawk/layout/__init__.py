"""Tenstorrent and vLLM KV layouts: tiles, block-float formats, device profiles, DRAM
bank interleaving, the Tenstorrent paged KV cache, and source (vLLM) KV layouts.

Everything here is pure logic (no I/O), torch/numpy only.
"""
