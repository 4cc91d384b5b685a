/*
 * kvfence.c: libkvfence, the C client library (include/kvfence/kvfence.h), on
 * the gRPC glue of common/rpc and the protobuf-c code of api/.
 */
#include "kvfence/kvfence.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "kvf_error.h"
#include "kvf_fdpass.h"
#include "kvf_pageset.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_client.h"
#include "kvf_clock.h"

#define DEFAULT_CALL_TIMEOUT_MS 5000
#define MAX_RANGES              65536

struct kvf_client {
    struct kvf_rpc_channel *ch;
    int64_t call_timeout_ms;
};

struct kvf_node_client {
    struct kvf_rpc_channel *ch;
    int64_t call_timeout_ms;
    char fd_socket[256]; /* "<socket_path>.fds" (kvf_fdpass.h) */
};

/* ---- status ------------------------------------------------------------------ */

/* Records `code` (positive) and a message; returns -code (client_internal.h:
 * pools.c reports the same way). */
int client_status(struct kvf_status *st, int code, const char *fmt, ...)
{
    if (st) {
        st->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->message, sizeof st->message, fmt, ap);
        va_end(ap);
    }
    return -code;
}

static int ok_status(struct kvf_status *st)
{
    if (st) {
        st->code = KVF_STATUS_OK;
        st->message[0] = '\0';
    }
    return 0;
}

const char *kvf_status_name(int code)
{
    if (code < 0)
        code = -code;
    if (code > KVF_STATUS_UNAUTHENTICATED)
        return "?";
    return kvf_grpc_code_name((enum kvf_grpc_code)code);
}

static int64_t now_ms(void)
{
    return kvf_clock_mono_ms();
}

/* ---- unary calls ----------------------------------------------------------------- */

/* Packs `req`, calls `method`, and unpacks the reply with `desc` into *resp_p
 * (when not NULL; free it with protobuf_c_message_free_unpacked). */
static int unary(struct kvf_rpc_channel *ch, int64_t timeout_ms, const char *method,
                 const ProtobufCMessage *req, const ProtobufCMessageDescriptor *desc,
                 ProtobufCMessage **resp_p, struct kvf_status *st)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", method);
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    struct kvf_rpc_status rst = {0};
    int rc = kvf_rpc_unary(ch, method, buf, len, timeout_ms > 0 ? timeout_ms : KVF_RPC_NO_TIMEOUT,
                           &resp, &rlen, &rst);
    free(buf);
    if (rc != 0) {
        free(resp);
        int code =
            rst.code > 0 && rst.code <= KVF_STATUS_UNAUTHENTICATED ? rst.code : KVF_STATUS_INTERNAL;
        return client_status(st, code, "%s", rst.message[0] ? rst.message : kvf_status_name(code));
    }
    if (resp_p) {
        *resp_p = protobuf_c_message_unpack(desc, NULL, rlen, resp);
        if (!*resp_p) {
            free(resp);
            return client_status(st, KVF_STATUS_INTERNAL, "%s: malformed reply (%zu bytes)", method,
                                 rlen);
        }
    }
    free(resp);
    return ok_status(st);
}

/* Page ranges in protobuf-c form: `n` structs plus the pointer array. */
struct ranges {
    Kvfence__V1__PageRange *v;
    Kvfence__V1__PageRange **p;
    size_t n;
};

static int ranges_make(struct ranges *r, const struct kvf_page_range *in, size_t n,
                       const char *what, struct kvf_status *st)
{
    memset(r, 0, sizeof *r);
    if (n > 0 && !in)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT, "%s: NULL with a count of %zu", what,
                             n);
    if (n > MAX_RANGES)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED, "%s: %zu ranges (at most %d)", what,
                             n, MAX_RANGES);
    if (n == 0)
        return 0;
    r->v = calloc(n, sizeof *r->v);
    r->p = calloc(n, sizeof *r->p);
    if (!r->v || !r->p) {
        free(r->v);
        free(r->p);
        memset(r, 0, sizeof *r);
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", what);
    }
    for (size_t i = 0; i < n; i++) {
        Kvfence__V1__PageRange init = KVFENCE__V1__PAGE_RANGE__INIT;
        r->v[i] = init;
        r->v[i].first = in[i].first;
        r->v[i].count = in[i].count;
        r->p[i] = &r->v[i];
    }
    r->n = n;
    return 0;
}

static void ranges_free(struct ranges *r)
{
    free(r->v);
    free(r->p);
    memset(r, 0, sizeof *r);
}

static int bad_arg(struct kvf_status *st, const char *fn, const char *what)
{
    return client_status(st, KVF_STATUS_INVALID_ARGUMENT, "%s: %s", fn, what);
}

/* ---- control plane client ------------------------------------------------------- */

void kvf_client_opts_init(struct kvf_client_opts *opts)
{
    if (!opts)
        return;
    memset(opts, 0, sizeof *opts);
    opts->call_timeout_ms = DEFAULT_CALL_TIMEOUT_MS;
}

static struct kvf_rpc_channel *channel_create(const char *target,
                                              const struct kvf_client_opts *opts, bool tls,
                                              struct kvf_status *st)
{
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    if (opts) {
        co.wait_for_ready = opts->wait_for_ready;
        if (tls) {
            co.tls_root_ca_path = opts->tls_root_ca_path;
            co.tls_cert_path = opts->tls_cert_path;
            co.tls_key_path = opts->tls_key_path;
            co.tls_target_name = opts->tls_target_name;
        }
    }
    if (tls && opts && (!opts->tls_cert_path != !opts->tls_key_path)) {
        client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                      "tls_cert_path and tls_key_path go together (both or neither)");
        return NULL;
    }
    if (tls && opts && opts->tls_cert_path && !opts->tls_root_ca_path) {
        client_status(st, KVF_STATUS_INVALID_ARGUMENT, "mutual TLS needs tls_root_ca_path");
        return NULL;
    }
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, &co);
    if (!ch)
        client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                      "cannot create a channel to %s (unreadable TLS file or bad option)", target);
    return ch;
}

int kvf_client_create(const char *target, const struct kvf_client_opts *opts, kvf_client **out,
                      struct kvf_status *st)
{
    if (out)
        *out = NULL;
    if (!target || !target[0] || !out)
        return bad_arg(st, "kvf_client_create", "target and out are required");
    kvf_client *c = calloc(1, sizeof *c);
    if (!c)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED, "kvf_client_create: out of memory");
    c->call_timeout_ms = opts ? opts->call_timeout_ms : DEFAULT_CALL_TIMEOUT_MS;
    c->ch = channel_create(target, opts, true, st);
    if (!c->ch) {
        free(c);
        return st ? -st->code : -KVF_STATUS_INVALID_ARGUMENT;
    }
    *out = c;
    return ok_status(st);
}

void kvf_client_destroy(kvf_client *c)
{
    if (!c)
        return;
    kvf_rpc_channel_destroy(c->ch);
    free(c);
}

static const char *const engine_features[] = {"QUIESCE_V1"};

/* ---- page sets ------------------------------------------------------------------ */

/* An encoded set and its PageSet message, built once (the RANGES form's
 * PageRange structs live here too). */
struct kvf_page_set {
    struct kvf_pageset_enc enc;
    struct ranges ranges;
    Kvfence__V1__PageSet msg;
};

int kvf_page_set_encode(const uint32_t *pages, size_t n, kvf_page_set **out, struct kvf_status *st)
{
    if (!out)
        return bad_arg(st, "kvf_page_set_encode", "out is required");
    *out = NULL;
    if (n > 0 && !pages)
        return bad_arg(st, "kvf_page_set_encode", "pages: NULL with a count");
    kvf_page_set *set = calloc(1, sizeof *set);
    if (!set)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_page_set_encode: out of memory");
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_pageset_encode(pages, n, &set->enc, &err);
    if (rc < 0) {
        free(set);
        return client_status(st, kvf_errno_to_grpc_code(rc), "kvf_page_set_encode: %s", err.msg);
    }
    kvfence__v1__page_set__init(&set->msg);
    switch (set->enc.form) {
    case KVF_PAGESET_RANGES:
        /* struct kvf_page_run and struct kvf_page_range: the same two fields */
        rc = ranges_make(&set->ranges, (const struct kvf_page_range *)set->enc.runs, set->enc.nruns,
                         "pages", NULL);
        if (rc) {
            kvf_page_set_destroy(set);
            return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                                 "kvf_page_set_encode: out of memory");
        }
        set->msg.n_ranges = set->ranges.n;
        set->msg.ranges = set->ranges.p;
        break;
    case KVF_PAGESET_BITMAP:
        set->msg.bitmap.data = set->enc.bytes;
        set->msg.bitmap.len = set->enc.nbytes;
        set->msg.bitmap_first = set->enc.bitmap_first;
        break;
    case KVF_PAGESET_DELTAS:
        set->msg.deltas.data = set->enc.bytes;
        set->msg.deltas.len = set->enc.nbytes;
        break;
    default:
        break;
    }
    *out = set;
    return ok_status(st);
}

void kvf_page_set_destroy(kvf_page_set *set)
{
    if (!set)
        return;
    ranges_free(&set->ranges);
    kvf_pageset_enc_free(&set->enc);
    free(set);
}

enum kvf_page_set_form kvf_page_set_form(const kvf_page_set *set)
{
    return set ? (enum kvf_page_set_form)set->enc.form : KVF_PAGE_SET_EMPTY;
}

size_t kvf_page_set_wire_size(const kvf_page_set *set)
{
    return set ? set->enc.wire_size : 0;
}

size_t kvf_page_set_page_count(const kvf_page_set *set)
{
    return set ? set->enc.pages : 0;
}

size_t kvf_page_set_run_count(const kvf_page_set *set)
{
    return set ? set->enc.nruns : 0;
}

/* The PageSet to send, or NULL for an empty set. */
static Kvfence__V1__PageSet *page_set_msg(const kvf_page_set *set)
{
    return set->enc.form == KVF_PAGESET_EMPTY ? NULL : (Kvfence__V1__PageSet *)&set->msg;
}

/* JoinRoom with join->ranges or, when `ps` is not NULL, that page set. */
static int join_room(kvf_client *c, const struct kvf_join *join, Kvfence__V1__PageSet *ps,
                     struct kvf_join_result *out, struct kvf_status *st)
{
    struct ranges r;
    int rc = ranges_make(&r, join->ranges, join->n_ranges, "join.ranges", st);
    if (rc)
        return rc;
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = (char **)engine_features;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)join->node_id;
    part.rank = join->rank;
    part.role = (Kvfence__V1__Role)join->role;
    Kvfence__V1__JoinRoomRequest req = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    req.room_id = join->room_id;
    req.expected_sources = join->expected_sources;
    req.expected_sinks = join->expected_sinks;
    req.participant = &part;
    req.engine_capabilities = &caps;
    req.pool_id = join->pool_id;
    req.n_ranges = r.n;
    req.ranges = r.p;
    req.page_set = ps;
    ProtobufCMessage *m = NULL;
    rc = unary(c->ch, c->call_timeout_ms, "/kvfence.v1.Control/JoinRoom", &req.base,
               &kvfence__v1__join_room_response__descriptor, &m, st);
    ranges_free(&r);
    if (rc)
        return rc;
    Kvfence__V1__JoinRoomResponse *resp = (Kvfence__V1__JoinRoomResponse *)m;
    if (out) {
        memset(out, 0, sizeof *out);
        if (resp->room) {
            out->room.room_id = resp->room->room_id;
            out->room.generation = resp->room->generation;
        }
        out->lease_id = resp->lease_id;
        out->state = (enum kvf_room_state)resp->state;
        out->protocol_version = resp->protocol_version;
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}

int kvf_join_room(kvf_client *c, const struct kvf_join *join, struct kvf_join_result *out,
                  struct kvf_status *st)
{
    if (!c || !join)
        return bad_arg(st, "kvf_join_room", "client and join are required");
    if (!join->node_id || !join->node_id[0])
        return bad_arg(st, "kvf_join_room", "join.node_id is required");
    return join_room(c, join, NULL, out, st);
}

int kvf_join_room_pages(kvf_client *c, const struct kvf_join *join, const kvf_page_set *pages,
                        struct kvf_join_result *out, struct kvf_status *st)
{
    if (!c || !join || !pages)
        return bad_arg(st, "kvf_join_room_pages", "client, join and pages are required");
    if (!join->node_id || !join->node_id[0])
        return bad_arg(st, "kvf_join_room_pages", "join.node_id is required");
    if (join->n_ranges > 0)
        return bad_arg(st, "kvf_join_room_pages", "join.ranges must be empty with a page set");
    return join_room(c, join, page_set_msg(pages), out, st);
}

/* ExtendLease with `ranges` or, when `ps` is not NULL, that page set. */
static int extend_lease(kvf_client *c, struct kvf_room_key room, uint64_t lease_id,
                        const struct kvf_page_range *ranges, size_t n_ranges,
                        Kvfence__V1__PageSet *ps, struct kvf_status *st)
{
    struct ranges r;
    int rc = ranges_make(&r, ranges, n_ranges, "ranges", st);
    if (rc)
        return rc;
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = room.room_id;
    rk.generation = room.generation;
    Kvfence__V1__ExtendLeaseRequest req = KVFENCE__V1__EXTEND_LEASE_REQUEST__INIT;
    req.room = &rk;
    req.lease_id = lease_id;
    req.n_ranges = r.n;
    req.ranges = r.p;
    req.page_set = ps;
    rc = unary(c->ch, c->call_timeout_ms, "/kvfence.v1.Control/ExtendLease", &req.base,
               &kvfence__v1__extend_lease_response__descriptor, NULL, st);
    ranges_free(&r);
    return rc;
}

int kvf_extend_lease(kvf_client *c, struct kvf_room_key room, uint64_t lease_id,
                     const struct kvf_page_range *ranges, size_t n_ranges, struct kvf_status *st)
{
    if (!c)
        return bad_arg(st, "kvf_extend_lease", "client is required");
    return extend_lease(c, room, lease_id, ranges, n_ranges, NULL, st);
}

int kvf_extend_lease_pages(kvf_client *c, struct kvf_room_key room, uint64_t lease_id,
                           const kvf_page_set *pages, struct kvf_status *st)
{
    if (!c || !pages)
        return bad_arg(st, "kvf_extend_lease_pages", "client and pages are required");
    if (pages->enc.form == KVF_PAGESET_EMPTY)
        return bad_arg(st, "kvf_extend_lease_pages", "pages: the set is empty");
    return extend_lease(c, room, lease_id, NULL, 0, page_set_msg(pages), st);
}

int kvf_complete_room(kvf_client *c, struct kvf_room_key room, const struct kvf_participant *who,
                      enum kvf_room_state *state_out, struct kvf_status *st)
{
    if (!c || !who || !who->node_id)
        return bad_arg(st, "kvf_complete_room", "client and who (with node_id) are required");
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = room.room_id;
    rk.generation = room.generation;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)who->node_id;
    part.rank = who->rank;
    part.role = (Kvfence__V1__Role)who->role;
    Kvfence__V1__CompleteRoomRequest req = KVFENCE__V1__COMPLETE_ROOM_REQUEST__INIT;
    req.room = &rk;
    req.participant = &part;
    ProtobufCMessage *m = NULL;
    int rc = unary(c->ch, c->call_timeout_ms, "/kvfence.v1.Control/CompleteRoom", &req.base,
                   &kvfence__v1__complete_room_response__descriptor, &m, st);
    if (rc)
        return rc;
    if (state_out)
        *state_out = (enum kvf_room_state)((Kvfence__V1__CompleteRoomResponse *)m)->state;
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}

int kvf_abort_room(kvf_client *c, struct kvf_room_key room, const char *detail,
                   struct kvf_abort_result *out, struct kvf_status *st)
{
    if (!c)
        return bad_arg(st, "kvf_abort_room", "client is required");
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = room.room_id;
    rk.generation = room.generation;
    Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    req.room = &rk;
    req.detail = (char *)(detail ? detail : "");
    ProtobufCMessage *m = NULL;
    int rc = unary(c->ch, c->call_timeout_ms, "/kvfence.v1.Control/AbortRoom", &req.base,
                   &kvfence__v1__abort_room_response__descriptor, &m, st);
    if (rc)
        return rc;
    Kvfence__V1__AbortRoomResponse *resp = (Kvfence__V1__AbortRoomResponse *)m;
    if (out) {
        memset(out, 0, sizeof *out);
        if (resp->room) {
            out->room.room_id = resp->room->room_id;
            out->room.generation = resp->room->generation;
        }
        if (resp->token) {
            out->token_hi = resp->token->hi;
            out->token_lo = resp->token->lo;
        }
        out->state = (enum kvf_room_state)resp->state;
        out->already_aborting = resp->already_aborting;
        out->reason = (int)resp->reason;
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}

/* ---- WatchLeases ------------------------------------------------------------------ */

/* Packs a WatchLeasesRequest from `f` (may be NULL) into *buf_p. */
static int pack_watch_request(const struct kvf_watch_filter *f, uint8_t **buf_p, size_t *len_p,
                              struct kvf_status *st)
{
    Kvfence__V1__WatchLeasesRequest req = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    if (f) {
        if ((f->n_ranks && !f->ranks) || (f->n_lease_ids && !f->lease_ids))
            return bad_arg(st, "kvf_watch_filter", "NULL ranks or lease_ids with a count");
        req.node_id = (char *)(f->node_id ? f->node_id : "");
        req.n_ranks = f->n_ranks;
        req.ranks = (uint32_t *)f->ranks;
        req.n_lease_ids = f->n_lease_ids;
        req.lease_ids = (uint64_t *)f->lease_ids;
        req.include_room_states = f->include_room_states;
    }
    size_t len = protobuf_c_message_get_packed_size(&req.base);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED, "WatchLeases: out of memory");
    protobuf_c_message_pack(&req.base, buf);
    *buf_p = buf;
    *len_p = len;
    return 0;
}

/* Opens WatchLeases with the packed request and half-closes. NULL when gRPC
 * refused (st says so). */
static struct kvf_rpc_client_stream *watch_open(struct kvf_rpc_channel *ch, const uint8_t *req,
                                                size_t len, int64_t timeout_ms,
                                                struct kvf_status *st)
{
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(ch, "/kvfence.v1.Control/WatchLeases", timeout_ms);
    if (!cs) {
        client_status(st, KVF_STATUS_INTERNAL, "WatchLeases: cannot open the stream");
        return NULL;
    }
    /* A failed send means the stream has already ended: recv gives why. */
    if (kvf_rpc_client_stream_send(cs, req, len) == 0)
        kvf_rpc_client_stream_half_close(cs);
    return cs;
}

static int status_from_rpc(struct kvf_status *st, const struct kvf_rpc_status *rst)
{
    int code =
        rst->code >= 0 && rst->code <= KVF_STATUS_UNAUTHENTICATED ? rst->code : KVF_STATUS_INTERNAL;
    return client_status(st, code, "%s", rst->message[0] ? rst->message : kvf_status_name(code));
}

int kvf_wait_released(kvf_client *c, uint64_t lease_id, int64_t deadline_ms, struct kvf_status *st)
{
    if (!c || lease_id == 0)
        return bad_arg(st, "kvf_wait_released", "client and a lease_id >= 1 are required");
    uint64_t ids[1] = {lease_id};
    struct kvf_watch_filter f = {.lease_ids = ids, .n_lease_ids = 1};
    uint8_t *req = NULL;
    size_t len = 0;
    int rc = pack_watch_request(&f, &req, &len, st);
    if (rc)
        return rc;
    int64_t end = deadline_ms > 0 ? now_ms() + deadline_ms : INT64_MAX;
    struct kvf_status last = {0};
    long backoff = 20;
    for (;;) {
        int64_t left = end == INT64_MAX ? KVF_RPC_NO_TIMEOUT : end - now_ms();
        if (end != INT64_MAX && left <= 0) {
            rc = client_status(st, KVF_STATUS_DEADLINE_EXCEEDED,
                               "lease %llu not released within %lld ms%s%s",
                               (unsigned long long)lease_id, (long long)deadline_ms,
                               last.code ? "; last error: " : "", last.code ? last.message : "");
            break;
        }
        struct kvf_rpc_client_stream *cs = watch_open(c->ch, req, len, left, st);
        if (!cs) {
            rc = st ? -st->code : -KVF_STATUS_INTERNAL;
            break;
        }
        bool released = false;
        struct kvf_rpc_status rst = {0};
        for (;;) {
            uint8_t *msg = NULL;
            size_t mlen = 0;
            int r = kvf_rpc_client_stream_recv(cs, KVF_RPC_NO_TIMEOUT, &msg, &mlen, &rst);
            if (r == KVF_RPC_STREAM_END)
                break;
            if (r != 0) {
                rst.code = KVF_STATUS_INTERNAL;
                snprintf(rst.message, sizeof rst.message, "WatchLeases: receive failed (%d)", r);
                break;
            }
            Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
            free(msg);
            if (!ev)
                continue;
            if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED && ev->released &&
                ev->released->lease_id == lease_id)
                released = true;
            kvfence__v1__lease_event__free_unpacked(ev, NULL);
            if (released)
                break;
        }
        kvf_rpc_client_stream_close(cs);
        if (released) {
            rc = ok_status(st);
            break;
        }
        if (rst.code == KVF_STATUS_DEADLINE_EXCEEDED) {
            last.code = 0;
            continue; /* the loop head reports it */
        }
        if (rst.code != KVF_STATUS_UNAVAILABLE && rst.code != KVF_STATUS_OK &&
            rst.code != KVF_STATUS_CANCELLED) {
            status_from_rpc(st, &rst);
            rc = st ? -st->code : -rst.code;
            break;
        }
        /* UNAVAILABLE (server down, restarting) or a clean end: resubscribe. */
        status_from_rpc(&last, &rst);
        int64_t nap = backoff;
        if (end != INT64_MAX && end - now_ms() < nap)
            nap = end - now_ms();
        if (nap > 0) {
            struct timespec ts = {.tv_sec = nap / 1000, .tv_nsec = (nap % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        backoff = backoff * 2 > 1000 ? 1000 : backoff * 2;
    }
    free(req);
    return rc;
}

/* A raw sink (kvf_watch_queue): every received LeaseEvent as its bytes, and
 * every break of the stream, instead of the decoded callback. */
typedef void (*watch_raw_fn)(void *ctx, enum kvf_lease_event_kind kind, const uint8_t *msg,
                             size_t len, const struct kvf_status *st);

struct kvf_watch {
    kvf_client *c;
    kvf_lease_cb cb;
    watch_raw_fn raw; /* set: cb is not used */
    void *ctx;
    uint8_t *req;
    size_t req_len;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;                        /* under mu */
    struct kvf_rpc_client_stream *cs; /* under mu */
};

static void deliver(struct kvf_watch *w, const Kvfence__V1__LeaseEvent *ev)
{
    struct kvf_lease_event e;
    memset(&e, 0, sizeof e);
    struct kvf_page_range small[16];
    struct kvf_page_range *rv = NULL;
    switch (ev->event_case) {
    case KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED: {
        const Kvfence__V1__Lease *l = ev->released;
        if (!l)
            return;
        e.kind = KVF_LEASE_EVENT_RELEASED;
        e.lease_id = l->lease_id;
        if (l->room) {
            e.room.room_id = l->room->room_id;
            e.room.generation = l->room->generation;
        }
        if (l->participant) {
            e.node_id = l->participant->node_id;
            e.rank = l->participant->rank;
        }
        e.pool_id = l->pool_id;
        rv = l->n_ranges <= 16 ? small : calloc(l->n_ranges, sizeof *rv);
        if (rv) {
            for (size_t i = 0; i < l->n_ranges; i++) {
                rv[i].first = l->ranges[i]->first;
                rv[i].count = l->ranges[i]->count;
            }
            e.ranges = rv;
            e.n_ranges = l->n_ranges;
        }
        break;
    }
    case KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE: {
        const Kvfence__V1__RoomStateChange *rs = ev->room_state;
        if (!rs)
            return;
        e.kind = KVF_LEASE_EVENT_ROOM_STATE;
        if (rs->room) {
            e.room.room_id = rs->room->room_id;
            e.room.generation = rs->room->generation;
        }
        e.old_state = (enum kvf_room_state)rs->old_state;
        e.new_state = (enum kvf_room_state)rs->new_state;
        e.abort_reason = (int)rs->reason;
        break;
    }
    case KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED:
        e.kind = KVF_LEASE_EVENT_SYNCED;
        e.replayed = ev->synced ? ev->synced->replayed : 0;
        break;
    default:
        return;
    }
    w->cb(&e, w->ctx);
    if (rv && rv != small)
        free(rv);
}

/* The event kind of a message, for the raw sink (0: one this library does
 * not know; queued all the same, the reader skips it). */
static enum kvf_lease_event_kind raw_kind(const Kvfence__V1__LeaseEvent *ev)
{
    switch (ev->event_case) {
    case KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED:
        return KVF_LEASE_EVENT_RELEASED;
    case KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE:
        return KVF_LEASE_EVENT_ROOM_STATE;
    case KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED:
        return KVF_LEASE_EVENT_SYNCED;
    default:
        return (enum kvf_lease_event_kind)0;
    }
}

static void *watch_main(void *arg)
{
    struct kvf_watch *w = arg;
    long backoff = 50;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        if (w->stop) {
            pthread_mutex_unlock(&w->mu);
            break;
        }
        struct kvf_status st = {0};
        w->cs = watch_open(w->c->ch, w->req, w->req_len, KVF_RPC_NO_TIMEOUT, &st);
        struct kvf_rpc_client_stream *cs = w->cs;
        pthread_mutex_unlock(&w->mu);
        struct kvf_rpc_status rst = {0};
        bool got_any = false;
        if (!cs) {
            rst.code = st.code;
            snprintf(rst.message, sizeof rst.message, "%s", st.message);
        } else {
            for (;;) {
                uint8_t *msg = NULL;
                size_t mlen = 0;
                int r = kvf_rpc_client_stream_recv(cs, KVF_RPC_NO_TIMEOUT, &msg, &mlen, &rst);
                if (r == KVF_RPC_STREAM_END)
                    break;
                if (r != 0) {
                    rst.code = KVF_STATUS_INTERNAL;
                    snprintf(rst.message, sizeof rst.message, "WatchLeases: receive failed (%d)",
                             r);
                    break;
                }
                Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
                if (!ev) {
                    free(msg);
                    continue;
                }
                got_any = true;
                if (w->raw)
                    w->raw(w->ctx, raw_kind(ev), msg, mlen, NULL);
                else
                    deliver(w, ev);
                free(msg);
                kvfence__v1__lease_event__free_unpacked(ev, NULL);
            }
        }
        pthread_mutex_lock(&w->mu);
        w->cs = NULL;
        bool stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        kvf_rpc_client_stream_close(cs);
        if (stop)
            break;
        struct kvf_lease_event e;
        memset(&e, 0, sizeof e);
        e.kind = KVF_LEASE_EVENT_DISCONNECTED;
        status_from_rpc(&e.status, &rst);
        if (e.status.code == KVF_STATUS_OK)
            e.status.code = KVF_STATUS_UNAVAILABLE;
        if (w->raw)
            w->raw(w->ctx, KVF_LEASE_EVENT_DISCONNECTED, NULL, 0, &e.status);
        else
            w->cb(&e, w->ctx);
        if (got_any)
            backoff = 50;
        /* Back off, waking early on stop. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += backoff * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&w->mu);
        while (!w->stop) {
            if (pthread_cond_timedwait(&w->cv, &w->mu, &ts) == ETIMEDOUT)
                break;
        }
        pthread_mutex_unlock(&w->mu);
        backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
    }
    return NULL;
}

static int watch_start(kvf_client *c, const struct kvf_watch_filter *filter, kvf_lease_cb cb,
                       watch_raw_fn raw, void *ctx, kvf_watch **out, struct kvf_status *st)
{
    kvf_watch *w = calloc(1, sizeof *w);
    if (!w)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED, "kvf_watch_leases: out of memory");
    w->c = c;
    w->cb = cb;
    w->raw = raw;
    w->ctx = ctx;
    int rc = pack_watch_request(filter, &w->req, &w->req_len, st);
    if (rc) {
        free(w);
        return rc;
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    int e = pthread_create(&w->thread, NULL, watch_main, w);
    if (e != 0) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w->req);
        free(w);
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_watch_leases: cannot start a thread: %s", strerror(e));
    }
    *out = w;
    return ok_status(st);
}

int kvf_watch_leases(kvf_client *c, const struct kvf_watch_filter *filter, kvf_lease_cb cb,
                     void *ctx, kvf_watch **out, struct kvf_status *st)
{
    if (out)
        *out = NULL;
    if (!c || !cb || !out)
        return bad_arg(st, "kvf_watch_leases", "client, callback and out are required");
    return watch_start(c, filter, cb, NULL, ctx, out, st);
}

void kvf_watch_stop(kvf_watch *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    if (w->cs)
        kvf_rpc_client_stream_cancel(w->cs);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w->req);
    free(w);
}

/* ---- queued lease watch ------------------------------------------------------------
 *
 * DESIGN: the watch's library thread is the only producer: it appends one
 * record per event under `mu` and then adds 1 to the eventfd. Any one
 * consumer thread drains under `mu`: it first resets the eventfd (a read of
 * a non-blocking eventfd), then copies whole records. An event appended
 * after the reset makes the descriptor readable again, so a reader that
 * polls, drains and polls again misses nothing; a spurious wake-up drains
 * nothing. */

struct wq_rec {
    struct wq_rec *next;
    uint32_t kind;
    uint32_t len;
    uint8_t data[];
};

struct kvf_watch_queue {
    kvf_watch *w;
    int efd;
    pthread_mutex_t mu;
    struct wq_rec *head, *tail; /* under mu */
};

/* Makes the descriptor readable. An eventfd write of 1 fails only when the
 * counter is at 2^64 - 2, which a reader that drains never lets happen. */
static void wq_ring(struct kvf_watch_queue *q)
{
    uint64_t one = 1;
    ssize_t n = write(q->efd, &one, sizeof one);
    (void)n;
}

static void wq_push(void *ctx, enum kvf_lease_event_kind kind, const uint8_t *msg, size_t len,
                    const struct kvf_status *st)
{
    struct kvf_watch_queue *q = ctx;
    size_t text = 0;
    if (st) { /* DISCONNECTED: the status code, then its message */
        text = strlen(st->message);
        len = sizeof(uint32_t) + text;
    }
    /* Out of memory: wait rather than lose a release (the stream backs up). */
    struct wq_rec *r;
    while (!(r = malloc(sizeof *r + len))) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 1000000};
        nanosleep(&ts, NULL);
    }
    r->next = NULL;
    r->kind = (uint32_t)kind;
    r->len = (uint32_t)len;
    if (st) {
        uint32_t code = (uint32_t)st->code;
        memcpy(r->data, &code, sizeof code);
        memcpy(r->data + sizeof code, st->message, text);
    } else if (len) {
        memcpy(r->data, msg, len);
    }
    pthread_mutex_lock(&q->mu);
    if (q->tail)
        q->tail->next = r;
    else
        q->head = r;
    q->tail = r;
    pthread_mutex_unlock(&q->mu);
    wq_ring(q);
}

int kvf_watch_queue_start(kvf_client *c, const struct kvf_watch_filter *filter,
                          kvf_watch_queue **out, struct kvf_status *st)
{
    if (out)
        *out = NULL;
    if (!c || !out)
        return bad_arg(st, "kvf_watch_queue_start", "client and out are required");
    struct kvf_watch_queue *q = calloc(1, sizeof *q);
    if (!q)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_watch_queue_start: out of memory");
    q->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (q->efd < 0) {
        int e = errno;
        free(q);
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_watch_queue_start: eventfd: %s", strerror(e));
    }
    pthread_mutex_init(&q->mu, NULL);
    int rc = watch_start(c, filter, NULL, wq_push, q, &q->w, st);
    if (rc) {
        pthread_mutex_destroy(&q->mu);
        close(q->efd);
        free(q);
        return rc;
    }
    *out = q;
    return 0;
}

int kvf_watch_queue_fd(const kvf_watch_queue *q)
{
    return q ? q->efd : -EINVAL;
}

int kvf_watch_queue_drain(kvf_watch_queue *q, uint8_t *buf, size_t cap, size_t *len_p)
{
    if (!q || !len_p || (!buf && cap))
        return -EINVAL;
    uint64_t n;
    size_t used = 0;
    int rc = 0;
    pthread_mutex_lock(&q->mu);
    ssize_t got = read(q->efd, &n, sizeof n); /* reset; EAGAIN when it was 0 */
    (void)got;
    while (q->head) {
        struct wq_rec *r = q->head;
        size_t need = 2 * sizeof(uint32_t) + r->len;
        if (used + need > cap) {
            if (used == 0) {
                *len_p = need;
                rc = -ENOBUFS;
            }
            wq_ring(q); /* left queued: readable again for the next call */
            break;
        }
        memcpy(buf + used, &r->kind, sizeof r->kind);
        memcpy(buf + used + sizeof r->kind, &r->len, sizeof r->len);
        memcpy(buf + used + 2 * sizeof(uint32_t), r->data, r->len);
        used += need;
        q->head = r->next;
        if (!q->head)
            q->tail = NULL;
        free(r);
    }
    pthread_mutex_unlock(&q->mu);
    if (rc == 0)
        *len_p = used;
    return rc;
}

void kvf_watch_queue_stop(kvf_watch_queue *q)
{
    if (!q)
        return;
    kvf_watch_stop(q->w); /* joins the producer */
    for (struct wq_rec *r = q->head; r;) {
        struct wq_rec *next = r->next;
        free(r);
        r = next;
    }
    pthread_mutex_destroy(&q->mu);
    close(q->efd);
    free(q);
}

/* ---- node client ------------------------------------------------------------------ */

int kvf_node_client_create(const char *socket_path, const struct kvf_client_opts *opts,
                           kvf_node_client **out, struct kvf_status *st)
{
    if (out)
        *out = NULL;
    if (!socket_path || !socket_path[0] || !out)
        return bad_arg(st, "kvf_node_client_create", "socket_path and out are required");
    char target[512];
    int n = snprintf(target, sizeof target, "%s%s",
                     strncmp(socket_path, "unix:", 5) == 0 ? "" : "unix:", socket_path);
    if (n < 0 || (size_t)n >= sizeof target)
        return bad_arg(st, "kvf_node_client_create", "socket_path too long");
    kvf_node_client *nc = calloc(1, sizeof *nc);
    if (!nc)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_node_client_create: out of memory");
    nc->call_timeout_ms = opts ? opts->call_timeout_ms : DEFAULT_CALL_TIMEOUT_MS;
    if (kvf_fdpass_path(target + 5, nc->fd_socket, sizeof nc->fd_socket) != 0) {
        free(nc);
        return bad_arg(st, "kvf_node_client_create", "socket_path too long");
    }
    nc->ch = channel_create(target, opts, false, st);
    if (!nc->ch) {
        free(nc);
        return st ? -st->code : -KVF_STATUS_INVALID_ARGUMENT;
    }
    *out = nc;
    return ok_status(st);
}

void kvf_node_client_destroy(kvf_node_client *n)
{
    if (!n)
        return;
    kvf_rpc_channel_destroy(n->ch);
    free(n);
}

/* RegisterPool of `req` (its memory set by the caller): the pool id. */
static int register_pool(kvf_node_client *n, Kvfence__V1__RegisterPoolRequest *req,
                         uint32_t *pool_id_out, struct kvf_status *st)
{
    ProtobufCMessage *m = NULL;
    int rc = unary(n->ch, n->call_timeout_ms, "/kvfence.v1.NodeLocal/RegisterPool", &req->base,
                   &kvfence__v1__register_pool_response__descriptor, &m, st);
    if (rc)
        return rc;
    Kvfence__V1__RegisterPoolResponse *resp = (Kvfence__V1__RegisterPoolResponse *)m;
    if (!resp->pool) {
        protobuf_c_message_free_unpacked(m, NULL);
        return client_status(st, KVF_STATUS_INTERNAL, "RegisterPool: the reply has no pool");
    }
    if (pool_id_out)
        *pool_id_out = resp->pool->pool_id;
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}

/* The fd socket's refusal as a status. */
static int fdpass_status(struct kvf_status *st, int rc, const struct kvf_error *err)
{
    int code = rc == -EACCES || rc == -EPERM   ? KVF_STATUS_PERMISSION_DENIED
               : rc == -ENOSPC                 ? KVF_STATUS_RESOURCE_EXHAUSTED
               : rc == -EINVAL || rc == -EBADF ? KVF_STATUS_INVALID_ARGUMENT
                                               : KVF_STATUS_UNAVAILABLE;
    return client_status(st, code, "RegisterPool: %s", err->msg);
}

/* A RegisterPool request with `pool`'s geometry; the caller sets its memory. */
static void shm_pool_request(Kvfence__V1__RegisterPoolRequest *req, const struct kvf_shm_pool *pool)
{
    kvfence__v1__register_pool_request__init(req);
    req->page_size = pool->page_size;
    req->page_count = pool->page_count;
    req->rank = pool->rank;
}

/* Hands `fd` over on the fd socket and registers it (host_fd). -ENOENT /
 * -ECONNREFUSED (no status set) when the node has no fd socket. */
static int register_pool_fd(kvf_node_client *n, int fd, const struct kvf_shm_pool *pool,
                            uint32_t *pool_id_out, struct kvf_status *st)
{
    uint8_t handle[KVF_FDPASS_HANDLE_SIZE];
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_fdpass_send(n->fd_socket, fd, handle, &err);
    if (rc == -ENOENT || rc == -ECONNREFUSED)
        return rc;
    if (rc != 0)
        return fdpass_status(st, rc, &err);
    Kvfence__V1__HostFdMemory hf = KVFENCE__V1__HOST_FD_MEMORY__INIT;
    hf.handle.data = handle;
    hf.handle.len = sizeof handle;
    hf.offset = pool->offset;
    hf.size = pool->size;
    Kvfence__V1__RegisterPoolRequest req;
    shm_pool_request(&req, pool);
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD;
    req.host_fd = &hf;
    return register_pool(n, &req, pool_id_out, st);
}

int kvf_register_pool_shm(kvf_node_client *n, const struct kvf_shm_pool *pool,
                          uint32_t *pool_id_out, struct kvf_status *st)
{
    if (!n || !pool || !pool->shm_name || !pool->shm_name[0])
        return bad_arg(st, "kvf_register_pool_shm", "node client and pool.shm_name are required");
    /* The engine opens its own object and hands the descriptor over: the
     * node maps only what its caller could open (docs/security.md). */
    int fd = shm_open(pool->shm_name, O_RDWR | O_CLOEXEC, 0);
    if (fd >= 0) {
        int rc = register_pool_fd(n, fd, pool, pool_id_out, st);
        close(fd);
        if (rc != -ENOENT && rc != -ECONNREFUSED)
            return rc;
    }
    /* By name: a node older than the fd socket, or an object this process
     * cannot open, which the node then refuses (NOT_FOUND, or
     * PERMISSION_DENIED unless every caller of its socket could open it). */
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = (char *)pool->shm_name;
    shm.offset = pool->offset;
    shm.size = pool->size;
    Kvfence__V1__RegisterPoolRequest req;
    shm_pool_request(&req, pool);
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    return register_pool(n, &req, pool_id_out, st);
}

int kvf_register_pool_fd(kvf_node_client *n, int fd, const struct kvf_shm_pool *pool,
                         uint32_t *pool_id_out, struct kvf_status *st)
{
    if (!n || !pool || fd < 0)
        return bad_arg(st, "kvf_register_pool_fd", "node client, fd and pool are required");
    int rc = register_pool_fd(n, fd, pool, pool_id_out, st);
    if (rc == -ENOENT || rc == -ECONNREFUSED)
        return client_status(st, KVF_STATUS_UNAVAILABLE,
                             "kvf_register_pool_fd: no fd socket at %s (a node older than it?)",
                             n->fd_socket);
    return rc;
}

/* For pools.c (client_internal.h). */
int client_register_pool(kvf_node_client *n, Kvfence__V1__RegisterPoolRequest *req,
                         uint32_t *pool_id_out, struct kvf_status *st)
{
    return register_pool(n, req, pool_id_out, st);
}

int client_hand_over(kvf_node_client *n, int fd, uint8_t *handle, struct kvf_status *st)
{
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_fdpass_send(n->fd_socket, fd, handle, &err);
    if (rc == -ENOENT || rc == -ECONNREFUSED || rc == 0)
        return rc;
    return fdpass_status(st, rc, &err);
}

int kvf_unregister_pool(kvf_node_client *n, uint32_t pool_id, struct kvf_status *st)
{
    if (!n)
        return bad_arg(st, "kvf_unregister_pool", "node client is required");
    Kvfence__V1__UnregisterPoolRequest req = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    req.pool_id = pool_id;
    return unary(n->ch, n->call_timeout_ms, "/kvfence.v1.NodeLocal/UnregisterPool", &req.base,
                 &kvfence__v1__unregister_pool_response__descriptor, NULL, st);
}

/* A chunk's request, its page ranges owned (chunk_req_free). */
struct chunk_req {
    Kvfence__V1__RoomKey rk;
    Kvfence__V1__SubmitChunkRequest req;
    struct ranges sr, dr;
};

static int chunk_req_make(struct chunk_req *cr, const struct kvf_chunk *chunk, const char *fn,
                          struct kvf_status *st)
{
    if (!chunk || !chunk->sink_node_id)
        return bad_arg(st, fn, "chunk and sink_node_id are required");
    if (chunk->aux_len && !chunk->aux)
        return bad_arg(st, fn, "aux is NULL with a length");
    int rc =
        ranges_make(&cr->sr, chunk->source_ranges, chunk->n_source_ranges, "source_ranges", st);
    if (rc)
        return rc;
    rc = ranges_make(&cr->dr, chunk->sink_ranges, chunk->n_sink_ranges, "sink_ranges", st);
    if (rc) {
        ranges_free(&cr->sr);
        return rc;
    }
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    cr->rk = rk;
    cr->rk.room_id = chunk->room.room_id;
    cr->rk.generation = chunk->room.generation;
    Kvfence__V1__SubmitChunkRequest req = KVFENCE__V1__SUBMIT_CHUNK_REQUEST__INIT;
    cr->req = req;
    cr->req.room = &cr->rk;
    cr->req.chunk_seq = chunk->chunk_seq;
    cr->req.source_rank = chunk->source_rank;
    cr->req.source_pool_id = chunk->source_pool_id;
    cr->req.n_source_ranges = cr->sr.n;
    cr->req.source_ranges = cr->sr.p;
    cr->req.sink_node_id = (char *)chunk->sink_node_id;
    cr->req.sink_rank = chunk->sink_rank;
    cr->req.sink_pool_id = chunk->sink_pool_id;
    cr->req.n_sink_ranges = cr->dr.n;
    cr->req.sink_ranges = cr->dr.p;
    cr->req.last_chunk = chunk->last_chunk;
    cr->req.aux.data = (uint8_t *)chunk->aux;
    cr->req.aux.len = chunk->aux_len;
    cr->req.source_lease_pages = chunk->source_lease_pages;
    cr->req.sink_lease_pages = chunk->sink_lease_pages;
    return 0;
}

static void chunk_req_free(struct chunk_req *cr)
{
    ranges_free(&cr->sr);
    ranges_free(&cr->dr);
}

int kvf_submit_chunk(kvf_node_client *n, const struct kvf_chunk *chunk, struct kvf_status *st)
{
    if (!n)
        return bad_arg(st, "kvf_submit_chunk", "node client is required");
    struct chunk_req cr;
    int rc = chunk_req_make(&cr, chunk, "kvf_submit_chunk", st);
    if (rc)
        return rc;
    rc = unary(n->ch, n->call_timeout_ms, "/kvfence.v1.NodeLocal/SubmitChunk", &cr.req.base,
               &kvfence__v1__submit_chunk_response__descriptor, NULL, st);
    chunk_req_free(&cr);
    return rc;
}

/* ---- pipelined submission (NodeLocal.SubmitChunks) ---------------------------------- */

struct kvf_chunk_stream {
    struct kvf_rpc_client_stream *cs;
    atomic_size_t outstanding; /* sent, result not read */
};

int kvf_chunk_stream_open(kvf_node_client *n, kvf_chunk_stream **out, struct kvf_status *st)
{
    if (out)
        *out = NULL;
    if (!n || !out)
        return bad_arg(st, "kvf_chunk_stream_open", "node client and out are required");
    kvf_chunk_stream *s = calloc(1, sizeof *s);
    if (!s)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_chunk_stream_open: out of memory");
    s->cs =
        kvf_rpc_client_stream_open(n->ch, "/kvfence.v1.NodeLocal/SubmitChunks", KVF_RPC_NO_TIMEOUT);
    if (!s->cs) {
        free(s);
        return client_status(st, KVF_STATUS_UNAVAILABLE, "kvf_chunk_stream_open: no stream");
    }
    atomic_init(&s->outstanding, 0);
    *out = s;
    return ok_status(st);
}

int kvf_chunk_stream_send(kvf_chunk_stream *s, const struct kvf_chunk *chunk, struct kvf_status *st)
{
    if (!s)
        return bad_arg(st, "kvf_chunk_stream_send", "stream is required");
    if (atomic_load(&s->outstanding) >= KVF_CHUNK_STREAM_WINDOW)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_chunk_stream_send: %d chunks outstanding: read a result first",
                             KVF_CHUNK_STREAM_WINDOW);
    struct chunk_req cr;
    int rc = chunk_req_make(&cr, chunk, "kvf_chunk_stream_send", st);
    if (rc)
        return rc;
    size_t len = kvfence__v1__submit_chunk_request__get_packed_size(&cr.req);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        chunk_req_free(&cr);
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_chunk_stream_send: out of memory");
    }
    kvfence__v1__submit_chunk_request__pack(&cr.req, buf);
    chunk_req_free(&cr);
    /* Counted before the send: a reader thread may see its result at once. */
    atomic_fetch_add(&s->outstanding, 1);
    rc = kvf_rpc_client_stream_send(s->cs, buf, len);
    free(buf);
    if (rc != 0) {
        atomic_fetch_sub(&s->outstanding, 1);
        if (rc == -EPIPE)
            return client_status(st, KVF_STATUS_FAILED_PRECONDITION,
                                 "kvf_chunk_stream_send: the stream was closed for sending");
        return client_status(st, KVF_STATUS_UNAVAILABLE,
                             "kvf_chunk_stream_send: the stream has ended (read it for why)");
    }
    return ok_status(st);
}

int kvf_chunk_stream_result(kvf_chunk_stream *s, int64_t timeout_ms, struct kvf_chunk_result *out,
                            struct kvf_status *st)
{
    if (!s || !out)
        return bad_arg(st, "kvf_chunk_stream_result", "stream and out are required");
    uint8_t *msg = NULL;
    size_t len = 0;
    struct kvf_rpc_status rst = {0};
    int rc = kvf_rpc_client_stream_recv(s->cs, timeout_ms > 0 ? timeout_ms : KVF_RPC_NO_TIMEOUT,
                                        &msg, &len, &rst);
    if (rc == -ETIMEDOUT)
        return client_status(st, KVF_STATUS_DEADLINE_EXCEEDED,
                             "kvf_chunk_stream_result: no result within %lld ms",
                             (long long)timeout_ms);
    if (rc == KVF_RPC_STREAM_END) {
        if (rst.code == KVF_STATUS_OK) {
            ok_status(st);
            return 0;
        }
        return status_from_rpc(st, &rst);
    }
    if (rc != 0)
        return client_status(st, KVF_STATUS_INTERNAL,
                             "kvf_chunk_stream_result: receive failed (%d)", rc);
    Kvfence__V1__SubmitChunkResult *r = kvfence__v1__submit_chunk_result__unpack(NULL, len, msg);
    free(msg);
    if (!r)
        return client_status(st, KVF_STATUS_INTERNAL, "kvf_chunk_stream_result: malformed result");
    size_t o = atomic_load(&s->outstanding);
    while (o > 0 && !atomic_compare_exchange_weak(&s->outstanding, &o, o - 1)) {
    }
    memset(out, 0, sizeof *out);
    out->chunk_seq = r->chunk_seq;
    out->status.code = r->code <= KVF_STATUS_UNAUTHENTICATED ? (int)r->code : KVF_STATUS_UNKNOWN;
    snprintf(out->status.message, sizeof out->status.message, "%s", r->message ? r->message : "");
    kvfence__v1__submit_chunk_result__free_unpacked(r, NULL);
    ok_status(st);
    return 1;
}

int kvf_chunk_stream_close_send(kvf_chunk_stream *s, struct kvf_status *st)
{
    if (!s)
        return bad_arg(st, "kvf_chunk_stream_close_send", "stream is required");
    int rc = kvf_rpc_client_stream_half_close(s->cs);
    if (rc != 0 && rc != -EALREADY)
        return client_status(st, KVF_STATUS_UNAVAILABLE, "kvf_chunk_stream_close_send: failed (%d)",
                             rc);
    return ok_status(st);
}

size_t kvf_chunk_stream_outstanding(kvf_chunk_stream *s)
{
    return s ? atomic_load(&s->outstanding) : 0;
}

void kvf_chunk_stream_destroy(kvf_chunk_stream *s)
{
    if (!s)
        return;
    kvf_rpc_client_stream_close(s->cs);
    free(s);
}
