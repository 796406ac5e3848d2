// SPDX-License-Identifier: GPL-2.0-only
/*
 * tt_peermem: MOFED peer-memory client for Tenstorrent (Blackhole) DRAM
 * exported by tt-kmd as a dma-buf (TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF,
 * tt-kmd >= 2.10). Lets ibv_reg_mr() on a registered virtual range produce
 * an MR whose pages are the NPU's BAR window, so the NIC DMAs straight into
 * NPU DRAM.
 *
 * Pieces:
 *  - /dev/tt_peermem: REGISTER / UNREGISTER (VA range -> dma-buf) pairs.
 *  - peer_memory_client callbacks, called by MOFED's ib_core.
 *  - dma-buf importer: dynamic attachment with allow_peer2peer (tt-kmd
 *    refuses importers without it), pinned, mapped under the dma-buf's
 *    reservation lock; move_notify (tt-kmd revokes exports on device
 *    removal) is forwarded to the RDMA core's invalidate callback.
 *  - debugfs tt_peermem/{stats,ranges[,revoke]}.
 * The decisions (which range, page size, sg entries, state transitions)
 * live in peermem_core.c; this file only performs them.
 *
 * Lock order: dma-buf resv -> (RDMA core's per-MR lock) -> ctx->lock;
 * tpm_reg_lock is a leaf. See peermem_core.h for why teardown of the
 * exporter mapping happens only in move_notify and release.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/build_bug.h>
#include <linux/debugfs.h>
#include <linux/dma-buf.h>
#include <linux/dma-direction.h>
#include <linux/dma-resv.h>
#include <linux/errno.h>
#include <linux/fs.h>
#include <linux/kernel.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/scatterlist.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>

#include "peer_mem_abi.h"
#include "peermem_core.h"
#include "tt_peermem_uapi.h"

#if LINUX_VERSION_CODE < KERNEL_VERSION(5, 16, 0)
#error "tt_peermem needs Linux >= 5.16 (dma-buf namespace, dynamic importers)"
#endif

/* dma_buf_* live in the DMA_BUF namespace; 6.13 made the name a string. */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 13, 0)
MODULE_IMPORT_NS("DMA_BUF");
#else
MODULE_IMPORT_NS(DMA_BUF);
#endif

#define TPM_VERSION "0.1.0"

static unsigned int max_ranges = 1024;
module_param(max_ranges, uint, 0444);
MODULE_PARM_DESC(max_ranges, "Registry capacity, in (VA range -> dma-buf) pairs (default 1024)");

static unsigned long max_page_size = 2UL << 20;
module_param(max_page_size, ulong, 0644);
MODULE_PARM_DESC(max_page_size,
		 "Largest page size, in bytes, reported to the RDMA core: 2097152 (default), 65536 or 4096");

static char *require_exporter = "tenstorrent";
module_param(require_exporter, charp, 0444);
MODULE_PARM_DESC(require_exporter,
		 "Only accept dma-bufs whose exporter module has this name (default tenstorrent; empty = any)");

static bool debug_revoke;
module_param(debug_revoke, bool, 0444);
MODULE_PARM_DESC(debug_revoke,
		 "Create debugfs tt_peermem/revoke to simulate an exporter revoke (testing only)");

/* ------------------------------------------------------------------ state */

static DEFINE_MUTEX(tpm_reg_lock);	/* protects tpm_reg */
static struct tpm_registry tpm_reg;
static struct tpm_range *tpm_reg_storage;

static void *tpm_reg_handle;			/* from ib_register_peer_memory_client */
static invalidate_peer_memory tpm_core_invalidate;	/* filled in by the core */

static struct dentry *tpm_debugfs;

static struct {
	atomic64_t acquires, acquire_misses, get_pages, maps, map_failures;
	atomic64_t unmaps, put_pages, releases, invalidations, contract_warnings;
} tpm_stats;

/* One context per acquire() of the RDMA core (one MR). */
struct tpm_ctx {
	struct mutex lock;		/* protects sm, core_sgt(_valid) */
	struct tpm_mr sm;
	struct tpm_window win;		/* page-rounded slice of the range */
	unsigned long addr;		/* bytes: VA as acquired */
	size_t size;			/* bytes: length as acquired */
	u32 range_id;
	struct dma_buf *dmabuf;		/* own reference, acquire..release */
	struct dma_buf_attachment *attach;
	struct sg_table *exp_sgt;	/* exporter mapping; changed under resv */
	struct sg_table core_sgt;	/* the table handed to the core */
	bool core_sgt_valid;
};

static void tpm_check_errno_numbers(void)
{
	BUILD_BUG_ON(TPM_ENOENT != ENOENT);
	BUILD_BUG_ON(TPM_ENOMEM != ENOMEM);
	BUILD_BUG_ON(TPM_EBUSY != EBUSY);
	BUILD_BUG_ON(TPM_EEXIST != EEXIST);
	BUILD_BUG_ON(TPM_ENODEV != ENODEV);
	BUILD_BUG_ON(TPM_EINVAL != EINVAL);
	BUILD_BUG_ON(TPM_ENOSPC != ENOSPC);
	BUILD_BUG_ON(TPM_ERANGE != ERANGE);
	BUILD_BUG_ON(TPM_EOVERFLOW != EOVERFLOW);
	BUILD_BUG_ON(sizeof(tpm_u64) != sizeof(u64));
}

static u64 tpm_owner_key(struct mm_struct *mm)
{
	return (u64)(uintptr_t)mm;
}

static struct mm_struct *tpm_owner_mm(u64 key)
{
	return (struct mm_struct *)(uintptr_t)key;
}

/* Drop what a registry entry holds: its dma-buf and its mm reference. */
static void tpm_range_put(const struct tpm_range *rg)
{
	dma_buf_put(rg->cookie);
	mmdrop(tpm_owner_mm(rg->owner));
}

/* --------------------------------------------------------- dma-buf import */

/* Unpin and unmap the exporter mapping. Caller holds the dma-buf's resv. */
static void tpm_teardown_locked(struct tpm_ctx *ctx)
{
	dma_resv_assert_held(ctx->dmabuf->resv);
	if (!ctx->exp_sgt)
		return;
	dma_buf_unmap_attachment(ctx->attach, ctx->exp_sgt, DMA_BIDIRECTIONAL);
	dma_buf_unpin(ctx->attach);
	ctx->exp_sgt = NULL;
}

/*
 * The exporter moves or revokes the buffer (tt-kmd: device removal). Called
 * with the dma-buf's resv held. Fence the MR through the RDMA core, then
 * drop our mapping while the lock is still held.
 */
static void tpm_move_notify(struct dma_buf_attachment *attach)
{
	struct tpm_ctx *ctx = attach->importer_priv;
	unsigned int act;
	u64 core_context;

	dma_resv_assert_held(attach->dmabuf->resv);

	mutex_lock(&ctx->lock);
	act = tpm_mr_invalidate_begin(&ctx->sm);
	core_context = ctx->sm.core_context;
	mutex_unlock(&ctx->lock);

	if (act & TPM_ACT_NOTIFY_CORE) {
		atomic64_inc(&tpm_stats.invalidations);
		pr_info("range %u: dma-buf revoked, invalidating MR\n", ctx->range_id);
		/* May call our dma_unmap/put_pages from this very task. */
		if (tpm_core_invalidate)
			tpm_core_invalidate(tpm_reg_handle, core_context);
	}

	mutex_lock(&ctx->lock);
	act = tpm_mr_invalidate_end(&ctx->sm);
	mutex_unlock(&ctx->lock);
	if (act & TPM_ACT_TEARDOWN)
		tpm_teardown_locked(ctx);
}

static const struct dma_buf_attach_ops tpm_importer_ops = {
	.allow_peer2peer = true,
	.move_notify = tpm_move_notify,
};

/*
 * Fill sg_head (allocated here) with the NIC-visible addresses of the MR's
 * window, from the exporter's mapping of the whole dma-buf.
 */
static int tpm_build_core_sgt(struct tpm_ctx *ctx, struct sg_table *exp_sgt,
			      struct sg_table *sg_head, tpm_u32 *n_out)
{
	struct tpm_seg *in, *out = NULL;
	struct scatterlist *sg;
	unsigned int i, n_in = exp_sgt->nents;
	int ret;

	in = kvmalloc_array(max(n_in, 1U), sizeof(*in), GFP_KERNEL);
	if (!in)
		return -ENOMEM;
	for_each_sgtable_dma_sg(exp_sgt, sg, i) {
		in[i].dma_addr = sg_dma_address(sg);
		in[i].nbytes = sg_dma_len(sg);
	}

	ret = tpm_sg_plan(in, n_in, ctx->win.dmabuf_offset, ctx->win.nbytes,
			  ctx->win.page_size, NULL, 0, n_out);
	if (ret)
		goto out;
	if (*n_out > INT_MAX) {
		ret = -EOVERFLOW;
		goto out;
	}
	out = kvmalloc_array(*n_out, sizeof(*out), GFP_KERNEL);
	if (!out) {
		ret = -ENOMEM;
		goto out;
	}
	ret = tpm_sg_plan(in, n_in, ctx->win.dmabuf_offset, ctx->win.nbytes,
			  ctx->win.page_size, out, *n_out, n_out);
	if (ret)
		goto out;

	ret = sg_alloc_table(sg_head, *n_out, GFP_KERNEL);
	if (ret)
		goto out;
	/* Page-less entries: only the DMA address and length mean anything. */
	for_each_sg(sg_head->sgl, sg, *n_out, i) {
		sg->offset = 0;
		sg->length = (unsigned int)out[i].nbytes;
		sg_dma_address(sg) = out[i].dma_addr;
		sg_dma_len(sg) = (unsigned int)out[i].nbytes;
	}
out:
	if (ret == -EINVAL)
		pr_warn("range %u: exporter mapping not aligned to %llu-byte pages; try max_page_size=4096\n",
			ctx->range_id, ctx->win.page_size);
	kvfree(out);
	kvfree(in);
	return ret;
}

/* -------------------------------------------------- peer_memory_client ops */

static int tpm_acquire(unsigned long addr, size_t size,
		       void *peer_mem_private_data, char *peer_mem_name,
		       void **client_context)
{
	const struct tpm_range *rg;
	struct tpm_window win;
	struct tpm_ctx *ctx;

	if (!current->mm)
		return 0;
	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return 0;	/* "not mine": errors must not claim the range */

	mutex_lock(&tpm_reg_lock);
	rg = tpm_registry_lookup(&tpm_reg, tpm_owner_key(current->mm), addr, size);
	if (!rg || tpm_window_compute(rg, addr, size, READ_ONCE(max_page_size), &win)) {
		mutex_unlock(&tpm_reg_lock);
		kfree(ctx);
		atomic64_inc(&tpm_stats.acquire_misses);
		return 0;
	}
	ctx->dmabuf = rg->cookie;
	get_dma_buf(ctx->dmabuf);
	ctx->range_id = rg->id;
	mutex_unlock(&tpm_reg_lock);

	/* Keep rmmod from blocking in ib_unregister while MRs exist. */
	if (!try_module_get(THIS_MODULE)) {
		dma_buf_put(ctx->dmabuf);
		kfree(ctx);
		return 0;
	}
	mutex_init(&ctx->lock);
	tpm_mr_init(&ctx->sm);
	ctx->win = win;
	ctx->addr = addr;
	ctx->size = size;
	*client_context = ctx;
	atomic64_inc(&tpm_stats.acquires);
	return 1;
}

static int tpm_get_pages(unsigned long addr, size_t size, int write, int force,
			 struct sg_table *sg_head, void *client_context,
			 u64 core_context)
{
	struct tpm_ctx *ctx = client_context;
	int ret;

	if (!ctx || addr != ctx->addr || size != ctx->size)
		return -EINVAL;
	mutex_lock(&ctx->lock);
	ret = tpm_mr_get_pages(&ctx->sm, core_context);
	mutex_unlock(&ctx->lock);
	if (!ret)
		atomic64_inc(&tpm_stats.get_pages);
	return ret;
}

static int tpm_dma_map(struct sg_table *sg_head, void *client_context,
		       struct device *dma_device, int dmasync, int *nmap)
{
	struct tpm_ctx *ctx = client_context;
	struct dma_buf_attachment *attach;
	struct sg_table *exp_sgt;
	unsigned int act;
	tpm_u32 n_out = 0;
	int ret;

	if (!ctx || !sg_head || !dma_device || !nmap)
		return -EINVAL;

	/* dma_buf_dynamic_attach() takes the resv itself: attach first. */
	if (!ctx->attach) {
		attach = dma_buf_dynamic_attach(ctx->dmabuf, dma_device,
						&tpm_importer_ops, ctx);
		if (IS_ERR(attach)) {
			ret = PTR_ERR(attach);
			pr_warn("range %u: dma_buf_dynamic_attach: %d\n", ctx->range_id, ret);
			goto out_count;
		}
		mutex_lock(&ctx->lock);
		ctx->attach = attach;
		tpm_mr_dma_map_done(&ctx->sm, true, false);
		mutex_unlock(&ctx->lock);
	} else if (ctx->attach->dev != dma_device) {
		ret = -EINVAL;
		goto out_count;
	}

	dma_resv_lock(ctx->dmabuf->resv, NULL);
	mutex_lock(&ctx->lock);
	ret = tpm_mr_dma_map_begin(&ctx->sm, &act);
	mutex_unlock(&ctx->lock);
	if (ret)
		goto out_unlock;
	if (act & TPM_ACT_TEARDOWN)
		tpm_teardown_locked(ctx);

	ret = dma_buf_pin(ctx->attach);
	if (ret)
		goto out_unlock;
	exp_sgt = dma_buf_map_attachment(ctx->attach, DMA_BIDIRECTIONAL);
	if (IS_ERR(exp_sgt)) {
		ret = PTR_ERR(exp_sgt);
		goto out_unpin;
	}
	ret = tpm_build_core_sgt(ctx, exp_sgt, sg_head, &n_out);
	if (ret)
		goto out_unmap;

	mutex_lock(&ctx->lock);
	ctx->exp_sgt = exp_sgt;
	ctx->core_sgt = *sg_head;
	ctx->core_sgt_valid = true;
	tpm_mr_dma_map_done(&ctx->sm, true, true);
	mutex_unlock(&ctx->lock);
	dma_resv_unlock(ctx->dmabuf->resv);

	*nmap = (int)n_out;
	atomic64_inc(&tpm_stats.maps);
	return 0;

out_unmap:
	dma_buf_unmap_attachment(ctx->attach, exp_sgt, DMA_BIDIRECTIONAL);
out_unpin:
	dma_buf_unpin(ctx->attach);
out_unlock:
	dma_resv_unlock(ctx->dmabuf->resv);
out_count:
	atomic64_inc(&tpm_stats.map_failures);
	return ret;
}

/*
 * Never takes the resv: the core may call this holding its per-MR lock,
 * which a concurrent move_notify (resv held) may be waiting for. The
 * exporter mapping is dropped in release() or move_notify instead.
 */
static int tpm_dma_unmap(struct sg_table *sg_head, void *client_context,
			 struct device *dma_device)
{
	struct tpm_ctx *ctx = client_context;
	int ret;

	if (!ctx)
		return -EINVAL;
	mutex_lock(&ctx->lock);
	if (ctx->core_sgt_valid && sg_head && sg_head->sgl != ctx->core_sgt.sgl) {
		mutex_unlock(&ctx->lock);
		WARN_ONCE(1, "tt_peermem: dma_unmap with a foreign sg_table\n");
		return -EINVAL;
	}
	ret = tpm_mr_dma_unmap(&ctx->sm);
	if (!ret && ctx->core_sgt_valid) {
		sg_free_table(&ctx->core_sgt);
		ctx->core_sgt_valid = false;
	}
	mutex_unlock(&ctx->lock);
	if (!ret)
		atomic64_inc(&tpm_stats.unmaps);
	return ret;
}

static void tpm_put_pages(struct sg_table *sg_head, void *client_context)
{
	struct tpm_ctx *ctx = client_context;
	enum tpm_mr_state st;
	int ret;

	if (!ctx)
		return;
	mutex_lock(&ctx->lock);
	st = ctx->sm.state;
	ret = tpm_mr_put_pages(&ctx->sm);
	mutex_unlock(&ctx->lock);
	if (ret) {
		atomic64_inc(&tpm_stats.contract_warnings);
		pr_warn_ratelimited("range %u: put_pages in state %s\n",
				    ctx->range_id, tpm_mr_state_name(st));
		return;
	}
	atomic64_inc(&tpm_stats.put_pages);
}

static unsigned long tpm_get_page_size(void *client_context)
{
	struct tpm_ctx *ctx = client_context;

	return ctx ? (unsigned long)ctx->win.page_size : PAGE_SIZE;
}

static void tpm_release(void *client_context)
{
	struct tpm_ctx *ctx = client_context;
	enum tpm_mr_state st;
	unsigned int act;

	if (!ctx)
		return;
	dma_resv_lock(ctx->dmabuf->resv, NULL);
	mutex_lock(&ctx->lock);
	st = ctx->sm.state;
	act = tpm_mr_release(&ctx->sm);
	mutex_unlock(&ctx->lock);
	if (act & TPM_ACT_TEARDOWN)
		tpm_teardown_locked(ctx);
	dma_resv_unlock(ctx->dmabuf->resv);

	if (act & TPM_ACT_CONTRACT) {
		atomic64_inc(&tpm_stats.contract_warnings);
		pr_warn_ratelimited("range %u: release in state %s\n",
				    ctx->range_id, tpm_mr_state_name(st));
	}
	if (ctx->core_sgt_valid)
		sg_free_table(&ctx->core_sgt);
	/* Detach takes the resv itself; after it no move_notify can come. */
	if (act & TPM_ACT_DETACH)
		dma_buf_detach(ctx->dmabuf, ctx->attach);
	dma_buf_put(ctx->dmabuf);
	mutex_destroy(&ctx->lock);
	kfree(ctx);
	atomic64_inc(&tpm_stats.releases);
	module_put(THIS_MODULE);
}

static struct peer_memory_client tpm_client = {
	.name = "tt_peermem",
	.version = TPM_VERSION,	/* version[15] stays 0: legacy semantics */
	.acquire = tpm_acquire,
	.get_pages = tpm_get_pages,
	.dma_map = tpm_dma_map,
	.dma_unmap = tpm_dma_unmap,
	.put_pages = tpm_put_pages,
	.get_page_size = tpm_get_page_size,
	.release = tpm_release,
};

/* ------------------------------------------------------- character device */

static long tpm_ioctl_register(struct file *filp,
			       struct tt_peermem_register __user *uarg)
{
	struct tt_peermem_register req;
	struct tpm_range rg = { 0 };
	struct dma_buf *dmabuf;
	tpm_u32 id;
	int ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (req.argsz != sizeof(req) || req.flags)
		return -EINVAL;
	if (!current->mm)
		return -EINVAL;

	dmabuf = dma_buf_get(req.dmabuf_fd);
	if (IS_ERR(dmabuf))
		return PTR_ERR(dmabuf);
	if (require_exporter && require_exporter[0] &&
	    (!dmabuf->exp_name || strcmp(dmabuf->exp_name, require_exporter))) {
		pr_info_ratelimited("refusing dma-buf from exporter '%s' (require_exporter=%s)\n",
				    dmabuf->exp_name ? dmabuf->exp_name : "?", require_exporter);
		ret = -EPERM;
		goto err_put;
	}
	ret = tpm_range_validate(req.va_start, req.nbytes, req.dmabuf_offset, dmabuf->size);
	if (ret)
		goto err_put;

	rg.va_start = req.va_start;
	rg.nbytes = req.nbytes;
	rg.dmabuf_offset = req.dmabuf_offset;
	rg.owner = tpm_owner_key(current->mm);
	rg.file = filp;
	rg.cookie = dmabuf;
	/* Pin the mm_struct so its address, our owner key, is not reused. */
	mmgrab(current->mm);
	mutex_lock(&tpm_reg_lock);
	ret = tpm_registry_add(&tpm_reg, &rg, &id);
	mutex_unlock(&tpm_reg_lock);
	if (ret) {
		mmdrop(current->mm);
		goto err_put;
	}
	if (put_user(id, &uarg->id)) {
		mutex_lock(&tpm_reg_lock);
		ret = tpm_registry_remove(&tpm_reg, filp, id, &rg);
		mutex_unlock(&tpm_reg_lock);
		if (!ret)
			tpm_range_put(&rg);
		return -EFAULT;
	}
	return 0;

err_put:
	dma_buf_put(dmabuf);
	return ret;
}

static long tpm_ioctl_unregister(struct file *filp,
				 struct tt_peermem_unregister __user *uarg)
{
	struct tt_peermem_unregister req;
	struct tpm_range rg;
	int ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (req.argsz != sizeof(req))
		return -EINVAL;
	mutex_lock(&tpm_reg_lock);
	ret = tpm_registry_remove(&tpm_reg, filp, req.id, &rg);
	mutex_unlock(&tpm_reg_lock);
	if (!ret)
		tpm_range_put(&rg);
	return ret;
}

static long tpm_ioctl(struct file *filp, unsigned int cmd, unsigned long arg)
{
	switch (cmd) {
	case TT_PEERMEM_IOCTL_REGISTER:
		return tpm_ioctl_register(filp, (void __user *)arg);
	case TT_PEERMEM_IOCTL_UNREGISTER:
		return tpm_ioctl_unregister(filp, (void __user *)arg);
	default:
		return -ENOTTY;
	}
}

static void tpm_drop_file(const void *filp)
{
	struct tpm_range rg;
	int more;

	do {
		mutex_lock(&tpm_reg_lock);
		more = tpm_registry_remove_file(&tpm_reg, filp, &rg);
		mutex_unlock(&tpm_reg_lock);
		if (more)
			tpm_range_put(&rg);
	} while (more);
}

static int tpm_file_release(struct inode *inode, struct file *filp)
{
	tpm_drop_file(filp);
	return 0;
}

static const struct file_operations tpm_fops = {
	.owner = THIS_MODULE,
	.open = nonseekable_open,
	.release = tpm_file_release,
	.unlocked_ioctl = tpm_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice tpm_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = TT_PEERMEM_DEVICE_NAME,
	.fops = &tpm_fops,
	.mode = 0660,
};

/* ---------------------------------------------------------------- debugfs */

static int tpm_stats_show(struct seq_file *m, void *unused)
{
	tpm_u32 count;

	mutex_lock(&tpm_reg_lock);
	count = tpm_reg.count;
	mutex_unlock(&tpm_reg_lock);
	seq_printf(m, "version %s\nranges %u\ncapacity %u\nmax_page_size %lu\n",
		   TPM_VERSION, count, max_ranges, READ_ONCE(max_page_size));
#define TPM_SHOW(f) seq_printf(m, #f " %lld\n", (long long)atomic64_read(&tpm_stats.f))
	TPM_SHOW(acquires);
	TPM_SHOW(acquire_misses);
	TPM_SHOW(get_pages);
	TPM_SHOW(maps);
	TPM_SHOW(map_failures);
	TPM_SHOW(unmaps);
	TPM_SHOW(put_pages);
	TPM_SHOW(releases);
	TPM_SHOW(invalidations);
	TPM_SHOW(contract_warnings);
#undef TPM_SHOW
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(tpm_stats);

static int tpm_ranges_show(struct seq_file *m, void *unused)
{
	tpm_u32 i;

	seq_puts(m, "id owner va_start nbytes dmabuf_offset exporter dmabuf_nbytes\n");
	mutex_lock(&tpm_reg_lock);
	for (i = 0; i < tpm_reg.count; i++) {
		const struct tpm_range *rg = &tpm_reg.ranges[i];
		const struct dma_buf *db = rg->cookie;

		seq_printf(m, "%u %p 0x%llx %llu %llu %s %zu\n", rg->id,
			   tpm_owner_mm(rg->owner), rg->va_start, rg->nbytes,
			   rg->dmabuf_offset, db->exp_name ? db->exp_name : "?",
			   db->size);
	}
	mutex_unlock(&tpm_reg_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(tpm_ranges);

/* Write a registration id: run the exporter-revoke path on its dma-buf. */
static ssize_t tpm_revoke_write(struct file *file, const char __user *ubuf,
				size_t len, loff_t *ppos)
{
	struct dma_buf *dmabuf = NULL;
	tpm_u32 i;
	u32 id;
	int ret;

	ret = kstrtou32_from_user(ubuf, len, 0, &id);
	if (ret)
		return ret;
	mutex_lock(&tpm_reg_lock);
	for (i = 0; i < tpm_reg.count; i++) {
		if (tpm_reg.ranges[i].id == id) {
			dmabuf = tpm_reg.ranges[i].cookie;
			get_dma_buf(dmabuf);
			break;
		}
	}
	mutex_unlock(&tpm_reg_lock);
	if (!dmabuf)
		return -ENOENT;
	dma_resv_lock(dmabuf->resv, NULL);
	dma_buf_move_notify(dmabuf);
	dma_resv_unlock(dmabuf->resv);
	dma_buf_put(dmabuf);
	return (ssize_t)len;
}

static const struct file_operations tpm_revoke_fops = {
	.owner = THIS_MODULE,
	.write = tpm_revoke_write,
	.llseek = noop_llseek,
};

static void tpm_debugfs_init(void)
{
	tpm_debugfs = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_file("stats", 0444, tpm_debugfs, NULL, &tpm_stats_fops);
	debugfs_create_file("ranges", 0400, tpm_debugfs, NULL, &tpm_ranges_fops);
	if (debug_revoke)
		debugfs_create_file("revoke", 0200, tpm_debugfs, NULL, &tpm_revoke_fops);
}

/* ------------------------------------------------------------------ module */

static int __init tpm_init(void)
{
	int ret;

	tpm_check_errno_numbers();
	if (!max_ranges || max_ranges > (1U << 20))
		return -EINVAL;
	tpm_reg_storage = kvcalloc(max_ranges, sizeof(*tpm_reg_storage), GFP_KERNEL);
	if (!tpm_reg_storage)
		return -ENOMEM;
	tpm_registry_init(&tpm_reg, tpm_reg_storage, max_ranges);

	ret = misc_register(&tpm_misc);
	if (ret)
		goto err_free;
	tpm_debugfs_init();

	tpm_reg_handle = ib_register_peer_memory_client(&tpm_client, &tpm_core_invalidate);
	if (!tpm_reg_handle) {
		pr_err("ib_register_peer_memory_client failed\n");
		ret = -EINVAL;
		goto err_misc;
	}
	pr_info("registered peer-memory client %s %s (max_page_size %lu)\n",
		tpm_client.name, tpm_client.version, max_page_size);
	return 0;

err_misc:
	debugfs_remove_recursive(tpm_debugfs);
	misc_deregister(&tpm_misc);
err_free:
	kvfree(tpm_reg_storage);
	return ret;
}

static void __exit tpm_exit(void)
{
	struct tpm_range rg;

	/* No MR is left: each holds a module reference until release(). */
	ib_unregister_peer_memory_client(tpm_reg_handle);
	debugfs_remove_recursive(tpm_debugfs);
	misc_deregister(&tpm_misc);
	/* Open files hold the module too, so this finds nothing; be safe. */
	while (tpm_reg.count &&
	       tpm_registry_remove_file(&tpm_reg, tpm_reg.ranges[0].file, &rg))
		tpm_range_put(&rg);
	kvfree(tpm_reg_storage);
}

module_init(tpm_init);
module_exit(tpm_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Peer-memory client: RDMA to Tenstorrent DRAM via tt-kmd dma-buf");
MODULE_VERSION(TPM_VERSION);
