/*
 * test_cp_snapshot.c: snapshot and restore of the control-plane state core
 * (kvf_cps_snapshot, kvf_cps_restore).
 *
 * The main check is equivalence: a state built by a seeded random mix of
 * operations is snapshotted at one time and restored at another, and then the
 * original and the copy get the same further operations (with the same relative
 * time steps and random sources in the same position): every return code,
 * every effect, every view, the stats and the next deadline must agree at every
 * step, and at the end both give the same image. Around it: a lease RELEASING
 * in the image is released exactly when it would have been, timers are re-based
 * onto the new clock, the empty and a large state, writer errors, and malformed
 * images (every truncation, 2,000 random byte flips), which must be refused or
 * give a state that passes a full internal consistency check and survives being
 * driven to the end (ASan-clean, no leaks).
 */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "cp_state_internal.h"
#include "cp_test_util.h"

/* A flipped pool size may ask for a huge page index: restore must say ENOMEM
 * then, which under ASan needs the allocator to return NULL. */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
    return "allocator_may_return_null=1";
}

#define NODES 5
#define ROOMS 10

static const char *const node_names[NODES] = {"n0", "n1", "n2", "n3", "n4"};

/* ---- images --------------------------------------------------------------- */

struct buf {
    unsigned char *p;
    size_t len, cap;
    size_t calls;
    size_t fail_after; /* fail the call that would pass this many bytes (0: never) */
    int fail_rc;
};

static int buf_write(void *ctx, const void *data, size_t len)
{
    struct buf *b = ctx;
    b->calls++;
    assert_true(len > 0 && len <= 4096);
    if (b->fail_after != 0 && b->len + len > b->fail_after)
        return b->fail_rc;
    if (b->len + len > b->cap) {
        size_t cap = b->cap == 0 ? 4096 : b->cap;
        while (cap < b->len + len)
            cap *= 2;
        b->p = realloc(b->p, cap);
        assert_non_null(b->p);
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, len);
    b->len += len;
    return 0;
}

static struct buf snap(const struct kvf_cps *st, kvf_time_ns now)
{
    struct buf b = {0};
    assert_int_equal(kvf_cps_snapshot(st, now, buf_write, &b), 0);
    return b;
}

static struct kvf_cps_opts test_opts(void)
{
    struct kvf_cps_opts o;
    kvf_cps_opts_init(&o);
    o.join_timeout = 5 * KVF_NS_PER_S;
    o.node_ttl = 3 * KVF_NS_PER_S;
    o.drain_deadline = 8 * KVF_NS_PER_S;
    o.tombstone_ttl = 20 * KVF_NS_PER_S;
    o.resend_initial = 200 * KVF_NS_PER_MS;
    o.resend_max = 2 * KVF_NS_PER_S;
    return o;
}

/* Restores `image` into a new fixture at `now`, its random source where
 * `rng` is. NULL (with f->err) when refused. */
static struct fixture *restore_fixture(const struct kvf_cps_opts *base, const struct buf *image,
                                       kvf_time_ns now, uint64_t rng, struct kvf_error *err)
{
    struct fixture *g = calloc(1, sizeof(*g));
    assert_non_null(g);
    g->rng = rng;
    g->now = now;
    struct kvf_cps_opts o = *base;
    o.random_fn = test_random;
    o.random_ctx = &g->rng;
    kvf_error_clear(err);
    g->st = kvf_cps_restore(&o, image->p, image->len, now, err);
    if (g->st == NULL) {
        free(g);
        return NULL;
    }
    return g;
}

/* ---- internal consistency ---------------------------------------------------- */

struct ptrset {
    const void **v;
    size_t n, cap;
};

static bool ps_has(const struct ptrset *s, const void *p)
{
    for (size_t i = 0; i < s->n; i++) {
        if (s->v[i] == p)
            return true;
    }
    return false;
}

static void ps_add(struct ptrset *s, const void *p)
{
    if (ps_has(s, p))
        return;
    if (s->n == s->cap) {
        s->cap = s->cap == 0 ? 16 : s->cap * 2;
        s->v = realloc(s->v, s->cap * sizeof(*s->v));
        assert_non_null(s->v);
    }
    s->v[s->n++] = p;
}

static size_t count_armed(const struct cp_timer *t, const struct cp_heap *h)
{
    if (!cp_timer_armed(t))
        return 0;
    assert_true(t->idx < h->n);
    assert_ptr_equal(h->v[t->idx], t);
    return 1;
}

/* Everything the core relies on, rebuilt from the objects and compared. */
static void check_state(const struct kvf_cps *st)
{
    struct kvf_cps_stats c;
    memset(&c, 0, sizeof(c));
    struct ptrset nodes = {0}, pools = {0};
    size_t armed = 0, nparts_total = 0;
    uint64_t awaiting = 0;
    const struct cp_heap *h = &st->timers;

    size_t pos = 0;
    struct cp_node *head;
    while ((head = cp_map_next(&st->nodes, &pos)) != NULL) {
        assert_true(head->current);
        assert_ptr_equal(cp_map_get_str(&st->nodes, head->id), head);
        for (struct cp_node *n = head; n != NULL; n = n->older) {
            assert_false(ps_has(&nodes, n));
            ps_add(&nodes, n);
            assert_string_equal(n->id, head->id);
            if (n != head) {
                assert_false(n->current);
                assert_int_equal(n->state, KVF_CPS_NODE_LOST);
            }
            assert_true(n->state >= 1 && n->state <= 3);
            c.nodes_by_state[n->state]++;
            armed += count_armed(&n->ttl, h);
            for (uint32_t i = 0; i < n->npools; i++)
                ps_add(&pools, n->pools[i]);
        }
    }
    for (size_t k = 0; k < nodes.n; k++) {
        const struct cp_node *n = nodes.v[k];
        uint32_t pending = 0;
        for (uint32_t i = 0; i < n->nfenced_by; i++) {
            const struct cp_fence *f = n->fenced_by[i];
            assert_ptr_equal(f->fenced, n);
            armed += count_armed(&f->timer, h);
            if (f->fencer != NULL) {
                pending++;
                assert_true(ps_has(&nodes, f->fencer));
                assert_int_equal(f->fencer->serial, f->fencer_serial);
                assert_false(f->acked);
            }
        }
        assert_int_equal(pending, n->fences_pending_as_fenced);
        c.notices_pending += pending;
        uint32_t reqs = 0;
        for (const struct cp_fence *f = n->fence_reqs; f != NULL; f = f->req_next) {
            reqs++;
            assert_ptr_equal(f->fencer, n);
            assert_true(ps_has(&nodes, f->fenced));
            if (f->req_next != NULL)
                assert_ptr_equal(f->req_next->req_prev, f);
        }
        if (reqs > 0)
            assert_int_not_equal(n->state, KVF_CPS_NODE_LOST);
        uint32_t nrn = 0;
        size_t live = 0;
        for (const struct cp_rnode *rn = n->rnodes; rn != NULL; rn = rn->node_next) {
            nrn++;
            assert_ptr_equal(rn->node, n);
            assert_ptr_equal(cp_map_get(&st->rooms, rn->room->key.room_id), rn->room);
            if (!cp_room_terminal(rn->room))
                live++;
            if (rn->node_next != NULL)
                assert_ptr_equal(rn->node_next->node_prev, rn);
        }
        assert_int_equal(nrn, n->nrnodes);
        assert_int_equal(live, n->room_count);
    }

    pos = 0;
    struct cp_room *room;
    while ((room = cp_map_next(&st->rooms, &pos)) != NULL) {
        assert_ptr_equal(cp_map_get(&st->rooms, room->key.room_id), room);
        assert_true(room->state >= 1 && room->state <= 5);
        c.rooms_by_state[room->state]++;
        if (room->state == KVF_CPS_ROOM_ABORTING && room->escalated)
            c.rooms_past_deadline++;
        assert_true(room->key.generation <= st->stats.generation);
        armed += count_armed(&room->timer, h);
        uint32_t src = 0, snk = 0, done = 0, room_awaiting = 0;
        for (uint32_t i = 0; i < room->nrnodes; i++) {
            const struct cp_rnode *rn = room->rnodes[i];
            assert_ptr_equal(rn->room, room);
            assert_true(ps_has(&nodes, rn->node));
            c.notices_pending += rn->notice_pending;
            armed += count_armed(&rn->timer, h);
            if (cp_timer_armed(&rn->timer))
                assert_true(rn->notice_pending);
            uint32_t np = 0, open = 0;
            for (uint32_t j = 0; j < room->nparts; j++) {
                np += room->parts[j]->rn == rn;
                open += room->parts[j]->rn == rn && !room->parts[j]->completed;
            }
            assert_int_equal(open, rn->nopen);
            assert_true(np > 0);
            for (uint32_t j = 0; j < i; j++)
                assert_ptr_not_equal(room->rnodes[j]->node, rn->node);
        }
        for (uint32_t i = 0; i < room->nparts; i++) {
            const struct cp_part *p = room->parts[i];
            nparts_total++;
            assert_ptr_equal(p->room, room);
            assert_ptr_equal(cp_map_get(&st->leases, p->lease_id), p);
            assert_true(p->lease_id < st->next_lease_id);
            assert_true(p->lease_state >= 1 && p->lease_state <= 3);
            c.leases_by_state[p->lease_state]++;
            bool fits =
                room->state <= KVF_CPS_ROOM_ACTIVE     ? p->lease_state == KVF_CPS_LEASE_ACTIVE
                : room->state == KVF_CPS_ROOM_ABORTING ? p->lease_state == KVF_CPS_LEASE_RELEASING
                : room->state == KVF_CPS_ROOM_ABORTED  ? p->lease_state != KVF_CPS_LEASE_ACTIVE
                                                       : p->lease_state == KVF_CPS_LEASE_RELEASED;
            assert_true(fits);
            if (cp_part_awaiting(p)) { /* waiting for its host: not proven there */
                assert_false(cp_rnode_host_proven(p->rn));
                awaiting++;
                room_awaiting++;
            }
            ps_add(&pools, p->pool);
            if (p->role == KVF_CPS_ROLE_SOURCE)
                src++;
            else
                snk++;
            done += p->completed;
        }
        assert_int_equal(src, cp_room_nsources(room));
        assert_int_equal(snk, room->nsinks);
        assert_int_equal(done == room->nparts, cp_room_all_completed(room));
        assert_int_equal(room_awaiting, room->nawaiting);
        if (room->nawaiting > 0) /* no tombstone timer while a lease waits */
            assert_false(cp_timer_armed(&room->timer));
    }
    assert_int_equal(nparts_total, st->leases.count);
    assert_int_equal(awaiting, st->stats.leases_awaiting_host_proof);

    for (size_t k = 0; k < pools.n; k++) {
        const struct cp_pool *pool = pools.v[k];
        uint32_t refs = 0, held = 0;
        for (size_t j = 0; j < nodes.n; j++) {
            const struct cp_node *n = nodes.v[j];
            for (uint32_t i = 0; i < n->npools; i++)
                refs += n->pools[i] == pool;
        }
        /* The index is rebuilt and compared over the pages up to the last
         * one held, and over the whole pool when that is not huge (a flipped
         * image may make a pool of billions of pages). */
        uint32_t span = 0;
        pos = 0;
        while ((room = cp_map_next(&st->rooms, &pos)) != NULL) {
            for (uint32_t i = 0; i < room->nparts; i++) {
                const struct cp_part *p = room->parts[i];
                for (uint32_t r = 0;
                     p->pool == pool && p->lease_state != KVF_CPS_LEASE_RELEASED && r < p->nranges;
                     r++) {
                    uint64_t end = (uint64_t)p->ranges[r].first + p->ranges[r].count;
                    assert_true(end <= pool->page_count);
                    if (end > span)
                        span = (uint32_t)end;
                }
            }
        }
        if (pool->page_count <= (1u << 20))
            span = pool->page_count;
        struct cp_page *pages = NULL;
        if (pool->pages != NULL) {
            pages = calloc(span + 1, sizeof(*pages));
            assert_non_null(pages);
        }
        pos = 0;
        while ((room = cp_map_next(&st->rooms, &pos)) != NULL) {
            for (uint32_t i = 0; i < room->nparts; i++) {
                const struct cp_part *p = room->parts[i];
                if (p->pool != pool)
                    continue;
                refs++;
                if (p->lease_state == KVF_CPS_LEASE_RELEASED)
                    continue;
                held++;
                if (p->nranges > 0)
                    assert_non_null(pages);
                for (uint32_t r = 0; r < p->nranges; r++) {
                    for (uint32_t pg = p->ranges[r].first;
                         pg < p->ranges[r].first + p->ranges[r].count; pg++) {
                        assert_true(pg < pool->page_count);
                        if (p->role == KVF_CPS_ROLE_SINK)
                            pages[pg].writer = (struct cp_part *)p;
                        else
                            pages[pg].readers++;
                    }
                }
            }
        }
        assert_int_equal(refs, pool->refs);
        assert_int_equal(held, pool->nleases);
        uint32_t listed = 0;
        for (const struct cp_part *p = pool->leases; p != NULL; p = p->pool_next) {
            listed++;
            assert_ptr_equal(p->pool, pool);
            assert_int_not_equal(p->lease_state, KVF_CPS_LEASE_RELEASED);
        }
        assert_int_equal(listed, held);
        if (pages != NULL) {
            uint32_t differ = 0;
            for (uint32_t pg = 0; pg < span; pg++)
                differ += pages[pg].writer != pool->pages[pg].writer ||
                          pages[pg].readers != pool->pages[pg].readers;
            assert_int_equal(differ, 0);
        }
        free(pages);
    }

    assert_int_equal(armed, h->n);
    for (uint32_t i = 0; i < h->n; i++) {
        assert_int_equal(h->v[i]->idx, i);
        assert_true(h->v[i]->seq <= h->seq);
        if (i > 0) {
            const struct cp_timer *parent = h->v[(i - 1) / 2];
            assert_true(parent->when < h->v[i]->when ||
                        (parent->when == h->v[i]->when && parent->seq < h->v[i]->seq));
        }
    }
    assert_memory_equal(c.rooms_by_state, st->stats.rooms_by_state, sizeof(c.rooms_by_state));
    assert_memory_equal(c.leases_by_state, st->stats.leases_by_state, sizeof(c.leases_by_state));
    assert_memory_equal(c.nodes_by_state, st->stats.nodes_by_state, sizeof(c.nodes_by_state));
    assert_int_equal(c.notices_pending, st->stats.notices_pending);
    assert_int_equal(c.rooms_past_deadline, st->stats.rooms_past_deadline);
    free(nodes.v);
    free(pools.v);
}

/* ---- comparing an original with its copy ------------------------------------- */

static int collect_room(void *ctx, const struct kvf_cps_room_view *v)
{
    struct kvf_cps_room_view *out = ctx;
    assert_true(v->key.room_id >= 1 && v->key.room_id <= 64);
    out[v->key.room_id - 1] = *v;
    return 0;
}

static void assert_effects_equal(const struct fixture *a, const struct fixture *b)
{
    assert_int_equal(a->nfx, b->nfx);
    for (size_t i = 0; i < a->nfx; i++) {
        const struct kvf_cps_effect *x = &a->fx[i], *y = &b->fx[i];
        assert_int_equal(x->kind, y->kind);
        assert_true(kvf_room_key_eq(x->key, y->key));
        assert_string_equal(x->node_id, y->node_id);
        assert_int_equal(x->incarnation, y->incarnation);
        assert_string_equal(x->peer_node, y->peer_node);
        assert_int_equal(x->peer_incarnation, y->peer_incarnation);
        assert_true(kvf_token_eq(x->token, y->token));
        assert_int_equal(x->attempt, y->attempt);
        assert_int_equal(x->lease_id, y->lease_id);
        assert_int_equal(x->rank, y->rank);
        assert_int_equal(x->role, y->role);
        assert_int_equal(x->old_state, y->old_state);
        assert_int_equal(x->new_state, y->new_state);
        assert_int_equal(x->reason, y->reason);
    }
}

/* Every view agrees; times agree relative to each fixture's clock. */
static void assert_states_equal(const struct fixture *a, const struct fixture *b)
{
    static struct kvf_cps_room_view ra[64], rb[64];
    memset(ra, 0, sizeof(ra));
    memset(rb, 0, sizeof(rb));
    assert_int_equal(kvf_cps_room_foreach(a->st, collect_room, ra), 0);
    assert_int_equal(kvf_cps_room_foreach(b->st, collect_room, rb), 0);
    for (size_t i = 0; i < 64; i++) {
        const struct kvf_cps_room_view *x = &ra[i], *y = &rb[i];
        assert_true(kvf_room_key_eq(x->key, y->key));
        if (x->key.room_id == 0)
            continue;
        assert_int_equal(x->state, y->state);
        assert_int_equal(x->abort_reason, y->abort_reason);
        assert_true(kvf_token_eq(x->token, y->token));
        assert_int_equal(x->expected_sources, y->expected_sources);
        assert_int_equal(x->expected_sinks, y->expected_sinks);
        assert_int_equal(x->protocol_version, y->protocol_version);
        assert_int_equal(a->now - x->created_at, b->now - y->created_at);
        assert_int_equal(a->now - x->state_since, b->now - y->state_since);
        assert_int_equal(x->escalated, y->escalated);
        assert_int_equal(x->participant_count, y->participant_count);
        for (size_t j = 0; j < x->participant_count; j++) {
            struct kvf_cps_participant_view p, q;
            assert_int_equal(kvf_cps_room_participant(a->st, x->key, j, &p), 0);
            assert_int_equal(kvf_cps_room_participant(b->st, y->key, j, &q), 0);
            assert_string_equal(p.node_id, q.node_id);
            assert_int_equal(p.incarnation, q.incarnation);
            assert_int_equal(p.rank, q.rank);
            assert_int_equal(p.role, q.role);
            assert_int_equal(p.lease_id, q.lease_id);
            assert_int_equal(p.pool_id, q.pool_id);
            assert_int_equal(p.lease_state, q.lease_state);
            assert_int_equal(p.completed, q.completed);
            assert_int_equal(p.node_drained, q.node_drained);
            assert_int_equal(p.node_fenced, q.node_fenced);
            assert_int_equal(p.range_count, q.range_count);
            if (p.range_count > 0)
                assert_memory_equal(p.ranges, q.ranges, p.range_count * sizeof(*p.ranges));
        }
    }
    for (size_t i = 0; i < NODES; i++) {
        struct kvf_cps_node_view x, y;
        int rx = kvf_cps_node_get(a->st, node_names[i], &x);
        assert_int_equal(rx, kvf_cps_node_get(b->st, node_names[i], &y));
        if (rx != 0)
            continue;
        assert_int_equal(x.incarnation, y.incarnation);
        assert_int_equal(x.state, y.state);
        assert_int_equal(x.protocol_version, y.protocol_version);
        assert_int_equal(x.features, y.features);
        assert_int_equal(x.pool_count, y.pool_count);
        assert_int_equal(x.room_count, y.room_count);
    }
    struct kvf_cps_stats sa, sb;
    kvf_cps_stats_get(a->st, &sa);
    kvf_cps_stats_get(b->st, &sb);
    assert_memory_equal(&sa, &sb, sizeof(sa));
    kvf_time_ns da = kvf_cps_next_deadline(a->st), db = kvf_cps_next_deadline(b->st);
    assert_int_equal(da == UINT64_MAX, db == UINT64_MAX);
    if (da != UINT64_MAX)
        assert_int_equal(da - a->now, db - b->now);
}

/* ---- random operations --------------------------------------------------------- */

enum op_kind {
    OP_ATTACH,
    OP_DETACH,
    OP_JOIN,
    OP_EXTEND,
    OP_ABORT,
    OP_COMPLETED,
    OP_FAILED,
    OP_DRAINED,
    OP_FENCED,
    OP_ADMIN_FENCE,
    OP_SET_POOL,
    OP_ADVANCE,
    OP_KINDS
};

struct op {
    enum op_kind kind;
    const char *node, *peer;
    uint64_t inc, peer_inc;
    kvf_room_key key;
    uint64_t lease_id;
    struct kvf_cps_join join;
    struct kvf_cps_page_range range;
    uint32_t rank;
    enum kvf_cps_role role;
    enum kvf_cps_abort_reason reason;
    kvf_token token;
    uint32_t pool_page_count;
    kvf_time_ns dt;
};

struct gen {
    uint64_t rng;
    uint64_t inc[NODES]; /* the incarnation the driver last attached */
};

static uint64_t rnd(struct gen *g, uint64_t n)
{
    uint64_t v;
    test_random(&g->rng, &v, sizeof(v));
    return v % n;
}

/* A participant of room `room_id` in `st`, if any. */
static bool pick_part(struct gen *g, const struct kvf_cps *st, uint64_t room_id,
                      struct kvf_cps_room_view *rv, struct kvf_cps_participant_view *pv)
{
    if (kvf_cps_room_get(st, (kvf_room_key){room_id, 0}, rv) != 0 || rv->participant_count == 0)
        return false;
    size_t idx = (size_t)rnd(g, rv->participant_count);
    return kvf_cps_room_participant(st, rv->key, idx, pv) == 0;
}

/* Draws the next operation, choosing among what exists in `st` (the original:
 * the copy must look the same anyway). */
static void gen_op(struct gen *g, const struct kvf_cps *st, struct op *op)
{
    memset(op, 0, sizeof(*op));
    static const uint32_t weights[OP_KINDS] = {8, 4, 24, 5, 6, 8, 2, 10, 6, 1, 2, 14};
    uint32_t total = 0;
    for (int i = 0; i < OP_KINDS; i++)
        total += weights[i];
    uint32_t x = (uint32_t)rnd(g, total);
    int k = 0;
    while (x >= weights[k])
        x -= weights[k++];
    op->kind = (enum op_kind)k;
    size_t ni = (size_t)rnd(g, NODES);
    op->node = node_names[ni];
    op->inc = g->inc[ni] != 0 ? g->inc[ni] : 1;
    uint64_t room_id = 1 + rnd(g, ROOMS);
    struct kvf_cps_room_view rv;
    struct kvf_cps_participant_view pv;
    switch (op->kind) {
    case OP_ATTACH:
        if (g->inc[ni] == 0)
            g->inc[ni] = 1;
        else if (rnd(g, 3) == 0)
            g->inc[ni]++;
        op->inc = g->inc[ni];
        break;
    case OP_JOIN: {
        struct kvf_cps_join *j = &op->join;
        j->room_id = room_id;
        if (kvf_cps_room_get(st, (kvf_room_key){room_id, 0}, &rv) == 0 &&
            rv.state <= KVF_CPS_ROOM_ABORTING && rnd(g, 8) != 0) {
            j->expected_sources = rv.expected_sources;
            j->expected_sinks = rv.expected_sinks;
        } else {
            j->expected_sources = 1 + (uint32_t)rnd(g, 2);
            j->expected_sinks = 1 + (uint32_t)rnd(g, 3);
        }
        j->node_id = op->node;
        j->rank = (uint32_t)rnd(g, 3);
        j->role = rnd(g, 2) == 0 ? KVF_CPS_ROLE_SOURCE : KVF_CPS_ROLE_SINK;
        j->engine_protocol_min = 1;
        j->engine_protocol_max = 1;
        j->engine_features = KVF_FEATURE_QUIESCE_V1;
        j->pool_id = rnd(g, 5) == 0 ? 2 : 1;
        op->range.first = (uint32_t)rnd(g, 240);
        op->range.count = 1 + (uint32_t)rnd(g, 12);
        j->ranges = &op->range;
        j->range_count = rnd(g, 5) == 0 ? 0 : 1; /* a dummy rank holds no page */
        break;
    }
    case OP_EXTEND:
        if (pick_part(g, st, room_id, &rv, &pv)) {
            op->key = rv.key;
            op->lease_id = pv.lease_id;
        } else {
            op->key = (kvf_room_key){room_id, 1};
            op->lease_id = 1 + rnd(g, 50);
        }
        op->range.first = (uint32_t)rnd(g, 256);
        op->range.count = 1 + (uint32_t)rnd(g, 6);
        break;
    case OP_ABORT:
        op->key = (kvf_room_key){room_id, 0};
        if (kvf_cps_room_get(st, op->key, &rv) == 0 && rnd(g, 2) == 0)
            op->key = rv.key;
        op->reason = (enum kvf_cps_abort_reason)(1 + rnd(g, 6));
        break;
    case OP_COMPLETED:
    case OP_FAILED:
    case OP_DRAINED:
        if (pick_part(g, st, room_id, &rv, &pv)) {
            op->node = node_names[pv.node_id[1] - '0'];
            op->inc = pv.incarnation;
            op->key = rv.key;
            op->rank = pv.rank;
            op->role = pv.role;
            op->token = rv.token;
            if (rnd(g, 10) == 0)
                op->token.lo ^= 1; /* a foreign token */
        } else {
            op->key = (kvf_room_key){room_id, 1};
            op->role = KVF_CPS_ROLE_SOURCE;
            op->token = (kvf_token){rnd(g, 2), 7};
        }
        break;
    case OP_FENCED: {
        size_t pi = (size_t)rnd(g, NODES);
        op->peer = node_names[pi];
        op->peer_inc = g->inc[pi] > 1 && rnd(g, 2) == 0 ? g->inc[pi] - 1 : g->inc[pi];
        break;
    }
    case OP_SET_POOL:
        op->pool_page_count = rnd(g, 2) == 0 ? 256 : 512;
        break;
    case OP_ADVANCE: {
        static const kvf_time_ns steps[] = {
            50 * KVF_NS_PER_MS, 300 * KVF_NS_PER_MS, 1 * KVF_NS_PER_S, 2 * KVF_NS_PER_S,
            4 * KVF_NS_PER_S,   9 * KVF_NS_PER_S,    25 * KVF_NS_PER_S};
        op->dt = steps[rnd(g, sizeof(steps) / sizeof(steps[0]))];
        break;
    }
    default:
        break;
    }
}

static int apply_op(struct fixture *f, const struct op *op)
{
    struct kvf_error *err = &f->err;
    kvf_error_clear(err);
    fx_reset(f);
    int rc = 0;
    switch (op->kind) {
    case OP_ATTACH: {
        struct kvf_cps_pool pools[2] = {{1, 65536, 256}, {2, 65536, 512}};
        struct kvf_cps_node_hello h = {
            .node_id = op->node,
            .incarnation = op->inc,
            .protocol_min = 1,
            .protocol_max = 1,
            .features = KVF_FEATURE_QUIESCE_V1 | KVF_FEATURE_FENCE_V1,
            .pools = pools,
            .pool_count = op->inc % 2 == 0 ? 2 : 1,
        };
        rc = kvf_cps_node_attach(f->st, &h, f->now, NULL, err);
        break;
    }
    case OP_DETACH:
        rc = kvf_cps_node_detach(f->st, op->node, op->inc, f->now, err);
        break;
    case OP_JOIN: {
        struct kvf_cps_join_result res;
        rc = kvf_cps_join(f->st, &op->join, f->now, &res, err);
        break;
    }
    case OP_EXTEND:
        rc = kvf_cps_lease_extend(f->st, op->key, op->lease_id, &op->range, 1, f->now, err);
        break;
    case OP_ABORT: {
        kvf_token t;
        rc = kvf_cps_room_abort(f->st, op->key, op->reason, f->now, &t, err);
        break;
    }
    case OP_COMPLETED:
        rc = kvf_cps_report_completed(f->st, op->node, op->inc, op->key, op->rank, op->role, f->now,
                                      err);
        break;
    case OP_FAILED: {
        kvf_token t;
        rc = kvf_cps_report_failed(f->st, op->node, op->inc, op->key, f->now, &t, err);
        break;
    }
    case OP_DRAINED:
        rc = kvf_cps_report_drained(f->st, op->node, op->inc, op->key, op->token, f->now, err);
        break;
    case OP_FENCED:
        rc = kvf_cps_report_fenced(f->st, op->node, op->inc, op->peer, op->peer_inc, f->now, err);
        break;
    case OP_ADMIN_FENCE:
        rc = kvf_cps_admin_fence(f->st, op->node, f->now, err);
        break;
    case OP_SET_POOL: {
        struct kvf_cps_pool p = {2, 65536, op->pool_page_count};
        rc = kvf_cps_node_set_pool(f->st, op->node, op->inc, &p, err);
        break;
    }
    case OP_ADVANCE:
        f->now += op->dt;
        kvf_cps_tick(f->st, f->now);
        break;
    default:
        break;
    }
    fx_collect(f);
    return rc;
}

/* Runs `steps` random operations on `f` alone. */
static void run_ops(struct gen *g, struct fixture *f, int steps)
{
    for (int i = 0; i < steps; i++) {
        struct op op;
        gen_op(g, f->st, &op);
        apply_op(f, &op);
    }
}

/* ---- tests --------------------------------------------------------------------- */

/* What the snapshotted states held, so that the equivalence test is known to
 * cover it. */
struct coverage {
    size_t older, fence_pending, fence_acked, releasing, tombstones, suspect, lost, armed, notices,
        escalated, shared_pools, steps_ok, effects;
};

static void cover(struct coverage *cv, const struct kvf_cps *st)
{
    size_t pos = 0;
    struct cp_node *n;
    while ((n = cp_map_next(&st->nodes, &pos)) != NULL) {
        cv->suspect += n->state == KVF_CPS_NODE_SUSPECT;
        cv->lost += n->state == KVF_CPS_NODE_LOST;
        for (struct cp_node *o = n; o != NULL; o = o->older) {
            cv->older += o != n;
            for (uint32_t i = 0; i < o->nfenced_by; i++) {
                cv->fence_pending += o->fenced_by[i]->fencer != NULL;
                cv->fence_acked += o->fenced_by[i]->acked;
            }
            for (uint32_t i = 0; i < o->npools; i++)
                cv->shared_pools += o->pools[i]->refs > 1 + o->pools[i]->nleases;
        }
    }
    pos = 0;
    struct cp_room *room;
    while ((room = cp_map_next(&st->rooms, &pos)) != NULL) {
        cv->tombstones += cp_room_terminal(room);
        cv->escalated += room->escalated;
        for (uint32_t i = 0; i < room->nparts; i++)
            cv->releasing += room->parts[i]->lease_state == KVF_CPS_LEASE_RELEASING;
        for (uint32_t i = 0; i < room->nrnodes; i++)
            cv->notices += room->rnodes[i]->notice_pending;
    }
    cv->armed += st->timers.n;
}

static void restored_copy_behaves_like_the_original(void **state)
{
    (void)state;
    struct kvf_cps_opts opts = test_opts();
    size_t total_bytes = 0;
    struct coverage cv;
    memset(&cv, 0, sizeof(cv));
    for (uint64_t seed = 1; seed <= 200; seed++) {
        struct fixture *f = fixture_new(&opts);
        struct gen g = {.rng = 0x5eed0000ull + seed * 7919};
        run_ops(&g, f, 60 + (int)(seed % 7) * 30);
        check_state(f->st);
        cover(&cv, f->st);

        struct buf image = snap(f->st, f->now);
        total_bytes += image.len;
        /* Another clock: a later boot, or an earlier one (monotonic clocks
         * restart), but far enough that no age goes below zero. */
        kvf_time_ns now2 = seed % 2 == 0 ? f->now + seed * 3600 * KVF_NS_PER_S
                                         : f->now - 999 * KVF_NS_PER_S + seed * KVF_NS_PER_MS;
        struct kvf_error err;
        struct fixture *c = restore_fixture(&opts, &image, now2, f->rng, &err);
        if (c == NULL)
            fail_msg("seed %" PRIu64 ": restore refused: %s", seed, err.msg);
        check_state(c->st);
        assert_states_equal(f, c);
        struct buf again = snap(c->st, c->now);
        assert_int_equal(again.len, image.len);
        assert_memory_equal(again.p, image.p, image.len);
        free(again.p);

        for (int step = 0; step < 200; step++) {
            struct op op;
            gen_op(&g, f->st, &op);
            int ra = apply_op(f, &op);
            int rb = apply_op(c, &op);
            if (ra != rb)
                fail_msg("seed %" PRIu64 " step %d op %d: rc %d vs %d (%s / %s)", seed, step,
                         (int)op.kind, ra, rb, f->err.msg, c->err.msg);
            assert_effects_equal(f, c);
            assert_states_equal(f, c);
            cv.steps_ok += ra == 0;
            cv.effects += f->nfx;
        }
        check_state(c->st);
        struct buf fa = snap(f->st, f->now), fb = snap(c->st, c->now);
        assert_int_equal(fa.len, fb.len);
        assert_memory_equal(fa.p, fb.p, fa.len);
        free(fa.p);
        free(fb.p);
        free(image.p);
        fixture_free(f);
        fixture_free(c);
    }
    print_message("[   INFO   ] 200 seeds, mean image %zu bytes; in the images: %zu older "
                  "incarnations, %zu SUSPECT, %zu LOST, %zu fences pending, %zu acked, "
                  "%zu RELEASING leases, %zu notices pending, %zu escalated rooms, %zu "
                  "tombstones, %zu shared pools, %zu armed timers; after: %zu ops ok of "
                  "40000, %zu effects compared\n",
                  total_bytes / 200, cv.older, cv.suspect, cv.lost, cv.fence_pending,
                  cv.fence_acked, cv.releasing, cv.notices, cv.escalated, cv.tombstones,
                  cv.shared_pools, cv.armed, cv.steps_ok, cv.effects);
    /* Each kind of object was in some image. */
    assert_true(cv.older > 0 && cv.suspect > 0 && cv.lost > 0 && cv.fence_pending > 0 &&
                cv.fence_acked > 0 && cv.releasing > 0 && cv.notices > 0 && cv.escalated > 0 &&
                cv.tombstones > 0 && cv.armed > 0);
}

static struct fixture *restore_here(const struct fixture *f, kvf_time_ns now2)
{
    struct kvf_cps_opts opts = f->st->opts;
    struct buf image = snap(f->st, f->now);
    struct kvf_error err;
    struct fixture *c = restore_fixture(&opts, &image, now2, f->rng, &err);
    free(image.p);
    if (c == NULL)
        fail_msg("restore refused: %s", err.msg);
    check_state(c->st);
    return c;
}

/* Source n1, sinks n2 and n3; aborted; n1 drained before the snapshot. */
static void releasing_lease_is_released_after_the_remaining_drains(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    for (int i = 1; i <= 3; i++)
        assert_int_equal(attach(f, node_names[i], 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 9,
                                              .sinks = 2,
                                              .node = "n1",
                                              .role = KVF_CPS_ROLE_SOURCE,
                                              .first = 0,
                                              .count = 8},
                          &r),
                     0);
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 9,
                                              .sinks = 2,
                                              .node = "n2",
                                              .role = KVF_CPS_ROLE_SINK,
                                              .first = 0,
                                              .count = 8},
                          &r),
                     0);
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 9,
                                              .sinks = 2,
                                              .node = "n3",
                                              .role = KVF_CPS_ROLE_SINK,
                                              .first = 8,
                                              .count = 4},
                          &r),
                     0);
    kvf_room_key key = r.key;
    kvf_token tok;
    assert_int_equal(kvf_cps_room_abort(f->st, key, KVF_CPS_ABORT_ENGINE, f->now, &tok, NULL), 0);
    assert_int_equal(kvf_cps_report_drained(f->st, "n1", 1, key, tok, f->now, NULL), 0);
    advance(f, 1 * KVF_NS_PER_S);

    struct fixture *c = restore_here(f, 7 * KVF_NS_PER_S);
    assert_states_equal(f, c);
    struct fixture *both[2] = {f, c};
    for (int k = 0; k < 2; k++) {
        struct fixture *x = both[k];
        fx_reset(x);
        for (size_t i = 0; i < 3; i++)
            assert_int_equal(lease_state(x, key, i), KVF_CPS_LEASE_RELEASING);
        /* The pages stay held: a new sink on n2's pages is refused. */
        assert_int_equal(
            join(
                x,
                &(struct join_args){
                    .room_id = 10, .node = "n2", .role = KVF_CPS_ROLE_SINK, .first = 4, .count = 2},
                NULL),
            -EBUSY);
        assert_int_equal(kvf_cps_report_drained(x->st, "n2", 1, key, tok, x->now, NULL), 0);
        fx_collect(x);
        assert_int_equal(fx_count(x, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
        assert_int_equal(room_state(x, key), KVF_CPS_ROOM_ABORTING);
        assert_int_equal(kvf_cps_report_drained(x->st, "n3", 1, key, tok, x->now, NULL), 0);
        fx_collect(x);
        assert_int_equal(fx_count(x, KVF_CPS_FX_LEASE_RELEASED, NULL), 3);
        assert_int_equal(room_state(x, key), KVF_CPS_ROOM_ABORTED);
        assert_int_equal(kvf_cps_report_drained(x->st, "n3", 1, key, tok, x->now, NULL), 0);
        fx_collect(x);
        assert_int_equal(fx_count(x, KVF_CPS_FX_LEASE_RELEASED, NULL), 3);
    }
    assert_effects_equal(f, c);
    check_state(c->st);
    fixture_free(f);
    fixture_free(c);
}

static void timers_are_rebased_onto_the_new_clock(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL); /* join timeout 30 s, node ttl 10 s */
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 3, .node = "n1", .role = KVF_CPS_ROLE_SOURCE, .first = 0, .count = 4},
             &r),
        0);
    advance(f, 10 * KVF_NS_PER_S);
    assert_int_equal(kvf_cps_node_detach(f->st, "n2", 1, f->now, NULL), 0);
    advance(f, 4 * KVF_NS_PER_S);

    /* The new clock is far behind the old one (a reboot). */
    kvf_time_ns now2 = 50 * KVF_NS_PER_S;
    struct fixture *c = restore_here(f, now2);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(c->st, r.key, &v), 0);
    assert_int_equal(v.created_at, now2 - 14 * KVF_NS_PER_S);
    assert_int_equal(v.state, KVF_CPS_ROOM_OPENING);
    /* n2's ttl has 6 s left, the join timeout 16 s. */
    assert_int_equal(kvf_cps_next_deadline(c->st), now2 + 6 * KVF_NS_PER_S);
    struct kvf_cps_node_view nv;
    assert_int_equal(kvf_cps_node_get(c->st, "n1", &nv), 0);
    assert_int_equal(nv.state, KVF_CPS_NODE_ATTACHED); /* kept: the service detaches it */
    assert_int_equal(kvf_cps_node_detach(c->st, "n1", 1, c->now, NULL), 0);
    assert_int_equal(kvf_cps_node_get(c->st, "n1", &nv), 0);
    assert_int_equal(nv.state, KVF_CPS_NODE_SUSPECT);
    advance(c, 6 * KVF_NS_PER_S - 1);
    assert_int_equal(kvf_cps_node_get(c->st, "n2", &nv), 0);
    assert_int_equal(nv.state, KVF_CPS_NODE_SUSPECT);
    advance(c, 1);
    assert_int_equal(kvf_cps_node_get(c->st, "n2", &nv), 0);
    assert_int_equal(nv.state, KVF_CPS_NODE_LOST);
    /* n1 re-attaches before its own (new) ttl: the room is still OPENING, then
     * times out 16 s after the restore. */
    assert_int_equal(attach(c, "n1", 1), 0);
    assert_int_equal(room_state(c, r.key), KVF_CPS_ROOM_OPENING);
    advance(c, 10 * KVF_NS_PER_S - 1);
    assert_int_equal(room_state(c, r.key), KVF_CPS_ROOM_OPENING);
    advance(c, 1);
    assert_int_equal(room_state(c, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(kvf_cps_room_get(c->st, r.key, &v), 0);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_JOIN_TIMEOUT);
    check_state(c->st);
    fixture_free(f);
    fixture_free(c);
}

static void empty_state_round_trips(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    struct buf image = snap(f->st, 0);
    print_message("[   INFO   ] empty image: %zu bytes\n", image.len);
    struct kvf_error err;
    struct fixture *c = restore_fixture(&f->st->opts, &image, 5, 1, &err);
    assert_non_null(c);
    check_state(c->st);
    assert_int_equal(kvf_cps_next_deadline(c->st), UINT64_MAX);
    struct kvf_cps_stats s;
    kvf_cps_stats_get(c->st, &s);
    struct kvf_cps_stats zero;
    memset(&zero, 0, sizeof(zero));
    assert_memory_equal(&s, &zero, sizeof(s));
    /* It works like a new state: lease ids and generations start at 1. */
    kvf_room_key key = join_pair(c, 1);
    assert_int_equal(key.generation, 1);
    free(image.p);
    fixture_free(f);
    fixture_free(c);
}

static double secs_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) / 1e9;
}

static void ten_thousand_rooms(void **state)
{
    (void)state;
    struct kvf_cps_opts opts;
    kvf_cps_opts_init(&opts);
    struct fixture *f = fixture_new(&opts);
    struct kvf_cps_pool pool = {.pool_id = 1, .page_size = 65536, .page_count = 1u << 20};
    for (int i = 0; i < 4; i++) {
        struct kvf_cps_node_hello h = {.node_id = node_names[i],
                                       .incarnation = 1,
                                       .protocol_min = 1,
                                       .protocol_max = 1,
                                       .features = KVF_FEATURE_QUIESCE_V1,
                                       .pools = &pool,
                                       .pool_count = 1};
        assert_int_equal(kvf_cps_node_attach(f->st, &h, f->now, NULL, NULL), 0);
    }
    for (uint32_t i = 0; i < 10000; i++) {
        struct join_args src = {.room_id = 1 + i,
                                .node = node_names[i % 2],
                                .role = KVF_CPS_ROLE_SOURCE,
                                .first = (i * 8) % 4096,
                                .count = 8};
        struct join_args snk = {.room_id = 1 + i,
                                .node = node_names[2 + i % 2],
                                .role = KVF_CPS_ROLE_SINK,
                                .first = i * 8,
                                .count = 8};
        assert_int_equal(join(f, &src, NULL), 0);
        assert_int_equal(join(f, &snk, NULL), 0);
        if (i % 3 == 0)
            assert_int_equal(kvf_cps_room_abort(f->st, (kvf_room_key){1 + i, 0},
                                                KVF_CPS_ABORT_ADMIN, f->now, NULL, NULL),
                             0);
        fx_reset(f);
    }
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct buf image = snap(f->st, f->now);
    double t_snap = secs_since(&t0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct kvf_error err;
    struct fixture *c = restore_fixture(&opts, &image, 1, f->rng, &err);
    double t_restore = secs_since(&t0);
    assert_non_null(c);
    print_message("[   INFO   ] 10,000 rooms: image %zu bytes, snapshot %.1f ms, "
                  "restore %.1f ms\n",
                  image.len, t_snap * 1e3, t_restore * 1e3);
    struct kvf_cps_stats sa, sb;
    kvf_cps_stats_get(f->st, &sa);
    kvf_cps_stats_get(c->st, &sb);
    assert_memory_equal(&sa, &sb, sizeof(sa));
    assert_int_equal(c->st->rooms.count, 10000);
    struct buf again = snap(c->st, c->now);
    assert_int_equal(again.len, image.len);
    assert_memory_equal(again.p, image.p, image.len);
    free(again.p);
    free(image.p);
    fixture_free(f);
    fixture_free(c);
}

/* A small state with a bit of everything: an older incarnation, a fence
 * request, an aborting room, a tombstone, an OPENING room, a SUSPECT node. */
static struct fixture *small_state(void)
{
    struct kvf_cps_opts opts = test_opts();
    struct fixture *f = fixture_new(&opts);
    kvf_room_key k1 = join_pair(f, 1);
    kvf_room_key k2 = join_pair(f, 2);
    assert_int_equal(attach(f, "n3", 1), 0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 3, .node = "n3", .role = KVF_CPS_ROLE_SOURCE, .first = 100, .count = 3},
             NULL),
        0);
    assert_int_equal(
        kvf_cps_report_completed(f->st, "n1", 1, k1, 0, KVF_CPS_ROLE_SOURCE, f->now, NULL), 0);
    assert_int_equal(
        kvf_cps_report_completed(f->st, "n2", 1, k1, 0, KVF_CPS_ROLE_SINK, f->now, NULL), 0);
    assert_int_equal(attach(f, "n2", 2), 0); /* n2:1 LOST, room 2 aborts, n1 fences it */
    (void)k2;
    assert_int_equal(kvf_cps_node_detach(f->st, "n3", 1, f->now, NULL), 0);
    advance(f, 300 * KVF_NS_PER_MS);
    return f;
}

static void restore_refuses(const struct buf *image, size_t len)
{
    struct kvf_cps_opts opts = test_opts();
    opts.random_fn = test_random;
    uint64_t rng = 1;
    opts.random_ctx = &rng;
    struct kvf_error err;
    kvf_error_clear(&err);
    struct kvf_cps *st = kvf_cps_restore(&opts, image->p, len, 0, &err);
    if (st != NULL)
        fail_msg("restore of %zu of %zu bytes succeeded", len, image->len);
    assert_int_equal(err.code, -EBADMSG);
}

static void every_truncation_is_refused(void **state)
{
    (void)state;
    struct fixture *f = small_state();
    struct buf image = snap(f->st, f->now);
    print_message("[   INFO   ] small image: %zu bytes\n", image.len);
    for (size_t len = 0; len < image.len; len++)
        restore_refuses(&image, len);
    /* One byte too many, another version, another magic. */
    image.p = realloc(image.p, image.len + 1);
    assert_non_null(image.p);
    image.p[image.len] = 0;
    restore_refuses(&image, image.len + 1);
    image.p[6] = 3;
    restore_refuses(&image, image.len);
    image.p[6] = 1; /* a version 1 image has no pool keys: this one does not parse as one */
    restore_refuses(&image, image.len);
    image.p[6] = 2;
    image.p[0] = 'X';
    restore_refuses(&image, image.len);
    image.p[0] = 'K';
    struct kvf_error err;
    struct fixture *c = restore_fixture(&f->st->opts, &image, 1, 1, &err);
    assert_non_null(c);
    check_state(c->st);
    fixture_free(c);
    free(image.p);
    fixture_free(f);
}

/* Drives a restored state through everything that frees objects: nodes come
 * back with new incarnations, fence everybody, time runs out. */
static int cmp_id(const void *a, const void *b)
{
    return strcmp(a, b);
}

static void drive_to_the_end(struct fixture *c)
{
    uint64_t inc = 1000;
    for (int round = 0; round < 2; round++) {
        /* In id order: map order differs between an original and its copy. */
        static char ids[64][CP_NODE_ID_MAX + 1];
        size_t nids = 0, pos = 0;
        struct cp_node *n;
        while ((n = cp_map_next(&c->st->nodes, &pos)) != NULL && nids < 64)
            memcpy(ids[nids++], n->id, sizeof(ids[0]));
        qsort(ids, nids, sizeof(ids[0]), cmp_id);
        for (size_t i = 0; i < nids; i++) {
            struct kvf_cps_pool p = {.pool_id = 1, .page_size = 65536, .page_count = 256};
            struct kvf_cps_node_hello h = {.node_id = ids[i],
                                           .incarnation = inc + (uint64_t)round,
                                           .protocol_min = 1,
                                           .protocol_max = 1,
                                           .features = KVF_FEATURE_QUIESCE_V1,
                                           .pools = &p,
                                           .pool_count = 1};
            kvf_cps_node_attach(c->st, &h, c->now, NULL, NULL);
            fx_reset(c);
        }
        /* Every live node reports every fence it was asked for. */
        for (size_t i = 0; i < nids; i++) {
            n = cp_node_current(c->st, ids[i]);
            while (n != NULL && n->fence_reqs != NULL) {
                const struct cp_fence *req = n->fence_reqs;
                int rc = kvf_cps_report_fenced(c->st, n->id, n->incarnation, req->fenced->id,
                                               req->fenced->incarnation, c->now, NULL);
                fx_reset(c);
                if (rc != 0)
                    break;
            }
        }
        check_state(c->st);
        for (int i = 0; i < 6; i++)
            advance(c, 3600 * KVF_NS_PER_S);
        fx_reset(c);
        check_state(c->st);
    }
}

static void random_byte_flips_never_break_anything(void **state)
{
    (void)state;
    struct kvf_cps_opts opts = test_opts();
    struct fixture *f = fixture_new(&opts);
    struct gen g = {.rng = 0xf1f1f1f1ull};
    run_ops(&g, f, 400);
    struct buf image = snap(f->st, f->now);
    unsigned char *orig = malloc(image.len);
    assert_non_null(orig);
    memcpy(orig, image.p, image.len);
    uint64_t rng = 0xabcdefull;
    size_t refused = 0, nomem = 0, accepted = 0;
    for (int i = 0; i < 2000; i++) {
        uint64_t r;
        test_random(&rng, &r, sizeof(r));
        size_t at = (size_t)(r % image.len);
        unsigned char x = (unsigned char)(1 + (r >> 32) % 255);
        image.p[at] ^= x;
        struct kvf_error err;
        struct fixture *c = restore_fixture(&opts, &image, 77 * KVF_NS_PER_S, r, &err);
        if (c == NULL) {
            if (err.code == -ENOMEM)
                nomem++;
            else
                assert_int_equal(err.code, -EBADMSG);
            refused++;
        } else {
            accepted++;
            check_state(c->st);
            drive_to_the_end(c);
            fixture_free(c);
        }
        image.p[at] ^= x;
    }
    assert_memory_equal(image.p, orig, image.len);
    print_message("[   INFO   ] %zu-byte image, 2000 flips: %zu refused (%zu out of memory), "
                  "%zu accepted and consistent\n",
                  image.len, refused, nomem, accepted);
    free(orig);
    free(image.p);
    fixture_free(f);
}

/* The unflipped image of a random state also survives being driven to the end
 * (the driver itself is sound). */
static void restored_random_state_drives_to_the_end(void **state)
{
    (void)state;
    struct kvf_cps_opts opts = test_opts();
    for (uint64_t seed = 1; seed <= 20; seed++) {
        struct fixture *f = fixture_new(&opts);
        struct gen g = {.rng = seed * 31337};
        run_ops(&g, f, 300);
        struct fixture *c = restore_here(f, f->now);
        drive_to_the_end(c);
        drive_to_the_end(f);
        assert_states_equal(f, c);
        fixture_free(f);
        fixture_free(c);
    }
}

static void writer_errors_stop_the_snapshot(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    for (uint64_t i = 1; i <= 100; i++)
        join_pair(f, i);
    struct buf whole = snap(f->st, f->now);
    assert_true(whole.len > 3 * 4096);
    assert_true(whole.calls > 3);
    struct buf b = {.fail_after = 4096 * 2 + 1, .fail_rc = -ENOSPC};
    assert_int_equal(kvf_cps_snapshot(f->st, f->now, buf_write, &b), -ENOSPC);
    assert_int_equal(b.calls, 3); /* stopped at the failing call */
    free(b.p);
    struct buf c = {.fail_after = 1, .fail_rc = 1};
    assert_int_equal(kvf_cps_snapshot(f->st, f->now, buf_write, &c), -EIO);
    free(c.p);
    assert_int_equal(kvf_cps_snapshot(NULL, 0, buf_write, &c), -EINVAL);
    assert_int_equal(kvf_cps_snapshot(f->st, 0, NULL, NULL), -EINVAL);
    free(whole.p);
    fixture_free(f);
}

static void restore_checks_its_arguments(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    struct buf image = snap(f->st, 0);
    struct kvf_cps_opts bad;
    kvf_cps_opts_init(&bad); /* no random source */
    struct kvf_error err;
    assert_null(kvf_cps_restore(&bad, image.p, image.len, 0, &err));
    assert_int_equal(err.code, -EINVAL);
    assert_null(kvf_cps_restore(NULL, image.p, image.len, 0, &err));
    assert_int_equal(err.code, -EINVAL);
    assert_null(kvf_cps_restore(&f->st->opts, NULL, 10, 0, &err));
    assert_int_equal(err.code, -EINVAL);
    assert_null(kvf_cps_restore(&f->st->opts, NULL, 0, 0, &err));
    assert_int_equal(err.code, -EBADMSG);
    assert_null(kvf_cps_restore(&f->st->opts, NULL, 0, 0, NULL));
    free(image.p);
    fixture_free(f);
}

/* Room update acks are not in the image (docs/state-cores.md, "Ordered room
 * updates"): after a restore nothing counts as acknowledged, the update is
 * asked again when each node re-attaches (with a version minted then), and
 * publication resumes only with the new acks. */
static void restored_acks_are_asked_again(void **state)
{
    (void)state;
    struct kvf_cps_opts o = test_opts();
    struct fixture *f = fixture_new(&o);
    kvf_room_key key = join_pair(f, 31);
    fx_collect(f);
    /* Both nodes acknowledge whatever they are sent until nothing moves. */
    for (int round = 0; round < 4; round++) {
        uint64_t v[2] = {0, 0};
        for (int i = 0; i < 2; i++) {
            size_t n = fx_count(f, KVF_CPS_FX_ROOM_UPDATE, i ? "n2" : "n1");
            if (n)
                v[i] = fx_find(f, KVF_CPS_FX_ROOM_UPDATE, i ? "n2" : "n1", n - 1)->version;
        }
        fx_reset(f);
        for (int i = 0; i < 2; i++)
            if (v[i])
                (void)kvf_cps_room_update_acked(f->st, i ? "n2" : "n1", 1, key, v[i], f->now,
                                                &f->err);
        fx_collect(f);
    }
    struct kvf_cps_participant_view pv;
    assert_int_equal(kvf_cps_room_participant(f->st, key, 1, &pv), 0);
    assert_true(pv.published);

    struct buf image = snap(f->st, f->now);
    struct kvf_error err;
    struct fixture *g = restore_fixture(&o, &image, f->now, f->rng, &err);
    assert_non_null(g);
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(kvf_cps_room_participant(g->st, key, i, &pv), 0);
        assert_false(pv.published); /* asked again, not assumed */
    }
    /* The service detaches every node after a restore; n2 comes back first. */
    assert_int_equal(kvf_cps_node_detach(g->st, "n1", 1, g->now, &g->err), 0);
    assert_int_equal(kvf_cps_node_detach(g->st, "n2", 1, g->now, &g->err), 0);
    fx_collect(g);
    fx_reset(g);
    assert_int_equal(attach(g, "n2", 1), 0);
    fx_collect(g);
    assert_int_equal(fx_count(g, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    uint64_t v2 = fx_find(g, KVF_CPS_FX_ROOM_UPDATE, "n2", 0)->version;
    assert_true(v2 > 0);
    /* n2 acknowledges the update sent now: its sink is published again. */
    fx_reset(g);
    assert_int_equal(kvf_cps_room_update_acked(g->st, "n2", 1, key, v2, g->now, &g->err), 0);
    fx_collect(g);
    assert_int_equal(kvf_cps_room_participant(g->st, key, 1, &pv), 0);
    assert_true(pv.published);
    /* n1 is away: its update waits for its session (routed to none now). */
    assert_int_equal(fx_count(g, KVF_CPS_FX_ROOM_UPDATE, "n1"), 1);
    fixture_free(f);
    fixture_free(g);
    free(image.p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(restored_copy_behaves_like_the_original),
        cmocka_unit_test(releasing_lease_is_released_after_the_remaining_drains),
        cmocka_unit_test(timers_are_rebased_onto_the_new_clock),
        cmocka_unit_test(empty_state_round_trips),
        cmocka_unit_test(ten_thousand_rooms),
        cmocka_unit_test(every_truncation_is_refused),
        cmocka_unit_test(random_byte_flips_never_break_anything),
        cmocka_unit_test(restored_random_state_drives_to_the_end),
        cmocka_unit_test(writer_errors_stop_the_snapshot),
        cmocka_unit_test(restore_checks_its_arguments),
        cmocka_unit_test(restored_acks_are_asked_again),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
