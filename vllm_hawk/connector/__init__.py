"""HawkConnector: vLLM KV connector for disaggregated prefill/decode (pull design).

Use it by module path::

    --kv-transfer-config '{"kv_connector": "HawkConnector",
                           "kv_connector_module_path": "vllm_hawk.connector",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

or, with the ``vllm.general_plugins`` entry point installed (``hawk_connector =
vllm_hawk.connector:register``), by name alone (``"kv_connector": "HawkConnector"``).
Settings: :mod:`vllm_hawk.connector.config` (its field table: ``config_doc``). Modules: ``connector`` (facade),
``scheduler``, ``worker``, ``metadata``, ``describe`` (what the KV caches are), ``debug``
(``HAWK_DEBUG_DIR``), ``stats``;
Algorithm 1 itself is :mod:`vllm_hawk.kvflow`.

Importing this package imports vLLM only through :mod:`vllm_hawk.connector.connector`,
loaded lazily, so ``register`` stays cheap in every vLLM process.
"""

from __future__ import annotations

CONNECTOR_NAME = "HawkConnector"


def register() -> None:
    """``vllm.general_plugins`` entry point: make ``"kv_connector": "HawkConnector"`` work.

    vLLM calls general plugins in every process (API server, engine core, workers),
    possibly more than once: registering again is a no-op. Also applies the AMX policy
    (``HAWK_CPU_AMX``, :mod:`vllm_hawk.cpu_amx`) in that process.
    """
    from vllm_hawk.cpu_amx import apply_from_plugin

    apply_from_plugin()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_hawk.connector.connector", CONNECTOR_NAME)


def __getattr__(name: str):
    if name == CONNECTOR_NAME:  # kv_connector_module_path="vllm_hawk.connector"
        from vllm_hawk.connector.connector import HawkConnector

        return HawkConnector
    raise AttributeError(name)


__all__ = ["CONNECTOR_NAME", "HawkConnector", "register"]
