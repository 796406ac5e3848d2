"""The HAWK decode worker's landing route on vllm-tt-plugin: which chips have a PCIe BAR,
what the NIC must reach in each bank, and the bank-buffer backend of each chip.

:func:`choose_landing` asks :func:`vllm_hawk.tenstorrent.route.choose_route` with what this
mesh is: its chips' ``/dev/tenstorrent/N`` (``chips_with_mmio`` of tt-umd's cluster
descriptor, ``ttnn._ttnn.cluster.serialize_cluster_descriptor()``), the KV cache's span of
each bank (direct mode: lowest to highest KV byte) and the receive buffer per bank
(staged: ``ring_nbytes`` over the banks). :func:`nic_chips` then builds the chips of a NIC
path (:class:`~vllm_hawk.npu.ttnn_kmd_chip.TTNNKmdChip` over the chip's own tt-kmd fd);
``host-staged`` keeps the :class:`~vllm_hawk.npu.ttnn_chip.TTNNChip` chips. Hardware paths
are NOT exercised in CI (ttsim has no tt-kmd device: ``host-staged``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.npu.bank_buffer import recv_nbytes_per_bank
from vllm_hawk.npu.ttnn_chip import DEVICE_LOCK
from vllm_hawk.tenstorrent.route import ChipLink, LandingRoute, choose_route

__all__ = ["chip_links", "choose_landing", "kv_span_per_bank", "nic_chips"]


def chip_links(mesh) -> list[ChipLink]:
    """Each mesh chip and its PCIe device (None: reached over Ethernet, no BAR), from
    ``chips_with_mmio`` (chip id -> PCIe device number) of tt-umd's cluster descriptor."""
    import yaml
    from ttnn._ttnn import cluster

    with DEVICE_LOCK:
        ids = [int(i) for i in mesh.get_device_ids()]
        path = cluster.serialize_cluster_descriptor()
    with open(path) as f:
        desc = yaml.safe_load(f) or {}
    mmio: dict[int, int] = {}
    for entry in desc.get("chips_with_mmio") or []:
        mmio.update({int(k): int(v) for k, v in dict(entry).items()})
    return [ChipLink(i, mmio.get(chip)) for i, chip in enumerate(ids)]


def kv_span_per_bank(buffers: Sequence) -> int:
    """Bytes of a bank from the first KV buffer's start to the last one's end (direct windows
    must cover them; the buffers are interleaved the same way over every bank)."""
    lo = min(b.address for b in buffers)
    return max(b.address + b.size_per_bank for b in buffers) - lo


def choose_landing(cache, cfg, links: Sequence[ChipLink], *, dev_root: str = "/") -> LandingRoute:
    """The route for ``cache`` (a :class:`~vllm_hawk.tenstorrent.vllm_tt.kv_cache.TTNNMeshKVCache`
    on the chips ``links``) and the connector config ``cfg`` (``mode``, ``recv_nbytes``,
    ``device_profile``)."""
    profile = load_profile(cfg.device_profile)
    chip = cache.chips[0]
    return choose_route(
        cfg.mode,
        profile.arch,
        chip.num_banks,
        links,
        kv_span_per_bank=kv_span_per_bank(chip.buffers),
        recv_bytes_per_bank=recv_nbytes_per_bank(cfg.recv_nbytes, chip.num_banks, profile.dram_alignment_bytes),
        kv_base_per_bank=min(b.address for b in chip.buffers),
        recv_base_per_bank=profile.dram_unreserved_base,
        simulator=os.environ.get("TT_METAL_SIMULATOR") or None,
        dev_root=dev_root,
    )


def nic_chips(mesh, profile: str, links: Sequence[ChipLink], route: LandingRoute) -> list:
    """One :class:`TTNNKmdChip` per chip, each with windows of the route's size on its own
    ``/dev/tenstorrent/N`` (HARDWARE ONLY)."""
    from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
    from vllm_hawk.npu.tt_kmd.device import TtKmdDevice
    from vllm_hawk.npu.ttnn_kmd_chip import TTNNKmdChip

    out: list = []
    try:
        for link in links:
            dev = TtKmdDevice.open(link.pci)
            try:
                windows = TtKmdBankBuffers(dev, window_bytes=route.windows.window_bytes, profile=profile)
                out.append(TTNNKmdChip(mesh, profile, link.index, windows))
            except BaseException:
                dev.close()
                raise
    except BaseException:
        for c in out:
            c.close()
        raise
    return out
