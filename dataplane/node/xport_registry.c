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
