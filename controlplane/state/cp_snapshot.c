/*
 * cp_snapshot.c: the image of the control-plane state core (kvf_cps_snapshot)
 * and the way back from it (kvf_cps_restore).
 *
 * Format, version 2 (version 1 images, without pool keys and witnesses, are
 * still read: no key, nothing witnessed). Every integer is little-endian and fixed-width; a string
 * is u16 length + bytes (no NUL); a list is u32 count + items. A timer is
 * u8 armed and, when armed, i64 remaining (deadline - now) + u64 arming seq.
 *
 *   header   "KVFCPS" u16 version u32 flags(0)
 *   counters u64 next_lease_id, next_serial, timer_seq, fx_dropped
 *   stats    u64 rooms_by_state[6] leases_by_state[4] nodes_by_state[4]
 *            notices_pending notices_sent notices_resent reports_stale
 *            reports_tokenless reports_unknown rooms_past_deadline
 *            fences_requested generation
 *   pools    list of {u32 pool_id, page_size, page_count; str key (v2)}
 *   nodes    list of chains {str id, list of incarnations, current first:
 *              u64 incarnation, serial; u8 state; u32 pmin, pmax, version,
 *              features; u8 gone (v2); timer ttl; list of u32 pool index;
 *              list of fence records {u64 fencer_serial, u8 acked,
 *              u32 attempt, timer}}
 *            (node index = position in this walk)
 *   rooms    list of {u64 room_id, generation, token.lo, token.hi; u8 state,
 *              reason, escalated; u32 expected_sources, expected_sinks, pmin,
 *              pmax; i64 created age, state age; timer;
 *              list of room-nodes {u32 node index, u8 drained,
 *                u8 notice_pending, u32 attempt, timer};
 *              list of participants {u64 lease_id, u32 room-node index, rank,
 *                u8 role, lease_state, completed, u32 pool index,
 *                list of ranges {u32 first, count}}}
 *   links    per node, in node order: list of u64 room_id (its room-node list,
 *              in order), list of u32 fenced node index (its pending fence
 *              requests, in order); per pool, in pool order: list of u64
 *              lease_id (its lease list, in order)
 *   trailer  "KVFEND"
 *
 * The order of the lists the rules walk (a node's rooms, its fence requests,
 * a pool's leases) is kept, and so are the timers' arming sequences, so that a
 * restored state emits exactly what the original would, in the same order.
 * Everything that can be derived is derived on restore (page index, pool refs
 * and lease counts, room and room-node counts, pending fence counts) and the
 * stats that count objects are checked against the objects. A room's leases
 * waiting for a host proof (RELEASING in a terminal room) are derived too,
 * with the gauge that counts them.
 *
 * DESIGN: rooms are written in room id order and node chains in id order, so
 * that one state at one `now` has one image (restore then snapshot gives the
 * same bytes). Restore builds into private tables and links objects as it goes;
 * on any error it frees from those tables, never through the maps or lists it
 * was building, so a bad image cannot make it free something twice.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

#define SNAP_MAGIC     "KVFCPS"
#define SNAP_TRAILER   "KVFEND"
#define SNAP_MAGIC_LEN 6
#define SNAP_VERSION   2
#define SNAP_CHUNK     4096

/* Smallest encodings, to bound every count by the bytes that remain. */
#define MIN_TIMER 1
#define MIN_POOL  12
#define MIN_NODE  (8 + 8 + 1 + 16 + MIN_TIMER + 4 + 4)
#define MIN_CHAIN (2 + 1 + 4 + MIN_NODE)
#define MIN_FENCE (8 + 1 + 4 + MIN_TIMER)
#define MIN_RNODE (4 + 1 + 1 + 4 + MIN_TIMER)
#define MIN_PART  (8 + 4 + 4 + 1 + 1 + 1 + 4 + 4)
#define MIN_ROOM  (32 + 3 + 16 + 16 + MIN_TIMER + 4 + 4)
#define MIN_RANGE 8

/* ---- time re-basing ------------------------------------------------------- */

/* a - b as a signed distance, saturated to +-INT64_MAX. */
static int64_t time_diff(kvf_time_ns a, kvf_time_ns b)
{
    if (a >= b) {
        uint64_t d = a - b;
        return d > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)d;
    }
    uint64_t d = b - a;
    return d > (uint64_t)INT64_MAX ? -INT64_MAX : -(int64_t)d;
}

/* t + d, saturated to 0 .. UINT64_MAX (no negation of INT64_MIN). */
static kvf_time_ns time_add(kvf_time_ns t, int64_t d)
{
    if (d >= 0) {
        uint64_t u = (uint64_t)d;
        return t > UINT64_MAX - u ? UINT64_MAX : t + u;
    }
    uint64_t u = (uint64_t)(-(d + 1)) + 1;
    return u > t ? 0 : t - u;
}

/* t - d, saturated likewise. */
static kvf_time_ns time_sub(kvf_time_ns t, int64_t d)
{
    if (d >= 0) {
        uint64_t u = (uint64_t)d;
        return u > t ? 0 : t - u;
    }
    uint64_t u = (uint64_t)(-(d + 1)) + 1;
    return t > UINT64_MAX - u ? UINT64_MAX : t + u;
}

/* ---- writer ---------------------------------------------------------------- */

struct wr {
    int (*fn)(void *ctx, const void *buf, size_t len);
    void *ctx;
    int rc;
    size_t n;
    unsigned char buf[SNAP_CHUNK];
};

static void wr_flush(struct wr *w)
{
    if (w->rc != 0 || w->n == 0)
        return;
    int rc = w->fn(w->ctx, w->buf, w->n);
    if (rc != 0)
        w->rc = rc < 0 ? rc : -EIO;
    w->n = 0;
}

static void wr_bytes(struct wr *w, const void *p, size_t len)
{
    const unsigned char *s = p;
    while (len > 0 && w->rc == 0) {
        size_t take = SNAP_CHUNK - w->n;
        if (take > len)
            take = len;
        memcpy(w->buf + w->n, s, take);
        w->n += take;
        s += take;
        len -= take;
        if (w->n == SNAP_CHUNK)
            wr_flush(w);
    }
}

static void wr_le(struct wr *w, uint64_t v, size_t width)
{
    unsigned char b[8];
    for (size_t i = 0; i < width; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    wr_bytes(w, b, width);
}

static void wr_u8(struct wr *w, uint64_t v)
{
    wr_le(w, v, 1);
}

static void wr_u16(struct wr *w, uint64_t v)
{
    wr_le(w, v, 2);
}

static void wr_u32(struct wr *w, uint64_t v)
{
    wr_le(w, v, 4);
}

static void wr_u64(struct wr *w, uint64_t v)
{
    wr_le(w, v, 8);
}

static void wr_i64(struct wr *w, int64_t v)
{
    wr_le(w, (uint64_t)v, 8);
}

static void wr_timer(struct wr *w, const struct cp_timer *t, kvf_time_ns now)
{
    if (!cp_timer_armed(t)) {
        wr_u8(w, 0);
        return;
    }
    wr_u8(w, 1);
    wr_i64(w, time_diff(t->when, now));
    wr_u64(w, t->seq);
}

static void wr_stats(struct wr *w, const struct kvf_cps_stats *s)
{
    for (size_t i = 0; i < 6; i++)
        wr_u64(w, s->rooms_by_state[i]);
    for (size_t i = 0; i < 4; i++)
        wr_u64(w, s->leases_by_state[i]);
    for (size_t i = 0; i < 4; i++)
        wr_u64(w, s->nodes_by_state[i]);
    wr_u64(w, s->notices_pending);
    wr_u64(w, s->notices_sent);
    wr_u64(w, s->notices_resent);
    wr_u64(w, s->reports_stale);
    wr_u64(w, s->reports_tokenless);
    wr_u64(w, s->reports_unknown);
    wr_u64(w, s->rooms_past_deadline);
    wr_u64(w, s->fences_requested);
    wr_u64(w, s->generation);
}

/* ---- snapshot ---------------------------------------------------------------- */

/* The objects of a state in image order, and pointer -> index maps. */
struct snap_ix {
    struct cp_room **rooms;
    size_t nrooms;
    struct cp_node **heads; /* current incarnations, by id */
    size_t nheads;
    struct cp_node **nodes; /* every incarnation, chain by chain */
    size_t nnodes, capnodes;
    struct cp_pool **pools;
    size_t npools, cappools;
    struct kvf_map node_ix; /* pointer -> index + 1 */
    struct kvf_map pool_ix;
};

static uint64_t ptr_key(const void *p)
{
    return (uint64_t)(uintptr_t)p;
}

static int ix_lookup(const struct kvf_map *m, const void *p, uint32_t *idx_p)
{
    void *v = cp_map_get(m, ptr_key(p));
    if (v == NULL)
        return -ENOENT;
    *idx_p = (uint32_t)((uintptr_t)v - 1);
    return 0;
}

static int ix_add(struct kvf_map *m, void ***vec, size_t *n, size_t *cap, void *p)
{
    if (cp_map_get(m, ptr_key(p)) != NULL)
        return 0;
    if (*n >= UINT32_MAX - 1)
        return -ENOMEM;
    if (*n == *cap) {
        size_t ncap = *cap == 0 ? 16 : *cap * 2;
        void **v = realloc(*vec, ncap * sizeof(*v));
        if (v == NULL)
            return -ENOMEM;
        *vec = v;
        *cap = ncap;
    }
    if (cp_map_put(m, ptr_key(p), (void *)(uintptr_t)(*n + 1)) != 0)
        return -ENOMEM;
    (*vec)[(*n)++] = p;
    return 0;
}

static int cmp_room(const void *a, const void *b)
{
    const struct cp_room *x = *(struct cp_room *const *)a;
    const struct cp_room *y = *(struct cp_room *const *)b;
    return x->key.room_id < y->key.room_id ? -1 : x->key.room_id > y->key.room_id;
}

static int cmp_node(const void *a, const void *b)
{
    const struct cp_node *x = *(struct cp_node *const *)a;
    const struct cp_node *y = *(struct cp_node *const *)b;
    return strcmp(x->id, y->id);
}

static void ix_fini(struct snap_ix *ix)
{
    free(ix->rooms);
    free(ix->heads);
    free(ix->nodes);
    free(ix->pools);
    cp_map_fini(&ix->node_ix);
    cp_map_fini(&ix->pool_ix);
}

static int ix_build(const struct kvf_cps *st, struct snap_ix *ix)
{
    memset(ix, 0, sizeof(*ix));
    cp_map_init(&ix->node_ix, false);
    cp_map_init(&ix->pool_ix, false);
    ix->rooms = malloc((st->rooms.count + 1) * sizeof(*ix->rooms));
    ix->heads = malloc((st->nodes.count + 1) * sizeof(*ix->heads));
    if (ix->rooms == NULL || ix->heads == NULL)
        return -ENOMEM;
    size_t pos = 0;
    struct cp_room *room;
    while ((room = cp_map_next(&st->rooms, &pos)) != NULL)
        ix->rooms[ix->nrooms++] = room;
    pos = 0;
    struct cp_node *node;
    while ((node = cp_map_next(&st->nodes, &pos)) != NULL)
        ix->heads[ix->nheads++] = node;
    qsort(ix->rooms, ix->nrooms, sizeof(*ix->rooms), cmp_room);
    qsort(ix->heads, ix->nheads, sizeof(*ix->heads), cmp_node);
    for (size_t i = 0; i < ix->nheads; i++) {
        for (node = ix->heads[i]; node != NULL; node = node->older) {
            if (ix_add(&ix->node_ix, (void ***)&ix->nodes, &ix->nnodes, &ix->capnodes, node) != 0)
                return -ENOMEM;
        }
    }
    for (size_t i = 0; i < ix->nnodes; i++) {
        for (uint32_t j = 0; j < ix->nodes[i]->npools; j++) {
            if (ix_add(&ix->pool_ix, (void ***)&ix->pools, &ix->npools, &ix->cappools,
                       ix->nodes[i]->pools[j]) != 0)
                return -ENOMEM;
        }
    }
    /* A lease's pool is listed by its node; this only keeps the image whole
     * if it ever is not. */
    for (size_t i = 0; i < ix->nrooms; i++) {
        for (uint32_t j = 0; j < ix->rooms[i]->nparts; j++) {
            if (ix_add(&ix->pool_ix, (void ***)&ix->pools, &ix->npools, &ix->cappools,
                       ix->rooms[i]->parts[j]->pool) != 0)
                return -ENOMEM;
        }
    }
    return 0;
}

static int wr_node(struct wr *w, const struct snap_ix *ix, const struct cp_node *node,
                   kvf_time_ns now)
{
    wr_u64(w, node->incarnation);
    wr_u64(w, node->serial);
    wr_u8(w, node->state);
    wr_u32(w, node->pmin);
    wr_u32(w, node->pmax);
    wr_u32(w, node->version);
    wr_u32(w, node->features);
    wr_u8(w, node->gone);
    wr_timer(w, &node->ttl, now);
    wr_u32(w, node->npools);
    for (uint32_t i = 0; i < node->npools; i++) {
        uint32_t idx;
        if (ix_lookup(&ix->pool_ix, node->pools[i], &idx) != 0)
            return -EINVAL;
        wr_u32(w, idx);
    }
    wr_u32(w, node->nfenced_by);
    for (uint32_t i = 0; i < node->nfenced_by; i++) {
        const struct cp_fence *f = node->fenced_by[i];
        wr_u64(w, f->fencer_serial);
        wr_u8(w, f->acked);
        wr_u32(w, f->attempt);
        wr_timer(w, &f->timer, now);
    }
    return 0;
}

static int wr_room(struct wr *w, const struct snap_ix *ix, const struct cp_room *room,
                   kvf_time_ns now)
{
    wr_u64(w, room->key.room_id);
    wr_u64(w, room->key.generation);
    wr_u64(w, room->token.lo);
    wr_u64(w, room->token.hi);
    wr_u8(w, room->state);
    wr_u8(w, room->reason);
    wr_u8(w, room->escalated);
    wr_u32(w, room->expected_sources);
    wr_u32(w, room->expected_sinks);
    wr_u32(w, room->pmin);
    wr_u32(w, room->pmax);
    wr_i64(w, time_diff(now, room->created_at));
    wr_i64(w, time_diff(now, room->state_since));
    wr_timer(w, &room->timer, now);
    wr_u32(w, room->nrnodes);
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        const struct cp_rnode *rn = room->rnodes[i];
        uint32_t idx;
        if (ix_lookup(&ix->node_ix, rn->node, &idx) != 0)
            return -EINVAL;
        wr_u32(w, idx);
        wr_u8(w, rn->drained);
        wr_u8(w, rn->notice_pending);
        wr_u32(w, rn->attempt);
        wr_timer(w, &rn->timer, now);
    }
    wr_u32(w, room->nparts);
    for (uint32_t i = 0; i < room->nparts; i++) {
        const struct cp_part *p = room->parts[i];
        uint32_t rn_idx = UINT32_MAX, pool_idx;
        for (uint32_t j = 0; j < room->nrnodes; j++) {
            if (room->rnodes[j] == p->rn)
                rn_idx = j;
        }
        if (rn_idx == UINT32_MAX || ix_lookup(&ix->pool_ix, p->pool, &pool_idx) != 0)
            return -EINVAL;
        wr_u64(w, p->lease_id);
        wr_u32(w, rn_idx);
        wr_u32(w, p->rank);
        wr_u8(w, p->role);
        wr_u8(w, p->lease_state);
        wr_u8(w, p->completed);
        wr_u32(w, pool_idx);
        wr_u32(w, p->nranges);
        for (uint32_t j = 0; j < p->nranges; j++) {
            wr_u32(w, p->ranges[j].first);
            wr_u32(w, p->ranges[j].count);
        }
    }
    return 0;
}

static int wr_links(struct wr *w, const struct snap_ix *ix)
{
    for (size_t i = 0; i < ix->nnodes; i++) {
        const struct cp_node *node = ix->nodes[i];
        wr_u32(w, node->nrnodes);
        for (const struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next)
            wr_u64(w, rn->room->key.room_id);
        uint32_t nreq = 0;
        for (const struct cp_fence *f = node->fence_reqs; f != NULL; f = f->req_next)
            nreq++;
        wr_u32(w, nreq);
        for (const struct cp_fence *f = node->fence_reqs; f != NULL; f = f->req_next) {
            uint32_t idx;
            if (ix_lookup(&ix->node_ix, f->fenced, &idx) != 0)
                return -EINVAL;
            wr_u32(w, idx);
        }
    }
    for (size_t i = 0; i < ix->npools; i++) {
        const struct cp_pool *pool = ix->pools[i];
        wr_u32(w, pool->nleases);
        for (const struct cp_part *p = pool->leases; p != NULL; p = p->pool_next)
            wr_u64(w, p->lease_id);
    }
    return 0;
}

int kvf_cps_snapshot(const struct kvf_cps *st, kvf_time_ns now,
                     int (*write_fn)(void *ctx, const void *buf, size_t len), void *ctx)
{
    if (st == NULL || write_fn == NULL)
        return -EINVAL;
    struct snap_ix ix;
    int rc = ix_build(st, &ix);
    struct wr *w = malloc(sizeof(*w));
    if (rc != 0 || w == NULL) {
        free(w);
        ix_fini(&ix);
        return -ENOMEM;
    }
    w->fn = write_fn;
    w->ctx = ctx;
    w->rc = 0;
    w->n = 0;

    wr_bytes(w, SNAP_MAGIC, SNAP_MAGIC_LEN);
    wr_u16(w, SNAP_VERSION);
    wr_u32(w, 0);
    wr_u64(w, st->next_lease_id);
    wr_u64(w, st->next_serial);
    wr_u64(w, st->timers.seq);
    wr_u64(w, st->fx_dropped);
    wr_stats(w, &st->stats);

    wr_u32(w, ix.npools);
    for (size_t i = 0; i < ix.npools; i++) {
        wr_u32(w, ix.pools[i]->pool_id);
        wr_u32(w, ix.pools[i]->page_size);
        wr_u32(w, ix.pools[i]->page_count);
        size_t klen = strlen(ix.pools[i]->key);
        wr_u16(w, klen);
        wr_bytes(w, ix.pools[i]->key, klen);
    }
    wr_u32(w, ix.nheads);
    for (size_t i = 0; i < ix.nheads && rc == 0; i++) {
        const struct cp_node *head = ix.heads[i];
        size_t idlen = strlen(head->id);
        wr_u16(w, idlen);
        wr_bytes(w, head->id, idlen);
        uint32_t ninc = 0;
        for (const struct cp_node *n = head; n != NULL; n = n->older)
            ninc++;
        wr_u32(w, ninc);
        for (const struct cp_node *n = head; n != NULL && rc == 0; n = n->older)
            rc = wr_node(w, &ix, n, now);
    }
    wr_u32(w, ix.nrooms);
    for (size_t i = 0; i < ix.nrooms && rc == 0; i++)
        rc = wr_room(w, &ix, ix.rooms[i], now);
    if (rc == 0)
        rc = wr_links(w, &ix);
    wr_bytes(w, SNAP_TRAILER, SNAP_MAGIC_LEN);
    wr_flush(w);
    if (rc == 0)
        rc = w->rc;
    free(w);
    ix_fini(&ix);
    return rc;
}

/* ---- reader ------------------------------------------------------------------ */

struct rd {
    const unsigned char *p;
    size_t len, off;
    const char *bad; /* what was wrong, first one */
    size_t bad_off;
};

static bool rd_fail(struct rd *r, const char *what)
{
    if (r->bad == NULL) {
        r->bad = what;
        r->bad_off = r->off;
    }
    return false;
}

static uint64_t rd_le(struct rd *r, size_t width)
{
    if (r->bad != NULL)
        return 0;
    if (r->len - r->off < width) {
        rd_fail(r, "truncated");
        r->off = r->len;
        return 0;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < width; i++)
        v |= (uint64_t)r->p[r->off + i] << (8 * i);
    r->off += width;
    return v;
}

static uint8_t rd_u8(struct rd *r)
{
    return (uint8_t)rd_le(r, 1);
}

static uint32_t rd_u32(struct rd *r)
{
    return (uint32_t)rd_le(r, 4);
}

static uint64_t rd_u64(struct rd *r)
{
    return rd_le(r, 8);
}

static int64_t rd_i64(struct rd *r)
{
    return (int64_t)rd_le(r, 8);
}

static bool rd_bool(struct rd *r, bool *v, const char *what)
{
    uint8_t b = rd_u8(r);
    if (b > 1)
        return rd_fail(r, what);
    *v = b != 0;
    return r->bad == NULL;
}

/* A list count, bounded by what its items need of the bytes that remain. */
static uint32_t rd_count(struct rd *r, size_t min_item, const char *what)
{
    uint32_t n = rd_u32(r);
    if (r->bad != NULL)
        return 0;
    if ((uint64_t)n * min_item > r->len - r->off) {
        rd_fail(r, what);
        return 0;
    }
    return n;
}

/* ---- restore ----------------------------------------------------------------- */

/* Everything restore allocated, so that a failure frees it all. */
struct rs {
    struct kvf_cps *st;
    struct rd r;
    kvf_time_ns now;
    uint64_t heap_seq;
    struct cp_pool **pools;
    uint32_t npools;
    uint32_t *pool_held; /* leases not RELEASED per pool */
    struct cp_node **nodes;
    uint32_t nnodes, capnodes;
    uint32_t *node_rn;   /* room-nodes per node */
    uint32_t *node_mark; /* room ordinal + 1 of the last room that named it */
    struct cp_room **rooms;
    uint32_t nrooms;
    struct kvf_map serials;
    bool nomem;
    uint16_t version; /* of the image */
};

static void rs_free_all(struct rs *s)
{
    for (uint32_t i = 0; s->rooms != NULL && i < s->nrooms; i++) {
        struct cp_room *room = s->rooms[i];
        if (room == NULL)
            continue;
        for (uint32_t j = 0; j < room->nparts; j++) {
            free(room->parts[j]->ranges);
            free(room->parts[j]);
        }
        for (uint32_t j = 0; j < room->nrnodes; j++)
            free(room->rnodes[j]);
        free(room->parts);
        free(room->rnodes);
        free(room);
    }
    for (uint32_t i = 0; i < s->nnodes; i++) {
        struct cp_node *node = s->nodes[i];
        for (uint32_t j = 0; j < node->nfenced_by; j++)
            free(node->fenced_by[j]);
        free(node->fenced_by);
        free(node->pools);
        free(node);
    }
    for (uint32_t i = 0; s->pools != NULL && i < s->npools; i++) {
        if (s->pools[i] != NULL)
            free(s->pools[i]->pages);
        free(s->pools[i]);
    }
    cp_map_fini(&s->st->rooms);
    cp_map_fini(&s->st->leases);
    cp_map_fini(&s->st->nodes);
    cp_heap_fini(&s->st->timers);
    free(s->st->fx);
    free(s->st);
    s->st = NULL;
}

static void rs_fini(struct rs *s)
{
    free(s->pools);
    free(s->pool_held);
    free(s->nodes);
    free(s->node_rn);
    free(s->node_mark);
    free(s->rooms);
    cp_map_fini(&s->serials);
}

static bool rs_nomem(struct rs *s)
{
    s->nomem = true;
    return false;
}

static bool rd_timer(struct rs *s, struct cp_timer *t)
{
    uint8_t armed = rd_u8(&s->r);
    if (armed > 1)
        return rd_fail(&s->r, "timer: armed is not 0 or 1");
    if (armed == 0)
        return s->r.bad == NULL;
    int64_t remaining = rd_i64(&s->r);
    uint64_t seq = rd_u64(&s->r);
    if (s->r.bad != NULL)
        return false;
    if (seq == 0 || seq > s->heap_seq)
        return rd_fail(&s->r, "timer: arming sequence out of range");
    if (cp_heap_restore(&s->st->timers, t, time_add(s->now, remaining), seq) != 0)
        return rs_nomem(s);
    return true;
}

static bool rd_stats(struct rd *r, struct kvf_cps_stats *x)
{
    memset(x, 0, sizeof(*x)); /* the derived gauges are counted on restore */
    for (size_t i = 0; i < 6; i++)
        x->rooms_by_state[i] = rd_u64(r);
    for (size_t i = 0; i < 4; i++)
        x->leases_by_state[i] = rd_u64(r);
    for (size_t i = 0; i < 4; i++)
        x->nodes_by_state[i] = rd_u64(r);
    x->notices_pending = rd_u64(r);
    x->notices_sent = rd_u64(r);
    x->notices_resent = rd_u64(r);
    x->reports_stale = rd_u64(r);
    x->reports_tokenless = rd_u64(r);
    x->reports_unknown = rd_u64(r);
    x->rooms_past_deadline = rd_u64(r);
    x->fences_requested = rd_u64(r);
    x->generation = rd_u64(r);
    return r->bad == NULL;
}

static bool rd_pools(struct rs *s)
{
    struct rd *r = &s->r;
    s->npools = rd_count(r, MIN_POOL, "pools: count exceeds the image");
    if (r->bad != NULL)
        return false;
    s->pools = calloc(s->npools + 1, sizeof(*s->pools));
    s->pool_held = calloc(s->npools + 1, sizeof(*s->pool_held));
    if (s->pools == NULL || s->pool_held == NULL)
        return rs_nomem(s);
    for (uint32_t i = 0; i < s->npools; i++) {
        struct cp_pool *pool = calloc(1, sizeof(*pool));
        if (pool == NULL)
            return rs_nomem(s);
        s->pools[i] = pool;
        pool->pool_id = rd_u32(r);
        pool->page_size = rd_u32(r);
        pool->page_count = rd_u32(r);
        if (r->bad != NULL)
            return false;
        if (pool->page_size == 0 || pool->page_count == 0)
            return rd_fail(r, "pool: zero page size or count");
        if (s->version >= 2) {
            size_t klen = (size_t)rd_le(r, 2);
            if (r->bad != NULL)
                return false;
            if (klen > KVF_CPS_POOL_KEY_MAX || klen > r->len - r->off)
                return rd_fail(r, "pool: key too long");
            memcpy(pool->key, r->p + r->off, klen);
            pool->key[klen] = '\0';
            if (memchr(pool->key, '\0', klen) != NULL)
                return rd_fail(r, "pool: NUL in key");
            r->off += klen;
        }
    }
    return true;
}

static bool rd_node(struct rs *s, struct cp_node *node)
{
    struct rd *r = &s->r;
    node->incarnation = rd_u64(r);
    node->serial = rd_u64(r);
    node->state = rd_u8(r);
    node->pmin = rd_u32(r);
    node->pmax = rd_u32(r);
    node->version = rd_u32(r);
    node->features = rd_u32(r);
    if (s->version >= 2 && !rd_bool(r, &node->gone, "node: gone is not 0 or 1"))
        return false;
    if (r->bad != NULL)
        return false;
    if (node->incarnation == 0)
        return rd_fail(r, "node: incarnation 0");
    if (node->state < KVF_CPS_NODE_ATTACHED || node->state > KVF_CPS_NODE_LOST)
        return rd_fail(r, "node: bad state");
    if (node->serial == 0 || node->serial >= s->st->next_serial)
        return rd_fail(r, "node: serial out of range");
    if (cp_map_get(&s->serials, node->serial) != NULL)
        return rd_fail(r, "node: serial repeated");
    if (cp_map_put(&s->serials, node->serial, node) != 0)
        return rs_nomem(s);
    if (!rd_timer(s, &node->ttl))
        return false;
    uint32_t npools = rd_count(r, 4, "node: pool count exceeds the image");
    if (r->bad != NULL)
        return false;
    node->pools = calloc(npools + 1, sizeof(*node->pools));
    if (node->pools == NULL)
        return rs_nomem(s);
    for (uint32_t i = 0; i < npools; i++) {
        uint32_t idx = rd_u32(r);
        if (r->bad != NULL)
            return false;
        if (idx >= s->npools)
            return rd_fail(r, "node: pool index out of range");
        node->pools[node->npools++] = s->pools[idx];
        s->pools[idx]->refs++;
    }
    uint32_t nf = rd_count(r, MIN_FENCE, "node: fence count exceeds the image");
    if (r->bad != NULL)
        return false;
    node->fenced_by = calloc(nf + 1, sizeof(*node->fenced_by));
    if (node->fenced_by == NULL)
        return rs_nomem(s);
    node->capfenced_by = nf + 1;
    for (uint32_t i = 0; i < nf; i++) {
        struct cp_fence *f = calloc(1, sizeof(*f));
        if (f == NULL)
            return rs_nomem(s);
        cp_timer_init(&f->timer, CP_TIMER_FENCE);
        node->fenced_by[node->nfenced_by++] = f;
        f->fenced = node;
        f->fencer_serial = rd_u64(r);
        if (!rd_bool(r, &f->acked, "fence: acked is not 0 or 1"))
            return false;
        f->attempt = rd_u32(r);
        if (!rd_timer(s, &f->timer))
            return false;
    }
    return true;
}

static bool rd_nodes(struct rs *s)
{
    struct rd *r = &s->r;
    uint32_t nchains = rd_count(r, MIN_CHAIN, "nodes: count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (cp_map_reserve(&s->st->nodes, nchains) != 0)
        return rs_nomem(s);
    for (uint32_t c = 0; c < nchains; c++) {
        char id[CP_NODE_ID_MAX + 1];
        size_t idlen = (size_t)rd_le(r, 2);
        if (r->bad != NULL)
            return false;
        if (idlen == 0 || idlen > CP_NODE_ID_MAX || idlen > r->len - r->off)
            return rd_fail(r, "node: bad id length");
        memcpy(id, r->p + r->off, idlen);
        id[idlen] = '\0';
        r->off += idlen;
        if (strlen(id) != idlen)
            return rd_fail(r, "node: NUL in id");
        if (cp_map_get_str(&s->st->nodes, id) != NULL)
            return rd_fail(r, "node: id repeated");
        uint32_t ninc = rd_count(r, MIN_NODE, "node: incarnation count exceeds the image");
        if (r->bad != NULL)
            return false;
        if (ninc == 0)
            return rd_fail(r, "node: no incarnation");
        struct cp_node *newer = NULL;
        for (uint32_t i = 0; i < ninc; i++) {
            if (s->nnodes == s->capnodes) {
                uint32_t cap = s->capnodes == 0 ? 16 : s->capnodes * 2;
                struct cp_node **v = realloc(s->nodes, cap * sizeof(*v));
                if (v == NULL)
                    return rs_nomem(s);
                s->nodes = v;
                s->capnodes = cap;
            }
            struct cp_node *node = calloc(1, sizeof(*node));
            if (node == NULL)
                return rs_nomem(s);
            cp_timer_init(&node->ttl, CP_TIMER_NODE_TTL);
            memcpy(node->id, id, idlen + 1);
            s->nodes[s->nnodes++] = node;
            if (!rd_node(s, node))
                return false;
            if (newer == NULL) {
                node->current = true;
                cp_map_put_str(&s->st->nodes, node->id, node);
            } else {
                if (node->incarnation >= newer->incarnation)
                    return rd_fail(r, "node: older incarnation is not smaller");
                if (node->state != KVF_CPS_NODE_LOST)
                    return rd_fail(r, "node: older incarnation is not LOST");
                newer->older = node;
            }
            newer = node;
        }
    }
    s->node_rn = calloc(s->nnodes + 1, sizeof(*s->node_rn));
    s->node_mark = calloc(s->nnodes + 1, sizeof(*s->node_mark));
    if (s->node_rn == NULL || s->node_mark == NULL)
        return rs_nomem(s);
    return true;
}

static bool lease_state_fits(int room_state, int lease_state)
{
    switch (room_state) {
    case KVF_CPS_ROOM_OPENING:
    case KVF_CPS_ROOM_ACTIVE:
        return lease_state == KVF_CPS_LEASE_ACTIVE;
    case KVF_CPS_ROOM_ABORTING:
        return lease_state == KVF_CPS_LEASE_RELEASING;
    case KVF_CPS_ROOM_ABORTED: /* RELEASING: waiting for a proof from its host */
        return lease_state == KVF_CPS_LEASE_RELEASED || lease_state == KVF_CPS_LEASE_RELEASING;
    default:
        return lease_state == KVF_CPS_LEASE_RELEASED;
    }
}

static bool rd_part(struct rs *s, struct cp_room *room, struct cp_part *p)
{
    struct rd *r = &s->r;
    p->room = room;
    p->lease_id = rd_u64(r);
    uint32_t rn_idx = rd_u32(r);
    p->rank = rd_u32(r);
    p->role = rd_u8(r);
    p->lease_state = rd_u8(r);
    if (!rd_bool(r, &p->completed, "participant: completed is not 0 or 1"))
        return false;
    uint32_t pool_idx = rd_u32(r);
    if (r->bad != NULL)
        return false;
    if (p->lease_id == 0 || p->lease_id >= s->st->next_lease_id)
        return rd_fail(r, "participant: lease id out of range");
    if (cp_map_get(&s->st->leases, p->lease_id) != NULL)
        return rd_fail(r, "participant: lease id repeated");
    if (rn_idx >= room->nrnodes)
        return rd_fail(r, "participant: room-node index out of range");
    if (p->role != KVF_CPS_ROLE_SOURCE && p->role != KVF_CPS_ROLE_SINK)
        return rd_fail(r, "participant: bad role");
    if (!lease_state_fits(room->state, p->lease_state))
        return rd_fail(r, "participant: lease state does not fit the room state");
    if (pool_idx >= s->npools)
        return rd_fail(r, "participant: pool index out of range");
    p->rn = room->rnodes[rn_idx];
    p->pool = s->pools[pool_idx];
    p->pool->refs++;
    if (p->lease_state != KVF_CPS_LEASE_RELEASED)
        s->pool_held[pool_idx]++;
    uint32_t n = rd_count(r, MIN_RANGE, "participant: range count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (n > 0) {
        p->ranges = malloc(n * sizeof(*p->ranges));
        if (p->ranges == NULL)
            return rs_nomem(s);
    }
    for (uint32_t i = 0; i < n; i++) {
        struct kvf_cps_page_range *g = &p->ranges[i];
        g->first = rd_u32(r);
        g->count = rd_u32(r);
        if (r->bad != NULL)
            return false;
        if (g->count == 0)
            return rd_fail(r, "participant: empty range");
        /* Leases not RELEASED hold their pages: they lie inside the pool. */
        if (p->lease_state != KVF_CPS_LEASE_RELEASED &&
            (uint64_t)g->first + g->count > p->pool->page_count)
            return rd_fail(r, "participant: range outside its pool");
        p->nranges++;
    }
    if (p->role == KVF_CPS_ROLE_SINK)
        room->nsinks++; /* the sources are counted by nparts - nsinks */
    if (!p->completed)
        p->rn->nopen++;
    cp_map_put(&s->st->leases, p->lease_id, p); /* reserved */
    return true;
}

static bool rd_room(struct rs *s, uint32_t ordinal, struct cp_room *room)
{
    struct rd *r = &s->r;
    room->key.room_id = rd_u64(r);
    room->key.generation = rd_u64(r);
    room->token.lo = rd_u64(r);
    room->token.hi = rd_u64(r);
    room->state = rd_u8(r);
    room->reason = rd_u8(r);
    if (!rd_bool(r, &room->escalated, "room: escalated is not 0 or 1"))
        return false;
    room->expected_sources = rd_u32(r);
    room->expected_sinks = rd_u32(r);
    room->pmin = rd_u32(r);
    room->pmax = rd_u32(r);
    room->created_at = time_sub(s->now, rd_i64(r));
    room->state_since = time_sub(s->now, rd_i64(r));
    if (r->bad != NULL)
        return false;
    if (room->key.room_id == 0 || room->key.room_id > KVF_ROOM_ID_MAX)
        return rd_fail(r, "room: id out of range");
    if (cp_map_get(&s->st->rooms, room->key.room_id) != NULL)
        return rd_fail(r, "room: id repeated");
    if (room->key.generation == 0 || room->key.generation > s->st->stats.generation)
        return rd_fail(r, "room: generation out of range");
    if (room->state < KVF_CPS_ROOM_OPENING || room->state > KVF_CPS_ROOM_ABORTED)
        return rd_fail(r, "room: bad state");
    if (room->reason > KVF_CPS_ABORT_CAPABILITY)
        return rd_fail(r, "room: bad abort reason");
    bool aborted = room->state == KVF_CPS_ROOM_ABORTING || room->state == KVF_CPS_ROOM_ABORTED;
    if (aborted == kvf_token_is_zero(room->token))
        return rd_fail(r, "room: token does not fit the state");
    if (room->expected_sources == 0 || room->expected_sinks == 0)
        return rd_fail(r, "room: zero expected participants");
    cp_map_put(&s->st->rooms, room->key.room_id, room); /* reserved */
    if (!rd_timer(s, &room->timer))
        return false;

    uint32_t nrn = rd_count(r, MIN_RNODE, "room: room-node count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (nrn == 0)
        return rd_fail(r, "room: no room-node");
    room->rnodes = calloc(nrn, sizeof(*room->rnodes));
    if (room->rnodes == NULL)
        return rs_nomem(s);
    room->caprnodes = nrn;
    for (uint32_t i = 0; i < nrn; i++) {
        struct cp_rnode *rn = calloc(1, sizeof(*rn));
        if (rn == NULL)
            return rs_nomem(s);
        cp_timer_init(&rn->timer, CP_TIMER_NOTICE);
        room->rnodes[room->nrnodes++] = rn;
        rn->room = room;
        uint32_t idx = rd_u32(r);
        if (!rd_bool(r, &rn->drained, "room-node: drained is not 0 or 1") ||
            !rd_bool(r, &rn->notice_pending, "room-node: notice_pending is not 0 or 1"))
            return false;
        uint32_t attempt = rd_u32(r);
        rn->attempt = attempt < UINT16_MAX ? (uint16_t)attempt : UINT16_MAX;
        if (r->bad != NULL)
            return false;
        if (idx >= s->nnodes)
            return rd_fail(r, "room-node: node index out of range");
        if (s->node_mark[idx] == ordinal + 1)
            return rd_fail(r, "room-node: node repeated in a room");
        s->node_mark[idx] = ordinal + 1;
        s->node_rn[idx]++;
        rn->node = s->nodes[idx];
        if (!rd_timer(s, &rn->timer))
            return false;
        /* Freeing a room-node cancels its timer only while a notice is
         * pending; an armed timer without one would outlive it. */
        if (cp_timer_armed(&rn->timer) && !rn->notice_pending)
            return rd_fail(r, "room-node: timer armed without a pending notice");
    }

    uint32_t np = rd_count(r, MIN_PART, "room: participant count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (np == 0)
        return rd_fail(r, "room: no participant");
    room->parts = calloc(np, sizeof(*room->parts));
    if (room->parts == NULL)
        return rs_nomem(s);
    room->capparts = np;
    if (cp_map_reserve(&s->st->leases, np) != 0)
        return rs_nomem(s);
    for (uint32_t i = 0; i < np; i++) {
        struct cp_part *p = calloc(1, sizeof(*p));
        if (p == NULL)
            return rs_nomem(s);
        room->parts[room->nparts++] = p;
        if (!rd_part(s, room, p))
            return false;
    }
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        bool any = false;
        for (uint32_t j = 0; j < room->nparts && !any; j++)
            any = room->parts[j]->rn == room->rnodes[i];
        if (!any)
            return rd_fail(r, "room: room-node without a participant");
    }
    if (cp_room_nsources(room) > room->expected_sources || room->nsinks > room->expected_sinks)
        return rd_fail(r, "room: more participants than expected");
    bool full =
        cp_room_nsources(room) == room->expected_sources && room->nsinks == room->expected_sinks;
    if ((room->state == KVF_CPS_ROOM_OPENING && full) ||
        (room->state == KVF_CPS_ROOM_ACTIVE && !full))
        return rd_fail(r, "room: participants do not fit the state");
    for (uint32_t i = 0; i < room->nparts; i++)
        room->nawaiting += cp_part_awaiting(room->parts[i]);
    if (room->nawaiting > 0 && cp_timer_armed(&room->timer))
        return rd_fail(r, "room: tombstone timer armed while a lease waits for a host proof");
    if (room->state == KVF_CPS_ROOM_COMPLETED && !cp_room_all_completed(room))
        return rd_fail(r, "room: COMPLETED with a participant not completed");
    return true;
}

static bool rd_rooms(struct rs *s)
{
    struct rd *r = &s->r;
    uint32_t n = rd_count(r, MIN_ROOM, "rooms: count exceeds the image");
    if (r->bad != NULL)
        return false;
    s->rooms = calloc(n + 1, sizeof(*s->rooms));
    if (s->rooms == NULL || cp_map_reserve(&s->st->rooms, n) != 0)
        return rs_nomem(s);
    s->nrooms = n;
    for (uint32_t i = 0; i < n; i++) {
        struct cp_room *room = calloc(1, sizeof(*room));
        if (room == NULL)
            return rs_nomem(s);
        cp_timer_init(&room->timer, CP_TIMER_ROOM);
        s->rooms[i] = room;
        if (!rd_room(s, i, room))
            return false;
    }
    return true;
}

static bool rnode_linked(const struct cp_rnode *rn)
{
    return rn->node_prev != NULL || rn->node->rnodes == rn;
}

static bool rd_node_links(struct rs *s, uint32_t idx)
{
    struct rd *r = &s->r;
    struct cp_node *node = s->nodes[idx];
    uint32_t nrn = rd_count(r, 8, "links: room count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (nrn != s->node_rn[idx])
        return rd_fail(r, "links: room count does not fit the rooms");
    struct cp_rnode *tail = NULL;
    for (uint32_t i = 0; i < nrn; i++) {
        uint64_t room_id = rd_u64(r);
        if (r->bad != NULL)
            return false;
        struct cp_room *room = cp_map_get(&s->st->rooms, room_id);
        struct cp_rnode *rn = room != NULL ? cp_room_rnode(room, node) : NULL;
        if (rn == NULL || rnode_linked(rn))
            return rd_fail(r, "links: room of a node unknown or repeated");
        rn->node_prev = tail;
        if (tail != NULL)
            tail->node_next = rn;
        else
            node->rnodes = rn;
        tail = rn;
        node->nrnodes++;
        if (!cp_room_terminal(room))
            node->room_count++;
    }
    uint32_t nreq = rd_count(r, 4, "links: fence request count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (nreq > 0 && node->state == KVF_CPS_NODE_LOST)
        return rd_fail(r, "links: a LOST node has fence requests");
    struct cp_fence *ftail = NULL;
    for (uint32_t i = 0; i < nreq; i++) {
        uint32_t fidx = rd_u32(r);
        if (r->bad != NULL)
            return false;
        if (fidx >= s->nnodes || fidx == idx)
            return rd_fail(r, "links: fenced node index out of range");
        struct cp_node *fenced = s->nodes[fidx];
        struct cp_fence *f = NULL;
        for (uint32_t j = 0; j < fenced->nfenced_by && f == NULL; j++) {
            if (fenced->fenced_by[j]->fencer_serial == node->serial)
                f = fenced->fenced_by[j];
        }
        if (f == NULL || f->acked || f->fencer != NULL)
            return rd_fail(r, "links: fence request unknown, acked or repeated");
        f->fencer = node;
        f->req_prev = ftail;
        if (ftail != NULL)
            ftail->req_next = f;
        else
            node->fence_reqs = f;
        ftail = f;
        fenced->fences_pending_as_fenced++;
    }
    return true;
}

static bool part_linked(const struct cp_part *p)
{
    return p->pool_prev != NULL || p->pool->leases == p;
}

static bool rd_pool_links(struct rs *s, uint32_t idx)
{
    struct rd *r = &s->r;
    struct cp_pool *pool = s->pools[idx];
    uint32_t n = rd_count(r, 8, "links: lease count exceeds the image");
    if (r->bad != NULL)
        return false;
    if (n != s->pool_held[idx])
        return rd_fail(r, "links: lease count does not fit the leases");
    struct cp_part *tail = NULL;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t lease_id = rd_u64(r);
        if (r->bad != NULL)
            return false;
        struct cp_part *p = cp_map_get(&s->st->leases, lease_id);
        if (p == NULL || p->pool != pool || p->lease_state == KVF_CPS_LEASE_RELEASED ||
            part_linked(p))
            return rd_fail(r, "links: lease of a pool unknown, released or repeated");
        p->pool_prev = tail;
        if (tail != NULL)
            tail->pool_next = p;
        else
            pool->leases = p;
        tail = p;
        pool->nleases++;
    }
    return true;
}

/* Marks the pages of every lease not RELEASED, as cp_pages_acquire() did. */
static bool build_page_index(struct rs *s)
{
    for (uint32_t i = 0; i < s->npools; i++) {
        struct cp_pool *pool = s->pools[i];
        for (struct cp_part *p = pool->leases; p != NULL; p = p->pool_next) {
            if (p->nranges > 0 && pool->pages == NULL) {
                pool->pages = calloc(pool->page_count, sizeof(*pool->pages));
                if (pool->pages == NULL)
                    return rs_nomem(s);
            }
            for (uint32_t j = 0; j < p->nranges; j++) {
                uint32_t end = p->ranges[j].first + p->ranges[j].count;
                for (uint32_t pg = p->ranges[j].first; pg < end; pg++) {
                    struct cp_page *e = &pool->pages[pg];
                    if (e->writer != NULL || (p->role == KVF_CPS_ROLE_SINK && e->readers > 0))
                        return rd_fail(&s->r, "pages: a page is written and held again");
                    if (p->role == KVF_CPS_ROLE_SINK)
                        e->writer = p;
                    else if (e->readers == UINT32_MAX)
                        return rd_fail(&s->r, "pages: reader count overflows");
                    else
                        e->readers++;
                }
            }
        }
    }
    return true;
}

/* The stats that count objects must count the objects. */
static bool check_stats(struct rs *s, const struct kvf_cps_stats *img)
{
    struct kvf_cps_stats c;
    memset(&c, 0, sizeof(c));
    for (uint32_t i = 0; i < s->nnodes; i++) {
        c.nodes_by_state[s->nodes[i]->state]++;
        c.notices_pending += s->nodes[i]->fences_pending_as_fenced;
    }
    for (uint32_t i = 0; i < s->nrooms; i++) {
        const struct cp_room *room = s->rooms[i];
        c.rooms_by_state[room->state]++;
        if (room->state == KVF_CPS_ROOM_ABORTING && room->escalated)
            c.rooms_past_deadline++;
        for (uint32_t j = 0; j < room->nparts; j++)
            c.leases_by_state[room->parts[j]->lease_state]++;
        for (uint32_t j = 0; j < room->nrnodes; j++)
            c.notices_pending += room->rnodes[j]->notice_pending;
    }
    if (memcmp(c.rooms_by_state, img->rooms_by_state, sizeof(c.rooms_by_state)) != 0 ||
        memcmp(c.leases_by_state, img->leases_by_state, sizeof(c.leases_by_state)) != 0 ||
        memcmp(c.nodes_by_state, img->nodes_by_state, sizeof(c.nodes_by_state)) != 0 ||
        c.notices_pending != img->notices_pending ||
        c.rooms_past_deadline != img->rooms_past_deadline)
        return rd_fail(&s->r, "stats: object counts do not fit the objects");
    for (uint32_t i = 0; i < s->nrooms; i++)
        s->st->stats.leases_awaiting_host_proof += s->rooms[i]->nawaiting;
    return true;
}

static bool rd_image(struct rs *s)
{
    struct rd *r = &s->r;
    struct kvf_cps *st = s->st;
    if (r->len < SNAP_MAGIC_LEN || memcmp(r->p, SNAP_MAGIC, SNAP_MAGIC_LEN) != 0)
        return rd_fail(r, "not a KVFCPS image");
    r->off = SNAP_MAGIC_LEN;
    uint64_t version = rd_le(r, 2);
    if (r->bad == NULL && (version == 0 || version > SNAP_VERSION))
        return rd_fail(r, "unsupported format version");
    s->version = (uint16_t)version;
    if (rd_u32(r) != 0 && r->bad == NULL)
        return rd_fail(r, "unknown flags");
    st->next_lease_id = rd_u64(r);
    st->next_serial = rd_u64(r);
    s->heap_seq = rd_u64(r);
    st->fx_dropped = rd_u64(r);
    struct kvf_cps_stats img;
    if (!rd_stats(r, &img))
        return false;
    if (st->next_lease_id == 0 || st->next_serial == 0)
        return rd_fail(r, "counters: zero");
    st->stats = img;
    st->timers.seq = s->heap_seq;
    if (!rd_pools(s) || !rd_nodes(s) || !rd_rooms(s))
        return false;
    for (uint32_t i = 0; i < s->nnodes; i++) {
        if (!rd_node_links(s, i))
            return false;
    }
    for (uint32_t i = 0; i < s->npools; i++) {
        if (!rd_pool_links(s, i))
            return false;
        if (s->pools[i]->refs == 0)
            return rd_fail(r, "pool: referenced by nothing");
    }
    if (r->len - r->off < SNAP_MAGIC_LEN ||
        memcmp(r->p + r->off, SNAP_TRAILER, SNAP_MAGIC_LEN) != 0)
        return rd_fail(r, "no trailer");
    r->off += SNAP_MAGIC_LEN;
    if (r->off != r->len)
        return rd_fail(r, "bytes after the trailer");
    return build_page_index(s) && check_stats(s, &img);
}

struct kvf_cps *kvf_cps_restore(const struct kvf_cps_opts *opts, const void *image, size_t len,
                                kvf_time_ns now, struct kvf_error *err)
{
    if (opts == NULL || !cp_opts_valid(opts)) {
        kvf_error_set(err, -EINVAL, "opts: missing or invalid");
        return NULL;
    }
    if (image == NULL && len > 0) {
        kvf_error_set(err, -EINVAL, "image: missing");
        return NULL;
    }
    struct rs s;
    memset(&s, 0, sizeof(s));
    s.st = kvf_cps_create(opts);
    if (s.st == NULL) {
        kvf_error_set(err, -ENOMEM, "out of memory");
        return NULL;
    }
    s.r.p = image;
    s.r.len = len;
    s.now = now;
    cp_map_init(&s.serials, false);
    bool ok = rd_image(&s);
    if (!ok) {
        if (s.nomem && s.r.bad == NULL)
            kvf_error_set(err, -ENOMEM, "out of memory");
        else
            kvf_error_set(err, -EBADMSG, "snapshot: %s at byte %zu",
                          s.r.bad != NULL ? s.r.bad : "malformed", s.r.bad_off);
        rs_free_all(&s);
    }
    struct kvf_cps *st = s.st;
    rs_fini(&s);
    return st;
}
