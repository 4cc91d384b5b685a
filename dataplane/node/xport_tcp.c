/*
 * xport_tcp.c: the TCP transport's class in the node's registry
 * (xport_registry.h): every remote sink that no earlier class claimed is
 * written over the node's TCP data port (tcp.h), through n->tcp_io (the
 * transport itself, or the fault wrapper around it: faults.h).
 *
 * The TCP transport is also the node's receive side (it lands the frames of
 * its peers in the pools), so it is made with the node (node_tcp_create, its
 * port announced in the Hello) and replaced by the self-fence with the new
 * incarnation's identity (node.c, node_self_fence); its start, stop and renew slots
 * here have nothing to do.
 *
 * Connects never block the owner thread: kvf_transport_tcp_connect starts a
 * non-blocking connect, and the connection's sender thread finishes it
 * within the node's --data-connect-timeout-ms; frames posted meanwhile wait
 * in the connection's queue and fail -ETIMEDOUT when the peer never answers.
 *
 * DESIGN (threads): owner thread.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kvfence/v1/types.pb-c.h"
#include "tcp.h"
#include "xport.h"
#include "xport_class.h"
#include "xport_registry.h"
#include "node_log.h"
#include "node_owner.h"

static int tcp_add_pool(struct kvf_node *n, const struct node_pool *p)
{
    struct kvf_transport_pool tp;
    node_xport_pool_desc(p, &tp);
    return kvf_transport_add_pool(n->tcp, &tp, NULL);
}

static void tcp_remove_pool(struct kvf_node *n, uint32_t pool_id)
{
    /* Receivers read rooms under rooms_lock: taking it for writing orders
     * the removal after every check in progress. */
    pthread_rwlock_wrlock(&n->rooms_lock);
    int rc = kvf_transport_remove_pool(n->tcp, pool_id);
    pthread_rwlock_unlock(&n->rooms_lock);
    if (rc != 0 && rc != -ENOENT)
        node_log("warn", NULL, "pool %u: tcp transport: %s", pool_id, strerror(-rc));
}

static int tcp_route(struct kvf_node *n, uint32_t peer, const struct node_member *sink,
                     struct node_route *rt, char *why, size_t why_len)
{
    (void)sink;
    struct node_peer *pe = &n->peers[peer];
    /* Every chunk asks: -EEXIST for a live (or still connecting)
     * connection, a new one in place of a connection that died (tcp.h), so
     * a peer is never given up for good. Never blocks. */
    if (!pe->fenced && pe->port) {
        int rc = kvf_transport_tcp_connect(n->tcp, peer, pe->host, pe->port);
        pe->connected = rc == 0 || rc == -EEXIST;
    }
    if (!pe->connected || pe->fenced) {
        snprintf(why, why_len, "%s", pe->fenced ? "fenced" : "not connected");
        return -ENOTCONN;
    }
    *rt = (struct node_route){n->tcp_io, peer, KVF_LT_OP_TCP_FRAME, NULL};
    return 1;
}

static int tcp_fence_peer(struct kvf_node *n, uint32_t peer)
{
    return kvf_transport_fence_peer(n->tcp_io, peer); /* held faults flushed too */
}

static void tcp_poll(struct kvf_node *n)
{
    struct kvf_completion c[NODE_POLL_BATCH];
    int got;
    while ((got = kvf_transport_poll(n->tcp_io, NODE_POLL_BATCH, c)) > 0)
        for (int i = 0; i < got; i++)
            node_completion(n, &c[i]);
}

static struct kvf_transport *tcp_waker(struct kvf_node *n)
{
    return n->tcp_io;
}

static const char *tcp_feature(const struct kvf_node *n)
{
    (void)n;
    return "TCP";
}

static bool tcp_endpoint(const struct kvf_node *n, int *kind_p, char *addr, size_t addr_len)
{
    *kind_p = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_DATA_TCP;
    snprintf(addr, addr_len, "%s:%u", n->data_host, n->data_port);
    return true;
}

const struct node_xport_class node_xport_tcp_class = {
    .name = "tcp",
    .start = node_xport_nop_start,
    .stop = node_xport_nop_stop,
    .add_pool = tcp_add_pool,
    .remove_pool = tcp_remove_pool,
    .route = tcp_route,
    .post_chunk = NULL,
    .fence_peer = tcp_fence_peer,
    .renew = node_xport_nop_renew,
    .poll = tcp_poll,
    .waker = tcp_waker,
    .next_ms = node_xport_never,
    .feature = tcp_feature,
    .endpoint = tcp_endpoint,
};
