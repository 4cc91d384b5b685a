/*
 * xport_registry.c: the node's transports, in routing order (the first class
 * that claims a sink carries the chunk): a sink on this node gets the local
 * transport; another node RDMA when its link is up; else TCP, which takes
 * every remote sink it can connect to. This table is the only place that
 * lists them (xport_registry.h).
 */
#include "xport_registry.h"

const struct node_xport_class *const node_xport_classes[] = {
    &node_xport_local_class,
    &node_xport_rdma_class,
    &node_xport_tcp_class,
    NULL,
};

int node_xport_nop_start(struct kvf_node *n)
{
    (void)n;
    return 0;
}

void node_xport_nop_stop(struct kvf_node *n)
{
    (void)n;
}

int node_xport_nop_peer(struct kvf_node *n, uint32_t peer)
{
    (void)n;
    (void)peer;
    return 0;
}

int node_xport_nop_renew(struct kvf_node *n)
{
    (void)n;
    return 0;
}

int64_t node_xport_never(struct kvf_node *n, int64_t now)
{
    (void)n;
    (void)now;
    return INT64_MAX;
}

bool node_xport_no_endpoint(const struct kvf_node *n, int *kind_p, char *addr, size_t addr_len)
{
    (void)n;
    (void)kind_p;
    (void)addr;
    (void)addr_len;
    return false;
}
