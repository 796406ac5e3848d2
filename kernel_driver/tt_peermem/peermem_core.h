/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * tt_peermem pure logic: range registry, page rounding, scatterlist planning
 * and the per-MR map/unmap/invalidate state machine.
 *
 * This header and peermem_core.c include NO headers at all, neither kernel
 * nor libc, so the very same object code is linked into the kernel module
 * and into the userspace sanitizer harness (kernel_driver/tests/).
 *
 * Units: every length, address and offset here is in BYTES unless the name
 * says otherwise (e.g. *_shift is a log2 of bytes). Errors are negative
 * errno values with the Linux numbering (TPM_E*), checked against the real
 * <errno.h>/<linux/errno.h> by both users at build time.
 */
#ifndef TT_PEERMEM_CORE_H
#define TT_PEERMEM_CORE_H

typedef unsigned long long tpm_u64;
typedef unsigned int tpm_u32;

/* Linux errno numbers (asm-generic/errno-base.h, errno.h). */
#define TPM_ENOENT	2
#define TPM_ENOMEM	12
#define TPM_EBUSY	16
#define TPM_EEXIST	17
#define TPM_ENODEV	19
#define TPM_EINVAL	22
#define TPM_ENOSPC	28
#define TPM_ERANGE	34
#define TPM_EOVERFLOW	75

/* Smallest page the client ever reports: 4 KiB (bytes). */
#define TPM_PAGE_SIZE_MIN	(1ULL << 12)
/* Largest page the client may report: 2 MiB (bytes). */
#define TPM_PAGE_SIZE_MAX	(1ULL << 21)
/* Page sizes (bytes) the client may report: 2 MiB, 64 KiB, 4 KiB. */
#define TPM_PAGE_SIZES_MASK	((1ULL << 21) | (1ULL << 16) | (1ULL << 12))

/*
 * A scatterlist entry's length is an unsigned int: at most 4 GiB - 1 bytes.
 * Entries are also kept a whole number of pages long, so the usable maximum
 * is that limit rounded down to the page size (see tpm_sg_max_entry()).
 */
#define TPM_SG_LEN_LIMIT	0xFFFFFFFFULL

/* ------------------------------------------------------------------------ */
/* Range registry                                                           */
/* ------------------------------------------------------------------------ */

/*
 * One registered (user virtual range -> dma-buf) pair.
 *
 * Ranges of one owner (address space) never overlap; adjacent ranges
 * ([a, b) and [b, c)) are allowed. Ranges of different owners are
 * independent: the same virtual address means different memory there.
 */
struct tpm_range {
	tpm_u64 va_start;	/* bytes: user VA, TPM_PAGE_SIZE_MIN aligned */
	tpm_u64 nbytes;		/* bytes: > 0, multiple of TPM_PAGE_SIZE_MIN */
	tpm_u64 dmabuf_offset;	/* bytes: where va_start lands in the dma-buf */
	tpm_u64 owner;		/* opaque address-space key (kernel: mm pointer) */
	const void *file;	/* opaque registering file, for close() cleanup */
	void *cookie;		/* opaque to the core (kernel: struct dma_buf *) */
	tpm_u32 id;		/* handle given to user space, never 0 */
};

/*
 * Sorted array of ranges, ordered by (owner, va_start). Storage is provided
 * by the caller (kvcalloc in the kernel, calloc in the harness); the core
 * never allocates. Not thread safe: the caller serialises.
 */
struct tpm_registry {
	struct tpm_range *ranges;
	tpm_u32 count;
	tpm_u32 capacity;
	tpm_u32 next_id;
};

void tpm_registry_init(struct tpm_registry *reg, struct tpm_range *storage,
		       tpm_u32 capacity);

/*
 * Validate a registration request. dmabuf_nbytes is the dma-buf's size.
 * Returns 0 or -TPM_EINVAL (alignment, zero length), -TPM_EOVERFLOW (the
 * range wraps the 64-bit space), -TPM_ERANGE (past the end of the dma-buf).
 */
int tpm_range_validate(tpm_u64 va_start, tpm_u64 nbytes, tpm_u64 dmabuf_offset,
		       tpm_u64 dmabuf_nbytes);

/*
 * Insert a copy of *in (its id field is ignored) after the caller validated
 * it with tpm_range_validate(). On success stores the new id in *id_out.
 * Returns 0, -TPM_EEXIST (overlaps a range of the same owner), -TPM_ENOSPC
 * (registry full) or -TPM_EINVAL (zero length / wrapping range).
 */
int tpm_registry_add(struct tpm_registry *reg, const struct tpm_range *in,
		     tpm_u32 *id_out);

/*
 * Remove the range with this id registered through this file, copying it
 * to *out (may be NULL) so the caller can drop its cookie.
 * Returns 0 or -TPM_ENOENT.
 */
int tpm_registry_remove(struct tpm_registry *reg, const void *file, tpm_u32 id,
			struct tpm_range *out);

/*
 * Remove any one range registered through this file (close() cleanup: call
 * until it returns 0). Returns 1 and fills *out when one was removed.
 */
int tpm_registry_remove_file(struct tpm_registry *reg, const void *file,
			     struct tpm_range *out);

/*
 * Find the range of this owner that wholly contains [addr, addr + nbytes).
 * Returns NULL when none does, when nbytes is 0 or when the span wraps.
 */
const struct tpm_range *tpm_registry_lookup(const struct tpm_registry *reg,
					    tpm_u64 owner, tpm_u64 addr,
					    tpm_u64 nbytes);

/* ------------------------------------------------------------------------ */
/* Page rounding                                                            */
/* ------------------------------------------------------------------------ */

/*
 * The page-rounded slice of a registered range that backs one MR request.
 * The MR asks for [addr, addr + nbytes); the window is that span rounded
 * out to whole pages of page_size bytes, and it always lies inside the
 * registered range.
 */
struct tpm_window {
	tpm_u64 va_start;	/* bytes: addr rounded down to page_size */
	tpm_u64 nbytes;		/* bytes: multiple of page_size */
	tpm_u64 dmabuf_offset;	/* bytes: dma-buf offset of va_start */
	tpm_u64 page_size;	/* bytes: 4 KiB, 64 KiB or 2 MiB */
};

/*
 * Choose the largest page size <= max_page_size (bytes, one of
 * TPM_PAGE_SIZES_MASK; larger values are clamped to 2 MiB) for which the
 * rounded window stays inside rg and the VA and the dma-buf offset are
 * congruent modulo the page size, and fill *win.
 * Returns 0, or -TPM_EINVAL if [addr, addr + nbytes) is empty, wraps or is
 * not inside rg, or max_page_size is below 4 KiB.
 */
int tpm_window_compute(const struct tpm_range *rg, tpm_u64 addr,
		       tpm_u64 nbytes, tpm_u64 max_page_size,
		       struct tpm_window *win);

/* ------------------------------------------------------------------------ */
/* Scatterlist planning                                                     */
/* ------------------------------------------------------------------------ */

/* One DMA-contiguous run: bus address and length, both in bytes. */
struct tpm_seg {
	tpm_u64 dma_addr;
	tpm_u64 nbytes;
};

/* Largest entry length (bytes) that fits an sg entry and is page-multiple. */
tpm_u64 tpm_sg_max_entry(tpm_u64 page_size);

/*
 * Turn the exporter's mapping of the whole dma-buf (in[0..n_in), in dma-buf
 * order from offset 0) into the entries handed to the RDMA core for the
 * window [win_offset, win_offset + win_nbytes) of the dma-buf:
 *  - clip to the window,
 *  - merge runs that are contiguous in bus address,
 *  - split so no entry exceeds tpm_sg_max_entry(page_size).
 * Every entry starts page_size aligned and is a whole number of pages.
 *
 * With out == NULL only counts. Stores the number of entries in *n_out.
 * Returns 0, -TPM_ERANGE (the exporter mapping does not cover the window),
 * -TPM_EINVAL (a run is not page_size aligned, bad arguments, empty
 * window) or -TPM_ENOSPC (out_cap too small; *n_out says how many needed).
 */
int tpm_sg_plan(const struct tpm_seg *in, tpm_u32 n_in, tpm_u64 win_offset,
		tpm_u64 win_nbytes, tpm_u64 page_size, struct tpm_seg *out,
		tpm_u32 out_cap, tpm_u32 *n_out);

/* ------------------------------------------------------------------------ */
/* Per-MR state machine                                                     */
/* ------------------------------------------------------------------------ */

/*
 * Lifecycle of one peer-memory context (one acquire() of the RDMA core):
 *
 *   ACQUIRED --get_pages--> PINNED --dma_map--> MAPPED
 *   MAPPED --dma_unmap--> PINNED --put_pages--> ACQUIRED
 *   MAPPED --invalidate (core did not unmap in its callback)--> INVALIDATED
 *   INVALIDATED --dma_unmap--> PINNED
 *   any --release--> RELEASED (terminal)
 *
 * The exporter's mapping (dma-buf attachment pinned and mapped) is tracked
 * apart from the state: dma_unmap() only forgets it (mapping_live stays
 * set), and it is torn down where the dma-buf reservation lock may be taken
 * safely: at invalidate_end() (the lock is already held by the exporter) or
 * at release(). This keeps the lock order resv -> core mapping lock ->
 * context lock, whatever path the RDMA core calls from.
 */
enum tpm_mr_state {
	TPM_MR_ACQUIRED = 0,
	TPM_MR_PINNED,
	TPM_MR_MAPPED,
	TPM_MR_INVALIDATED,
	TPM_MR_RELEASED,
};

/* Actions the caller must perform after a transition (bit mask). */
#define TPM_ACT_NOTIFY_CORE	0x1u	/* call the core's invalidate callback */
#define TPM_ACT_TEARDOWN	0x2u	/* unmap + unpin the exporter mapping */
#define TPM_ACT_DETACH		0x4u	/* detach from the dma-buf */
#define TPM_ACT_CONTRACT	0x8u	/* the core broke the call order: warn */

struct tpm_mr {
	enum tpm_mr_state state;
	tpm_u64 core_context;	/* from get_pages(), passed to invalidate */
	_Bool revoked;		/* exporter revoked the dma-buf: no new map */
	_Bool mapping_live;	/* exporter mapping exists (teardown owed) */
	_Bool attached;		/* attachment exists (detach owed) */
	tpm_u32 invalidations;	/* number of invalidate_begin() that hit */
};

const char *tpm_mr_state_name(enum tpm_mr_state st);

void tpm_mr_init(struct tpm_mr *mr);
/* ACQUIRED -> PINNED. -TPM_ENODEV if revoked, -TPM_EINVAL otherwise. */
int tpm_mr_get_pages(struct tpm_mr *mr, tpm_u64 core_context);
/*
 * Check a dma_map may start (state PINNED, not revoked). *actions gets
 * TPM_ACT_TEARDOWN when a mapping left by an earlier dma_unmap must be
 * torn down before mapping again.
 */
int tpm_mr_dma_map_begin(struct tpm_mr *mr, unsigned int *actions);
/* Record the attachment (attached) and, if mapped, PINNED -> MAPPED. */
void tpm_mr_dma_map_done(struct tpm_mr *mr, _Bool attached, _Bool mapped);
/* MAPPED or INVALIDATED -> PINNED. -TPM_EINVAL from any other state. */
int tpm_mr_dma_unmap(struct tpm_mr *mr);
/* PINNED -> ACQUIRED. -TPM_EINVAL from any other state. */
int tpm_mr_put_pages(struct tpm_mr *mr);
/*
 * The exporter revokes the dma-buf. Marks the context revoked; returns
 * TPM_ACT_NOTIFY_CORE when it is MAPPED (only then does the core hold a
 * live MR to fence), else 0. Never notifies while a dma_map is still in
 * progress: the core holds its mapping lock then and would deadlock.
 */
unsigned int tpm_mr_invalidate_begin(struct tpm_mr *mr);
/*
 * After the core's callback returned. MAPPED (core did not unmap) ->
 * INVALIDATED. Returns TPM_ACT_TEARDOWN if the exporter mapping is live.
 */
unsigned int tpm_mr_invalidate_end(struct tpm_mr *mr);
/*
 * any -> RELEASED. Returns TPM_ACT_TEARDOWN / TPM_ACT_DETACH as owed, and
 * TPM_ACT_CONTRACT if the core released a context that was still pinned
 * or mapped. A second release returns TPM_ACT_CONTRACT only.
 */
unsigned int tpm_mr_release(struct tpm_mr *mr);

#endif /* TT_PEERMEM_CORE_H */
