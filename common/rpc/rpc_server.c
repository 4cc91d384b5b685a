/*
 * rpc_server.c: the gRPC server of kvfence on the gRPC core C API (1.51).
 *
 * It owns the grpc_server, one completion queue (CQ) and the CQ threads that
 * drive it, the table of registered methods, the requests kept posted for each
 * method (plus a generic one that answers UNIMPLEMENTED for unknown methods),
 * and one context per live call: struct kvf_rpc_call for unary calls,
 * struct kvf_rpc_stream for streams. Messages are opaque bytes.
 *
 * DESIGN (threads). All CQ threads call grpc_completion_queue_next() on the
 * one CQ; every tag is a struct srv_tag embedded in the object it belongs to,
 * so a completion finds its object with container_of. Handlers and stream
 * callbacks run on those threads; the owner may complete calls and send on
 * streams from any thread. Each call and stream has a mutex that serialises
 * every grpc_call_start_batch on it (pitfall 3) and its state; callbacks run
 * without it. A stream has at most one read and one send outstanding: the read
 * loop reposts only after on_message returns, so on_open < on_message* <
 * on_half_close < on_closed per stream; sends wait in a FIFO and go out one at
 * a time, the status after the last of them.
 *
 * Lifetimes. A call context holds two references: one for gRPC's side (the
 * grpc_call plus every batch in flight) and one for the owner (dropped by
 * reply/fail). gRPC's side is let go -- grpc_call_unref and the server's live
 * count decremented -- when no batch is outstanding, which happens after
 * RECV_CLOSE_ON_SERVER, posted when the call arrives, completes. So a client
 * that cancels or misses its deadline frees gRPC's side at once, and a late
 * reply finds no grpc_call, returns -ECANCELED and frees the context without
 * touching the server. Streams are the same with an owner refcount instead of
 * the reply. If grpc_call_start_batch fails no completion will come (pitfall
 * 1): the op is never counted and the call is cancelled so that RECV_CLOSE
 * completes. The server counts posted requests and gRPC-side call contexts in
 * `live`; shutdown waits for that count and the shutdown tag before
 * destroying the server and shutting the CQ down, then joins the threads.
 *
 * Observer. When opts.on_call_done is set, each call reports once, at the one
 * point where its gRPC side is let go (call_settle_unlock,
 * stream_settle_unlock, srv_generic_done), just before the server's `live`
 * count drops, so the server (and the method name it owns) is still alive.
 * The code is the status we sent, unless it never went out or the client
 * cancelled (then CANCELLED or DEADLINE_EXCEEDED). No lock is held while the
 * observer runs.
 *
 * Lock order: call/stream mutex, then server mutex.
 */
#include "rpc_server.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "rpc_internal.h"

enum srv_tag_kind {
    TAG_REQUEST,         /* struct srv_request: a registered call arrived */
    TAG_GENERIC_REQUEST, /* struct srv_generic: an unknown method arrived */
    TAG_GENERIC_DONE,    /* struct srv_generic: UNIMPLEMENTED was sent */
    TAG_UNARY_CLOSE,     /* struct kvf_rpc_call: RECV_CLOSE_ON_SERVER */
    TAG_UNARY_REPLY,     /* struct kvf_rpc_call: the reply batch */
    TAG_STREAM_CLOSE,    /* struct kvf_rpc_stream: RECV_CLOSE_ON_SERVER */
    TAG_STREAM_READ,     /* struct kvf_rpc_stream: RECV_MESSAGE */
    TAG_STREAM_SEND,     /* struct kvf_rpc_stream: SEND_MESSAGE */
    TAG_STREAM_STATUS,   /* struct kvf_rpc_stream: SEND_STATUS_FROM_SERVER */
    TAG_SHUTDOWN,        /* struct kvf_rpc_server: grpc_server_shutdown_and_notify */
};

struct srv_tag {
    enum srv_tag_kind kind;
};

enum srv_method_kind { METHOD_UNARY, METHOD_SERVER_STREAMING, METHOD_BIDI };

struct srv_method {
    struct srv_method *next;
    char *name;
    enum srv_method_kind kind;
    kvf_rpc_unary_fn unary;
    struct kvf_rpc_stream_callbacks cbs;
    void *ctx;
    void *handle; /* from grpc_server_register_method */
};

/* One posted grpc_server_request_registered_call; reposted after each call. */
struct srv_request {
    struct srv_tag tag;
    struct kvf_rpc_server *srv;
    struct srv_method *method;
    grpc_call *gcall;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
};

/* One posted grpc_server_request_call; becomes the UNIMPLEMENTED answer. */
struct srv_generic {
    struct srv_tag tag_req;
    struct srv_tag tag_done;
    struct kvf_rpc_server *srv;
    grpc_call *gcall;
    grpc_call_details details;
    grpc_metadata_array md;
    int cancelled;
    grpc_slice status_msg;
    int64_t arrived_ns; /* for the observer */
};

enum srv_state { SRV_CREATED, SRV_STARTED, SRV_STOPPED };

struct kvf_rpc_server {
    char *listen_addr;
    unsigned n_threads;
    size_t max_message;
    size_t max_receive;                       /* <= max_message */
    char *pem_cert, *pem_key, *pem_client_ca; /* NULL when plaintext */
    struct srv_method *methods;
    /* The observer (rpc_server.h); fixed after create. */
    void (*on_call_done)(void *ctx, const char *method, int grpc_code, uint64_t latency_ns);
    void *observer_ctx;

    grpc_server *gsrv;
    grpc_completion_queue *cq;
    pthread_t *threads;
    unsigned n_running;
    struct srv_tag tag_shutdown;
    atomic_bool stopping; /* shutdown started: read by close-reason code */

    pthread_mutex_t mu; /* guards what follows */
    pthread_cond_t cv;  /* live or shutdown_done changed */
    enum srv_state state;
    bool shutdown_done; /* the shutdown tag came back */
    size_t live;        /* posted requests + gRPC-side call contexts */
    size_t calls;       /* gRPC-side call contexts alone */
};

struct kvf_rpc_call {
    struct srv_tag tag_close;
    struct srv_tag tag_reply;
    pthread_mutex_t mu;
    struct kvf_rpc_server *srv; /* NULL once gRPC's side is let go */
    grpc_call *gcall;           /* NULL once gRPC's side is let go */
    grpc_metadata_array md;
    int64_t deadline_ns;
    unsigned refs;        /* gRPC's side + the owner's */
    unsigned ops_pending; /* batches in flight */
    int cancelled;        /* RECV_CLOSE_ON_SERVER output */
    bool close_done;
    bool completed;          /* reply or fail was called */
    bool status_sent;        /* the reply batch (with its status) was handed to gRPC */
    int sent_code;           /* that status */
    const char *method_name; /* the server's copy, for the observer */
    int64_t arrived_ns;
    grpc_byte_buffer *reply_bb;
    grpc_slice details;
    bool has_details;
};

struct stream_msg {
    struct stream_msg *next;
    grpc_byte_buffer *bb;
};

struct kvf_rpc_stream {
    struct srv_tag tag_close;
    struct srv_tag tag_read;
    struct srv_tag tag_send;
    struct srv_tag tag_status;
    pthread_mutex_t mu;
    struct kvf_rpc_server *srv; /* NULL once gRPC's side is let go */
    const struct srv_method *method;
    grpc_call *gcall; /* NULL once gRPC's side is let go */
    grpc_metadata_array md;
    int64_t deadline_ns;
    unsigned refs;        /* gRPC's side + owner references */
    unsigned ops_pending; /* batches in flight */
    int cancelled;        /* RECV_CLOSE_ON_SERVER output */
    bool opened;          /* on_open was called */
    bool close_done;
    bool read_busy; /* on_open running, or a read pending or being delivered */
    bool closed_fired;
    bool closed_cb_done;
    bool md_sent; /* SEND_INITIAL_METADATA went out with a batch */
    bool send_busy;
    bool send_failed;
    bool finish_requested;
    bool status_started;
    struct stream_msg *q_head, *q_tail;
    size_t q_len;
    grpc_byte_buffer *send_bb;
    grpc_byte_buffer *recv_bb;
    int fin_code;
    grpc_slice fin_details;
    bool fin_has_details;
    int64_t arrived_ns; /* for the observer */
    void *user;
};

/* --- server bookkeeping --------------------------------------------------- */

/* An object counted in `live` is gone. The server may be freed by the
 * shutting-down thread as soon as this returns: callers touch it no more. */
static void srv_live_drop(struct kvf_rpc_server *srv, bool is_call)
{
    pthread_mutex_lock(&srv->mu);
    srv->live--;
    if (is_call)
        srv->calls--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

static int64_t srv_deadline_ns(gpr_timespec deadline)
{
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0)
        return INT64_MAX;
    gpr_timespec left = gpr_time_sub(deadline, gpr_now(deadline.clock_type));
    return kvf_clock_mono_ns() + (int64_t)left.tv_sec * 1000000000LL + left.tv_nsec;
}

static grpc_status_code srv_status_code(int code)
{
    if (code <= 0 || code > KVF_GRPC_UNAUTHENTICATED)
        return GRPC_STATUS_UNKNOWN; /* OK is not a failure; garbage neither */
    return (grpc_status_code)code;
}

/* The code a call ended with, for the observer: the status we sent if it went
 * out and the client did not cancel, else why it did not. */
static int srv_end_code(bool status_sent, int sent_code, int cancelled, int64_t deadline_ns)
{
    if (status_sent && !cancelled)
        return sent_code;
    if (deadline_ns != INT64_MAX && kvf_clock_mono_ns() + 1000000 >= deadline_ns)
        return KVF_GRPC_DEADLINE_EXCEEDED;
    return KVF_GRPC_CANCELLED;
}

/* Tells the observer, if any, that a call ended. The server must be alive:
 * call it before dropping the call from `live`. */
static void srv_observe(struct kvf_rpc_server *srv, const char *method, int code,
                        int64_t arrived_ns)
{
    if (!srv->on_call_done)
        return;
    int64_t now = kvf_clock_mono_ns();
    srv->on_call_done(srv->observer_ctx, method, code,
                      now > arrived_ns ? (uint64_t)(now - arrived_ns) : 0);
}

/* --- posted requests ---------------------------------------------------- */

static void srv_request_free(struct srv_request *r)
{
    grpc_metadata_array_destroy(&r->md);
    if (r->payload)
        grpc_byte_buffer_destroy(r->payload);
    free(r);
}

/* Posts `r` unless the server is stopping; a request that cannot be posted is
 * freed and uncounted. Called with srv->mu held. */
static void srv_request_post_locked(struct kvf_rpc_server *srv, struct srv_request *r)
{
    grpc_call_error ce = GRPC_CALL_ERROR;
    if (!atomic_load(&srv->stopping)) {
        r->gcall = NULL;
        r->payload = NULL;
        grpc_metadata_array_init(&r->md);
        ce = grpc_server_request_registered_call(
            srv->gsrv, r->method->handle, &r->gcall, &r->deadline, &r->md,
            r->method->kind == METHOD_BIDI ? NULL : &r->payload, srv->cq, srv->cq, &r->tag);
        if (ce != GRPC_CALL_OK) {
            rpc_log("request_registered_call %s: %s", r->method->name,
                    grpc_call_error_to_string(ce));
            grpc_metadata_array_destroy(&r->md);
        }
    }
    if (ce != GRPC_CALL_OK) {
        free(r);
        srv->live--;
        pthread_cond_broadcast(&srv->cv);
    }
}

static void srv_generic_free(struct srv_generic *g)
{
    grpc_call_details_destroy(&g->details);
    grpc_metadata_array_destroy(&g->md);
    grpc_slice_unref(g->status_msg);
    free(g);
}

/* Posts a new generic request. Called with srv->mu held. */
static void srv_generic_post_locked(struct kvf_rpc_server *srv)
{
    if (atomic_load(&srv->stopping))
        return;
    struct srv_generic *g = calloc(1, sizeof(*g));
    if (!g) {
        rpc_log("out of memory posting the generic request");
        return;
    }
    g->tag_req.kind = TAG_GENERIC_REQUEST;
    g->tag_done.kind = TAG_GENERIC_DONE;
    g->arrived_ns = 0;
    g->srv = srv;
    g->status_msg = grpc_empty_slice();
    grpc_call_details_init(&g->details);
    grpc_metadata_array_init(&g->md);
    grpc_call_error ce = grpc_server_request_call(srv->gsrv, &g->gcall, &g->details, &g->md,
                                                  srv->cq, srv->cq, &g->tag_req);
    if (ce != GRPC_CALL_OK) {
        rpc_log("server_request_call: %s", grpc_call_error_to_string(ce));
        srv_generic_free(g);
        return;
    }
    srv->live++;
}

/* An unknown method arrived (ok) or the posted request was killed (!ok). */
static void srv_generic_arrived(struct kvf_rpc_server *srv, struct srv_generic *g, bool ok)
{
    if (!ok) {
        srv_generic_free(g);
        srv_live_drop(srv, false);
        return;
    }
    g->arrived_ns = kvf_clock_mono_ns();
    pthread_mutex_lock(&srv->mu);
    srv->calls++; /* g now counts as a call; a fresh request takes its place */
    srv_generic_post_locked(srv);
    pthread_mutex_unlock(&srv->mu);

    char msg[256];
    snprintf(msg, sizeof(msg), "method %.*s is not implemented",
             (int)GRPC_SLICE_LENGTH(g->details.method),
             (const char *)GRPC_SLICE_START_PTR(g->details.method));
    g->status_msg = grpc_slice_from_copied_string(msg);
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
    ops[1].data.send_status_from_server.status_details = &g->status_msg;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &g->cancelled;
    grpc_call_error ce = grpc_call_start_batch(g->gcall, ops, 3, &g->tag_done, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("UNIMPLEMENTED batch: %s", grpc_call_error_to_string(ce));
        grpc_call_cancel(g->gcall, NULL);
        grpc_call_unref(g->gcall);
        int64_t arrived = g->arrived_ns;
        srv_generic_free(g);
        srv_observe(srv, "unknown", KVF_GRPC_CANCELLED, arrived);
        srv_live_drop(srv, true);
    }
}

static void srv_generic_done(struct kvf_rpc_server *srv, struct srv_generic *g)
{
    grpc_call_unref(g->gcall);
    int64_t arrived = g->arrived_ns;
    srv_generic_free(g);
    srv_observe(srv, "unknown", KVF_GRPC_UNIMPLEMENTED, arrived);
    srv_live_drop(srv, true);
}

/* --- unary calls -------------------------------------------------------- */

/* Called with c->mu held; unlocks it. Lets gRPC's side go once no batch is in
 * flight, drops `drop` more references, frees the context at zero. */
static void call_settle_unlock(struct kvf_rpc_call *c, unsigned drop)
{
    grpc_call *g = NULL;
    struct kvf_rpc_server *srv = NULL;
    const char *method = NULL;
    int end_code = 0;
    int64_t arrived = 0;
    if (c->gcall && c->ops_pending == 0) {
        g = c->gcall;
        srv = c->srv;
        c->gcall = NULL;
        c->srv = NULL;
        grpc_metadata_array_destroy(&c->md);
        drop++;
        if (srv->on_call_done) {
            method = c->method_name;
            end_code = srv_end_code(c->status_sent, c->sent_code, c->cancelled, c->deadline_ns);
            arrived = c->arrived_ns;
        }
    }
    c->refs -= drop;
    bool last = c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (g) {
        grpc_call_unref(g);
        if (method)
            srv_observe(srv, method, end_code, arrived);
        srv_live_drop(srv, true);
    }
    if (last) {
        pthread_mutex_destroy(&c->mu);
        free(c);
    }
}

static void srv_unary_arrived(struct kvf_rpc_server *srv, struct srv_method *m, grpc_call *gcall,
                              grpc_metadata_array md, gpr_timespec deadline,
                              grpc_byte_buffer *payload)
{
    int64_t arrived = kvf_clock_mono_ns();
    struct kvf_rpc_call *c = calloc(1, sizeof(*c));
    if (!c) {
        grpc_call_cancel_with_status(gcall, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        grpc_call_unref(gcall);
        grpc_metadata_array_destroy(&md);
        if (payload)
            grpc_byte_buffer_destroy(payload);
        srv_observe(srv, m->name, KVF_GRPC_RESOURCE_EXHAUSTED, arrived);
        srv_live_drop(srv, true);
        return;
    }
    c->method_name = m->name;
    c->arrived_ns = arrived;
    c->tag_close.kind = TAG_UNARY_CLOSE;
    c->tag_reply.kind = TAG_UNARY_REPLY;
    pthread_mutex_init(&c->mu, NULL);
    c->srv = srv;
    c->gcall = gcall;
    c->md = md;
    c->deadline_ns = srv_deadline_ns(deadline);
    c->refs = 2; /* already counted in `live` by srv_request_arrived */

    /* Posted first so that a cancel or a missed deadline frees gRPC's side
     * even if the owner has not replied yet. */
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    pthread_mutex_lock(&c->mu);
    grpc_call_error ce = grpc_call_start_batch(gcall, &op, 1, &c->tag_close, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("%s: RECV_CLOSE batch: %s", m->name, grpc_call_error_to_string(ce));
        grpc_call_cancel(gcall, NULL);
        c->completed = true;
        if (payload)
            grpc_byte_buffer_destroy(payload);
        call_settle_unlock(c, 1); /* no batch: gRPC's side goes now */
        return;
    }
    c->ops_pending = 1;
    pthread_mutex_unlock(&c->mu);

    if (!payload) {
        kvf_rpc_call_fail(c, KVF_GRPC_INVALID_ARGUMENT, "request message missing");
        return;
    }
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, payload)) {
        grpc_byte_buffer_destroy(payload);
        kvf_rpc_call_fail(c, KVF_GRPC_INTERNAL, "cannot read request");
        return;
    }
    grpc_slice req = grpc_byte_buffer_reader_readall(&rd); /* all slices, pitfall 5 */
    grpc_byte_buffer_reader_destroy(&rd);
    grpc_byte_buffer_destroy(payload);
    m->unary(m->ctx, c, GRPC_SLICE_START_PTR(req), GRPC_SLICE_LENGTH(req));
    grpc_slice_unref(req);
}

static int call_complete(struct kvf_rpc_call *c, grpc_status_code code, const char *message,
                         const uint8_t *bytes, size_t len)
{
    grpc_byte_buffer *bb = NULL;
    if (code == GRPC_STATUS_OK)
        bb = rpc_bb_from_bytes(bytes, len);
    int rc;
    pthread_mutex_lock(&c->mu);
    c->completed = true;
    if (!c->gcall || c->close_done) {
        rc = -ECANCELED; /* cancelled, past its deadline, or shut down */
    } else {
        grpc_op ops[3];
        size_t n = 0;
        memset(ops, 0, sizeof(ops));
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        if (bb) {
            ops[n].op = GRPC_OP_SEND_MESSAGE;
            ops[n++].data.send_message.send_message = bb;
        }
        if (message && code != GRPC_STATUS_OK) {
            c->details = grpc_slice_from_copied_string(message);
            c->has_details = true;
        }
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = code;
        ops[n++].data.send_status_from_server.status_details = c->has_details ? &c->details : NULL;
        grpc_call_error ce = grpc_call_start_batch(c->gcall, ops, n, &c->tag_reply, NULL);
        if (ce == GRPC_CALL_OK) {
            c->reply_bb = bb;
            bb = NULL;
            c->ops_pending++;
            c->status_sent = true;
            c->sent_code = (int)code;
            rc = 0;
        } else {
            rpc_log("reply batch: %s", grpc_call_error_to_string(ce));
            grpc_call_cancel(c->gcall, NULL); /* so that RECV_CLOSE completes */
            if (c->has_details) {
                grpc_slice_unref(c->details);
                c->has_details = false;
            }
            rc = -EIO;
        }
    }
    call_settle_unlock(c, 1); /* the owner's reference */
    if (bb)
        grpc_byte_buffer_destroy(bb);
    return rc;
}

int kvf_rpc_call_reply(struct kvf_rpc_call *call, const uint8_t *bytes, size_t len)
{
    return call_complete(call, GRPC_STATUS_OK, NULL, bytes, len);
}

int kvf_rpc_call_fail(struct kvf_rpc_call *call, int code, const char *message)
{
    return call_complete(call, srv_status_code(code), message, NULL, 0);
}

static void call_on_close(struct kvf_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    c->ops_pending--;
    c->close_done = true;
    call_settle_unlock(c, 0);
}

static void call_on_reply(struct kvf_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    c->ops_pending--;
    grpc_byte_buffer_destroy(c->reply_bb); /* consumed, still ours to free (pitfall 4) */
    c->reply_bb = NULL;
    if (c->has_details) {
        grpc_slice_unref(c->details);
        c->has_details = false;
    }
    call_settle_unlock(c, 0);
}

int64_t kvf_rpc_call_deadline_ns(const struct kvf_rpc_call *call)
{
    return call->deadline_ns;
}

int kvf_rpc_call_peer(struct kvf_rpc_call *call, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return -EINVAL;
    pthread_mutex_lock(&call->mu);
    if (!call->gcall) {
        pthread_mutex_unlock(&call->mu);
        return -ECANCELED;
    }
    char *peer = grpc_call_get_peer(call->gcall);
    pthread_mutex_unlock(&call->mu);
    snprintf(buf, cap, "%s", peer ? peer : "");
    gpr_free(peer);
    return 0;
}

static void identity_add(struct kvf_rpc_identity *id, const grpc_auth_property *p)
{
    if (id->n_names >= KVF_RPC_NAMES || p->value == NULL || p->value_length == 0)
        return;
    size_t n = p->value_length < KVF_RPC_NAME_MAX - 1 ? p->value_length : KVF_RPC_NAME_MAX - 1;
    memcpy(id->names[id->n_names], p->value, n);
    id->names[id->n_names][n] = '\0';
    id->n_names++;
}

/* Caller holds the lock that keeps `gcall` alive. */
static void identity_of(grpc_call *gcall, struct kvf_rpc_identity *id)
{
    memset(id, 0, sizeof *id);
    grpc_auth_context *ctx = grpc_call_auth_context(gcall);
    if (ctx == NULL)
        return;
    /* A peer is verified only when it presented a certificate that the
     * server checked: server-only TLS has an auth context too, with no
     * x509 names in it. */
    if (grpc_auth_context_peer_is_authenticated(ctx)) {
        const char *kinds[] = {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME};
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
            grpc_auth_property_iterator it =
                grpc_auth_context_find_properties_by_name(ctx, kinds[k]);
            const grpc_auth_property *p;
            while ((p = grpc_auth_property_iterator_next(&it)) != NULL)
                identity_add(id, p);
        }
        id->verified = id->n_names > 0;
    }
    grpc_auth_context_release(ctx);
}

int kvf_rpc_call_identity(struct kvf_rpc_call *call, struct kvf_rpc_identity *id_p)
{
    pthread_mutex_lock(&call->mu);
    if (!call->gcall) {
        pthread_mutex_unlock(&call->mu);
        return -ECANCELED;
    }
    identity_of(call->gcall, id_p);
    pthread_mutex_unlock(&call->mu);
    return 0;
}

int kvf_rpc_stream_identity(struct kvf_rpc_stream *stream, struct kvf_rpc_identity *id_p)
{
    pthread_mutex_lock(&stream->mu);
    if (!stream->gcall) {
        pthread_mutex_unlock(&stream->mu);
        return -ECANCELED;
    }
    identity_of(stream->gcall, id_p);
    pthread_mutex_unlock(&stream->mu);
    return 0;
}

int kvf_rpc_call_metadata(struct kvf_rpc_call *call, const char *key, char *buf, size_t cap,
                          size_t *len_p)
{
    if (!key || !buf || cap == 0)
        return -EINVAL;
    size_t klen = strlen(key);
    int rc = -ENOENT;
    pthread_mutex_lock(&call->mu);
    if (!call->gcall)
        rc = -ECANCELED;
    for (size_t i = 0; rc == -ENOENT && i < call->md.count; i++) {
        const grpc_metadata *md = &call->md.metadata[i];
        if (GRPC_SLICE_LENGTH(md->key) != klen ||
            memcmp(GRPC_SLICE_START_PTR(md->key), key, klen) != 0)
            continue;
        size_t vlen = GRPC_SLICE_LENGTH(md->value);
        size_t n = vlen < cap - 1 ? vlen : cap - 1;
        memcpy(buf, GRPC_SLICE_START_PTR(md->value), n);
        buf[n] = '\0';
        if (len_p)
            *len_p = vlen;
        rc = 0;
    }
    pthread_mutex_unlock(&call->mu);
    return rc;
}

/* --- server streams ----------------------------------------------------- */

static void stream_free_queue_locked(struct kvf_rpc_stream *s)
{
    while (s->q_head) {
        struct stream_msg *m = s->q_head;
        s->q_head = m->next;
        grpc_byte_buffer_destroy(m->bb);
        free(m);
    }
    s->q_tail = NULL;
    s->q_len = 0;
}

static void stream_free(struct kvf_rpc_stream *s)
{
    if (s->fin_has_details)
        grpc_slice_unref(s->fin_details);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static enum kvf_rpc_close_reason stream_close_reason(struct kvf_rpc_stream *s)
{
    if (!s->cancelled)
        return KVF_RPC_CLOSED_FINISHED;
    /* gRPC core reports only "cancelled". The server's idea of the deadline
     * comes from the timeout the client sent, measured from when the call
     * arrived, so it runs a little behind the client's: a cancel within
     * 100 ms of it is taken as the deadline (a diagnosis only; under load the
     * gap reaches tens of ms). */
    if (s->deadline_ns != INT64_MAX && kvf_clock_mono_ns() + 100000000 >= s->deadline_ns)
        return KVF_RPC_CLOSED_DEADLINE;
    if (s->srv && atomic_load(&s->srv->stopping))
        return KVF_RPC_CLOSED_SHUTDOWN;
    return KVF_RPC_CLOSED_CANCELLED;
}

/* Called with s->mu held; unlocks it. Fires on_closed once the call is closed
 * and no read or callback is in progress, lets gRPC's side go once on_closed
 * has returned and no batch is in flight, drops `drop` references. */
static void stream_settle_unlock(struct kvf_rpc_stream *s, unsigned drop)
{
    if (s->close_done && !s->read_busy && !s->closed_fired) {
        s->closed_fired = true;
        stream_free_queue_locked(s);
        if (s->opened && s->method->cbs.on_closed) {
            enum kvf_rpc_close_reason reason = stream_close_reason(s);
            pthread_mutex_unlock(&s->mu);
            s->method->cbs.on_closed(s->method->ctx, s, reason);
            pthread_mutex_lock(&s->mu);
        }
        s->closed_cb_done = true;
    }
    grpc_call *g = NULL;
    struct kvf_rpc_server *srv = NULL;
    const char *method = NULL;
    int end_code = 0;
    int64_t arrived = 0;
    if (s->gcall && s->closed_cb_done && s->ops_pending == 0) {
        g = s->gcall;
        srv = s->srv;
        s->gcall = NULL;
        s->srv = NULL;
        grpc_metadata_array_destroy(&s->md);
        drop++;
        if (srv->on_call_done) {
            method = s->method->name;
            end_code = srv_end_code(s->status_started, s->fin_code, s->cancelled, s->deadline_ns);
            arrived = s->arrived_ns;
        }
    }
    s->refs -= drop;
    bool last = s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (g) {
        grpc_call_unref(g);
        if (method)
            srv_observe(srv, method, end_code, arrived);
        srv_live_drop(srv, true);
    }
    if (last)
        stream_free(s);
}

/* Starts one read. Called with s->mu held. */
static void stream_start_read_locked(struct kvf_rpc_stream *s)
{
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->recv_bb;
    s->recv_bb = NULL;
    grpc_call_error ce = grpc_call_start_batch(s->gcall, &op, 1, &s->tag_read, NULL);
    if (ce == GRPC_CALL_OK) {
        s->ops_pending++;
        s->read_busy = true;
    } else {
        rpc_log("%s: read batch: %s", s->method->name, grpc_call_error_to_string(ce));
        s->read_busy = false;
        grpc_call_cancel(s->gcall, NULL);
    }
}

/* Sends `bb` (taking it on success). Called with s->mu held. With more
 * messages queued behind it, the write-buffer hint lets gRPC hold it back and
 * write it with the next ones (the last queued one is sent without the hint,
 * which flushes them all). */
static int stream_start_send_locked(struct kvf_rpc_stream *s, grpc_byte_buffer *bb)
{
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!s->md_sent)
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    if (s->q_head)
        ops[n].flags = GRPC_WRITE_BUFFER_HINT;
    ops[n++].data.send_message.send_message = bb;
    grpc_call_error ce = grpc_call_start_batch(s->gcall, ops, n, &s->tag_send, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("%s: send batch: %s", s->method->name, grpc_call_error_to_string(ce));
        s->send_failed = true;
        grpc_call_cancel(s->gcall, NULL);
        return -EIO;
    }
    s->md_sent = true;
    s->send_bb = bb;
    s->send_busy = true;
    s->ops_pending++;
    return 0;
}

/* Sends the finish status. Called with s->mu held. */
static int stream_start_status_locked(struct kvf_rpc_stream *s)
{
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!s->md_sent)
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)s->fin_code;
    ops[n++].data.send_status_from_server.status_details =
        s->fin_has_details ? &s->fin_details : NULL;
    grpc_call_error ce = grpc_call_start_batch(s->gcall, ops, n, &s->tag_status, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("%s: status batch: %s", s->method->name, grpc_call_error_to_string(ce));
        grpc_call_cancel(s->gcall, NULL);
        return -EIO;
    }
    s->md_sent = true;
    s->status_started = true;
    s->ops_pending++;
    return 0;
}

static void srv_stream_arrived(struct kvf_rpc_server *srv, const struct srv_method *m,
                               grpc_call *gcall, grpc_metadata_array md, gpr_timespec deadline,
                               grpc_byte_buffer *payload)
{
    int64_t arrived = kvf_clock_mono_ns();
    struct kvf_rpc_stream *s = calloc(1, sizeof(*s));
    if (!s) {
        grpc_call_cancel_with_status(gcall, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        grpc_call_unref(gcall);
        grpc_metadata_array_destroy(&md);
        if (payload)
            grpc_byte_buffer_destroy(payload);
        srv_observe(srv, m->name, KVF_GRPC_RESOURCE_EXHAUSTED, arrived);
        srv_live_drop(srv, true);
        return;
    }
    s->arrived_ns = arrived;
    s->tag_close.kind = TAG_STREAM_CLOSE;
    s->tag_read.kind = TAG_STREAM_READ;
    s->tag_send.kind = TAG_STREAM_SEND;
    s->tag_status.kind = TAG_STREAM_STATUS;
    pthread_mutex_init(&s->mu, NULL);
    s->srv = srv;
    s->method = m;
    s->gcall = gcall;
    s->md = md;
    s->deadline_ns = srv_deadline_ns(deadline);
    s->refs = 1;
    s->read_busy = true; /* holds on_closed back until on_open has returned */
    /* already counted in `live` by srv_request_arrived */

    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &s->cancelled;
    pthread_mutex_lock(&s->mu);
    grpc_call_error ce = grpc_call_start_batch(gcall, &op, 1, &s->tag_close, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("%s: RECV_CLOSE batch: %s", m->name, grpc_call_error_to_string(ce));
        grpc_call_cancel(gcall, NULL);
        s->close_done = true; /* nothing pending: never opened, goes now */
        s->read_busy = false;
        if (payload)
            grpc_byte_buffer_destroy(payload);
        stream_settle_unlock(s, 0);
        return;
    }
    s->ops_pending = 1;

    grpc_slice req = grpc_empty_slice();
    if (m->kind == METHOD_SERVER_STREAMING) {
        grpc_byte_buffer_reader rd;
        if (!payload || !grpc_byte_buffer_reader_init(&rd, payload)) {
            s->read_busy = false;
            s->finish_requested = true;
            s->fin_code = GRPC_STATUS_INVALID_ARGUMENT;
            s->fin_details = grpc_slice_from_static_string("request message missing");
            s->fin_has_details = true;
            stream_start_status_locked(s);
            if (payload)
                grpc_byte_buffer_destroy(payload);
            stream_settle_unlock(s, 0);
            return;
        }
        req = grpc_byte_buffer_reader_readall(&rd); /* all slices, pitfall 5 */
        grpc_byte_buffer_reader_destroy(&rd);
        grpc_byte_buffer_destroy(payload);
    }
    s->opened = true;
    pthread_mutex_unlock(&s->mu);

    m->cbs.on_open(m->ctx, s, m->kind == METHOD_SERVER_STREAMING ? GRPC_SLICE_START_PTR(req) : NULL,
                   GRPC_SLICE_LENGTH(req));
    grpc_slice_unref(req);

    pthread_mutex_lock(&s->mu);
    if (m->kind == METHOD_BIDI && !s->close_done)
        stream_start_read_locked(s);
    else
        s->read_busy = false;
    stream_settle_unlock(s, 0);
}

static void stream_on_read(struct kvf_rpc_stream *s, bool ok)
{
    pthread_mutex_lock(&s->mu);
    s->ops_pending--;
    grpc_byte_buffer *bb = s->recv_bb;
    s->recv_bb = NULL;
    const struct srv_method *m = s->method;
    if (ok && bb && !(s->close_done && s->cancelled)) {
        pthread_mutex_unlock(&s->mu);
        grpc_byte_buffer_reader rd;
        if (grpc_byte_buffer_reader_init(&rd, bb)) {
            grpc_slice msg = grpc_byte_buffer_reader_readall(&rd);
            grpc_byte_buffer_reader_destroy(&rd);
            if (m->cbs.on_message)
                m->cbs.on_message(m->ctx, s, GRPC_SLICE_START_PTR(msg), GRPC_SLICE_LENGTH(msg));
            grpc_slice_unref(msg);
        }
        grpc_byte_buffer_destroy(bb);
        pthread_mutex_lock(&s->mu);
        if (!s->close_done)
            stream_start_read_locked(s);
        else
            s->read_busy = false;
    } else if (ok && !bb && !s->close_done) {
        /* The client half-closed: no more reads. */
        pthread_mutex_unlock(&s->mu);
        if (m->cbs.on_half_close)
            m->cbs.on_half_close(m->ctx, s);
        pthread_mutex_lock(&s->mu);
        s->read_busy = false;
    } else {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        s->read_busy = false;
    }
    stream_settle_unlock(s, 0);
}

static void stream_on_send(struct kvf_rpc_stream *s, bool ok)
{
    pthread_mutex_lock(&s->mu);
    s->ops_pending--;
    grpc_byte_buffer_destroy(s->send_bb); /* pitfall 4 */
    s->send_bb = NULL;
    s->send_busy = false;
    if (!ok)
        s->send_failed = true;
    if (s->send_failed || s->close_done) {
        stream_free_queue_locked(s);
    } else if (s->q_head) {
        struct stream_msg *next = s->q_head;
        s->q_head = next->next;
        if (!s->q_head)
            s->q_tail = NULL;
        s->q_len--;
        if (stream_start_send_locked(s, next->bb) != 0) {
            grpc_byte_buffer_destroy(next->bb);
            stream_free_queue_locked(s);
        }
        free(next);
    } else if (s->finish_requested && !s->status_started) {
        stream_start_status_locked(s);
    }
    stream_settle_unlock(s, 0);
}

static void stream_on_status(struct kvf_rpc_stream *s)
{
    pthread_mutex_lock(&s->mu);
    s->ops_pending--;
    stream_settle_unlock(s, 0);
}

static void stream_on_close(struct kvf_rpc_stream *s)
{
    pthread_mutex_lock(&s->mu);
    s->ops_pending--;
    s->close_done = true;
    stream_settle_unlock(s, 0);
}

int kvf_rpc_stream_send(struct kvf_rpc_stream *stream, const uint8_t *bytes, size_t len)
{
    struct stream_msg *item = malloc(sizeof(*item));
    if (!item)
        return -ENOMEM;
    item->next = NULL;
    item->bb = rpc_bb_from_bytes(bytes, len);
    int rc = 0;
    pthread_mutex_lock(&stream->mu);
    if (stream->close_done || stream->send_failed) {
        rc = -ECANCELED;
    } else if (stream->finish_requested) {
        rc = -EPIPE;
    } else if (stream->send_busy) {
        if (stream->q_tail)
            stream->q_tail->next = item;
        else
            stream->q_head = item;
        stream->q_tail = item;
        stream->q_len++;
        item = NULL;
    } else {
        rc = stream_start_send_locked(stream, item->bb);
        if (rc == 0) {
            free(item);
            item = NULL;
        }
    }
    pthread_mutex_unlock(&stream->mu);
    if (item) {
        grpc_byte_buffer_destroy(item->bb);
        free(item);
    }
    return rc;
}

int kvf_rpc_stream_finish(struct kvf_rpc_stream *stream, int code, const char *message)
{
    int rc = 0;
    pthread_mutex_lock(&stream->mu);
    if (stream->close_done) {
        rc = -ECANCELED;
    } else if (stream->finish_requested) {
        rc = -EALREADY;
    } else {
        stream->finish_requested = true;
        stream->fin_code = code < 0 || code > KVF_GRPC_UNAUTHENTICATED ? KVF_GRPC_UNKNOWN : code;
        if (message) {
            stream->fin_details = grpc_slice_from_copied_string(message);
            stream->fin_has_details = true;
        }
        if (!stream->send_busy && !stream->send_failed)
            rc = stream_start_status_locked(stream);
    }
    pthread_mutex_unlock(&stream->mu);
    return rc;
}

void kvf_rpc_stream_ref(struct kvf_rpc_stream *stream)
{
    pthread_mutex_lock(&stream->mu);
    stream->refs++;
    pthread_mutex_unlock(&stream->mu);
}

void kvf_rpc_stream_unref(struct kvf_rpc_stream *stream)
{
    if (!stream)
        return;
    pthread_mutex_lock(&stream->mu);
    bool last = --stream->refs == 0;
    pthread_mutex_unlock(&stream->mu);
    if (last)
        stream_free(stream);
}

void kvf_rpc_stream_set_user(struct kvf_rpc_stream *stream, void *user)
{
    pthread_mutex_lock(&stream->mu);
    stream->user = user;
    pthread_mutex_unlock(&stream->mu);
}

void *kvf_rpc_stream_user(struct kvf_rpc_stream *stream)
{
    pthread_mutex_lock(&stream->mu);
    void *user = stream->user;
    pthread_mutex_unlock(&stream->mu);
    return user;
}

int64_t kvf_rpc_stream_deadline_ns(const struct kvf_rpc_stream *stream)
{
    return stream->deadline_ns;
}

size_t kvf_rpc_stream_queued(struct kvf_rpc_stream *stream)
{
    pthread_mutex_lock(&stream->mu);
    size_t n = stream->q_len + (stream->send_busy ? 1 : 0);
    pthread_mutex_unlock(&stream->mu);
    return n;
}

/* --- dispatch and CQ threads -------------------------------------------- */

static void srv_request_arrived(struct kvf_rpc_server *srv, struct srv_request *r, bool ok)
{
    if (!ok) {
        srv_request_free(r); /* killed by shutdown */
        srv_live_drop(srv, false);
        return;
    }
    struct srv_method *m = r->method;
    grpc_call *gcall = r->gcall;
    grpc_metadata_array md = r->md;
    gpr_timespec deadline = r->deadline;
    grpc_byte_buffer *payload = r->payload;

    pthread_mutex_lock(&srv->mu);
    /* Count the new call before the request may be uncounted: once shutdown
     * has begun the request is not reposted, and for a moment `live` would
     * otherwise read 0 while this thread still holds a grpc_call. Shutdown
     * could then destroy the server and shut the CQ down, and our first
     * batch on the call would hit gRPC's assertion on a shut-down CQ. */
    srv->live++;
    srv->calls++;
    srv_request_post_locked(srv, r); /* the next call can arrive meanwhile */
    pthread_mutex_unlock(&srv->mu);

    if (m->kind == METHOD_UNARY)
        srv_unary_arrived(srv, m, gcall, md, deadline, payload);
    else
        srv_stream_arrived(srv, m, gcall, md, deadline, payload);
}

static void srv_dispatch(struct kvf_rpc_server *srv, void *tag, bool ok)
{
    struct srv_tag *t = tag;
    switch (t->kind) {
    case TAG_REQUEST:
        srv_request_arrived(srv, container_of_rpc(t, struct srv_request, tag), ok);
        break;
    case TAG_GENERIC_REQUEST:
        srv_generic_arrived(srv, container_of_rpc(t, struct srv_generic, tag_req), ok);
        break;
    case TAG_GENERIC_DONE:
        srv_generic_done(srv, container_of_rpc(t, struct srv_generic, tag_done));
        break;
    case TAG_UNARY_CLOSE:
        call_on_close(container_of_rpc(t, struct kvf_rpc_call, tag_close));
        break;
    case TAG_UNARY_REPLY:
        call_on_reply(container_of_rpc(t, struct kvf_rpc_call, tag_reply));
        break;
    case TAG_STREAM_CLOSE:
        stream_on_close(container_of_rpc(t, struct kvf_rpc_stream, tag_close));
        break;
    case TAG_STREAM_READ:
        stream_on_read(container_of_rpc(t, struct kvf_rpc_stream, tag_read), ok);
        break;
    case TAG_STREAM_SEND:
        stream_on_send(container_of_rpc(t, struct kvf_rpc_stream, tag_send), ok);
        break;
    case TAG_STREAM_STATUS:
        stream_on_status(container_of_rpc(t, struct kvf_rpc_stream, tag_status));
        break;
    case TAG_SHUTDOWN:
        pthread_mutex_lock(&srv->mu);
        srv->shutdown_done = true;
        pthread_cond_broadcast(&srv->cv);
        pthread_mutex_unlock(&srv->mu);
        break;
    }
}

static void *srv_thread_main(void *arg)
{
    struct kvf_rpc_server *srv = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE)
            srv_dispatch(srv, ev.tag, ev.success != 0);
    }
    return NULL;
}

/* --- public life cycle -------------------------------------------------- */

void kvf_rpc_server_opts_init(struct kvf_rpc_server_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->listen_addr = "127.0.0.1:0";
}

struct kvf_rpc_server *kvf_rpc_server_create(const struct kvf_rpc_server_opts *opts)
{
    if (!opts || !opts->listen_addr || !opts->listen_addr[0]) {
        rpc_log("server: no listen address");
        return NULL;
    }
    if (!opts->tls_cert_path != !opts->tls_key_path ||
        (opts->tls_client_ca_path && !opts->tls_cert_path)) {
        rpc_log(
            "server: TLS needs both a certificate and a key (and the client CA only with them)");
        return NULL;
    }
    struct kvf_rpc_server *srv = calloc(1, sizeof(*srv));
    if (!srv) {
        rpc_log("server: out of memory");
        return NULL;
    }
    srv->listen_addr = strdup(opts->listen_addr);
    if (!srv->listen_addr)
        goto err_free_srv;
    if (opts->tls_cert_path) {
        int rc = rpc_read_file(opts->tls_cert_path, &srv->pem_cert);
        const char *bad = opts->tls_cert_path;
        if (rc == 0) {
            rc = rpc_read_file(opts->tls_key_path, &srv->pem_key);
            bad = opts->tls_key_path;
        }
        if (rc == 0 && opts->tls_client_ca_path) {
            rc = rpc_read_file(opts->tls_client_ca_path, &srv->pem_client_ca);
            bad = opts->tls_client_ca_path;
        }
        if (rc != 0) {
            rpc_log("server: cannot read %s: %s", bad, strerror(-rc));
            goto err_free_pems;
        }
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    srv->n_threads = opts->cq_threads ? opts->cq_threads : (cores > 0 ? (unsigned)cores : 1);
    srv->max_message =
        opts->max_message_bytes ? opts->max_message_bytes : KVF_RPC_DEFAULT_MAX_MESSAGE;
    if (srv->max_message > INT32_MAX) {
        rpc_log("server: max_message_bytes %zu is over 2 GiB", srv->max_message);
        goto err_free_pems;
    }
    srv->max_receive = opts->max_receive_bytes && opts->max_receive_bytes < srv->max_message
                           ? opts->max_receive_bytes
                           : srv->max_message;
    srv->threads = calloc(srv->n_threads, sizeof(*srv->threads));
    if (!srv->threads)
        goto err_free_pems;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&srv->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&srv->mu, NULL);
    srv->tag_shutdown.kind = TAG_SHUTDOWN;
    srv->on_call_done = opts->on_call_done;
    srv->observer_ctx = opts->observer_ctx;
    srv->state = SRV_CREATED;
    grpc_init();
    return srv;

err_free_pems:
    free(srv->pem_cert);
    free(srv->pem_key);
    free(srv->pem_client_ca);
    free(srv->listen_addr);
err_free_srv:
    free(srv);
    return NULL;
}

static int srv_add_method(struct kvf_rpc_server *srv, const char *method, enum srv_method_kind kind,
                          kvf_rpc_unary_fn unary, const struct kvf_rpc_stream_callbacks *cbs,
                          void *ctx)
{
    if (!srv || !method || method[0] != '/' || !strchr(method + 1, '/'))
        return -EINVAL;
    if (srv->state != SRV_CREATED)
        return -EPERM;
    for (struct srv_method *m = srv->methods; m; m = m->next)
        if (strcmp(m->name, method) == 0)
            return -EEXIST;
    struct srv_method *m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->name = strdup(method);
    if (!m->name) {
        free(m);
        return -ENOMEM;
    }
    m->kind = kind;
    m->unary = unary;
    if (cbs)
        m->cbs = *cbs;
    m->ctx = ctx;
    m->next = srv->methods;
    srv->methods = m;
    return 0;
}

int kvf_rpc_server_add_unary(struct kvf_rpc_server *srv, const char *method,
                             kvf_rpc_unary_fn handler, void *ctx)
{
    if (!handler)
        return -EINVAL;
    return srv_add_method(srv, method, METHOD_UNARY, handler, NULL, ctx);
}

int kvf_rpc_server_add_stream(struct kvf_rpc_server *srv, const char *method,
                              enum kvf_rpc_stream_kind kind,
                              const struct kvf_rpc_stream_callbacks *cbs, void *ctx)
{
    if (!cbs || !cbs->on_open || (kind != KVF_RPC_SERVER_STREAMING && kind != KVF_RPC_BIDI))
        return -EINVAL;
    return srv_add_method(srv, method, kind == KVF_RPC_BIDI ? METHOD_BIDI : METHOD_SERVER_STREAMING,
                          NULL, cbs, ctx);
}

/* Tears down a grpc_server that never got CQ threads: shut it down, take the
 * tag off the CQ here, destroy it and the CQ. */
static void srv_unwind_unserved(struct kvf_rpc_server *srv)
{
    grpc_server_shutdown_and_notify(srv->gsrv, srv->cq, &srv->tag_shutdown);
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_OP_COMPLETE && ev.tag == &srv->tag_shutdown)
            break;
    }
    grpc_server_destroy(srv->gsrv);
    srv->gsrv = NULL;
    grpc_completion_queue_shutdown(srv->cq);
    while (grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(srv->cq);
    srv->cq = NULL;
}

static grpc_server_credentials *srv_credentials(struct kvf_rpc_server *srv)
{
    if (!srv->pem_cert)
        return grpc_insecure_server_credentials_create();
    grpc_ssl_pem_key_cert_pair pair = {.private_key = srv->pem_key, .cert_chain = srv->pem_cert};
    return grpc_ssl_server_credentials_create_ex(
        srv->pem_client_ca, &pair, 1,
        srv->pem_client_ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                           : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
}

int kvf_rpc_server_start(struct kvf_rpc_server *srv)
{
    if (!srv)
        return -EINVAL;
    if (srv->state != SRV_CREATED)
        return -EPERM;

    grpc_arg args[3];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_ALLOW_REUSEPORT; /* pitfall 7 */
    args[0].value.integer = 0;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[1].value.integer = (int)srv->max_receive;
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[2].value.integer = (int)srv->max_message;
    grpc_channel_args chargs = {.num_args = 3, .args = args};

    srv->cq = grpc_completion_queue_create_for_next(NULL);
    srv->gsrv = grpc_server_create(&chargs, NULL);
    grpc_server_register_completion_queue(srv->gsrv, srv->cq, NULL);
    int rc;
    for (struct srv_method *m = srv->methods; m; m = m->next) {
        m->handle = grpc_server_register_method(srv->gsrv, m->name, NULL,
                                                m->kind == METHOD_BIDI
                                                    ? GRPC_SRM_PAYLOAD_NONE
                                                    : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER,
                                                0);
        if (!m->handle) {
            rpc_log("server: cannot register %s", m->name);
            rc = -EINVAL;
            goto err_unwind_server;
        }
    }
    grpc_server_credentials *creds = srv_credentials(srv);
    if (!creds) {
        rpc_log("server: bad TLS credentials");
        rc = -EINVAL;
        goto err_unwind_server;
    }
    int port = grpc_server_add_http2_port(srv->gsrv, srv->listen_addr, creds);
    grpc_server_credentials_release(creds);
    if (port <= 0) {
        rpc_log("server: cannot listen on %s", srv->listen_addr);
        rc = -EADDRINUSE;
        goto err_unwind_server;
    }
    grpc_server_start(srv->gsrv);

    /* CQ threads take no signals: the daemon's main thread sigwaits for them. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (unsigned i = 0; i < srv->n_threads; i++) {
        if (pthread_create(&srv->threads[i], NULL, srv_thread_main, srv) != 0) {
            rpc_log("server: CQ thread %u did not start", i);
            break;
        }
        srv->n_running++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (srv->n_running == 0) {
        rc = -EAGAIN;
        goto err_unwind_server;
    }

    pthread_mutex_lock(&srv->mu);
    srv->state = SRV_STARTED;
    unsigned per_method = srv->n_running < 2 ? 2 : srv->n_running;
    for (struct srv_method *m = srv->methods; m; m = m->next) {
        for (unsigned i = 0; i < per_method; i++) {
            struct srv_request *r = calloc(1, sizeof(*r));
            if (!r)
                break;
            r->tag.kind = TAG_REQUEST;
            r->srv = srv;
            r->method = m;
            srv->live++;
            srv_request_post_locked(srv, r);
        }
    }
    srv_generic_post_locked(srv); /* pitfall 6: unknown methods */
    pthread_mutex_unlock(&srv->mu);
    return strncmp(srv->listen_addr, "unix:", 5) == 0 ? 0 : port;

err_unwind_server:
    srv_unwind_unserved(srv);
    srv->state = SRV_STOPPED;
    return rc;
}

void kvf_rpc_server_shutdown(struct kvf_rpc_server *srv, unsigned grace_ms)
{
    if (!srv)
        return;
    pthread_mutex_lock(&srv->mu);
    if (srv->state != SRV_STARTED) {
        srv->state = SRV_STOPPED;
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    srv->state = SRV_STOPPED;
    atomic_store(&srv->stopping, true); /* under mu: no request is posted after this */
    pthread_mutex_unlock(&srv->mu);

    grpc_server_shutdown_and_notify(srv->gsrv, srv->cq, &srv->tag_shutdown);

    struct timespec until = kvf_clock_mono_after_ms(grace_ms);
    pthread_mutex_lock(&srv->mu);
    while (!(srv->shutdown_done && srv->live == 0))
        if (pthread_cond_timedwait(&srv->cv, &srv->mu, &until) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&srv->mu);

    /* Calls still running after the grace period are cancelled: their
     * RECV_CLOSE completes, which lets gRPC's side of each go. */
    grpc_server_cancel_all_calls(srv->gsrv);
    pthread_mutex_lock(&srv->mu);
    while (!(srv->shutdown_done && srv->live == 0))
        pthread_cond_wait(&srv->cv, &srv->mu);
    pthread_mutex_unlock(&srv->mu);

    grpc_server_destroy(srv->gsrv);
    srv->gsrv = NULL;
    grpc_completion_queue_shutdown(srv->cq);
    for (unsigned i = 0; i < srv->n_running; i++)
        pthread_join(srv->threads[i], NULL);
    srv->n_running = 0;
    grpc_completion_queue_destroy(srv->cq);
    srv->cq = NULL;
}

void kvf_rpc_server_destroy(struct kvf_rpc_server *srv)
{
    if (!srv)
        return;
    kvf_rpc_server_shutdown(srv, 0);
    while (srv->methods) {
        struct srv_method *m = srv->methods;
        srv->methods = m->next;
        free(m->name);
        free(m);
    }
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
    free(srv->threads);
    free(srv->pem_cert);
    free(srv->pem_key);
    free(srv->pem_client_ca);
    free(srv->listen_addr);
    free(srv);
    grpc_shutdown();
}

size_t kvf_rpc_server_calls_in_flight(struct kvf_rpc_server *srv)
{
    pthread_mutex_lock(&srv->mu);
    size_t n = srv->calls;
    pthread_mutex_unlock(&srv->mu);
    return n;
}
