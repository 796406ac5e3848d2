/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tenstorrent_ioctl.h - the subset of the tt-kmd character-device ABI that
 * vllm-hawk uses to reach Blackhole DRAM banks over PCIe BAR4 TLB windows.
 *
 * Written for vllm-hawk from a reading of tt-kmd's ioctl.h, memory.c, tlb.c
 * and blackhole.c at tag ttkmd-2.10.0-6-g4af7192
 * (commit 4af71921ac021e24859ae15d8438997a44dbbf58, module version 2.10.1-pre).
 * The layout of every struct below must stay byte-identical to the driver's;
 * tests/test_tt_kmd_abi.py compiles this header and compares it field by field
 * with the ctypes mirror in vllm_hawk/npu/tt_kmd/ioctl.py.
 *
 * Facts recorded from that reading (not part of the ABI, useful to callers):
 *  - Every request is _IO(0xFA, n): the argument size is NOT encoded in the
 *    request number; the driver reads the struct through the pointer.
 *  - Device nodes are /dev/tenstorrent/<ordinal>; PCI vendor 0x1E52,
 *    device 0x401E (Wormhole) or 0xB140 (Blackhole).
 *  - ALLOCATE_TLB takes an exact window size. Blackhole offers 2 MiB windows
 *    in BAR0 and 4 GiB windows in BAR4 (count = BAR4 length / 4 GiB, at most 8).
 *    Wormhole offers 1/2/16 MiB windows only: no 4 GiB window exists there.
 *  - CONFIGURE_TLB requires config.addr to be aligned to the window size.
 *  - mmap() of a window must start at out.mmap_offset_{uc,wc} exactly and may be
 *    shorter than the window. FREE_TLB fails with EBUSY while it is mmap'd.
 *  - EXPORT_TLB_DMABUF (needs tt-kmd >= 2.10.0 and Linux >= 5.8) wraps
 *    [offset, offset + size) of an owned window in a dma-buf; offset and size
 *    must be page aligned (size 0 = to the end of the window). The export pins
 *    the window until the dma-buf's last reference is dropped.
 */
#ifndef VLLM_HAWK_TENSTORRENT_IOCTL_H
#define VLLM_HAWK_TENSTORRENT_IOCTL_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define TENSTORRENT_IOCTL_MAGIC 0xFA

#define TENSTORRENT_IOCTL_GET_DEVICE_INFO	_IO(TENSTORRENT_IOCTL_MAGIC, 0)
#define TENSTORRENT_IOCTL_GET_DRIVER_INFO	_IO(TENSTORRENT_IOCTL_MAGIC, 5)
#define TENSTORRENT_IOCTL_ALLOCATE_TLB		_IO(TENSTORRENT_IOCTL_MAGIC, 11)
#define TENSTORRENT_IOCTL_FREE_TLB		_IO(TENSTORRENT_IOCTL_MAGIC, 12)
#define TENSTORRENT_IOCTL_CONFIGURE_TLB		_IO(TENSTORRENT_IOCTL_MAGIC, 13)
#define TENSTORRENT_IOCTL_SET_POWER_STATE	_IO(TENSTORRENT_IOCTL_MAGIC, 15)
#define TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF	_IO(TENSTORRENT_IOCTL_MAGIC, 16)

/* GET_DEVICE_INFO: in.output_size_bytes = sizeof(out); the driver fills out. */
struct tenstorrent_get_device_info_in {
	__u32 output_size_bytes;
};

struct tenstorrent_get_device_info_out {
	__u32 output_size_bytes;
	__u16 vendor_id;
	__u16 device_id;
	__u16 subsystem_vendor_id;
	__u16 subsystem_id;
	__u16 bus_dev_fn;		/* [0:2] function, [3:7] device, [8:15] bus */
	__u16 max_dma_buf_size_log2;
	__u16 pci_domain;
	__u16 reserved;
};

struct tenstorrent_get_device_info {
	struct tenstorrent_get_device_info_in in;
	struct tenstorrent_get_device_info_out out;
};

/* GET_DRIVER_INFO: the ioctl API version and the module's semantic version. */
struct tenstorrent_get_driver_info_in {
	__u32 output_size_bytes;
};

struct tenstorrent_get_driver_info_out {
	__u32 output_size_bytes;
	__u32 driver_version;		/* ioctl API version (2) */
	__u8 driver_version_major;
	__u8 driver_version_minor;
	__u8 driver_version_patch;
	__u8 reserved0;
};

struct tenstorrent_get_driver_info {
	struct tenstorrent_get_driver_info_in in;
	struct tenstorrent_get_driver_info_out out;
};

/* ALLOCATE_TLB: in.size is the exact window size in bytes. */
struct tenstorrent_allocate_tlb_in {
	__u64 size;
	__u64 reserved;
};

struct tenstorrent_allocate_tlb_out {
	__u32 id;
	__u32 reserved0;
	__u64 mmap_offset_uc;		/* mmap() offset for an uncached mapping */
	__u64 mmap_offset_wc;		/* mmap() offset for a write-combined mapping */
	__u64 reserved1;
};

struct tenstorrent_allocate_tlb {
	struct tenstorrent_allocate_tlb_in in;
	struct tenstorrent_allocate_tlb_out out;
};

/* FREE_TLB: returns the window to the pool (EBUSY while it is mmap'd). */
struct tenstorrent_free_tlb_in {
	__u32 id;
};

struct tenstorrent_free_tlb_out {
};

struct tenstorrent_free_tlb {
	struct tenstorrent_free_tlb_in in;
	struct tenstorrent_free_tlb_out out;
};

/* Where a window points on the NOC: endpoint (x_end, y_end), byte address addr. */
struct tenstorrent_noc_tlb_config {
	__u64 addr;			/* NOC address, aligned to the window size */
	__u16 x_end;
	__u16 y_end;
	__u16 x_start;			/* multicast only */
	__u16 y_start;			/* multicast only */
	__u8 noc;			/* 0 or 1 */
	__u8 mcast;
	__u8 ordering;			/* 0 relaxed, 1 strict, 2 posted */
	__u8 linked;
	__u8 static_vc;
	__u8 reserved0[3];
	__u32 reserved1[2];
};

struct tenstorrent_configure_tlb_in {
	__u32 id;
	__u32 reserved;
	struct tenstorrent_noc_tlb_config config;
};

struct tenstorrent_configure_tlb_out {
	__u64 reserved;
};

struct tenstorrent_configure_tlb {
	struct tenstorrent_configure_tlb_in in;
	struct tenstorrent_configure_tlb_out out;
};

/* SET_POWER_STATE (Blackhole): GDDR PHYs may be powered down unless requested. */
#define TT_POWER_FLAG_MAX_AI_CLK	(1U << 0)
#define TT_POWER_FLAG_MRISC_PHY_WAKEUP	(1U << 1)
#define TT_POWER_FLAG_TENSIX_ENABLE	(1U << 2)
#define TT_POWER_FLAG_L2CPU_ENABLE	(1U << 3)
#define TT_POWER_VALIDITY(flags_count, settings_count) \
	((((flags_count) & 0xF) << 0) | (((settings_count) & 0xF) << 4))

struct tenstorrent_power_state {
	__u32 argsz;			/* sizeof(struct tenstorrent_power_state) */
	__u32 flags;			/* must be 0 */
	__u8 reserved0;
	__u8 validity;			/* TT_POWER_VALIDITY(n_flags, n_settings) */
	__u16 power_flags;		/* TT_POWER_FLAG_* */
	__u16 power_settings[14];
};

/* EXPORT_TLB_DMABUF (ioctl 16, Blackhole): fd is written back by the driver. */
struct tenstorrent_export_tlb_dmabuf {
	__u32 argsz;			/* sizeof(struct tenstorrent_export_tlb_dmabuf) */
	__u32 flags;			/* must be 0 */
	__u32 tlb_id;			/* from ALLOCATE_TLB, owned by this fd */
	__s32 fd;			/* OUT: the dma-buf file descriptor */
	__u64 offset;			/* byte offset in the window, page aligned */
	__u64 size;			/* bytes, page multiple; 0 = to window end */
};

#endif /* VLLM_HAWK_TENSTORRENT_IOCTL_H */
