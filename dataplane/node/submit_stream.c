/*
 * submit_stream.c: NodeLocal.SubmitChunks, pipelined chunk submission on one
 * bidi stream (node.proto SubmitChunkRequest -> SubmitChunkResult).
 *
 * Why: a unary SubmitChunk costs a round trip per chunk, and an engine cannot
 * overlap calls of one (source rank, sink rank) pair (chunk_seq must rise in
 * admission order). On one stream the requests stay in order and many are in
 * flight.
 *
 * Order: gRPC delivers one stream's messages one at a time (the next read is
 * posted after on_message returns), on_message posts one job
 * per request, and the owner runs jobs first in, first out: requests are
 * admitted and answered in the order sent. The owner answers each with
 * node_submit_chunk (local_svc.c), the function the unary SubmitChunk uses:
 * same checks, same codes. A refused request gets its result and the stream
 * goes on.
 *
 * DESIGN (threads, flow control): streams are in a list under watch_lock
 * (CQ threads add and remove them; the owner queues results under it:
 * kvf_rpc_stream_send only queues, so the owner never waits for a client).
 * gRPC keeps reading, so the bound is enforced on arrival: a client keeps at
 * most SUBSTREAM_WINDOW requests outstanding; a request that finds more of
 * its stream without a written result (posted and not answered, or answered
 * and not yet written), plus a little slack, ends the stream with
 * RESOURCE_EXHAUSTED. A stream ends with OK once the client half-closed
 * and every request was answered; at shutdown, once the owner exited, with
 * UNAVAILABLE. A request read before its stream ended is still run (as a
 * unary call whose client left); its result is dropped.
 *
 * Lifetime: a struct node_substream holds a stream reference; it is counted
 * (one for the open stream, one per queued job) and freed at the last put.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "faults.h"
#include "local_svc.h"
#include "node_owner.h"
#include "node_types.h"
#include "submit_stream.h"

#define SUBSTREAM_WINDOW 64 /* a client's bound: requests sent, result not received */
/* Above the client's bound, the node counts at most one result the client
 * already has (its send completion is not seen yet): a little slack. */
#define SUBSTREAM_SLACK 8
#define SUBSTREAM_MAX   64 /* SubmitChunks streams per node */

struct node_substream {
    struct kvf_rpc_stream *stream; /* referenced */
    atomic_uint refs;
    /* Under watch_lock. */
    unsigned pending; /* posted to the owner, not answered */
    bool half_closed; /* the client sends no more */
    bool ended;       /* finish was called, or the stream closed */
    struct node_substream *next;
};

void node_substream_put(struct node_substream *s)
{
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        kvf_rpc_stream_unref(s->stream);
        free(s);
    }
}

/* One SubmitChunks request for the owner thread: the decoded request (NULL:
 * undecodable, answered in order) and a reference on its stream. */
struct substream_job {
    struct node_substream *sub;
    Kvfence__V1__SubmitChunkRequest *submit;
};

/* The job is freed (run or dropped): the request and its reference go. */
static void substream_job_free(void *arg)
{
    struct substream_job *a = arg;
    if (a->submit)
        kvfence__v1__submit_chunk_request__free_unpacked(a->submit, NULL);
    node_substream_put(a->sub);
    free(a);
}

static void substream_job_run(struct kvf_node *n, void *arg);

/* hold_stream (faults.h): the fault module may keep the request back. */
static bool substream_job_hold(struct kvf_node *n, struct node_job *j)
{
    return node_fault_hold_stream(n, j);
}

/* watch_lock held. */
static void end_locked(struct node_substream *s, int code, const char *msg)
{
    if (s->ended)
        return;
    s->ended = true;
    kvf_rpc_stream_finish(s->stream, code, msg);
}

/* ---- stream callbacks (CQ threads) ------------------------------------------------------ */

static void s_on_open(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    (void)req;
    (void)len;
    struct kvf_node *n = ctx;
    struct node_substream *s = calloc(1, sizeof *s);
    if (!s) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    pthread_mutex_lock(&n->watch_lock);
    size_t count = 0;
    for (struct node_substream *o = n->substreams; o; o = o->next)
        count++;
    if (count >= SUBSTREAM_MAX) {
        pthread_mutex_unlock(&n->watch_lock);
        free(s);
        char msg[64];
        snprintf(msg, sizeof msg, "SubmitChunks streams: limit %d per node", SUBSTREAM_MAX);
        kvf_rpc_stream_finish(stream, KVF_GRPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    kvf_rpc_stream_ref(stream);
    s->stream = stream;
    atomic_init(&s->refs, 1);
    s->next = n->substreams;
    n->substreams = s;
    kvf_rpc_stream_set_user(stream, s);
    pthread_mutex_unlock(&n->watch_lock);
}

static void s_on_message(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *msg, size_t len)
{
    struct kvf_node *n = ctx;
    static const uint8_t empty[1];
    struct node_substream *s = kvf_rpc_stream_user(stream);
    if (!s)
        return; /* refused at open */
    pthread_mutex_lock(&n->watch_lock);
    if (s->ended) {
        pthread_mutex_unlock(&n->watch_lock);
        return;
    }
    if (s->pending + kvf_rpc_stream_queued(stream) >= SUBSTREAM_WINDOW + SUBSTREAM_SLACK) {
        char why[128];
        snprintf(why, sizeof why,
                 "SubmitChunks: more than %d requests without a result: keep at most %d "
                 "outstanding",
                 SUBSTREAM_WINDOW, SUBSTREAM_WINDOW);
        end_locked(s, KVF_GRPC_RESOURCE_EXHAUSTED, why);
        pthread_mutex_unlock(&n->watch_lock);
        return;
    }
    s->pending++;
    pthread_mutex_unlock(&n->watch_lock);

    /* NULL (undecodable) is answered in order by the owner. */
    Kvfence__V1__SubmitChunkRequest *r =
        kvfence__v1__submit_chunk_request__unpack(NULL, len, len ? msg : empty);
    struct substream_job *a = calloc(1, sizeof *a);
    struct node_job *j = a ? node_job_new(substream_job_run, a, substream_job_free) : NULL;
    const char *refused = NULL;
    if (!j) {
        free(a);
        refused = "out of memory";
    } else {
        a->submit = r;
        a->sub = s;
        j->hold = substream_job_hold;
        atomic_fetch_add(&s->refs, 1);
        if (node_post(n, j) != 0)
            refused = "node shutting down";
    }
    if (refused) {
        if (j)
            node_job_free(j); /* frees r, puts the reference */
        else if (r)
            kvfence__v1__submit_chunk_request__free_unpacked(r, NULL);
        pthread_mutex_lock(&n->watch_lock);
        s->pending--;
        end_locked(s, j ? KVF_GRPC_UNAVAILABLE : KVF_GRPC_RESOURCE_EXHAUSTED, refused);
        pthread_mutex_unlock(&n->watch_lock);
    }
}

static void s_on_half_close(void *ctx, struct kvf_rpc_stream *stream)
{
    struct kvf_node *n = ctx;
    struct node_substream *s = kvf_rpc_stream_user(stream);
    if (!s)
        return;
    pthread_mutex_lock(&n->watch_lock);
    s->half_closed = true;
    if (s->pending == 0)
        end_locked(s, KVF_GRPC_OK, NULL);
    pthread_mutex_unlock(&n->watch_lock);
}

static void s_on_closed(void *ctx, struct kvf_rpc_stream *stream, enum kvf_rpc_close_reason why)
{
    (void)why;
    struct kvf_node *n = ctx;
    pthread_mutex_lock(&n->watch_lock);
    struct node_substream *s = kvf_rpc_stream_user(stream);
    for (struct node_substream **pp = &n->substreams; s && *pp; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    }
    if (s)
        s->ended = true;
    kvf_rpc_stream_set_user(stream, NULL);
    pthread_mutex_unlock(&n->watch_lock);
    if (s)
        node_substream_put(s);
}

int node_substream_register(struct kvf_node *n)
{
    struct kvf_rpc_stream_callbacks cbs = {0};
    cbs.on_open = s_on_open;
    cbs.on_message = s_on_message;
    cbs.on_half_close = s_on_half_close;
    cbs.on_closed = s_on_closed;
    return kvf_rpc_server_add_stream(n->local_srv, "/kvfence.v1.NodeLocal/SubmitChunks",
                                     KVF_RPC_BIDI, &cbs, n);
}

/* ---- the owner ------------------------------------------------------------------------------ */

/* One request: its result is queued on the stream, in order. */
static void substream_job_run(struct kvf_node *n, void *arg)
{
    const struct substream_job *j = arg;
    struct node_substream *s = j->sub;
    struct node_submit_out o = {KVF_GRPC_OK, "", 0};
    const char *why = NULL;
    if (!j->submit) {
        o.code = node_local_status(-EINVAL);
        snprintf(o.msg, sizeof o.msg, "undecodable SubmitChunkRequest");
    } else if ((why = node_submit_shape(j->submit)) != NULL) {
        o.code = node_local_status(-EINVAL);
        snprintf(o.msg, sizeof o.msg, "%s", why);
    } else {
        (void)node_submit_chunk(n, j->submit, &o);
    }
    Kvfence__V1__SubmitChunkResult res = KVFENCE__V1__SUBMIT_CHUNK_RESULT__INIT;
    res.chunk_seq = j->submit ? j->submit->chunk_seq : 0;
    res.code = (uint32_t)o.code;
    res.message = o.msg;
    uint8_t buf[sizeof o.msg + 32];
    size_t len = kvfence__v1__submit_chunk_result__get_packed_size(&res);
    kvfence__v1__submit_chunk_result__pack(&res, buf);

    pthread_mutex_lock(&n->watch_lock);
    s->pending--;
    if (!s->ended && kvf_rpc_stream_send(s->stream, buf, len) != 0)
        s->ended = true; /* closed: on_closed puts it */
    if (s->half_closed && s->pending == 0)
        end_locked(s, KVF_GRPC_OK, NULL);
    pthread_mutex_unlock(&n->watch_lock);
}

/* ---- shutdown ------------------------------------------------------------------------------- */

void node_substream_end_all(struct kvf_node *n)
{
    pthread_mutex_lock(&n->watch_lock);
    for (struct node_substream *s = n->substreams; s; s = s->next)
        end_locked(s, KVF_GRPC_UNAVAILABLE, "node shutting down");
    pthread_mutex_unlock(&n->watch_lock);
}
