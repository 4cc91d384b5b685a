/*
 * pool_admin.c: NodeLocal.UnregisterPool.
 *
 * A pool is removed only when no lifetime that could touch it can still
 * admit or has an op in flight: every room with a lease on this node in the
 * pool (a local member naming it) must have a DRAINED lifetime. DRAINED
 * means admission is closed for good, so no TCP receiver can admit a frame
 * into the pool after the check; the transport looks the pool up again after
 * each admission, so a receiver that read the pool before the removal still
 * never writes into it (tcp.h, kvf_transport_tcp_remove_pool). Then the pool
 * leaves the transports (TCP, local), is unmapped, and the control plane is told
 * (PoolUpdate.removed_pool_ids).
 *
 * DESIGN: the handler runs on a gRPC CQ thread and only decodes; the owner
 * thread checks, removes and answers (unregister_pool_run).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "devpool.h"
#include "kvf_error.h"
#include "control_session.h"
#include "node_log.h"
#include "node_owner.h"
#include "node_types.h"
#include "pool_admin.h"
#include "tcp.h"
#include "xport.h"

/* An UnregisterPool call's job argument: the pool, and the call until it is
 * answered (dropped unrun: it fails UNAVAILABLE when freed). */
struct unregister_job {
    struct kvf_rpc_call *call; /* NULL once answered */
    uint32_t pool_id;
};

static void unregister_job_free(void *arg)
{
    struct unregister_job *j = arg;
    if (j->call)
        kvf_rpc_call_fail(j->call, KVF_GRPC_UNAVAILABLE, "node shutting down");
    free(j);
}

/* Owner thread: checks, removes and answers. */
static void unregister_pool_run(struct kvf_node *n, void *arg)
{
    struct unregister_job *j = arg;
    uint32_t id = j->pool_id;
    struct node_pool *p = node_pool_find(n, id);
    if (!p) {
        char msg[96];
        snprintf(msg, sizeof msg, "pool_id: no pool %u on this node", id);
        kvf_rpc_call_fail(j->call, KVF_GRPC_NOT_FOUND, msg);
        j->call = NULL;
        return;
    }
    for (struct node_room *r = n->rooms; r; r = r->next) {
        enum kvf_lt_state st = kvf_lt_state(r->core.lt);
        if (st == KVF_LT_DRAINED)
            continue;
        for (size_t i = 0; i < r->nmembers; i++) {
            const struct node_member *m = &r->members[i];
            if (!m->local || m->pool_id != id)
                continue;
            char msg[256];
            snprintf(msg, sizeof msg,
                     "pool_id: pool %u holds the lease of rank %u in room %" PRIu64 ":%" PRIu64
                     " whose lifetime is %s: retry once it is drained",
                     id, m->rank, r->key.room_id, r->key.generation, kvf_lt_state_name(st));
            kvf_rpc_call_fail(j->call, KVF_GRPC_FAILED_PRECONDITION, msg);
            j->call = NULL;
            return;
        }
    }
    node_xport_remove_pool(n, id); /* every transport (errors logged) */
    node_devpool_log_stats(p);
    struct node_pool gone = *p;
    *p = n->pools[--n->npools];
    kvf_pool_close(gone.pool);
    node_log("info", NULL, "pool %u unregistered (rank %u, %u pages of %u bytes)", id, gone.rank,
             gone.page_count, gone.page_size);

    node_session_send_pool_removed(n, id); /* or the next Hello / Resync says it */

    Kvfence__V1__UnregisterPoolResponse resp = KVFENCE__V1__UNREGISTER_POOL_RESPONSE__INIT;
    uint8_t buf[8];
    size_t len = kvfence__v1__unregister_pool_response__get_packed_size(&resp);
    kvfence__v1__unregister_pool_response__pack(&resp, buf);
    kvf_rpc_call_reply(j->call, buf, len);
    j->call = NULL;
}

static void h_unregister_pool(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct kvf_node *n = ctx;
    static const uint8_t empty[1];
    Kvfence__V1__UnregisterPoolRequest *r =
        kvfence__v1__unregister_pool_request__unpack(NULL, len, len ? req : empty);
    if (!r) {
        kvf_rpc_call_fail(call, KVF_GRPC_INVALID_ARGUMENT, "undecodable UnregisterPoolRequest");
        return;
    }
    uint32_t id = r->pool_id;
    kvfence__v1__unregister_pool_request__free_unpacked(r, NULL);
    if (id == 0) {
        kvf_rpc_call_fail(call, KVF_GRPC_INVALID_ARGUMENT, "pool_id: must be >= 1");
        return;
    }
    struct unregister_job *a = calloc(1, sizeof *a);
    struct node_job *j = a ? node_job_new(unregister_pool_run, a, unregister_job_free) : NULL;
    if (!j) {
        free(a);
        kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    a->call = call;
    a->pool_id = id;
    node_post_or_fail(n, j);
}

int node_pool_admin_register(struct kvf_node *n)
{
    return kvf_rpc_server_add_unary(n->local_srv, "/kvfence.v1.NodeLocal/UnregisterPool",
                                    h_unregister_pool, n);
}
