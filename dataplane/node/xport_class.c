/*
 * xport_class.c: what the transport classes share (xport_class.h): their
 * no-op slots and the pool descriptor.
 */
#include "xport_class.h"

#include "devpool.h"
#include "node_types.h"
#include "transport.h"

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

void node_xport_pool_desc(const struct node_pool *p, struct kvf_transport_pool *out)
{
    bool dev = node_devpool_is(p);
    *out = (struct kvf_transport_pool){.id = p->id,
                                       .base = dev ? NULL : p->base,
                                       .dev = dev ? p->pool : NULL,
                                       .page_size = p->page_size,
                                       .page_count = p->page_count};
}
