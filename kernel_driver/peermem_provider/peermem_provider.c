// SPDX-License-Identifier: GPL-2.0-only
/*
 * peermem_provider: TEST ONLY stand-in for MOFED's ib_core peer-memory API.
 *
 * Exports ib_register_peer_memory_client / ib_unregister_peer_memory_client
 * so tt_peermem links (modpost) and loads on kernels without MOFED, and
 * drives a registered client the way MOFED's core does, through debugfs:
 *
 *   /sys/kernel/debug/peermem_provider/
 *     control        write "map ADDR SIZE" (ADDR hex, SIZE bytes):
 *                        acquire -> get_pages -> get_page_size -> dma_map
 *                    write "unmap": dma_unmap -> put_pages -> release
 *                    write "cycle ADDR SIZE": map then unmap
 *                    read: one line describing the last command's results
 *     clients        registered client names and versions
 *     sgl            the current MR's DMA entries, "DMA_ADDR LEN" (hex, bytes)
 *                    one per line; empty when no MR is mapped
 *     invalidations  invalidate callbacks received (count)
 *
 * The "NIC" is a platform device with a 64-bit DMA mask (dma-direct).
 * On invalidation it behaves like MOFED for a legacy client: it fences
 * (nothing to fence here) and then calls dma_unmap and put_pages from
 * inside the callback. Never load this next to MOFED.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/debugfs.h>
#include <linux/dma-mapping.h>
#include <linux/kernel.h>
#include <linux/list.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/platform_device.h>
#include <linux/scatterlist.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/uaccess.h>

#include "../tt_peermem/peer_mem_abi.h"

struct prov_client {
	struct list_head node;
	const struct peer_memory_client *ops;
};

/* The one MR ("umem") this provider holds between map and unmap. */
struct prov_mr {
	struct prov_client *client;
	void *ctx;
	struct sg_table sgt;
	u64 core_context;
	unsigned long addr;		/* bytes: VA */
	size_t size;			/* bytes */
	bool pinned, mapped;
};

static DEFINE_MUTEX(prov_lock);	/* protects everything below */
static LIST_HEAD(prov_clients);
static struct prov_mr prov_mr;
static bool prov_mr_valid;
static u64 prov_next_core_context = 1;
static char prov_log[512];
static atomic_t prov_invalidations;
static struct dentry *prov_debugfs;
static struct platform_device *prov_pdev;

static void prov_unmap_locked(struct prov_mr *mr, const char *why)
{
	const struct peer_memory_client *ops = mr->client->ops;
	int unmap_ret = 0;

	if (mr->mapped)
		unmap_ret = ops->dma_unmap(&mr->sgt, mr->ctx, &prov_pdev->dev);
	mr->mapped = false;
	memset(&mr->sgt, 0, sizeof(mr->sgt));	/* as MOFED does */
	if (mr->pinned)
		ops->put_pages(&mr->sgt, mr->ctx);
	mr->pinned = false;
	scnprintf(prov_log, sizeof(prov_log), "%s dma_unmap=%d put_pages=done\n",
		  why, unmap_ret);
}

/* The invalidate callback handed to clients (MOFED legacy behaviour). */
static int prov_invalidate(void *reg_handle, u64 core_context)
{
	atomic_inc(&prov_invalidations);
	mutex_lock(&prov_lock);
	if (prov_mr_valid && prov_mr.client == reg_handle &&
	    prov_mr.core_context == core_context)
		prov_unmap_locked(&prov_mr, "invalidate");
	mutex_unlock(&prov_lock);
	return 0;
}

void *ib_register_peer_memory_client(const struct peer_memory_client *peer_client,
				     invalidate_peer_memory *invalidate_callback)
{
	struct prov_client *c;

	if (!peer_client || !peer_client->acquire || !peer_client->release)
		return NULL;
	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c)
		return NULL;
	c->ops = peer_client;
	if (invalidate_callback)
		*invalidate_callback = prov_invalidate;
	mutex_lock(&prov_lock);
	list_add_tail(&c->node, &prov_clients);
	mutex_unlock(&prov_lock);
	pr_info("client %.*s %.*s registered\n", IB_PEER_MEMORY_NAME_MAX,
		peer_client->name, IB_PEER_MEMORY_VER_MAX, peer_client->version);
	return c;
}
EXPORT_SYMBOL(ib_register_peer_memory_client);

void ib_unregister_peer_memory_client(void *reg_handle)
{
	struct prov_client *c = reg_handle;

	mutex_lock(&prov_lock);
	if (prov_mr_valid && prov_mr.client == c) {
		prov_unmap_locked(&prov_mr, "unregister");
		c->ops->release(prov_mr.ctx);
		prov_mr_valid = false;
	}
	list_del(&c->node);
	mutex_unlock(&prov_lock);
	kfree(c);
}
EXPORT_SYMBOL(ib_unregister_peer_memory_client);

/* acquire -> get_pages -> get_page_size -> dma_map, as ib_peer_umem_get. */
static int prov_map_locked(unsigned long addr, size_t size)
{
	struct prov_mr *mr = &prov_mr;
	const struct peer_memory_client *ops;
	struct prov_client *c;
	unsigned long page_size;
	struct scatterlist *sg;
	u64 total = 0;
	int ret, nmap = 0, i;

	if (prov_mr_valid)
		return -EBUSY;
	if (list_empty(&prov_clients))
		return -ENODEV;
	memset(mr, 0, sizeof(*mr));
	ret = 0;
	list_for_each_entry(c, &prov_clients, node) {
		ret = c->ops->acquire(addr, size, NULL, NULL, &mr->ctx);
		if (ret > 0) {
			mr->client = c;
			break;
		}
	}
	if (!mr->client) {
		scnprintf(prov_log, sizeof(prov_log), "map acquire=0\n");
		return -ENOENT;
	}
	ops = mr->client->ops;
	mr->addr = addr;
	mr->size = size;
	mr->core_context = prov_next_core_context++;
	ret = ops->get_pages(addr, size, 1, 0, NULL, mr->ctx, mr->core_context);
	if (ret) {
		scnprintf(prov_log, sizeof(prov_log), "map acquire=1 get_pages=%d\n", ret);
		ops->release(mr->ctx);
		return ret;
	}
	mr->pinned = true;
	page_size = ops->get_page_size(mr->ctx);
	ret = ops->dma_map(&mr->sgt, mr->ctx, &prov_pdev->dev, 0, &nmap);
	if (ret) {
		scnprintf(prov_log, sizeof(prov_log),
			  "map acquire=1 get_pages=0 page_size=%lu dma_map=%d\n",
			  page_size, ret);
		ops->put_pages(&mr->sgt, mr->ctx);
		ops->release(mr->ctx);
		return ret;
	}
	mr->mapped = true;
	prov_mr_valid = true;
	for_each_sg(mr->sgt.sgl, sg, nmap, i)
		total += sg_dma_len(sg);
	scnprintf(prov_log, sizeof(prov_log),
		  "map acquire=1 get_pages=0 page_size=%lu dma_map=0 nmap=%d total=%llu first_dma=%pad\n",
		  page_size, nmap, total, nmap ? &sg_dma_address(mr->sgt.sgl) : &(dma_addr_t){0});
	return 0;
}

/* dma_unmap -> put_pages -> release, as ib_peer_umem_release. */
static int prov_unmap_release_locked(void)
{
	if (!prov_mr_valid)
		return -ENOENT;
	prov_unmap_locked(&prov_mr, "unmap");
	prov_mr.client->ops->release(prov_mr.ctx);
	prov_mr_valid = false;
	strlcat(prov_log, "release=done\n", sizeof(prov_log));
	return 0;
}

static ssize_t prov_control_write(struct file *file, const char __user *ubuf,
				  size_t len, loff_t *ppos)
{
	char buf[96], maplog[sizeof(prov_log)];
	unsigned long addr;
	size_t size;
	int ret;

	if (len >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, len))
		return -EFAULT;
	buf[len] = '\0';

	mutex_lock(&prov_lock);
	if (sscanf(buf, "map %lx %zu", &addr, &size) == 2) {
		ret = prov_map_locked(addr, size);
	} else if (sscanf(buf, "cycle %lx %zu", &addr, &size) == 2) {
		ret = prov_map_locked(addr, size);
		if (!ret) {
			strscpy(maplog, prov_log, sizeof(maplog));
			ret = prov_unmap_release_locked();
			/* Keep both lines: the map results and the unmap results. */
			strlcat(maplog, prov_log, sizeof(maplog));
			strscpy(prov_log, maplog, sizeof(prov_log));
		}
	} else if (!strncmp(buf, "unmap", 5)) {
		ret = prov_unmap_release_locked();
	} else {
		ret = -EINVAL;
	}
	mutex_unlock(&prov_lock);
	return ret ? ret : (ssize_t)len;
}

static ssize_t prov_control_read(struct file *file, char __user *ubuf,
				 size_t len, loff_t *ppos)
{
	char copy[sizeof(prov_log)];

	mutex_lock(&prov_lock);
	strscpy(copy, prov_log, sizeof(copy));
	mutex_unlock(&prov_lock);
	return simple_read_from_buffer(ubuf, len, ppos, copy, strlen(copy));
}

static const struct file_operations prov_control_fops = {
	.owner = THIS_MODULE,
	.read = prov_control_read,
	.write = prov_control_write,
	.llseek = default_llseek,
};

static int prov_clients_show(struct seq_file *m, void *unused)
{
	struct prov_client *c;

	mutex_lock(&prov_lock);
	list_for_each_entry(c, &prov_clients, node)
		seq_printf(m, "%.*s %.*s\n", IB_PEER_MEMORY_NAME_MAX, c->ops->name,
			   IB_PEER_MEMORY_VER_MAX, c->ops->version);
	mutex_unlock(&prov_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(prov_clients);

/* The mapped MR's entries, so a test can compare them with the pages it owns. */
static int prov_sgl_show(struct seq_file *m, void *unused)
{
	struct scatterlist *sg;
	unsigned int i;

	mutex_lock(&prov_lock);
	if (prov_mr_valid && prov_mr.mapped)
		for_each_sg(prov_mr.sgt.sgl, sg, prov_mr.sgt.nents, i)
			seq_printf(m, "%llx %x\n", (unsigned long long)sg_dma_address(sg),
				   sg_dma_len(sg));
	mutex_unlock(&prov_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(prov_sgl);

static int __init prov_init(void)
{
	int ret;

	prov_pdev = platform_device_register_simple(KBUILD_MODNAME, -1, NULL, 0);
	if (IS_ERR(prov_pdev))
		return PTR_ERR(prov_pdev);
	ret = dma_coerce_mask_and_coherent(&prov_pdev->dev, DMA_BIT_MASK(64));
	if (ret) {
		platform_device_unregister(prov_pdev);
		return ret;
	}
	prov_debugfs = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_file("control", 0600, prov_debugfs, NULL, &prov_control_fops);
	debugfs_create_file("clients", 0444, prov_debugfs, NULL, &prov_clients_fops);
	debugfs_create_file("sgl", 0400, prov_debugfs, NULL, &prov_sgl_fops);
	debugfs_create_atomic_t("invalidations", 0444, prov_debugfs, &prov_invalidations);
	pr_info("TEST provider of the MOFED peer-memory API loaded\n");
	return 0;
}

static void __exit prov_exit(void)
{
	debugfs_remove_recursive(prov_debugfs);
	platform_device_unregister(prov_pdev);
}

module_init(prov_init);
module_exit(prov_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("TEST ONLY: stand-in exporter of the MOFED peer-memory client API");
