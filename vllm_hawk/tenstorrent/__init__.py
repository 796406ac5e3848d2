"""The Tenstorrent decode: both engine integrations, the cache interface they share, and
where a KV connector finds the running engine's cache.

* :mod:`.emulated`: our vLLM platform plugin (vLLM 0.32) whose KV cache lives in emulated
  Tenstorrent DRAM banks on the CPU (``make demo``, machines without ttnn);
* :mod:`.vllm_tt`: the HAWK decode worker on Tenstorrent's vllm-tt-plugin (vLLM 0.25.1,
  ttnn), for a real or simulated device (docs/tenstorrent.md);
* :mod:`.kv_cache`: :class:`~.kv_cache.MeshKVCache` and :class:`~.kv_cache.ChipKVCache`, the
  protocols both integrations' caches implement and the connector's sink reads;
* :mod:`.registry`: engine -> its cache, for the connector;
* :mod:`.device`: which device profile the decode runs on (named once);
* :mod:`.launcher`: the ``--tt-*`` flags of ``hawk vllm``.

The two integrations import nothing of each other (tests/test_import_layers.py). Bank-buffer
backends (emulated, ttnn, tt-kmd) live in :mod:`vllm_hawk.npu`.
"""
