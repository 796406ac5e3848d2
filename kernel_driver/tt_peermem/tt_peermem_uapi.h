/* SPDX-License-Identifier: GPL-2.0-only WITH Linux-syscall-note */
/*
 * User-space interface of /dev/tt_peermem.
 *
 * A process registers "this virtual range of mine is backed by that dma-buf
 * (from TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF), starting at this offset".
 * When the RDMA core (MOFED) later fails to pin an ibv_reg_mr() range with
 * get_user_pages and asks its peer-memory clients, tt_peermem claims ranges
 * inside a registration of the calling process and maps the dma-buf for
 * the NIC. The VA should be one GUP cannot pin: the process's mmap of the
 * same TLB window from /dev/tenstorrent/N (VM_IO), or a PROT_NONE
 * reservation.
 *
 * Registrations belong to the file they were made through; closing it
 * drops them. MRs created earlier keep their own dma-buf reference and stay
 * valid until deregistered or revoked by tt-kmd.
 */
#ifndef TT_PEERMEM_UAPI_H
#define TT_PEERMEM_UAPI_H

#ifdef __KERNEL__
#include <linux/types.h>
#include <linux/ioctl.h>
#else
#include <linux/types.h>
#include <sys/ioctl.h>
#endif

#define TT_PEERMEM_DEVICE_NAME "tt_peermem"
#define TT_PEERMEM_IOC_MAGIC 0xF7

/*
 * @argsz:          sizeof(struct tt_peermem_register)
 * @flags:          must be 0
 * @dmabuf_fd:      dma-buf file descriptor
 * @id:             OUT: registration handle (never 0)
 * @va_start:       bytes: start of the user virtual range, 4 KiB aligned
 * @nbytes:         bytes: length, > 0, multiple of 4 KiB
 * @dmabuf_offset:  bytes: offset into the dma-buf that va_start maps to,
 *                  4 KiB aligned; dmabuf_offset + nbytes <= dma-buf size
 *
 * Errors: EINVAL (alignment, flags, argsz), EOVERFLOW (range wraps), ERANGE
 * (past the dma-buf's end), EEXIST (overlaps a registration of this
 * process), ENOSPC (registry full), EBADF (not a dma-buf), EPERM (dma-buf
 * from an exporter other than tt-kmd, see module parameter
 * require_exporter).
 */
struct tt_peermem_register {
	__u32 argsz;
	__u32 flags;
	__s32 dmabuf_fd;
	__u32 id;
	__u64 va_start;
	__u64 nbytes;
	__u64 dmabuf_offset;
};

/* Remove registration @id made through this file. ENOENT if none. */
struct tt_peermem_unregister {
	__u32 argsz;
	__u32 id;
};

#define TT_PEERMEM_IOCTL_REGISTER \
	_IOWR(TT_PEERMEM_IOC_MAGIC, 1, struct tt_peermem_register)
#define TT_PEERMEM_IOCTL_UNREGISTER \
	_IOW(TT_PEERMEM_IOC_MAGIC, 2, struct tt_peermem_unregister)

#endif /* TT_PEERMEM_UAPI_H */
