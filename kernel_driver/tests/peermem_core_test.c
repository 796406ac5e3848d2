// SPDX-License-Identifier: GPL-2.0-only
/*
 * Userspace harness for tt_peermem's pure logic (peermem_core.c), built
 * with -fsanitize=address,undefined -fno-sanitize-recover by
 * `make -C kernel_driver harness`. Prints one line per test and, last,
 * exactly "N passed, N failed". Exit status 0 only if nothing failed.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tt_peermem/peermem_core.h"

/* The core's private errno numbers must be Linux's. */
_Static_assert(TPM_ENOENT == ENOENT, "ENOENT");
_Static_assert(TPM_ENOMEM == ENOMEM, "ENOMEM");
_Static_assert(TPM_EBUSY == EBUSY, "EBUSY");
_Static_assert(TPM_EEXIST == EEXIST, "EEXIST");
_Static_assert(TPM_ENODEV == ENODEV, "ENODEV");
_Static_assert(TPM_EINVAL == EINVAL, "EINVAL");
_Static_assert(TPM_ENOSPC == ENOSPC, "ENOSPC");
_Static_assert(TPM_ERANGE == ERANGE, "ERANGE");
_Static_assert(TPM_EOVERFLOW == EOVERFLOW, "EOVERFLOW");

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define GiB (1ULL << 30)

static int g_passed, g_failed, g_cur_failed;
static const char *g_cur;

#define CHECK(cond)							\
	do {								\
		if (!(cond)) {						\
			printf("FAIL - %s: %s:%d: %s\n", g_cur, __FILE__, \
			       __LINE__, #cond);			\
			g_cur_failed = 1;				\
			return;						\
		}							\
	} while (0)

#define CHECK_EQ(a, b)							\
	do {								\
		unsigned long long _a = (unsigned long long)(a);	\
		unsigned long long _b = (unsigned long long)(b);	\
		if (_a != _b) {						\
			printf("FAIL - %s: %s:%d: %s == %s (%llu != %llu)\n", \
			       g_cur, __FILE__, __LINE__, #a, #b, _a, _b); \
			g_cur_failed = 1;				\
			return;						\
		}							\
	} while (0)

static void run(const char *name, void (*fn)(void))
{
	g_cur = name;
	g_cur_failed = 0;
	fn();
	if (g_cur_failed) {
		g_failed++;
	} else {
		g_passed++;
		printf("ok - %s\n", name);
	}
}

/* ---------------------------------------------------------------- helpers */

#define CAP 16
static struct tpm_range g_store[CAP];
static struct tpm_registry g_reg;
static const int g_file_a, g_file_b;	/* addresses used as file keys */

static void reg_reset(tpm_u32 cap)
{
	memset(g_store, 0xA5, sizeof(g_store));	/* poison */
	tpm_registry_init(&g_reg, g_store, cap);
}

static int add(tpm_u64 owner, const void *file, tpm_u64 va, tpm_u64 n,
	       tpm_u64 off, tpm_u32 *id)
{
	struct tpm_range r = { .va_start = va, .nbytes = n, .dmabuf_offset = off,
			       .owner = owner, .file = file, .cookie = NULL };
	return tpm_registry_add(&g_reg, &r, id);
}

static void check_sorted_disjoint(void)
{
	tpm_u32 i;

	for (i = 1; i < g_reg.count; i++) {
		const struct tpm_range *a = &g_reg.ranges[i - 1], *b = &g_reg.ranges[i];

		CHECK(a->owner < b->owner ||
		      (a->owner == b->owner && a->va_start + a->nbytes <= b->va_start));
	}
}

/* ------------------------------------------------------------ validation */

static void t_validate_ok(void)
{
	CHECK_EQ(tpm_range_validate(0x10000, 4 * KiB, 0, 4 * KiB), 0);
	/* Ends exactly at the dma-buf's end. */
	CHECK_EQ(tpm_range_validate(0x7f0000000000ULL, 4 * GiB, 4 * GiB, 8 * GiB), 0);
}

static void t_validate_alignment(void)
{
	CHECK_EQ(tpm_range_validate(0x10001, 4 * KiB, 0, 1 * MiB), -EINVAL);
	CHECK_EQ(tpm_range_validate(0x10000, 4 * KiB + 1, 0, 1 * MiB), -EINVAL);
	CHECK_EQ(tpm_range_validate(0x10000, 4 * KiB, 512, 1 * MiB), -EINVAL);
	CHECK_EQ(tpm_range_validate(0x10000, 0, 0, 1 * MiB), -EINVAL);
}

static void t_validate_wrap_and_end(void)
{
	/* End would be 2^64: not representable. */
	CHECK_EQ(tpm_range_validate(~0ULL - 4 * KiB + 1, 4 * KiB, 0, 1 * MiB), -EOVERFLOW);
	CHECK_EQ(tpm_range_validate(~0ULL - 4 * KiB + 1, 8 * KiB, 0, 1 * MiB), -EOVERFLOW);
	/* One page past the dma-buf end. */
	CHECK_EQ(tpm_range_validate(0, 8 * KiB, 1 * MiB - 4 * KiB, 1 * MiB), -ERANGE);
	/* dma-buf offset + length wraps. */
	CHECK_EQ(tpm_range_validate(0x1000, 8 * KiB, ~0ULL - 4095, ~0ULL), -ERANGE);
}

/* -------------------------------------------------------------- registry */

static void t_registry_add_lookup(void)
{
	const struct tpm_range *r;
	tpm_u32 id = 0;

	reg_reset(CAP);
	CHECK_EQ(add(1, &g_file_a, 0x100000, 64 * KiB, 0, &id), 0);
	CHECK(id != 0);
	r = tpm_registry_lookup(&g_reg, 1, 0x100000, 64 * KiB);
	CHECK(r && r->id == id);
	r = tpm_registry_lookup(&g_reg, 1, 0x100000 + 60 * KiB, 4 * KiB);
	CHECK(r && r->id == id);
	r = tpm_registry_lookup(&g_reg, 1, 0x100123, 1);
	CHECK(r && r->id == id);
	/* Last byte in, one past out. */
	CHECK(tpm_registry_lookup(&g_reg, 1, 0x100000 + 64 * KiB - 1, 1));
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x100000 + 64 * KiB, 1));
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x100000 - 1, 2));
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x100000, 64 * KiB + 1));
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x100000, 0));
	CHECK(!tpm_registry_lookup(&g_reg, 1, ~0ULL - 10, 100));
	/* Other owner, same VA: not ours. */
	CHECK(!tpm_registry_lookup(&g_reg, 2, 0x100000, 4 * KiB));
	CHECK(!tpm_registry_lookup(&g_reg, 0, 0x100000, 4 * KiB));
}

static void t_registry_overlap(void)
{
	reg_reset(CAP);
	CHECK_EQ(add(1, &g_file_a, 0x100000, 64 * KiB, 0, NULL), 0);
	/* exact, head, tail, inside, around */
	CHECK_EQ(add(1, &g_file_a, 0x100000, 64 * KiB, 0, NULL), -EEXIST);
	CHECK_EQ(add(1, &g_file_a, 0x100000 - 4 * KiB, 8 * KiB, 0, NULL), -EEXIST);
	CHECK_EQ(add(1, &g_file_a, 0x100000 + 60 * KiB, 8 * KiB, 0, NULL), -EEXIST);
	CHECK_EQ(add(1, &g_file_a, 0x100000 + 8 * KiB, 4 * KiB, 0, NULL), -EEXIST);
	CHECK_EQ(add(1, &g_file_a, 0x100000 - 4 * KiB, 128 * KiB, 0, NULL), -EEXIST);
	/* Overlap through a different file of the same owner is still refused. */
	CHECK_EQ(add(1, &g_file_b, 0x100000, 4 * KiB, 0, NULL), -EEXIST);
	CHECK_EQ(g_reg.count, 1);
	check_sorted_disjoint();
}

static void t_registry_adjacent(void)
{
	const struct tpm_range *r;
	tpm_u32 a, b, c;

	reg_reset(CAP);
	CHECK_EQ(add(1, &g_file_a, 0x200000, 64 * KiB, 0, &b), 0);
	CHECK_EQ(add(1, &g_file_a, 0x200000 + 64 * KiB, 4 * KiB, 0, &c), 0);
	CHECK_EQ(add(1, &g_file_a, 0x200000 - 4 * KiB, 4 * KiB, 0, &a), 0);
	CHECK_EQ(g_reg.count, 3);
	check_sorted_disjoint();
	/* Each lookup lands in exactly its range; a span across two fails. */
	r = tpm_registry_lookup(&g_reg, 1, 0x200000 - 1, 1);
	CHECK(r && r->id == a);
	r = tpm_registry_lookup(&g_reg, 1, 0x200000, 1);
	CHECK(r && r->id == b);
	r = tpm_registry_lookup(&g_reg, 1, 0x200000 + 64 * KiB, 4 * KiB);
	CHECK(r && r->id == c);
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x200000 - 4, 8));
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x200000 + 64 * KiB - 4, 8));
}

static void t_registry_owners_independent(void)
{
	const struct tpm_range *r;
	tpm_u32 id1, id2;

	reg_reset(CAP);
	CHECK_EQ(add(7, &g_file_a, 0x400000, 8 * KiB, 0, &id1), 0);
	CHECK_EQ(add(3, &g_file_b, 0x400000, 8 * KiB, 4 * KiB, &id2), 0);
	CHECK(id1 != id2);
	check_sorted_disjoint();
	r = tpm_registry_lookup(&g_reg, 7, 0x400000, 8 * KiB);
	CHECK(r && r->id == id1 && r->dmabuf_offset == 0);
	r = tpm_registry_lookup(&g_reg, 3, 0x401000, 4 * KiB);
	CHECK(r && r->id == id2 && r->dmabuf_offset == 4 * KiB);
}

static void t_registry_capacity(void)
{
	tpm_u32 i;

	reg_reset(4);
	for (i = 0; i < 4; i++)
		CHECK_EQ(add(1, &g_file_a, 0x100000 + i * 8 * KiB, 4 * KiB, 0, NULL), 0);
	CHECK_EQ(add(1, &g_file_a, 0x900000, 4 * KiB, 0, NULL), -ENOSPC);
	/* Overlap is reported before fullness. */
	CHECK_EQ(add(1, &g_file_a, 0x100000, 4 * KiB, 0, NULL), -EEXIST);
	/* Storage past capacity untouched (still poison). */
	CHECK_EQ(g_store[4].id, 0xA5A5A5A5u);
	reg_reset(0);
	CHECK_EQ(add(1, &g_file_a, 0x100000, 4 * KiB, 0, NULL), -ENOSPC);
}

static void t_registry_remove(void)
{
	struct tpm_range out;
	tpm_u32 a, b;

	reg_reset(CAP);
	CHECK_EQ(add(1, &g_file_a, 0x100000, 4 * KiB, 0, &a), 0);
	CHECK_EQ(add(1, &g_file_b, 0x200000, 4 * KiB, 0, &b), 0);
	/* Wrong file may not remove it. */
	CHECK_EQ(tpm_registry_remove(&g_reg, &g_file_b, a, &out), -ENOENT);
	CHECK_EQ(tpm_registry_remove(&g_reg, &g_file_a, 12345, &out), -ENOENT);
	CHECK_EQ(tpm_registry_remove(&g_reg, &g_file_a, a, &out), 0);
	CHECK_EQ(out.va_start, 0x100000);
	CHECK_EQ(out.id, a);
	CHECK(!tpm_registry_lookup(&g_reg, 1, 0x100000, 1));
	CHECK_EQ(tpm_registry_remove(&g_reg, &g_file_a, a, NULL), -ENOENT);
	/* Re-add the same span: gets a fresh id. */
	CHECK_EQ(add(1, &g_file_a, 0x100000, 4 * KiB, 0, &a), 0);
	CHECK(a != b);
	CHECK_EQ(g_reg.count, 2);
}

static void t_registry_remove_file(void)
{
	struct tpm_range out;
	tpm_u32 i, n = 0;

	reg_reset(CAP);
	for (i = 0; i < 6; i++)
		CHECK_EQ(add(1, (i & 1) ? &g_file_b : &g_file_a,
			     0x100000 + i * 4 * KiB, 4 * KiB, 0, NULL), 0);
	while (tpm_registry_remove_file(&g_reg, &g_file_a, &out)) {
		CHECK(out.file == &g_file_a);
		n++;
	}
	CHECK_EQ(n, 3);
	CHECK_EQ(g_reg.count, 3);
	for (i = 0; i < g_reg.count; i++)
		CHECK(g_reg.ranges[i].file == &g_file_b);
	CHECK_EQ(tpm_registry_remove_file(&g_reg, &g_file_a, NULL), 0);
}

static void t_registry_id_wrap(void)
{
	tpm_u32 a, b, c;

	reg_reset(CAP);
	g_reg.next_id = 0xFFFFFFFFu;
	CHECK_EQ(add(1, &g_file_a, 0x100000, 4 * KiB, 0, &a), 0);
	CHECK_EQ(a, 0xFFFFFFFFu);
	CHECK_EQ(add(1, &g_file_a, 0x200000, 4 * KiB, 0, &b), 0);
	CHECK_EQ(b, 1);	/* 0 is skipped */
	/* An id still in use is skipped after wrap. */
	g_reg.next_id = 1;
	CHECK_EQ(add(1, &g_file_a, 0x300000, 4 * KiB, 0, &c), 0);
	CHECK_EQ(c, 2);
}

static void t_registry_randomized(void)
{
	/* Random add/remove against a per-page bitmap model of one owner. */
	static unsigned char model[256];	/* page -> id low byte or 0 */
	struct tpm_range store[64];
	struct tpm_registry reg;
	uint64_t s = 0x9E3779B97F4A7C15ULL;
	int step;

	memset(model, 0, sizeof(model));
	tpm_registry_init(&reg, store, 64);
	for (step = 0; step < 4000; step++) {
		unsigned int p, n, i, overlap = 0;
		struct tpm_range r;
		tpm_u32 id;
		int ret;

		s ^= s << 13; s ^= s >> 7; s ^= s << 17;
		p = (unsigned int)(s % 250);
		n = 1 + (unsigned int)((s >> 20) % 6);
		if (p + n > 256)
			n = 256 - p;
		if ((s >> 40) & 1) {
			for (i = p; i < p + n; i++)
				overlap |= model[i] != 0;
			r = (struct tpm_range){ .va_start = p * 4 * KiB, .nbytes = n * 4 * KiB,
						.owner = 5, .file = &g_file_a };
			ret = tpm_registry_add(&reg, &r, &id);
			if (overlap) {
				CHECK(ret == -EEXIST);
			} else if (reg.count == 64 && ret == -ENOSPC) {
				continue;
			} else {
				CHECK_EQ(ret, 0);
				for (i = p; i < p + n; i++)
					model[i] = (unsigned char)(id & 0xFF) | 1;
			}
		} else if (reg.count) {
			struct tpm_range out;
			tpm_u32 victim = reg.ranges[(s >> 8) % reg.count].id;

			CHECK_EQ(tpm_registry_remove(&reg, &g_file_a, victim, &out), 0);
			for (i = 0; i < out.nbytes / (4 * KiB); i++)
				model[out.va_start / (4 * KiB) + i] = 0;
		}
		/* Lookups of single pages agree with the model. */
		for (i = 0; i < 256; i += 17)
			CHECK((tpm_registry_lookup(&reg, 5, i * 4 * KiB, 1) != NULL) ==
			      (model[i] != 0));
	}
}

/* -------------------------------------------------------------- rounding */

static struct tpm_range mkrange(tpm_u64 va, tpm_u64 n, tpm_u64 off)
{
	return (struct tpm_range){ .va_start = va, .nbytes = n, .dmabuf_offset = off };
}

static void t_window_4k_rounding(void)
{
	struct tpm_range rg = mkrange(0x7f0000001000ULL, 64 * KiB, 4 * KiB);
	struct tpm_window w;

	/* 100 bytes starting 0x10 into the second page. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start + 4 * KiB + 0x10, 100, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 4 * KiB);
	CHECK_EQ(w.va_start, rg.va_start + 4 * KiB);
	CHECK_EQ(w.nbytes, 4 * KiB);
	CHECK_EQ(w.dmabuf_offset, 8 * KiB);
	/* Straddling a page boundary takes two pages. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start + 4 * KiB - 1, 2, 4 * KiB, &w), 0);
	CHECK_EQ(w.va_start, rg.va_start);
	CHECK_EQ(w.nbytes, 8 * KiB);
	CHECK_EQ(w.dmabuf_offset, 4 * KiB);
	/* Whole range. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start, rg.nbytes, 4 * KiB, &w), 0);
	CHECK_EQ(w.nbytes, 64 * KiB);
}

static void t_window_2m(void)
{
	struct tpm_range rg = mkrange(0x7f0000000000ULL, 8 * MiB, 2 * MiB);
	struct tpm_window w;

	CHECK_EQ(tpm_window_compute(&rg, rg.va_start + 3 * MiB, 1 * MiB, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 2 * MiB);
	CHECK_EQ(w.va_start, rg.va_start + 2 * MiB);
	CHECK_EQ(w.nbytes, 2 * MiB);
	CHECK_EQ(w.dmabuf_offset, 4 * MiB);
	/* Straddles 2 MiB boundary: two huge pages. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start + 2 * MiB - 1, 2, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 2 * MiB);
	CHECK_EQ(w.nbytes, 4 * MiB);
	/* Capped by max_page_size. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start, 8 * MiB, 4 * KiB, &w), 0);
	CHECK_EQ(w.page_size, 4 * KiB);
	/* Larger caps clamp to 2 MiB. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start, 8 * MiB, 1ULL << 30, &w), 0);
	CHECK_EQ(w.page_size, 2 * MiB);
}

static void t_window_fallback(void)
{
	/* Range of 2 MiB + 64 KiB starting 2 MiB aligned: tail cannot round to 2 MiB. */
	struct tpm_range rg = mkrange(0x40000000ULL, 2 * MiB + 64 * KiB, 0);
	struct tpm_window w;

	CHECK_EQ(tpm_window_compute(&rg, rg.va_start + 2 * MiB + 4 * KiB, 8 * KiB, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 64 * KiB);
	CHECK_EQ(w.va_start, rg.va_start + 2 * MiB);
	CHECK_EQ(w.nbytes, 64 * KiB);
	/* Range not 64 KiB aligned at its end either: 4 KiB. */
	rg = mkrange(0x40000000ULL, 2 * MiB + 12 * KiB, 0);
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start + 2 * MiB + 4 * KiB, 8 * KiB, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 4 * KiB);
	/* Inside the first 2 MiB the huge page still fits. */
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start, 2 * MiB, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 2 * MiB);
}

static void t_window_congruence(void)
{
	/* VA 2 MiB aligned but dma-buf offset only 4 KiB: must use 4 KiB pages. */
	struct tpm_range rg = mkrange(0x40000000ULL, 8 * MiB, 4 * KiB);
	struct tpm_window w;

	CHECK_EQ(tpm_window_compute(&rg, rg.va_start, 4 * MiB, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 4 * KiB);
	/* Both off by the same 64 KiB: 64 KiB pages fit. */
	rg = mkrange(0x40010000ULL, 8 * MiB, 0x10000);
	CHECK_EQ(tpm_window_compute(&rg, rg.va_start, 4 * MiB, 2 * MiB, &w), 0);
	CHECK_EQ(w.page_size, 64 * KiB);
	CHECK_EQ(w.dmabuf_offset, 0x10000);
}

static void t_window_invalid(void)
{
	struct tpm_range rg = mkrange(0x100000, 64 * KiB, 0);
	struct tpm_window w;

	CHECK_EQ(tpm_window_compute(&rg, 0x100000, 0, 2 * MiB, &w), -EINVAL);
	CHECK_EQ(tpm_window_compute(&rg, 0x100000 - 1, 2, 2 * MiB, &w), -EINVAL);
	CHECK_EQ(tpm_window_compute(&rg, 0x100000, 64 * KiB + 1, 2 * MiB, &w), -EINVAL);
	CHECK_EQ(tpm_window_compute(&rg, ~0ULL - 5, 10, 2 * MiB, &w), -EINVAL);
	CHECK_EQ(tpm_window_compute(&rg, 0x100000, 4 * KiB, 2 * KiB, &w), -EINVAL);
}

/* ------------------------------------------------------------------- sg */

static void t_sg_max_entry(void)
{
	CHECK_EQ(tpm_sg_max_entry(4 * KiB), 4 * GiB - 4 * KiB);
	CHECK_EQ(tpm_sg_max_entry(64 * KiB), 4 * GiB - 64 * KiB);
	CHECK_EQ(tpm_sg_max_entry(2 * MiB), 4 * GiB - 2 * MiB);
	CHECK_EQ(tpm_sg_max_entry(3 * KiB), 0);
	CHECK_EQ(tpm_sg_max_entry(0), 0);
	CHECK_EQ(tpm_sg_max_entry(8 * GiB), 0);
}

static void t_sg_single_small(void)
{
	struct tpm_seg in[] = { { 0x80000000ULL, 1 * MiB } };
	struct tpm_seg out[4];
	tpm_u32 n;

	CHECK_EQ(tpm_sg_plan(in, 1, 8 * KiB, 16 * KiB, 4 * KiB, out, 4, &n), 0);
	CHECK_EQ(n, 1);
	CHECK_EQ(out[0].dma_addr, 0x80000000ULL + 8 * KiB);
	CHECK_EQ(out[0].nbytes, 16 * KiB);
}

static void t_sg_exact_4g_splits(void)
{
	/* A 4 GiB window cannot be one entry: 4 GiB - 4 KiB + 4 KiB. */
	struct tpm_seg in[] = { { 0x2000000000ULL, 4 * GiB } };
	struct tpm_seg out[4];
	tpm_u32 n;

	CHECK_EQ(tpm_sg_plan(in, 1, 0, 4 * GiB, 4 * KiB, out, 4, &n), 0);
	CHECK_EQ(n, 2);
	CHECK_EQ(out[0].nbytes, 4 * GiB - 4 * KiB);
	CHECK_EQ(out[1].dma_addr, 0x2000000000ULL + 4 * GiB - 4 * KiB);
	CHECK_EQ(out[1].nbytes, 4 * KiB);
	CHECK(out[0].nbytes <= 0xFFFFFFFFULL);
	/* 4 GiB - 4 KiB fits in one entry exactly. */
	CHECK_EQ(tpm_sg_plan(in, 1, 0, 4 * GiB - 4 * KiB, 4 * KiB, out, 4, &n), 0);
	CHECK_EQ(n, 1);
	/* 2 MiB pages: 4 GiB - 2 MiB + 2 MiB. */
	CHECK_EQ(tpm_sg_plan(in, 1, 0, 4 * GiB, 2 * MiB, out, 4, &n), 0);
	CHECK_EQ(n, 2);
	CHECK_EQ(out[0].nbytes, 4 * GiB - 2 * MiB);
	CHECK_EQ(out[1].nbytes, 2 * MiB);
}

static void t_sg_huge_merge_and_split(void)
{
	/* 16 GiB exported as 1 GiB contiguous chunks (tt-kmd style). */
	struct tpm_seg in[16], out[8];
	tpm_u64 base = 0x100000000000ULL, sum = 0;
	tpm_u32 i, n;

	for (i = 0; i < 16; i++)
		in[i] = (struct tpm_seg){ base + i * GiB, GiB };
	CHECK_EQ(tpm_sg_plan(in, 16, 0, 16 * GiB, 4 * KiB, NULL, 0, &n), 0);
	CHECK_EQ(n, 5);	/* 4 x (4 GiB - 4 KiB) + 16 KiB */
	CHECK_EQ(tpm_sg_plan(in, 16, 0, 16 * GiB, 4 * KiB, out, 8, &n), 0);
	for (i = 0; i < n; i++) {
		CHECK(out[i].nbytes <= 0xFFFFFFFFULL);
		CHECK_EQ(out[i].nbytes % (4 * KiB), 0);
		CHECK_EQ(out[i].dma_addr, base + sum);
		sum += out[i].nbytes;
	}
	CHECK_EQ(sum, 16 * GiB);
	CHECK_EQ(out[4].nbytes, 16 * KiB);
	/* Sub-window crossing chunk boundaries, 2 MiB pages. */
	CHECK_EQ(tpm_sg_plan(in, 16, 3 * GiB - 2 * MiB, 6 * GiB, 2 * MiB, out, 8, &n), 0);
	CHECK_EQ(n, 2);
	CHECK_EQ(out[0].dma_addr, base + 3 * GiB - 2 * MiB);
	CHECK_EQ(out[0].nbytes, 4 * GiB - 2 * MiB);
	CHECK_EQ(out[1].nbytes, 2 * GiB + 2 * MiB);
}

static void t_sg_noncontiguous(void)
{
	/* Gaps in bus address: never merged. */
	struct tpm_seg in[] = { { 0x10000, 8 * KiB }, { 0x40000, 8 * KiB }, { 0x42000, 4 * KiB } };
	struct tpm_seg out[4];
	tpm_u32 n;

	CHECK_EQ(tpm_sg_plan(in, 3, 4 * KiB, 16 * KiB, 4 * KiB, out, 4, &n), 0);
	CHECK_EQ(n, 2);
	CHECK_EQ(out[0].dma_addr, 0x11000);
	CHECK_EQ(out[0].nbytes, 4 * KiB);
	CHECK_EQ(out[1].dma_addr, 0x40000);
	CHECK_EQ(out[1].nbytes, 12 * KiB);
}

static void t_sg_errors(void)
{
	struct tpm_seg in[] = { { 0x10000, 8 * KiB }, { 0x30000, 8 * KiB } };
	struct tpm_seg odd[] = { { 0x10000, 6 * KiB }, { 0x30000, 10 * KiB } };
	struct tpm_seg zero[] = { { 0x10000, 0 } };
	struct tpm_seg out[1];
	tpm_u32 n = 99;

	/* Window past the exporter mapping. */
	CHECK_EQ(tpm_sg_plan(in, 2, 8 * KiB, 12 * KiB, 4 * KiB, out, 1, &n), -ERANGE);
	CHECK_EQ(n, 0);
	/* Unaligned window / page size. */
	CHECK_EQ(tpm_sg_plan(in, 2, 1 * KiB, 4 * KiB, 4 * KiB, out, 1, &n), -EINVAL);
	CHECK_EQ(tpm_sg_plan(in, 2, 0, 5 * KiB, 4 * KiB, out, 1, &n), -EINVAL);
	CHECK_EQ(tpm_sg_plan(in, 2, 0, 4 * KiB, 3 * KiB, out, 1, &n), -EINVAL);
	CHECK_EQ(tpm_sg_plan(in, 2, 0, 0, 4 * KiB, out, 1, &n), -EINVAL);
	/* Exporter runs not page aligned at a discontinuity. */
	CHECK_EQ(tpm_sg_plan(odd, 2, 0, 16 * KiB, 4 * KiB, NULL, 0, &n), -EINVAL);
	/* Only zero-length exporter runs. */
	CHECK_EQ(tpm_sg_plan(zero, 1, 0, 4 * KiB, 4 * KiB, NULL, 0, &n), -ERANGE);
	/* No input at all. */
	CHECK_EQ(tpm_sg_plan(NULL, 0, 0, 4 * KiB, 4 * KiB, NULL, 0, &n), -ERANGE);
	/* Too little room: reports how much is needed, writes only out_cap. */
	CHECK_EQ(tpm_sg_plan(in, 2, 0, 16 * KiB, 4 * KiB, out, 1, &n), -ENOSPC);
	CHECK_EQ(n, 2);
	CHECK_EQ(out[0].dma_addr, 0x10000);
}

/* Property test: random exporter layouts vs. a per-page reference mapping. */
static void t_sg_randomized(void)
{
	uint64_t s = 0xD1B54A32D192ED03ULL;
	int iter;

	for (iter = 0; iter < 3000; iter++) {
		struct tpm_seg in[12], out[64];
		tpm_u64 pages_total = 0, page = 4 * KiB, off, len, sum = 0;
		tpm_u64 ref_dma[256];
		tpm_u32 n_in, i, n, p, k;
		int ret;

		s ^= s << 13; s ^= s >> 7; s ^= s << 17;
		n_in = 1 + (tpm_u32)(s % 12);
		for (i = 0; i < n_in; i++) {
			tpm_u64 np = 1 + ((s >> (i * 3)) % 20);
			/* Half the time contiguous with the previous run. */
			tpm_u64 dma = (i && ((s >> (i + 30)) & 1)) ?
				in[i - 1].dma_addr + in[i - 1].nbytes :
				(0x100000ULL + i * 0x1000000ULL);

			in[i] = (struct tpm_seg){ dma, np * page };
			for (k = 0; k < np && pages_total < 256; k++)
				ref_dma[pages_total++] = dma + k * page;
		}
		if (pages_total >= 256)
			continue;
		off = (s >> 40) % pages_total;
		len = 1 + (s >> 48) % (pages_total - off);
		ret = tpm_sg_plan(in, n_in, off * page, len * page, page, out, 64, &n);
		CHECK_EQ(ret, 0);
		/* Entries, expanded page by page, reproduce the reference. */
		p = (tpm_u32)off;
		for (i = 0; i < n; i++) {
			CHECK(out[i].nbytes > 0 && out[i].nbytes % page == 0);
			if (i)	/* maximal merging: no two adjacent entries contiguous */
				CHECK(out[i - 1].dma_addr + out[i - 1].nbytes != out[i].dma_addr);
			for (k = 0; k < out[i].nbytes / page; k++)
				CHECK_EQ(out[i].dma_addr + k * page, ref_dma[p++]);
			sum += out[i].nbytes;
		}
		CHECK_EQ(sum, len * page);
	}
}

/* -------------------------------------------------------- state machine */

static void t_mr_happy_path(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(m.state, TPM_MR_ACQUIRED);
	CHECK_EQ(tpm_mr_get_pages(&m, 42), 0);
	CHECK_EQ(m.state, TPM_MR_PINNED);
	CHECK_EQ(m.core_context, 42);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	CHECK_EQ(act, 0);
	tpm_mr_dma_map_done(&m, 1, 1);
	CHECK_EQ(m.state, TPM_MR_MAPPED);
	CHECK(m.mapping_live && m.attached);
	CHECK_EQ(tpm_mr_dma_unmap(&m), 0);
	CHECK_EQ(m.state, TPM_MR_PINNED);
	CHECK(m.mapping_live);	/* teardown deferred to release */
	CHECK_EQ(tpm_mr_put_pages(&m), 0);
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_TEARDOWN | TPM_ACT_DETACH);
	CHECK_EQ(m.state, TPM_MR_RELEASED);
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_CONTRACT);
}

static void t_mr_invalid_transitions(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), -EINVAL);	/* before get_pages */
	CHECK_EQ(tpm_mr_dma_unmap(&m), -EINVAL);
	CHECK_EQ(tpm_mr_put_pages(&m), -EINVAL);
	CHECK_EQ(tpm_mr_get_pages(&m, 1), 0);
	CHECK_EQ(tpm_mr_get_pages(&m, 1), -EINVAL);		/* twice */
	CHECK_EQ(tpm_mr_dma_unmap(&m), -EINVAL);		/* not mapped */
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	tpm_mr_dma_map_done(&m, 1, 1);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), -EINVAL);	/* map twice */
	CHECK_EQ(tpm_mr_put_pages(&m), -EINVAL);		/* put while mapped */
	CHECK_EQ(tpm_mr_get_pages(&m, 1), -EINVAL);
	CHECK_EQ(m.state, TPM_MR_MAPPED);
	/* Release while mapped: everything owed, plus a contract warning. */
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_TEARDOWN | TPM_ACT_DETACH | TPM_ACT_CONTRACT);
	CHECK_EQ(tpm_mr_get_pages(&m, 1), -EINVAL);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), -EINVAL);
	CHECK_EQ(tpm_mr_dma_unmap(&m), -EINVAL);
	CHECK_EQ(tpm_mr_put_pages(&m), -EINVAL);
	CHECK_EQ(tpm_mr_invalidate_begin(&m), 0);
	CHECK_EQ(tpm_mr_invalidate_end(&m), 0);
}

static void t_mr_map_failure(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_get_pages(&m, 1), 0);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	tpm_mr_dma_map_done(&m, 1, 0);	/* attached, mapping failed */
	CHECK_EQ(m.state, TPM_MR_PINNED);
	CHECK(!m.mapping_live);
	CHECK_EQ(tpm_mr_put_pages(&m), 0);
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_DETACH);
}

static void t_mr_remap_after_unmap(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_get_pages(&m, 1), 0);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	tpm_mr_dma_map_done(&m, 1, 1);
	CHECK_EQ(tpm_mr_dma_unmap(&m), 0);
	/* The deferred mapping must be torn down before a new one. */
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	CHECK_EQ(act, TPM_ACT_TEARDOWN);
	CHECK(!m.mapping_live);
	tpm_mr_dma_map_done(&m, 0, 1);
	CHECK_EQ(m.state, TPM_MR_MAPPED);
	CHECK(m.attached);
}

/* Invalidate while mapped; the core unmaps from inside its callback (MOFED legacy). */
static void t_mr_invalidate_core_unmaps(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_get_pages(&m, 9), 0);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	tpm_mr_dma_map_done(&m, 1, 1);
	CHECK_EQ(tpm_mr_invalidate_begin(&m), TPM_ACT_NOTIFY_CORE);
	CHECK_EQ(m.invalidations, 1);
	/* ... inside the core's invalidate callback: */
	CHECK_EQ(tpm_mr_dma_unmap(&m), 0);
	CHECK_EQ(tpm_mr_put_pages(&m), 0);
	/* ... callback returned. */
	CHECK_EQ(tpm_mr_invalidate_end(&m), TPM_ACT_TEARDOWN);
	CHECK_EQ(m.state, TPM_MR_ACQUIRED);
	CHECK(m.revoked && !m.mapping_live);
	/* No resurrection after revoke. */
	CHECK_EQ(tpm_mr_get_pages(&m, 9), -ENODEV);
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_DETACH);
}

/* Invalidate while mapped; the core only fences, unmaps later from dereg. */
static void t_mr_invalidate_core_defers(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_get_pages(&m, 9), 0);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	tpm_mr_dma_map_done(&m, 1, 1);
	CHECK_EQ(tpm_mr_invalidate_begin(&m), TPM_ACT_NOTIFY_CORE);
	CHECK_EQ(tpm_mr_invalidate_end(&m), TPM_ACT_TEARDOWN);
	CHECK_EQ(m.state, TPM_MR_INVALIDATED);
	/* A second revoke is a no-op. */
	CHECK_EQ(tpm_mr_invalidate_begin(&m), 0);
	CHECK_EQ(tpm_mr_invalidate_end(&m), 0);
	CHECK_EQ(m.invalidations, 1);
	/* The dereg path then runs normally, with nothing left to tear down. */
	CHECK_EQ(tpm_mr_dma_unmap(&m), 0);
	CHECK_EQ(tpm_mr_put_pages(&m), 0);
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_DETACH);
}

/* Invalidate and a concurrent dereg: dereg's unmap ran before the callback. */
static void t_mr_invalidate_races_dereg(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_get_pages(&m, 9), 0);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), 0);
	tpm_mr_dma_map_done(&m, 1, 1);
	CHECK_EQ(tpm_mr_invalidate_begin(&m), TPM_ACT_NOTIFY_CORE);
	CHECK_EQ(tpm_mr_dma_unmap(&m), 0);	/* dereg, under the core's lock */
	CHECK_EQ(tpm_mr_invalidate_end(&m), TPM_ACT_TEARDOWN);
	CHECK_EQ(m.state, TPM_MR_PINNED);
	CHECK_EQ(tpm_mr_put_pages(&m), 0);
	CHECK_EQ(tpm_mr_release(&m), TPM_ACT_DETACH);
}

/* Revoke while a dma_map is still in progress: must not notify (deadlock). */
static void t_mr_invalidate_while_pinned(void)
{
	struct tpm_mr m;
	unsigned int act;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_get_pages(&m, 3), 0);
	CHECK_EQ(tpm_mr_invalidate_begin(&m), 0);
	CHECK_EQ(tpm_mr_invalidate_end(&m), 0);
	CHECK_EQ(m.state, TPM_MR_PINNED);
	CHECK_EQ(tpm_mr_dma_map_begin(&m, &act), -ENODEV);
	CHECK_EQ(tpm_mr_put_pages(&m), 0);
	CHECK_EQ(tpm_mr_release(&m), 0);
}

static void t_mr_invalidate_before_get_pages(void)
{
	struct tpm_mr m;

	tpm_mr_init(&m);
	CHECK_EQ(tpm_mr_invalidate_begin(&m), 0);
	CHECK_EQ(tpm_mr_get_pages(&m, 3), -ENODEV);
	CHECK_EQ(m.state, TPM_MR_ACQUIRED);
	CHECK_EQ(tpm_mr_release(&m), 0);
}

static void t_mr_state_names(void)
{
	CHECK(!strcmp(tpm_mr_state_name(TPM_MR_ACQUIRED), "acquired"));
	CHECK(!strcmp(tpm_mr_state_name(TPM_MR_MAPPED), "mapped"));
	CHECK(!strcmp(tpm_mr_state_name(TPM_MR_INVALIDATED), "invalidated"));
	CHECK(!strcmp(tpm_mr_state_name((enum tpm_mr_state)99), "unknown"));
}

static int mr_eq(const struct tpm_mr *a, const struct tpm_mr *b)
{
	return a->state == b->state && a->core_context == b->core_context &&
	       a->revoked == b->revoked && a->mapping_live == b->mapping_live &&
	       a->attached == b->attached && a->invalidations == b->invalidations;
}

/* Exhaustive: from every reachable state, every op either succeeds per the
 * documented table or fails without changing anything. */
static void t_mr_exhaustive(void)
{
	enum { OP_GET, OP_MAP, OP_UNMAP, OP_PUT, OP_INVAL, OP_REL, N_OPS };
	int seq, len;

	for (len = 1; len <= 6; len++) {
		int total = 1, i;

		for (i = 0; i < len; i++)
			total *= N_OPS;
		for (seq = 0; seq < total; seq++) {
			struct tpm_mr m;
			int code = seq;

			tpm_mr_init(&m);
			for (i = 0; i < len; i++, code /= N_OPS) {
				struct tpm_mr before = m;
				unsigned int act = 0;
				int ret = 0;

				switch (code % N_OPS) {
				case OP_GET:
					ret = tpm_mr_get_pages(&m, 5);
					break;
				case OP_MAP:
					ret = tpm_mr_dma_map_begin(&m, &act);
					if (!ret)
						tpm_mr_dma_map_done(&m, 1, 1);
					break;
				case OP_UNMAP:
					ret = tpm_mr_dma_unmap(&m);
					break;
				case OP_PUT:
					ret = tpm_mr_put_pages(&m);
					break;
				case OP_INVAL:
					act = tpm_mr_invalidate_begin(&m);
					act |= tpm_mr_invalidate_end(&m);
					CHECK(!(act & TPM_ACT_NOTIFY_CORE) ||
					      before.state == TPM_MR_MAPPED);
					break;
				case OP_REL:
					act = tpm_mr_release(&m);
					CHECK_EQ(m.state, TPM_MR_RELEASED);
					CHECK(!m.mapping_live && !m.attached);
					break;
				}
				if (ret)
					CHECK(mr_eq(&before, &m));
				/* Invariants. */
				CHECK(!(m.mapping_live && !m.attached));
				CHECK(m.state != TPM_MR_MAPPED || m.mapping_live);
				CHECK(m.state != TPM_MR_INVALIDATED || m.revoked);
			}
		}
	}
}

int main(void)
{
	run("validate_ok", t_validate_ok);
	run("validate_alignment", t_validate_alignment);
	run("validate_wrap_and_end", t_validate_wrap_and_end);
	run("registry_add_lookup", t_registry_add_lookup);
	run("registry_overlap", t_registry_overlap);
	run("registry_adjacent", t_registry_adjacent);
	run("registry_owners_independent", t_registry_owners_independent);
	run("registry_capacity", t_registry_capacity);
	run("registry_remove", t_registry_remove);
	run("registry_remove_file", t_registry_remove_file);
	run("registry_id_wrap", t_registry_id_wrap);
	run("registry_randomized", t_registry_randomized);
	run("window_4k_rounding", t_window_4k_rounding);
	run("window_2m", t_window_2m);
	run("window_fallback", t_window_fallback);
	run("window_congruence", t_window_congruence);
	run("window_invalid", t_window_invalid);
	run("sg_max_entry", t_sg_max_entry);
	run("sg_single_small", t_sg_single_small);
	run("sg_exact_4g_splits", t_sg_exact_4g_splits);
	run("sg_huge_merge_and_split", t_sg_huge_merge_and_split);
	run("sg_noncontiguous", t_sg_noncontiguous);
	run("sg_errors", t_sg_errors);
	run("sg_randomized", t_sg_randomized);
	run("mr_happy_path", t_mr_happy_path);
	run("mr_invalid_transitions", t_mr_invalid_transitions);
	run("mr_map_failure", t_mr_map_failure);
	run("mr_remap_after_unmap", t_mr_remap_after_unmap);
	run("mr_invalidate_core_unmaps", t_mr_invalidate_core_unmaps);
	run("mr_invalidate_core_defers", t_mr_invalidate_core_defers);
	run("mr_invalidate_races_dereg", t_mr_invalidate_races_dereg);
	run("mr_invalidate_while_pinned", t_mr_invalidate_while_pinned);
	run("mr_invalidate_before_get_pages", t_mr_invalidate_before_get_pages);
	run("mr_state_names", t_mr_state_names);
	run("mr_exhaustive", t_mr_exhaustive);
	printf("%d passed, %d failed\n", g_passed, g_failed);
	return g_failed ? 1 : 0;
}
