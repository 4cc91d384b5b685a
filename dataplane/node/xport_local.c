/*
 * xport_local.c: the local transport's class in the node's registry
 * (xport_registry.h): a sink participant of this node (same node id and
 * incarnation) is written by memcpy workers (local.h) under the node's own
 * peer index.
 *
 * Test knob (opts.test_local_hold_file): while that file exists the local
 * transport starts no copy (kvf_transport_local_set_hold), so a test can hold
 * same-node ops in flight across an abort. It is looked at before every local
 * post and on every owner loop turn (at least every HOLD_CHECK_MS while it is
 * set); while it holds, the node writes the number of held copies to
 * "<file>.queued" whenever it changes, so the test knows when its ops are
 * posted.
 *
 * DESIGN (threads): owner thread, except start/stop (node start and stop);
 * the copies run on the local transport's workers.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvf_file.h"
#include "local.h"
#include "xport_internal.h"
#include "xport_class.h"
#include "xport_registry.h"
#include "node_log.h"
#include "node_owner.h"

#define HOLD_CHECK_MS 5

/* The local transport with the node's limits (at start, and when renewed). */
static struct kvf_transport *local_create(void)
{
    struct kvf_transport_local_opts lo;
    kvf_transport_local_opts_init(&lo);
    lo.max_peers = NODE_MAX_PEERS;
    lo.max_pools = NODE_MAX_POOLS;
    return kvf_transport_local_create(&lo);
}

static int local_start(struct kvf_node *n)
{
    n->xp->local = local_create();
    return n->xp->local ? 0 : -ENOMEM;
}

static void local_stop(struct kvf_node *n)
{
    kvf_transport_destroy(n->xp->local);
    n->xp->local = NULL;
}

static int add_pool_to(struct kvf_transport *t, const struct node_pool *p)
{
    struct kvf_transport_pool tp;
    node_xport_pool_desc(p, &tp);
    return kvf_transport_add_pool(t, &tp, NULL);
}

static int local_add_pool(struct kvf_node *n, const struct node_pool *p)
{
    return add_pool_to(n->xp->local, p);
}

static void local_remove_pool(struct kvf_node *n, uint32_t pool_id)
{
    int rc = kvf_transport_remove_pool(n->xp->local, pool_id);
    if (rc != 0 && rc != -ENOENT)
        node_log("warn", NULL, "pool %u: local transport: %s", pool_id, strerror(-rc));
}

static void write_held(struct node_xport *xp, const char *path)
{
    struct kvf_transport_local_stats st;
    kvf_transport_local_stats(xp->local, &st);
    if (st.queued + 1 == xp->held_written)
        return;
    char dst[300];
    snprintf(dst, sizeof dst, "%s.queued", path);
    if (kvf_file_printf(dst, 0, "%" PRIu64 "\n", st.queued) == 0)
        xp->held_written = st.queued + 1;
}

static void update_hold(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    const char *path = n->opts.test_local_hold_file;
    if (!path || !path[0])
        return;
    bool hold = access(path, F_OK) == 0;
    if (hold != xp->held) {
        xp->held = hold;
        xp->held_written = 0;
        kvf_transport_local_set_hold(xp->local, hold);
        node_log("info", NULL, "test: local copies %s", hold ? "held" : "released");
    }
    if (hold)
        write_held(xp, path);
}

static int local_route(struct kvf_node *n, uint32_t peer, const struct node_member *sink,
                       struct node_route *rt, char *why, size_t why_len)
{
    struct node_xport *xp = n->xp;
    if (!sink->local)
        return 0;
    /* Idempotent; a new incarnation of this node gets a new index. */
    int rc = kvf_transport_local_add_peer(xp->local, peer);
    if (rc != 0) {
        snprintf(why, why_len, "local transport: %s", strerror(-rc));
        return rc;
    }
    xp->self_known = true;
    xp->self_peer = peer;
    update_hold(n);
    *rt = (struct node_route){xp->local, peer, KVF_LT_OP_CUDA_COPY, NULL};
    return 1;
}

static void local_poll(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    update_hold(n);
    struct kvf_completion c[NODE_POLL_BATCH];
    int got;
    while ((got = kvf_transport_poll(xp->local, NODE_POLL_BATCH, c)) > 0)
        for (int i = 0; i < got; i++)
            node_completion(n, &c[i]);
}

/* Self-fencing: fences this node's own peer index: queued copies complete
 * FLUSHED, a copy in progress is waited for, later local posts fail
 * (-ESTALE); then a fresh transport with the same pools replaces it, so that
 * the new incarnation's local index is not a fenced one. */
static int local_renew(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    if (xp->self_known) { /* else no local copy was ever posted */
        int rc = kvf_transport_fence_peer(xp->local, xp->self_peer);
        if (rc != 0)
            return rc;
        local_poll(n); /* hand the flushed copies back to their chunks */
    }
    struct kvf_transport *fresh = local_create();
    if (!fresh)
        return -ENOMEM;
    int rc = 0;
    for (uint32_t i = 0; i < n->npools && rc == 0; i++)
        rc = add_pool_to(fresh, &n->pools[i]);
    if (rc != 0) {
        kvf_transport_destroy(fresh);
        return rc;
    }
    kvf_transport_destroy(xp->local);
    xp->local = fresh;
    xp->self_known = false;
    xp->held = false; /* the test knob is applied again to the new transport */
    return 0;
}

static struct kvf_transport *local_waker(struct kvf_node *n)
{
    return n->xp ? n->xp->local : NULL;
}

static int64_t local_next_ms(struct kvf_node *n, int64_t now)
{
    const char *hold = n->opts.test_local_hold_file;
    return hold && hold[0] ? now + HOLD_CHECK_MS : INT64_MAX;
}

static const char *local_feature(const struct kvf_node *n)
{
    (void)n;
    return "LOCAL";
}

const struct node_xport_class node_xport_local_class = {
    .name = "local",
    .start = local_start,
    .stop = local_stop,
    .add_pool = local_add_pool,
    .remove_pool = local_remove_pool,
    .route = local_route,
    .post_chunk = NULL,
    .fence_peer = node_xport_nop_peer, /* only remote peers are fenced */
    .renew = local_renew,
    .poll = local_poll,
    .waker = local_waker,
    .next_ms = local_next_ms,
    .feature = local_feature,
    .endpoint = node_xport_no_endpoint,
};
