/*
 * xport_class.h: what the transport classes of the node's registry
 * (xport_registry.h) share: the slots of a class that has nothing to do
 * there, and the transports' view of a registered pool. Below the classes
 * and the registry: it calls none of them.
 */
#ifndef KVF_NODE_XPORT_CLASS_H
#define KVF_NODE_XPORT_CLASS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvf_node;
struct kvf_transport_pool;
struct node_pool;

/* Slot helpers for classes that have nothing to do there. */
int node_xport_nop_start(struct kvf_node *n);
void node_xport_nop_stop(struct kvf_node *n);
int node_xport_nop_peer(struct kvf_node *n, uint32_t peer);
int node_xport_nop_renew(struct kvf_node *n);
int64_t node_xport_never(struct kvf_node *n, int64_t now);
bool node_xport_no_endpoint(const struct kvf_node *n, int *kind_p, char *addr, size_t addr_len);

/* The transports' view of a registered pool (transport.h add_pool): host
 * pages, or a device pool written through the pool. */
void node_xport_pool_desc(const struct node_pool *p, struct kvf_transport_pool *out);

#endif /* KVF_NODE_XPORT_CLASS_H */
