/*
 * node_core.c: the node's rules (node_core.h): drain and completion
 * decisions, abort handling, terminal retention and peer slots, emitted as
 * effects.
 *
 * Retention: a room joins the retention queue (oldest first) the first time
 * it is terminal, that is its outcome is settled here (an abort token, a
 * tokenless close, every local participant complete) and its lifetime is
 * proven drained. kvf_ncore_collect() forgets the oldest ones beyond
 * retain_max: the lifetime table remembers the generation as late, so a
 * repeated notice or a stray message for the room is still recognised, and
 * the caller frees the rest. No clock is involved: memory is bounded by a
 * count, and nothing is released by time.
 *
 * DESIGN: owner thread only (node_core.h).
 */
#include "node_core.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NCORE_PEER_ID_MAX 128

struct ncore_peer {
    char node_id[NCORE_PEER_ID_MAX + 1];
    uint64_t incarnation;
    uint32_t refs;
    bool used;
    bool fenced;
};

struct kvf_ncore {
    struct kvf_ncore_opts opts;
    struct kvf_lt_table *lts;
    char reason[256];

    /* Effects: a ring of fx_cap entries, fx_len of them from fx_head. */
    struct kvf_ncore_fx *fx;
    size_t fx_cap, fx_head, fx_len;
    struct kvf_ncore_fx fx_scratch; /* where an effect goes when the queue cannot grow */
    uint64_t fx_dropped;

    /* Retention queue, oldest at rhead. */
    struct kvf_ncore_room *rhead, *rtail;
    size_t retained;

    struct ncore_peer *peers;

    uint64_t rooms_opened, rooms_forgotten, peers_recycled;
};

void kvf_ncore_opts_init(struct kvf_ncore_opts *o)
{
    memset(o, 0, sizeof *o);
    o->retain_max = 1024;
    o->max_peers = 64;
}

struct kvf_ncore *kvf_ncore_create(const struct kvf_ncore_opts *o)
{
    if (!o || o->max_peers == 0)
        return NULL;
    struct kvf_ncore *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->opts = *o;
    c->lts = kvf_lt_table_create();
    if (!c->lts)
        goto err_free_core;
    c->peers = calloc(o->max_peers, sizeof *c->peers);
    if (!c->peers)
        goto err_free_lts;
    c->fx_cap = 16;
    c->fx = calloc(c->fx_cap, sizeof *c->fx);
    if (!c->fx)
        goto err_free_peers;
    return c;

err_free_peers:
    free(c->peers);
err_free_lts:
    kvf_lt_table_destroy(c->lts);
err_free_core:
    free(c);
    return NULL;
}

void kvf_ncore_destroy(struct kvf_ncore *c)
{
    if (!c)
        return;
    while (c->rhead)
        kvf_ncore_room_unlink(c, c->rhead);
    kvf_lt_table_destroy(c->lts);
    free(c->peers);
    free(c->fx);
    free(c);
}

struct kvf_lt_table *kvf_ncore_lts(struct kvf_ncore *c)
{
    return c->lts;
}

const char *kvf_ncore_reason(const struct kvf_ncore *c)
{
    return c->reason;
}

static int refuse(struct kvf_ncore *c, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(struct kvf_ncore *c, int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->reason, sizeof c->reason, fmt, ap);
    va_end(ap);
    return err;
}

/* ---- effects ----------------------------------------------------------------- */

/* Appends a zeroed effect of `kind` for `r` (may be NULL). The queue
 * doubles when full; if that fails the effect goes to a scratch slot and is
 * counted as dropped (kvf_ncore_stats), as the control plane's core does.
 * The caller drains the queue after every call, so it holds a handful. */
static struct kvf_ncore_fx *fx_push(struct kvf_ncore *c, enum kvf_ncore_fx_kind kind,
                                    const struct kvf_ncore_room *r)
{
    struct kvf_ncore_fx *f = &c->fx_scratch;
    if (c->fx_len == c->fx_cap) {
        size_t cap = c->fx_cap * 2;
        struct kvf_ncore_fx *fx = calloc(cap, sizeof *fx);
        if (fx) {
            for (size_t i = 0; i < c->fx_len; i++)
                fx[i] = c->fx[(c->fx_head + i) % c->fx_cap];
            free(c->fx);
            c->fx = fx;
            c->fx_cap = cap;
            c->fx_head = 0;
        }
    }
    if (c->fx_len < c->fx_cap) {
        f = &c->fx[(c->fx_head + c->fx_len) % c->fx_cap];
        c->fx_len++;
    } else {
        c->fx_dropped++;
    }
    memset(f, 0, sizeof *f);
    f->kind = kind;
    if (r) {
        f->room = r->key;
        f->user = r->user;
    }
    return f;
}

bool kvf_ncore_fx_take(struct kvf_ncore *c, struct kvf_ncore_fx *fx_p)
{
    if (c->fx_len == 0)
        return false;
    *fx_p = c->fx[c->fx_head];
    c->fx_head = (c->fx_head + 1) % c->fx_cap;
    c->fx_len--;
    return true;
}

size_t kvf_ncore_fx_pending(const struct kvf_ncore *c)
{
    return c->fx_len;
}

/* ---- rooms ------------------------------------------------------------------- */

int kvf_ncore_room_open(struct kvf_ncore *c, struct kvf_ncore_room *r, kvf_room_key key, void *user)
{
    struct kvf_lt *lt;
    int rc = kvf_lt_table_open(c->lts, key, &lt);
    if (rc != 0)
        return refuse(c, rc, "%s",
                      rc == -ESTALE   ? "room generation is late here"
                      : rc == -EEXIST ? "room is open already"
                      : rc == -EINVAL ? "room key is invalid"
                                      : "out of memory for the room");
    memset(r, 0, sizeof *r);
    r->key = key;
    r->user = user;
    r->lt = lt;
    c->rooms_opened++;
    return 0;
}

void kvf_ncore_room_members(struct kvf_ncore *c, struct kvf_ncore_room *r, uint32_t nlocal,
                            uint32_t ndone)
{
    (void)c;
    r->local_parts = nlocal;
    r->local_done = ndone <= nlocal ? ndone : nlocal;
}

bool kvf_ncore_room_terminal(const struct kvf_ncore_room *r)
{
    return r->ended && r->drained_seen;
}

static void close_peers(struct kvf_ncore *c, struct kvf_ncore_room *r)
{
    if (r->peers_closed)
        return;
    r->peers_closed = true;
    fx_push(c, KVF_NCORE_FX_CLOSE_PEERS, r);
}

static void retain(struct kvf_ncore *c, struct kvf_ncore_room *r)
{
    if (r->retained || !kvf_ncore_room_terminal(r))
        return;
    r->retained = true;
    r->rnext = NULL;
    r->rprev = c->rtail;
    if (c->rtail)
        c->rtail->rnext = r;
    else
        c->rhead = r;
    c->rtail = r;
    c->retained++;
}

void kvf_ncore_room_check(struct kvf_ncore *c, struct kvf_ncore_room *r)
{
    if (kvf_lt_state(r->lt) != KVF_LT_DRAINED)
        return;
    if (!r->drained_seen) {
        r->drained_seen = true;
        (void)kvf_lt_take_drained(r->lt);
        close_peers(c, r);
        fx_push(c, KVF_NCORE_FX_ROOM_DRAINED, r);
    }
    if (r->aborting && !r->drained_sent) {
        r->drained_sent = true;
        fx_push(c, KVF_NCORE_FX_SEND_DRAINED, r);
    }
    retain(c, r);
}

void kvf_ncore_room_abort(struct kvf_ncore *c, struct kvf_ncore_room *r, kvf_token token,
                          uint64_t notice_id)
{
    bool first = !r->aborting;
    r->aborting = true;
    r->ended = true;
    r->token = token;
    r->notice_id = notice_id;
    close_peers(c, r);
    (void)kvf_lt_close(r->lt);
    if (first)
        fx_push(c, KVF_NCORE_FX_ROOM_ABORTING, r);
    if (kvf_lt_state(r->lt) != KVF_LT_DRAINED)
        return;
    /* Drained: say so, and again for a repeated notice (the first answer
     * may have been lost with a session). */
    r->drained_sent = false;
    kvf_ncore_room_check(c, r);
}

void kvf_ncore_room_end(struct kvf_ncore *c, struct kvf_ncore_room *r)
{
    r->ended = true;
    (void)kvf_lt_close(r->lt);
    kvf_ncore_room_check(c, r);
}

/* ---- sink completion ------------------------------------------------------------ */

bool kvf_ncore_sink_ready(const struct kvf_ncore_sink *s)
{
    return s->pages_landed >= s->pages && s->status_bytes == s->bytes_landed && s->rx_inflight == 0;
}

int kvf_ncore_part_completed(struct kvf_ncore *c, struct kvf_ncore_room *r, uint32_t rank,
                             bool sink)
{
    if (r->aborting)
        return refuse(c, -ECANCELED, "%s", "room is aborting");
    struct kvf_ncore_fx *f = fx_push(c, KVF_NCORE_FX_SEND_COMPLETED, r);
    f->rank = rank;
    f->sink = sink;
    if (r->local_done < r->local_parts)
        r->local_done++;
    if (r->local_done < r->local_parts)
        return 0;
    /* Every local participant is complete: nothing may start for the room. */
    r->ended = true;
    close_peers(c, r);
    (void)kvf_lt_close(r->lt);
    kvf_ncore_room_check(c, r);
    return 0;
}

/* ---- chunk admission ------------------------------------------------------------- */

int kvf_ncore_chunk_no_room(struct kvf_ncore *c, kvf_room_key key, bool stopping)
{
    if (stopping || kvf_lt_table_is_late(c->lts, key))
        return refuse(c, -ESTALE, "room %" PRIu64 ":%" PRIu64 " is late on this node", key.room_id,
                      key.generation);
    return refuse(c, -EAGAIN,
                  "room %" PRIu64 ":%" PRIu64 ": no room update on this node yet: retry",
                  key.room_id, key.generation);
}

int kvf_ncore_chunk_state(struct kvf_ncore *c, struct kvf_ncore_room *r,
                          const struct kvf_ncore_chunk *q)
{
    kvf_room_key k = r->key;
    const char *sink_node = q->sink_node ? q->sink_node : "";
    if (r->aborting)
        return refuse(c, -ECANCELED, "room %" PRIu64 ":%" PRIu64 " is aborting on this node",
                      k.room_id, k.generation);
    if (q->have_update && q->src_local && q->src_completed) {
        if (!q->sink_known || q->pair_exists)
            return refuse(c, -EPROTO, "source %u completed: its transfers ended", q->src_rank);
        /* Completed went out because every pair the source had ended; this
         * pair's sink can never complete, so the room fails. */
        if (!q->src_failed) {
            struct kvf_ncore_fx *f = fx_push(c, KVF_NCORE_FX_SEND_FAILED, r);
            f->rank = q->src_rank;
            f->sink = false;
            snprintf(f->reason, sizeof f->reason,
                     "source %u completed before any chunk for sink %s rank %u", q->src_rank,
                     sink_node, q->sink_rank);
        }
        return refuse(c, -EPROTO,
                      "source %u completed: no chunk for a new sink (%s rank %u); the room fails",
                      q->src_rank, sink_node, q->sink_rank);
    }
    if (kvf_lt_state(r->lt) != KVF_LT_OPEN)
        return refuse(c, -ECANCELED, "room %" PRIu64 ":%" PRIu64 " is closed on this node",
                      k.room_id, k.generation);
    if (!q->have_update)
        return refuse(c, -EAGAIN, "%s", "no room update on this node yet: retry");
    if (!q->sink_known && q->sink_unpublished)
        return refuse(c, -EAGAIN,
                      "sink: node %s has not acknowledged the room yet, its pages are not "
                      "known here: retry",
                      sink_node);
    if (!q->src_local)
        return refuse(c, -EPROTO, "source_rank: no source participant %u on this node",
                      q->src_rank);
    if (!q->sink_known)
        return refuse(c, -EPROTO, "sink: no sink participant %s rank %u in the room", sink_node,
                      q->sink_rank);
    return 0;
}

int kvf_ncore_chunk_order(struct kvf_ncore *c, const struct kvf_ncore_chunk *q)
{
    if (q->pair_exists && q->pair_last_submitted)
        return refuse(c, -EPROTO, "source %u already submitted its last chunk for sink %s rank %u",
                      q->src_rank, q->sink_node ? q->sink_node : "", q->sink_rank);
    if (q->pair_exists && q->seq <= q->pair_last_seq)
        return refuse(c, -EEXIST, "chunk_seq %" PRIu64 " not above %" PRIu64, q->seq,
                      q->pair_last_seq);
    return 0;
}

/* ---- retention ---------------------------------------------------------------- */

void kvf_ncore_room_unlink(struct kvf_ncore *c, struct kvf_ncore_room *r)
{
    if (!r->retained)
        return;
    if (r->rprev)
        r->rprev->rnext = r->rnext;
    else
        c->rhead = r->rnext;
    if (r->rnext)
        r->rnext->rprev = r->rprev;
    else
        c->rtail = r->rprev;
    r->rnext = r->rprev = NULL;
    r->retained = false;
    c->retained--;
}

void kvf_ncore_room_hold(struct kvf_ncore_room *r)
{
    r->holds++;
}

void kvf_ncore_room_release(struct kvf_ncore_room *r)
{
    if (r->holds > 0)
        r->holds--;
}

size_t kvf_ncore_collect(struct kvf_ncore *c)
{
    size_t forgotten = 0;
    struct kvf_ncore_room *next;
    for (struct kvf_ncore_room *r = c->rhead; r && c->retained > c->opts.retain_max; r = next) {
        next = r->rnext;
        if (r->holds > 0)
            continue;
        kvf_ncore_room_unlink(c, r);
        /* Terminal means drained, so the table takes it back; queued chunks
         * were dropped by the close. */
        (void)kvf_lt_table_forget(c->lts, r->key);
        r->lt = NULL;
        fx_push(c, KVF_NCORE_FX_ROOM_FREE, r);
        c->rooms_forgotten++;
        forgotten++;
    }
    return forgotten;
}

/* ---- peer slots --------------------------------------------------------------- */

int kvf_ncore_peer_find(const struct kvf_ncore *c, const char *node_id, uint64_t incarnation,
                        uint32_t *idx_p)
{
    for (uint32_t i = 0; i < c->opts.max_peers; i++) {
        const struct ncore_peer *p = &c->peers[i];
        if (p->used && p->incarnation == incarnation && strcmp(p->node_id, node_id) == 0) {
            *idx_p = i;
            return 0;
        }
    }
    return -ENOENT;
}

int kvf_ncore_peer_get(struct kvf_ncore *c, const char *node_id, uint64_t incarnation,
                       uint32_t *idx_p, bool *fresh_p)
{
    if (!node_id || !*node_id || strlen(node_id) > NCORE_PEER_ID_MAX)
        return refuse(c, -EINVAL, "%s", "peer node_id is empty or too long");
    uint32_t idx;
    if (kvf_ncore_peer_find(c, node_id, incarnation, &idx) == 0) {
        if (fresh_p)
            *fresh_p = false;
        *idx_p = idx;
        return 0;
    }
    uint32_t pick = UINT32_MAX;
    for (uint32_t i = 0; i < c->opts.max_peers && pick == UINT32_MAX; i++)
        if (!c->peers[i].used)
            pick = i;
    for (uint32_t i = 0; i < c->opts.max_peers && pick == UINT32_MAX; i++)
        if (c->peers[i].fenced && c->peers[i].refs == 0)
            pick = i;
    for (uint32_t i = 0; i < c->opts.max_peers && pick == UINT32_MAX; i++)
        if (c->peers[i].refs == 0 && c->peers[i].incarnation < incarnation &&
            strcmp(c->peers[i].node_id, node_id) == 0)
            pick = i;
    for (uint32_t i = 0; i < c->opts.max_peers && pick == UINT32_MAX; i++)
        if (c->peers[i].refs == 0)
            pick = i;
    if (pick == UINT32_MAX)
        return refuse(c, -E2BIG, "%s", "every peer slot holds a live or referenced incarnation");
    struct ncore_peer *p = &c->peers[pick];
    if (p->used) {
        struct kvf_ncore_fx *fx = fx_push(c, KVF_NCORE_FX_PEER_RECYCLE, NULL);
        fx->peer = pick;
        fx->fence = !p->fenced;
        c->peers_recycled++;
    }
    memset(p, 0, sizeof *p);
    snprintf(p->node_id, sizeof p->node_id, "%s", node_id);
    p->incarnation = incarnation;
    p->used = true;
    if (fresh_p)
        *fresh_p = true;
    *idx_p = pick;
    return 0;
}

void kvf_ncore_peer_fenced(struct kvf_ncore *c, uint32_t idx)
{
    if (idx < c->opts.max_peers && c->peers[idx].used)
        c->peers[idx].fenced = true;
}

bool kvf_ncore_peer_is_fenced(const struct kvf_ncore *c, uint32_t idx)
{
    return idx < c->opts.max_peers && c->peers[idx].fenced;
}

void kvf_ncore_peer_ref(struct kvf_ncore *c, uint32_t idx)
{
    if (idx < c->opts.max_peers && c->peers[idx].used)
        c->peers[idx].refs++;
}

void kvf_ncore_peer_unref(struct kvf_ncore *c, uint32_t idx)
{
    if (idx < c->opts.max_peers && c->peers[idx].refs > 0)
        c->peers[idx].refs--;
}

void kvf_ncore_peers_reset(struct kvf_ncore *c)
{
    memset(c->peers, 0, (size_t)c->opts.max_peers * sizeof *c->peers);
}

/* ---- counters ----------------------------------------------------------------- */

void kvf_ncore_stats(const struct kvf_ncore *c, struct kvf_ncore_stats *s_p)
{
    struct kvf_ncore_stats s;
    memset(&s, 0, sizeof s);
    s.retained = c->retained;
    s.rooms_opened = c->rooms_opened;
    s.rooms_forgotten = c->rooms_forgotten;
    s.lifetimes = kvf_lt_table_count(c->lts);
    for (uint32_t i = 0; i < c->opts.max_peers; i++)
        s.peers_used += c->peers[i].used;
    s.peers_recycled = c->peers_recycled;
    s.fx_cap = c->fx_cap;
    s.fx_dropped = c->fx_dropped;
    *s_p = s;
}
