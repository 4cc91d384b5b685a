/*
 * node_health.c: grpc.health.v1.Health on the node's unix socket, next to
 * NodeLocal. The registry and the RPC glue are common/introspect's
 * (kvf_health, kvf_health_rpc_register), the ones kvfence-control serves;
 * this file only decides what the node's status is.
 *
 * The decision (docs/node.md, "Health"): the node is SERVING while it can do
 * its job, that is while its control-plane session is welcomed: attached as
 * its current incarnation, so its rooms' leases are known and its pools
 * announced. It is NOT_SERVING before the first Welcome, while the session
 * is down or being re-established (the control plane restarts, or the node
 * self-fenced and attaches as a new incarnation), once the control plane
 * refused it (fatal), and from the moment it starts draining at SIGTERM.
 * The same status is registered for "" (the whole server, what probes ask)
 * and for "kvfence.v1.NodeLocal".
 *
 * DESIGN: the owner thread owns the inputs (session_welcomed, stop_requested)
 * and calls node_health_update() after each turn of its loop, so the status
 * is decided in one place and lags a change by one turn at most. It writes
 * the registry only when the status changes. Check and Watch run on the
 * NodeLocal server's CQ threads and only read the registry (its mutex).
 */
#include <errno.h>
#include <stdatomic.h>

#include "health.h"
#include "health_rpc.h"
#include "control_session.h"
#include "node_health.h"
#include "node_log.h"
#include "node_types.h"

#define NODE_LOCAL_SERVICE "kvfence.v1.NodeLocal"

static void set_all(struct kvf_node *n, enum kvf_health_status status)
{
    (void)kvf_health_set(n->health, "", status);
    (void)kvf_health_set(n->health, NODE_LOCAL_SERVICE, status);
}

int node_health_register(struct kvf_node *n)
{
    n->health = kvf_health_create();
    if (!n->health)
        return -ENOMEM;
    /* A new registry says "" = SERVING: not before the first Welcome. */
    int rc = kvf_health_set(n->health, "", KVF_HEALTH_NOT_SERVING);
    if (rc == 0)
        rc = kvf_health_set(n->health, NODE_LOCAL_SERVICE, KVF_HEALTH_NOT_SERVING);
    if (rc == 0)
        rc = kvf_health_rpc_register(n->local_srv, n->health);
    n->health_serving = false;
    return rc;
}

void node_health_update(struct kvf_node *n)
{
    if (!n->health)
        return;
    bool serving = node_session_up(n) && !n->stop_requested && atomic_load(&n->fatal) == 0;
    if (serving == n->health_serving)
        return;
    n->health_serving = serving;
    set_all(n, serving ? KVF_HEALTH_SERVING : KVF_HEALTH_NOT_SERVING);
    node_log("info", NULL, "health: %s", serving ? "SERVING" : "NOT_SERVING");
}

void node_health_shutdown(struct kvf_node *n)
{
    kvf_health_shutdown(n->health); /* accepts NULL */
}

void node_health_free(struct kvf_node *n)
{
    kvf_health_destroy(n->health);
    n->health = NULL;
}
