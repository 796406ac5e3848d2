"""Settings of the Tenstorrent decode platform, read from ``HAWK_TT_*`` environment variables.

The plugin is OFF unless ``HAWK_TT_PLATFORM`` names a backend, so installing the package
never changes what vLLM does on a GPU node. Every variable, its values and its default:

``HAWK_TT_PLATFORM``    ``emulated`` (unset, empty, ``0``, ``off``: plugin inactive). A Tenstorrent
                        device is reached through vllm-tt-plugin with the HAWK decode worker
                        (:mod:`vllm_hawk.tenstorrent.vllm_tt`), never through this plugin
``HAWK_TT_DEVICE``      device profile name (shipped in ``vllm_hawk/layout/profiles/devices``, or
                        in ``HAWK_CONFIG_DIR``) or YAML path, for serving without HawkConnector;
                        default ``p150a``. With HawkConnector its ``device_profile`` names the
                        device and this one, if set, must agree (:mod:`vllm_hawk.tenstorrent.device`)
``HAWK_TT_CHIPS``       chips of a mesh the KV heads are sharded over, a positive integer; default:
                        the profile's ``chips`` (n300: 2 Wormhole chips; p150a: 1; ``p150a`` with
                        2 or 4 is a Blackhole group). Chip ``c`` holds KV heads ``[c*H/n,
                        (c+1)*H/n)`` (:func:`vllm_hawk.layout.tp.shard_heads`); a count that cannot
                        split the model's heads fails at engine start-up naming this variable
``HAWK_TT_KV_DTYPE``    tile format of the KV cache: ``bfloat16`` (default) | ``bfloat8_b`` |
                        ``bfloat4_b``. vLLM's ``kv_cache_dtype`` must stay ``auto`` or ``bfloat16``:
                        it is a closed set of names that has no block-float entry. The
                        block-float formats are lossy; one that misses the accuracy contract
                        on the shipped test models (bfloat4_b) is warned about when the KV
                        cache is made (:mod:`vllm_hawk.tenstorrent.kv_accuracy`)
``HAWK_TT_BANK_MIB``    emulated DRAM per bank in MiB (default 256; untouched pages cost nothing)
``HAWK_TT_KV_FRACTION`` share of each bank the KV cache may take (default 0.5; the rest stays
                        free for the connector's per-bank receive buffers)

Pure: no vLLM import, so it can be checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_hawk import envs
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES

ENV_PLATFORM = "HAWK_TT_PLATFORM"
ENV_DEVICE = "HAWK_TT_DEVICE"
ENV_CHIPS = "HAWK_TT_CHIPS"
ENV_KV_DTYPE = "HAWK_TT_KV_DTYPE"
ENV_BANK_MIB = "HAWK_TT_BANK_MIB"
ENV_KV_FRACTION = "HAWK_TT_KV_FRACTION"

BACKENDS = ("emulated",)
#: name and class of the attention backend (registered with vLLM by .platform)
ATTN_BACKEND_NAME = "HAWK_TT_PAGED"
ATTN_BACKEND_PATH = "vllm_hawk.tenstorrent.emulated.attention.TTPagedAttentionBackend"
_OFF = ("", "0", "off", "none", "false", "no")


class TTPluginConfigError(ValueError):
    """A ``HAWK_TT_*`` variable has a value the plugin cannot use; the message names it."""


@dataclass(frozen=True)
class TTPluginConfig:
    """What the platform was asked for. ``backend`` is None when the plugin is off."""

    backend: str | None
    device: str | None = None  # HAWK_TT_DEVICE; None: not set (see vllm_hawk.tenstorrent.device)
    kv_dtype: str = "bfloat16"
    bank_mib: int = 256
    kv_fraction: float = 0.5
    chips: int | None = None  # None: the device profile's ``chips``

    @property
    def bank_size_bytes(self) -> int:
        return self.bank_mib << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TTPluginConfig:
        """Parse the environment (default ``os.environ``); raises TTPluginConfigError."""
        env = envs.tt_env(env)
        raw = env.get(ENV_PLATFORM, "").strip().lower()
        backend = None if raw in _OFF else raw
        if backend is not None and backend not in BACKENDS:
            raise TTPluginConfigError(
                f"{ENV_PLATFORM}={env.get(ENV_PLATFORM)!r}: expected one of {BACKENDS} (or unset)"
            )
        kv_dtype = env.get(ENV_KV_DTYPE, "").strip() or "bfloat16"
        if kv_dtype not in KV_DTYPES:
            raise TTPluginConfigError(f"{ENV_KV_DTYPE}={kv_dtype!r}: expected one of {KV_DTYPES}")
        device = env.get(ENV_DEVICE, "").strip() or None
        try:
            bank_mib = int(env.get(ENV_BANK_MIB, "").strip() or 256)
            kv_fraction = float(env.get(ENV_KV_FRACTION, "").strip() or 0.5)
        except ValueError as e:
            raise TTPluginConfigError(f"{ENV_BANK_MIB} / {ENV_KV_FRACTION}: {e}") from None
        if bank_mib <= 0:
            raise TTPluginConfigError(f"{ENV_BANK_MIB}={bank_mib}: must be positive")
        if not 0.0 < kv_fraction <= 1.0:
            raise TTPluginConfigError(f"{ENV_KV_FRACTION}={kv_fraction}: must be in (0, 1]")
        raw_chips = env.get(ENV_CHIPS, "").strip()
        chips = None
        if raw_chips:
            try:
                chips = int(raw_chips)
            except ValueError:
                raise TTPluginConfigError(f"{ENV_CHIPS}={raw_chips!r}: expected a positive integer") from None
            if chips <= 0:
                raise TTPluginConfigError(f"{ENV_CHIPS}={chips}: must be positive")
        return cls(backend, device, kv_dtype, bank_mib, kv_fraction, chips)

    def num_chips(self, profile_chips: int) -> int:
        """Chips of the mesh: ``HAWK_TT_CHIPS``, else the device profile's ``chips``."""
        return self.chips if self.chips is not None else profile_chips


def kv_dtype_for(vllm_cache_dtype: str, cfg: TTPluginConfig) -> str:
    """The tile format the KV cache uses, given vLLM's ``kv_cache_dtype`` string.

    ``auto`` and ``bfloat16`` defer to ``HAWK_TT_KV_DTYPE``; anything else (fp8 variants,
    float16) has no Tenstorrent tile format here and is refused."""
    if vllm_cache_dtype not in ("auto", "bfloat16"):
        raise TTPluginConfigError(
            f"kv_cache_dtype={vllm_cache_dtype!r} is not supported by the Tenstorrent platform; "
            f"keep 'auto' and choose the tile format with {ENV_KV_DTYPE} ({'|'.join(KV_DTYPES)})"
        )
    return cfg.kv_dtype
