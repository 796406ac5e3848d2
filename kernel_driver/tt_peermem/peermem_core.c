// SPDX-License-Identifier: GPL-2.0-only
/*
 * tt_peermem pure logic. No headers besides our own: this file is built
 * into the kernel module and into the userspace sanitizer harness.
 * All lengths, addresses and offsets are in bytes.
 */
#include "peermem_core.h"

#define TPM_NULL ((void *)0)

static int is_pow2(tpm_u64 x)
{
	return x && !(x & (x - 1));
}

static tpm_u64 round_down_p2(tpm_u64 x, tpm_u64 p)
{
	return x & ~(p - 1);
}

/* Round x up to p (a power of two); returns 0 and sets *ovf on wrap. */
static tpm_u64 round_up_p2(tpm_u64 x, tpm_u64 p, int *ovf)
{
	tpm_u64 r = (x + (p - 1)) & ~(p - 1);

	if (r < x)
		*ovf = 1;
	return r;
}

/* [start, start + n) with n > 0 wraps unless start + n >= start (n > 0). */
static int span_wraps(tpm_u64 start, tpm_u64 n)
{
	return start + n < start;
}

/* ------------------------------------------------------------------------ */
/* Registry                                                                 */
/* ------------------------------------------------------------------------ */

void tpm_registry_init(struct tpm_registry *reg, struct tpm_range *storage,
		       tpm_u32 capacity)
{
	reg->ranges = storage;
	reg->count = 0;
	reg->capacity = storage ? capacity : 0;
	reg->next_id = 1;
}

int tpm_range_validate(tpm_u64 va_start, tpm_u64 nbytes, tpm_u64 dmabuf_offset,
		       tpm_u64 dmabuf_nbytes)
{
	const tpm_u64 mask = TPM_PAGE_SIZE_MIN - 1;

	if (!nbytes || (va_start & mask) || (nbytes & mask) ||
	    (dmabuf_offset & mask))
		return -TPM_EINVAL;
	/* The end address va_start + nbytes must be representable. */
	if (span_wraps(va_start, nbytes) || va_start + nbytes == 0)
		return -TPM_EOVERFLOW;
	if (span_wraps(dmabuf_offset, nbytes) ||
	    dmabuf_offset + nbytes > dmabuf_nbytes)
		return -TPM_ERANGE;
	return 0;
}

/* (owner, va) ordering: negative if a sorts before b. */
static int key_cmp(tpm_u64 owner_a, tpm_u64 va_a, tpm_u64 owner_b,
		   tpm_u64 va_b)
{
	if (owner_a != owner_b)
		return owner_a < owner_b ? -1 : 1;
	if (va_a != va_b)
		return va_a < va_b ? -1 : 1;
	return 0;
}

/* Index of the first range whose key is > (owner, va). */
static tpm_u32 upper_bound(const struct tpm_registry *reg, tpm_u64 owner,
			   tpm_u64 va)
{
	tpm_u32 lo = 0, hi = reg->count;

	while (lo < hi) {
		tpm_u32 mid = lo + (hi - lo) / 2;
		const struct tpm_range *r = &reg->ranges[mid];

		if (key_cmp(r->owner, r->va_start, owner, va) <= 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static int id_in_use(const struct tpm_registry *reg, tpm_u32 id)
{
	tpm_u32 i;

	for (i = 0; i < reg->count; i++)
		if (reg->ranges[i].id == id)
			return 1;
	return 0;
}

static tpm_u32 alloc_id(struct tpm_registry *reg)
{
	/* count < capacity <= 2^32 - 1, so a free id always exists. */
	for (;;) {
		tpm_u32 id = reg->next_id++;

		if (reg->next_id == 0)
			reg->next_id = 1;
		if (id && !id_in_use(reg, id))
			return id;
	}
}

int tpm_registry_add(struct tpm_registry *reg, const struct tpm_range *in,
		     tpm_u32 *id_out)
{
	tpm_u64 end = in->va_start + in->nbytes;	/* exclusive */
	tpm_u32 pos, i;

	if (!in->nbytes)
		return -TPM_EINVAL;
	if (span_wraps(in->va_start, in->nbytes) || end == 0)
		return -TPM_EINVAL;

	pos = upper_bound(reg, in->owner, in->va_start);
	/* Predecessor of the same owner must end at or before our start. */
	if (pos > 0) {
		const struct tpm_range *p = &reg->ranges[pos - 1];

		if (p->owner == in->owner && p->va_start + p->nbytes > in->va_start)
			return -TPM_EEXIST;
	}
	/* Successor of the same owner must start at or after our end. */
	if (pos < reg->count) {
		const struct tpm_range *n = &reg->ranges[pos];

		if (n->owner == in->owner && n->va_start < end)
			return -TPM_EEXIST;
	}
	if (reg->count >= reg->capacity)
		return -TPM_ENOSPC;

	for (i = reg->count; i > pos; i--)
		reg->ranges[i] = reg->ranges[i - 1];
	reg->ranges[pos] = *in;
	reg->ranges[pos].id = alloc_id(reg);
	reg->count++;
	if (id_out)
		*id_out = reg->ranges[pos].id;
	return 0;
}

static void remove_at(struct tpm_registry *reg, tpm_u32 pos,
		      struct tpm_range *out)
{
	tpm_u32 i;

	if (out)
		*out = reg->ranges[pos];
	for (i = pos; i + 1 < reg->count; i++)
		reg->ranges[i] = reg->ranges[i + 1];
	reg->count--;
}

int tpm_registry_remove(struct tpm_registry *reg, const void *file, tpm_u32 id,
			struct tpm_range *out)
{
	tpm_u32 i;

	for (i = 0; i < reg->count; i++) {
		if (reg->ranges[i].id == id && reg->ranges[i].file == file) {
			remove_at(reg, i, out);
			return 0;
		}
	}
	return -TPM_ENOENT;
}

int tpm_registry_remove_file(struct tpm_registry *reg, const void *file,
			     struct tpm_range *out)
{
	tpm_u32 i;

	for (i = 0; i < reg->count; i++) {
		if (reg->ranges[i].file == file) {
			remove_at(reg, i, out);
			return 1;
		}
	}
	return 0;
}

const struct tpm_range *tpm_registry_lookup(const struct tpm_registry *reg,
					    tpm_u64 owner, tpm_u64 addr,
					    tpm_u64 nbytes)
{
	const struct tpm_range *r;
	tpm_u32 pos;

	if (!nbytes || span_wraps(addr, nbytes))
		return TPM_NULL;
	pos = upper_bound(reg, owner, addr);
	if (pos == 0)
		return TPM_NULL;
	r = &reg->ranges[pos - 1];
	if (r->owner != owner)
		return TPM_NULL;
	/* r->va_start <= addr; containment: addr + nbytes <= end. */
	if (addr - r->va_start >= r->nbytes ||
	    nbytes > r->nbytes - (addr - r->va_start))
		return TPM_NULL;
	return r;
}

/* ------------------------------------------------------------------------ */
/* Page rounding                                                            */
/* ------------------------------------------------------------------------ */

int tpm_window_compute(const struct tpm_range *rg, tpm_u64 addr,
		       tpm_u64 nbytes, tpm_u64 max_page_size,
		       struct tpm_window *win)
{
	tpm_u64 rg_end = rg->va_start + rg->nbytes;	/* exclusive */
	tpm_u64 page;

	if (!nbytes || span_wraps(addr, nbytes) || max_page_size < TPM_PAGE_SIZE_MIN)
		return -TPM_EINVAL;
	if (addr < rg->va_start || addr + nbytes > rg_end)
		return -TPM_EINVAL;
	if (max_page_size > TPM_PAGE_SIZE_MAX)
		max_page_size = TPM_PAGE_SIZE_MAX;

	for (page = TPM_PAGE_SIZE_MAX; page >= TPM_PAGE_SIZE_MIN; page >>= 1) {
		tpm_u64 lo, hi;
		int ovf = 0;

		if (page > max_page_size || !(TPM_PAGE_SIZES_MASK & page))
			continue;
		/* VA and dma-buf offset must share their offset within a page. */
		if ((rg->va_start - rg->dmabuf_offset) & (page - 1))
			continue;
		lo = round_down_p2(addr, page);
		hi = round_up_p2(addr + nbytes, page, &ovf);
		if (ovf || lo < rg->va_start || hi > rg_end)
			continue;
		win->va_start = lo;
		win->nbytes = hi - lo;
		win->dmabuf_offset = rg->dmabuf_offset + (lo - rg->va_start);
		win->page_size = page;
		return 0;
	}
	/* Unreachable for a validated range (4 KiB always fits). */
	return -TPM_EINVAL;
}

/* ------------------------------------------------------------------------ */
/* Scatterlist planning                                                     */
/* ------------------------------------------------------------------------ */

tpm_u64 tpm_sg_max_entry(tpm_u64 page_size)
{
	if (!is_pow2(page_size) || page_size > TPM_SG_LEN_LIMIT)
		return 0;
	return round_down_p2(TPM_SG_LEN_LIMIT, page_size);
}

/* Emit one contiguous run, split at max_entry bytes. */
static int emit_run(tpm_u64 dma, tpm_u64 len, tpm_u64 page_size,
		    tpm_u64 max_entry, struct tpm_seg *out, tpm_u32 out_cap,
		    tpm_u64 *count)
{
	if ((dma & (page_size - 1)) || (len & (page_size - 1)))
		return -TPM_EINVAL;
	while (len) {
		tpm_u64 chunk = len < max_entry ? len : max_entry;

		if (out && *count < out_cap) {
			out[*count].dma_addr = dma;
			out[*count].nbytes = chunk;
		}
		(*count)++;
		dma += chunk;
		len -= chunk;
	}
	return 0;
}

int tpm_sg_plan(const struct tpm_seg *in, tpm_u32 n_in, tpm_u64 win_offset,
		tpm_u64 win_nbytes, tpm_u64 page_size, struct tpm_seg *out,
		tpm_u32 out_cap, tpm_u32 *n_out)
{
	tpm_u64 max_entry = tpm_sg_max_entry(page_size);
	tpm_u64 win_end = win_offset + win_nbytes;	/* exclusive */
	tpm_u64 seg_off = 0;	/* dma-buf offset of in[i] */
	tpm_u64 run_dma = 0, run_len = 0, count = 0;
	tpm_u32 i;
	int ret;

	*n_out = 0;
	if (!max_entry || !win_nbytes || span_wraps(win_offset, win_nbytes) ||
	    (win_offset & (page_size - 1)) || (win_nbytes & (page_size - 1)))
		return -TPM_EINVAL;

	for (i = 0; i < n_in && seg_off < win_end; i++) {
		tpm_u64 s_start = seg_off, s_end = seg_off + in[i].nbytes;
		tpm_u64 lo, hi, dma;

		if (span_wraps(seg_off, in[i].nbytes))
			return -TPM_EINVAL;
		seg_off = s_end;
		if (s_end <= win_offset || !in[i].nbytes)
			continue;
		lo = s_start > win_offset ? s_start : win_offset;
		hi = s_end < win_end ? s_end : win_end;
		dma = in[i].dma_addr + (lo - s_start);
		if (run_len && run_dma + run_len == dma) {
			run_len += hi - lo;	/* contiguous: merge */
			continue;
		}
		if (run_len) {
			ret = emit_run(run_dma, run_len, page_size, max_entry,
				       out, out_cap, &count);
			if (ret)
				return ret;
		}
		run_dma = dma;
		run_len = hi - lo;
	}
	if (seg_off < win_end)
		return -TPM_ERANGE;
	ret = emit_run(run_dma, run_len, page_size, max_entry, out, out_cap,
		       &count);
	if (ret)
		return ret;
	if (count > 0xFFFFFFFFULL)
		return -TPM_EOVERFLOW;
	*n_out = (tpm_u32)count;
	if (out && count > out_cap)
		return -TPM_ENOSPC;
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Per-MR state machine                                                     */
/* ------------------------------------------------------------------------ */

const char *tpm_mr_state_name(enum tpm_mr_state st)
{
	switch (st) {
	case TPM_MR_ACQUIRED:
		return "acquired";
	case TPM_MR_PINNED:
		return "pinned";
	case TPM_MR_MAPPED:
		return "mapped";
	case TPM_MR_INVALIDATED:
		return "invalidated";
	case TPM_MR_RELEASED:
		return "released";
	}
	return "unknown";
}

void tpm_mr_init(struct tpm_mr *mr)
{
	mr->state = TPM_MR_ACQUIRED;
	mr->core_context = 0;
	mr->revoked = 0;
	mr->mapping_live = 0;
	mr->attached = 0;
	mr->invalidations = 0;
}

int tpm_mr_get_pages(struct tpm_mr *mr, tpm_u64 core_context)
{
	if (mr->state != TPM_MR_ACQUIRED)
		return -TPM_EINVAL;
	if (mr->revoked)
		return -TPM_ENODEV;
	mr->core_context = core_context;
	mr->state = TPM_MR_PINNED;
	return 0;
}

int tpm_mr_dma_map_begin(struct tpm_mr *mr, unsigned int *actions)
{
	*actions = 0;
	if (mr->state != TPM_MR_PINNED)
		return -TPM_EINVAL;
	if (mr->revoked)
		return -TPM_ENODEV;
	if (mr->mapping_live) {
		mr->mapping_live = 0;
		*actions = TPM_ACT_TEARDOWN;
	}
	return 0;
}

void tpm_mr_dma_map_done(struct tpm_mr *mr, _Bool attached, _Bool mapped)
{
	if (attached)
		mr->attached = 1;
	if (mapped && mr->state == TPM_MR_PINNED) {
		mr->mapping_live = 1;
		mr->state = TPM_MR_MAPPED;
	}
}

int tpm_mr_dma_unmap(struct tpm_mr *mr)
{
	if (mr->state != TPM_MR_MAPPED && mr->state != TPM_MR_INVALIDATED)
		return -TPM_EINVAL;
	mr->state = TPM_MR_PINNED;
	return 0;
}

int tpm_mr_put_pages(struct tpm_mr *mr)
{
	if (mr->state != TPM_MR_PINNED)
		return -TPM_EINVAL;
	mr->state = TPM_MR_ACQUIRED;
	return 0;
}

unsigned int tpm_mr_invalidate_begin(struct tpm_mr *mr)
{
	if (mr->state == TPM_MR_RELEASED)
		return 0;
	mr->revoked = 1;
	if (mr->state != TPM_MR_MAPPED)
		return 0;
	mr->invalidations++;
	return TPM_ACT_NOTIFY_CORE;
}

unsigned int tpm_mr_invalidate_end(struct tpm_mr *mr)
{
	if (mr->state == TPM_MR_RELEASED)
		return 0;
	if (mr->state == TPM_MR_MAPPED)
		mr->state = TPM_MR_INVALIDATED;
	if (mr->mapping_live) {
		mr->mapping_live = 0;
		return TPM_ACT_TEARDOWN;
	}
	return 0;
}

unsigned int tpm_mr_release(struct tpm_mr *mr)
{
	unsigned int act = 0;

	if (mr->state == TPM_MR_RELEASED)
		return TPM_ACT_CONTRACT;
	if (mr->state != TPM_MR_ACQUIRED)
		act |= TPM_ACT_CONTRACT;
	if (mr->mapping_live)
		act |= TPM_ACT_TEARDOWN;
	if (mr->attached)
		act |= TPM_ACT_DETACH;
	mr->mapping_live = 0;
	mr->attached = 0;
	mr->state = TPM_MR_RELEASED;
	return act;
}
