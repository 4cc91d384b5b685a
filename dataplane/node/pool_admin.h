/*
 * pool_admin.h: NodeLocal.UnregisterPool.
 * Functions of pool_admin.c only; the shared types are node_types.h.
 */
#ifndef KVF_NODE_POOL_ADMIN_H
#define KVF_NODE_POOL_ADMIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

int node_pool_admin_register(struct kvf_node *n); /* adds UnregisterPool */

#endif /* KVF_NODE_POOL_ADMIN_H */
