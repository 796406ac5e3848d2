/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The MOFED / MLNX_OFED "PeerDirect" peer-memory client ABI, written from
 * its documented layout (include/rdma/peer_mem.h of MLNX_OFED). Mainline
 * Linux has no such API; the symbols below are exported by MOFED's ib_core
 * on a real node, and by kernel_driver/peermem_provider in our tests.
 *
 * Layout, in order (must not change: the core reads it by offset):
 *   name[64], version[16], acquire, get_pages, dma_map, dma_unmap,
 *   put_pages, get_page_size, release, get_context_private_data,
 *   put_context_private_data.
 *
 * Compatibility: current MOFED reads up to .release and, only when
 * version[IB_PEER_MEMORY_VER_MAX - 1] != 0, a trailing "ex" block. We keep
 * that byte 0 (legacy client: the core calls dma_unmap/put_pages itself on
 * invalidation) and leave the two private-data hooks NULL, which older
 * MOFED releases that do read them accept.
 */
#ifndef TT_PEER_MEM_ABI_H
#define TT_PEER_MEM_ABI_H

#include <linux/types.h>

struct device;
struct sg_table;

#define IB_PEER_MEMORY_NAME_MAX 64
#define IB_PEER_MEMORY_VER_MAX 16

struct peer_memory_client {
	char name[IB_PEER_MEMORY_NAME_MAX];
	char version[IB_PEER_MEMORY_VER_MAX];
	/*
	 * Is [addr, addr + size) (bytes, user VA of the current process) ours?
	 * Returns 1 and sets *client_context if so, 0 otherwise (also on error).
	 */
	int (*acquire)(unsigned long addr, size_t size, void *peer_mem_private_data,
		       char *peer_mem_name, void **client_context);
	/*
	 * Pin the memory. sg_head may be NULL (current MOFED): do not touch it.
	 * core_context identifies the MR in later invalidate callbacks.
	 */
	int (*get_pages)(unsigned long addr, size_t size, int write, int force,
			 struct sg_table *sg_head, void *client_context,
			 u64 core_context);
	/* Fill sg_head with DMA addresses for dma_device; *nmap = entries. */
	int (*dma_map)(struct sg_table *sg_head, void *client_context,
		       struct device *dma_device, int dmasync, int *nmap);
	int (*dma_unmap)(struct sg_table *sg_head, void *client_context,
			 struct device *dma_device);
	void (*put_pages)(struct sg_table *sg_head, void *client_context);
	/* Page size in bytes of the mapping handed out by dma_map. */
	unsigned long (*get_page_size)(void *client_context);
	/* Free the context; no pages are pinned any more when it is called. */
	void (*release)(void *client_context);
	void *(*get_context_private_data)(u64 peer_id);
	void (*put_context_private_data)(void *context);
};

/* Called by the client to revoke an MR; core_context is from get_pages. */
typedef int (*invalidate_peer_memory)(void *reg_handle, u64 core_context);

/*
 * Returns a registration handle or NULL. When invalidate_callback is not
 * NULL the core stores its invalidate function there and treats the client
 * as one that may invalidate.
 */
void *ib_register_peer_memory_client(const struct peer_memory_client *peer_client,
				     invalidate_peer_memory *invalidate_callback);
/* Waits until no MR uses the client any more. */
void ib_unregister_peer_memory_client(void *reg_handle);

#endif /* TT_PEER_MEM_ABI_H */
