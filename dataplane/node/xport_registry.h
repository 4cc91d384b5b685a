/*
 * xport_registry.h: the node's transport registry. Each transport the node
 * can send a chunk through (local, RDMA, TCP) is one const struct
 * node_xport_class that covers its whole life on the node: start and stop,
 * pools, the route to a sink (which also connects or starts a link), how a
 * chunk is posted, FencePeer, a new incarnation, completions, the owner
 * loop's wake descriptor and deadline, and what the Hello announces.
 *
 * The generic node code (xport.c: the router, the Hello's features and
 * endpoints, the owner's polling and waits, pools, fences) walks
 * node_xport_classes[] and never names a transport; each class lives with
 * its transport's node code (xport_local.c, xport_tcp.c, rdma_link.c). Adding
 * a transport is one new class and one row in xport_registry.c, whose order
 * is the routing preference: the first class that claims a sink carries the
 * chunk.
 *
 * DESIGN (threads): every slot runs on the owner thread, except start (node
 * start, before the owner runs) and stop (after it exited). Slots are never
 * NULL except post_chunk (see there).
 */
#ifndef KVF_NODE_XPORT_REGISTRY_H
#define KVF_NODE_XPORT_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

struct node_chunk;
struct node_route;

struct node_xport_class {
    const char *name;

    /* Node start, in registry order (after the staging engine): 0, or
     * -errno (logged) and the node does not start. */
    int (*start)(struct kvf_node *n);
    /* After the owner thread stopped, in reverse order; frees what start
     * made. Runs after a failed start too. */
    void (*stop)(struct kvf_node *n);

    /* A pool was registered: 0, or -errno and the pool is refused (the
     * classes before this one drop it again, nothing is half-applied). */
    int (*add_pool)(struct kvf_node *n, const struct node_pool *p);
    /* The pool is unregistered (every lifetime that could use it drained);
     * errors are logged, never returned: the pool goes anyway. */
    void (*remove_pool)(struct kvf_node *n, uint32_t pool_id);

    /* The route to `sink` (peer index `peer`): 1 with *rt filled when this
     * class carries the chunk (connecting or starting a link as it needs:
     * never blocking); 0 when it does not (the next class is asked); -errno
     * with `why` filled when the chunk must be refused. */
    int (*route)(struct kvf_node *n, uint32_t peer, const struct node_member *sink,
                 struct node_route *rt, char *why, size_t why_len);

    /* Queues the frames of a chunk routed here (all filled in) and posts
     * what the transport takes, each frame admitted right before its post.
     * NULL: the submit path admits and posts each frame itself
     * (kvf_transport_post_write), all at once. */
    void (*post_chunk)(struct kvf_node *n, struct node_chunk *ch);

    /* FencePeer (and the self-fence): no byte can move between this node
     * and `peer` through this transport any more once it returns 0. */
    int (*fence_peer)(struct kvf_node *n, uint32_t peer);

    /* Self-fence, when the node takes a new incarnation: whatever the old
     * incarnation's peers could still reach is fenced and replaced. 0 or
     * -errno (the old state stays, fenced). */
    int (*renew)(struct kvf_node *n);

    /* Owner loop: hands the completions back (node_completion) and
     * starts what waited. Never blocks. */
    void (*poll)(struct kvf_node *n);

    /* Owner loop: the transport whose wake descriptor (transport.h) the
     * owner sleeps on; NULL when there is none now. */
    struct kvf_transport *(*waker)(struct kvf_node *n);

    /* Owner loop: by when (node_now_ms time) it must be polled although no
     * descriptor woke the owner (work in flight without a descriptor, a
     * message due); INT64_MAX when never. */
    int64_t (*next_ms)(struct kvf_node *n, int64_t now);

    /* Hello: the feature name it announces now (NULL: none), and its
     * endpoint: true with *kind_p (Kvfence__V1__EndpointKind) and `addr`
     * filled, false when it has none. */
    const char *(*feature)(const struct kvf_node *n);
    bool (*endpoint)(const struct kvf_node *n, int *kind_p, char *addr, size_t addr_len);
};

/* The registry, in routing order, NULL-terminated (xport_registry.c). */
extern const struct node_xport_class *const node_xport_classes[];

/* The classes (each with its transport's node code). */
extern const struct node_xport_class node_xport_local_class; /* xport_local.c */
extern const struct node_xport_class node_xport_rdma_class;  /* rdma_link.c */
extern const struct node_xport_class node_xport_tcp_class;   /* xport_tcp.c */

/* What the classes share (their no-op slots, the pool descriptor) is in
 * xport_class.h, below them, so that this table and the classes do not call
 * each other. */

#endif /* KVF_NODE_XPORT_REGISTRY_H */
