"""Which Tenstorrent device profile a decode runs on: it is named once.

With HawkConnector configured (``--kv-transfer-config``), the connector's
``kv_connector_extra_config.device_profile`` names the device: for both sides of the pair
(the prefill transforms into that device's layout) and for the decode's engine (the
emulated platform emulates that profile; the vllm-tt-plugin worker checks every chip
against it). The platform's own setting (``HAWK_TT_DEVICE`` / ``--tt-device``) is then
unneeded, and one naming another device is refused, naming both. Without the connector
(plain serving) the platform's setting names the device, default :data:`DEFAULT_DEVICE`.
"""

from __future__ import annotations

from vllm_hawk.connector import CONNECTOR_NAME
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.protocol.compat import VLLM_PROFILE

__all__ = ["DEFAULT_DEVICE", "connector_device", "decode_device"]

DEFAULT_DEVICE = "p150a"


def connector_device(vllm_config) -> str | None:
    """The ``device_profile`` of the engine's HawkConnector configuration, or None (no
    HawkConnector). ValueError when it is ``vllm``: a GG pair cannot decode on this device."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or ktc.kv_connector != CONNECTOR_NAME:
        return None
    from vllm_hawk.connector.config import parse_config

    profile = parse_config(ktc.kv_connector_extra_config or {}).device_profile
    if profile == VLLM_PROFILE:
        raise ValueError(
            f"kv_connector_extra_config.device_profile={VLLM_PROFILE!r} (a GG pair) on a Tenstorrent "
            "decode: set pair 'gn-hawk' or 'gn-host' and device_profile to this device (e.g. 'p150a')"
        )
    return profile


def decode_device(vllm_config, platform_device: str | None, platform_setting: str) -> str:
    """The device profile (name or YAML path) the engine's decode runs on (see module doc).

    ``platform_device``: what the platform was told (None: nothing), ``platform_setting``:
    where that came from (e.g. ``HAWK_TT_DEVICE``), for the refusal."""
    named = connector_device(vllm_config)
    if named is None:
        return platform_device or DEFAULT_DEVICE
    if platform_device and platform_device != named and load_profile(platform_device).name != named:
        raise ValueError(
            f"{platform_setting}={platform_device!r} but kv_connector_extra_config.device_profile="
            f"{named!r}: name the decode's device once, in the connector's device_profile "
            f"(and leave {platform_setting} unset)"
        )
    return named
