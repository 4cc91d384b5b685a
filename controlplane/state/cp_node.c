/*
 * cp_node.c: nodes, their incarnations, their pools, and fences.
 *
 * A node id maps to its current incarnation. A node is ATTACHED while its
 * session is up, SUSPECT once the session ended (the ttl runs; nothing is
 * aborted or released: a lost heartbeat is not a dead RDMA path, R12) and LOST
 * when the ttl passed or a new incarnation attached. Losing a node aborts its
 * non-terminal rooms and asks every other live node of its rooms to fence it.
 *
 * Fences are per node pair, not per room, because queue pairs and sockets are
 * per peer: one record per (fencer, fenced incarnation), owned by the fenced
 * node and naming the fencer by serial number. A request is re-sent with the
 * notice backoff until the fencer reports PeerFenced or is itself LOST, and is
 * re-sent at once when the fencer re-attaches.
 *
 * An older incarnation stays reachable from the current one (`older`) while a
 * room or a pending fence request refers to it, so that late reports about it
 * are recognised; then it is freed. A LOST current incarnation stays in the
 * map so that it cannot attach again under the same incarnation.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

static bool key_set(const char *key)
{
    return key != NULL && key[0] != '\0';
}

bool cp_node_id_valid(const char *id)
{
    return id != NULL && id[0] != '\0' && strnlen(id, CP_NODE_ID_MAX + 1) <= CP_NODE_ID_MAX;
}

struct cp_node *cp_node_current(const struct kvf_cps *st, const char *id)
{
    return cp_map_get_str(&st->nodes, id);
}

static struct cp_node *node_incarnation(const struct kvf_cps *st, const char *id, uint64_t inc)
{
    for (struct cp_node *n = cp_node_current(st, id); n != NULL; n = n->older) {
        if (n->incarnation == inc)
            return n;
    }
    return NULL;
}

int cp_node_for_report(struct kvf_cps *st, const char *id, uint64_t incarnation,
                       struct cp_node **node_p, struct kvf_error *err)
{
    if (!cp_node_id_valid(id))
        return kvf_error_set(err, -EINVAL, "node_id: must be 1..%d bytes", CP_NODE_ID_MAX);
    struct cp_node *node = cp_node_current(st, id);
    if (node == NULL || incarnation > node->incarnation) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -ENOENT, "node %s incarnation %" PRIu64 " is not attached", id,
                             incarnation);
    }
    if (incarnation < node->incarnation) {
        st->stats.reports_stale++;
        return kvf_error_set(err, -ESTALE,
                             "node %s: incarnation %" PRIu64 " was replaced by %" PRIu64, id,
                             incarnation, node->incarnation);
    }
    if (node->state == KVF_CPS_NODE_LOST) {
        st->stats.reports_stale++;
        return kvf_error_set(err, -ESTALE, "node %s incarnation %" PRIu64 " is LOST", id,
                             incarnation);
    }
    *node_p = node;
    return 0;
}

struct cp_pool *cp_node_pool(const struct cp_node *node, uint32_t pool_id)
{
    for (uint32_t i = 0; i < node->npools; i++) {
        if (node->pools[i]->pool_id == pool_id)
            return node->pools[i];
    }
    return NULL;
}

void cp_node_set_state(struct kvf_cps *st, struct cp_node *node, enum kvf_cps_node_state s,
                       kvf_time_ns now)
{
    int old = node->state;
    if (old != 0)
        st->stats.nodes_by_state[old]--;
    st->stats.nodes_by_state[s]++;
    node->state = (uint8_t)s;
    node->state_since = now;
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_NODE_STATE);
    cp_fx_set_node(fx, node);
    fx->old_state = old;
    fx->new_state = s;
}

void cp_node_link_rnode(struct cp_node *node, struct cp_rnode *rn)
{
    rn->node_prev = NULL;
    rn->node_next = node->rnodes;
    if (node->rnodes != NULL)
        node->rnodes->node_prev = rn;
    node->rnodes = rn;
    node->nrnodes++;
}

void cp_node_unlink_rnode(struct cp_node *node, struct cp_rnode *rn)
{
    if (rn->node_prev != NULL)
        rn->node_prev->node_next = rn->node_next;
    else
        node->rnodes = rn->node_next;
    if (rn->node_next != NULL)
        rn->node_next->node_prev = rn->node_prev;
    rn->node_prev = NULL;
    rn->node_next = NULL;
    node->nrnodes--;
}

/* ---- fences -------------------------------------------------------------- */

static struct cp_fence *fence_find(const struct cp_node *fenced, uint64_t fencer_serial)
{
    for (uint32_t i = 0; i < fenced->nfenced_by; i++) {
        if (fenced->fenced_by[i]->fencer_serial == fencer_serial)
            return fenced->fenced_by[i];
    }
    return NULL;
}

bool cp_node_fenced_by(const struct cp_node *fenced, const struct cp_node *fencer)
{
    const struct cp_fence *f = fence_find(fenced, fencer->serial);
    return f != NULL && f->acked;
}

static struct cp_fence *fence_new(struct cp_node *fenced, struct cp_node *fencer)
{
    if (fenced->nfenced_by == fenced->capfenced_by) {
        uint32_t cap = fenced->capfenced_by == 0 ? 4 : fenced->capfenced_by * 2;
        struct cp_fence **v = realloc(fenced->fenced_by, cap * sizeof(*v));
        if (v == NULL)
            return NULL;
        fenced->fenced_by = v;
        fenced->capfenced_by = cap;
    }
    struct cp_fence *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    f->fenced = fenced;
    f->fencer_serial = fencer->serial;
    cp_timer_init(&f->timer, CP_TIMER_FENCE);
    fenced->fenced_by[fenced->nfenced_by++] = f;
    return f;
}

static void fence_emit(struct kvf_cps *st, struct cp_fence *f)
{
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_FENCE_PEER);
    cp_fx_set_node(fx, f->fencer);
    memcpy(fx->peer_node, f->fenced->id, sizeof(fx->peer_node));
    fx->peer_incarnation = f->fenced->incarnation;
    fx->attempt = f->attempt;
    if (f->attempt == 0)
        st->stats.notices_sent++;
    else
        st->stats.notices_resent++;
}

/* The request is no longer pending: acknowledged, or its fencer is gone. */
static void fence_settle(struct kvf_cps *st, struct cp_fence *f, bool acked)
{
    struct cp_node *fencer = f->fencer;
    if (fencer != NULL) {
        if (f->req_prev != NULL)
            f->req_prev->req_next = f->req_next;
        else
            fencer->fence_reqs = f->req_next;
        if (f->req_next != NULL)
            f->req_next->req_prev = f->req_prev;
        f->req_prev = NULL;
        f->req_next = NULL;
        f->fencer = NULL;
        f->fenced->fences_pending_as_fenced--;
        st->stats.notices_pending--;
    }
    cp_heap_cancel(&st->timers, &f->timer);
    if (acked)
        f->acked = true;
}

void cp_fence_request(struct kvf_cps *st, struct cp_node *fencer, struct cp_node *fenced,
                      kvf_time_ns now)
{
    if (fencer == fenced || fencer->state == KVF_CPS_NODE_LOST)
        return;
    if (fence_find(fenced, fencer->serial) != NULL)
        return; /* once per (fencer, fenced incarnation) */
    struct cp_fence *f = fence_new(fenced, fencer);
    if (f == NULL) {
        st->fx_dropped++; /* out of memory: the drain deadline asks again */
        return;
    }
    f->fencer = fencer;
    f->req_next = fencer->fence_reqs;
    if (fencer->fence_reqs != NULL)
        fencer->fence_reqs->req_prev = f;
    fencer->fence_reqs = f;
    fenced->fences_pending_as_fenced++;
    st->stats.fences_requested++;
    st->stats.notices_pending++;
    fence_emit(st, f);
    cp_heap_arm(&st->timers, &f->timer, now + cp_backoff(st, 0));
}

void cp_fence_fire(struct kvf_cps *st, struct cp_fence *f, kvf_time_ns now)
{
    if (f->fencer == NULL || f->acked)
        return;
    f->attempt++;
    fence_emit(st, f);
    cp_heap_arm(&st->timers, &f->timer, now + cp_backoff(st, f->attempt));
}

/* ---- lifecycle ------------------------------------------------------------ */

void cp_node_free(struct kvf_cps *st, struct cp_node *node)
{
    for (uint32_t i = 0; i < node->nfenced_by; i++) {
        fence_settle(st, node->fenced_by[i], false);
        free(node->fenced_by[i]);
    }
    free(node->fenced_by);
    for (uint32_t i = 0; i < node->npools; i++)
        cp_pool_free(node->pools[i]);
    free(node->pools);
    cp_heap_cancel(&st->timers, &node->ttl);
    st->stats.nodes_by_state[node->state]--;
    free(node);
}

void cp_node_maybe_free(struct kvf_cps *st, struct cp_node *node)
{
    if (node->current || node->state != KVF_CPS_NODE_LOST || node->nrnodes > 0 ||
        node->fences_pending_as_fenced > 0)
        return;
    struct cp_node *n = cp_node_current(st, node->id);
    while (n != NULL && n->older != node)
        n = n->older;
    if (n != NULL)
        n->older = node->older;
    cp_node_free(st, node);
}

void cp_node_lose(struct kvf_cps *st, struct cp_node *node, kvf_time_ns now)
{
    if (node->state == KVF_CPS_NODE_LOST)
        return;
    cp_heap_cancel(&st->timers, &node->ttl);
    cp_node_set_state(st, node, KVF_CPS_NODE_LOST, now);
    /* A LOST node gets no more notices and carries out no fences. */
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next)
        cp_notice_cancel(st, rn);
    while (node->fence_reqs != NULL) {
        struct cp_fence *f = node->fence_reqs;
        struct cp_node *fenced = f->fenced;
        fence_settle(st, f, false);
        cp_node_maybe_free(st, fenced);
    }
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next) {
        if (rn->room->state == KVF_CPS_ROOM_OPENING || rn->room->state == KVF_CPS_ROOM_ACTIVE)
            cp_room_abort(st, rn->room, KVF_CPS_ABORT_NODE_LOST, now);
    }
    /* Rooms whose leases are not released yet: their live nodes fence it. */
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next) {
        struct cp_room *room = rn->room;
        if (room->state != KVF_CPS_ROOM_ABORTING)
            continue;
        for (uint32_t i = 0; i < room->nrnodes; i++) {
            struct cp_node *peer = room->rnodes[i]->node;
            if (peer != node)
                cp_fence_request(st, peer, node, now);
        }
    }
    /* Its loss may complete a barrier: a LOST peer counts as quiescent-making. */
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next)
        cp_room_try_finish(st, rn->room, now);
}

void cp_node_ttl_fire(struct kvf_cps *st, struct cp_node *node, kvf_time_ns now)
{
    if (node->state == KVF_CPS_NODE_SUSPECT)
        cp_node_lose(st, node, now);
}

/* ---- attach, detach, pools ------------------------------------------------ */

int cp_pool_validate(const struct kvf_cps_pool *p, const char *field, size_t i,
                     struct kvf_error *err)
{
    if (p->page_size == 0)
        return kvf_error_set(err, -EINVAL, "%s[%zu].page_size: must be > 0", field, i);
    if (p->page_count == 0)
        return kvf_error_set(err, -EINVAL, "%s[%zu].page_count: must be > 0", field, i);
    return 0;
}

static int validate_hello(const struct kvf_cps *st, const struct kvf_cps_node_hello *h,
                          struct kvf_error *err)
{
    if (h == NULL)
        return kvf_error_set(err, -EINVAL, "hello: missing");
    if (!cp_node_id_valid(h->node_id))
        return kvf_error_set(err, -EINVAL, "node_id: must be 1..%d bytes", CP_NODE_ID_MAX);
    if (h->incarnation == 0)
        return kvf_error_set(err, -EINVAL, "incarnation: must be > 0");
    if (h->protocol_min == 0 || h->protocol_min > h->protocol_max)
        return kvf_error_set(err, -EINVAL, "protocol: bad range %" PRIu32 "..%" PRIu32,
                             h->protocol_min, h->protocol_max);
    if (h->pool_count > st->opts.max_pools_per_node)
        return kvf_error_set(err, -E2BIG, "pools: %zu pools, limit %" PRIu32, h->pool_count,
                             st->opts.max_pools_per_node);
    if (h->pool_count > 0 && h->pools == NULL)
        return kvf_error_set(err, -EINVAL, "pools: missing");
    for (size_t i = 0; i < h->pool_count; i++) {
        int rc = cp_pool_validate(&h->pools[i], "pools", i, err);
        if (rc != 0)
            return rc;
        for (size_t j = 0; j < i; j++) {
            if (h->pools[j].pool_id == h->pools[i].pool_id)
                return kvf_error_set(err, -EINVAL, "pools[%zu].pool_id: %" PRIu32 " repeated", i,
                                     h->pools[i].pool_id);
        }
    }
    for (size_t i = 0; i < h->pool_count; i++) {
        if (h->pools[i].key != NULL &&
            strnlen(h->pools[i].key, KVF_CPS_POOL_KEY_MAX + 1) > KVF_CPS_POOL_KEY_MAX)
            return kvf_error_set(err, -EINVAL, "pools[%zu].key: longer than %d bytes", i,
                                 KVF_CPS_POOL_KEY_MAX);
        for (size_t j = 0; j < i && key_set(h->pools[i].key); j++) {
            if (key_set(h->pools[j].key) && strcmp(h->pools[j].key, h->pools[i].key) == 0)
                return kvf_error_set(err, -EINVAL, "pools[%zu].key: '%s' repeated", i,
                                     h->pools[i].key);
        }
    }
    if (h->witnessed_gone >= h->incarnation)
        return kvf_error_set(err, -EINVAL,
                             "witnessed_gone: %" PRIu64 " is not below incarnation %" PRIu64,
                             h->witnessed_gone, h->incarnation);
    uint32_t lo = h->protocol_min > st->opts.protocol_min ? h->protocol_min : st->opts.protocol_min;
    uint32_t hi = h->protocol_max < st->opts.protocol_max ? h->protocol_max : st->opts.protocol_max;
    if (lo > hi)
        return kvf_error_set(err, -ENOTSUP,
                             "protocol: node %s speaks %" PRIu32 "..%" PRIu32
                             ", control plane %" PRIu32 "..%" PRIu32,
                             h->node_id, h->protocol_min, h->protocol_max, st->opts.protocol_min,
                             st->opts.protocol_max);
    return 0;
}

static void set_caps(const struct kvf_cps *st, struct cp_node *n,
                     const struct kvf_cps_node_hello *h)
{
    n->pmin = h->protocol_min > st->opts.protocol_min ? h->protocol_min : st->opts.protocol_min;
    n->pmax = h->protocol_max < st->opts.protocol_max ? h->protocol_max : st->opts.protocol_max;
    n->version = n->pmax;
    n->features = h->features;
}

/* The pool with memory `key` in which an incarnation of the chain from
 * `older` down still holds leases, or NULL. */
static struct cp_pool *held_pool(const struct cp_node *older, const char *key)
{
    if (!key_set(key))
        return NULL;
    for (const struct cp_node *n = older; n != NULL; n = n->older) {
        for (uint32_t i = 0; i < n->npools; i++) {
            struct cp_pool *p = n->pools[i];
            if (p->nleases > 0 && strcmp(p->key, key) == 0)
                return p;
        }
    }
    return NULL;
}

int cp_pool_check_key(const struct cp_node *older, const struct kvf_cps_pool *p, const char *field,
                      size_t i, struct kvf_error *err)
{
    if (p->key != NULL && strnlen(p->key, KVF_CPS_POOL_KEY_MAX + 1) > KVF_CPS_POOL_KEY_MAX)
        return kvf_error_set(err, -EINVAL, "%s[%zu].key: longer than %d bytes", field, i,
                             KVF_CPS_POOL_KEY_MAX);
    const struct cp_pool *held = held_pool(older, p->key);
    if (held != NULL && (held->page_size != p->page_size || held->page_count != p->page_count))
        return kvf_error_set(err, -EBUSY,
                             "%s[%zu]: memory '%s' still has %" PRIu32 " leases of an older "
                             "incarnation with %" PRIu32 " pages of %" PRIu32
                             " bytes; its size cannot change until they are released",
                             field, i, p->key, held->nleases, held->page_count, held->page_size);
    return 0;
}

int cp_pool_check_unique(const struct cp_node *node, const struct kvf_cps_pool *p,
                         const char *field, size_t i, struct kvf_error *err)
{
    if (!key_set(p->key))
        return 0;
    for (uint32_t k = 0; k < node->npools; k++) {
        const struct cp_pool *q = node->pools[k];
        if (q->pool_id != p->pool_id && strcmp(q->key, p->key) == 0)
            return kvf_error_set(err, -EEXIST,
                                 "%s[%zu].key: memory '%s' is already pool %" PRIu32 " of node %s",
                                 field, i, p->key, q->pool_id, node->id);
    }
    return 0;
}

bool cp_pool_key_fits(const struct cp_pool *pool, const struct kvf_cps_pool *p)
{
    return pool->nleases == 0 || strcmp(pool->key, key_set(p->key) ? p->key : "") == 0;
}

void cp_pool_set_key(struct cp_pool *pool, const struct kvf_cps_pool *p)
{
    snprintf(pool->key, sizeof(pool->key), "%s", key_set(p->key) ? p->key : "");
}

struct cp_pool *cp_pool_new(const struct cp_node *older, const struct kvf_cps_pool *p)
{
    /* The same memory as a pool whose leases an older incarnation holds:
     * those pages stay out of every new lease until they are released. */
    struct cp_pool *pool = held_pool(older, p->key);
    if (pool != NULL) {
        cp_pool_ref(pool);
        pool->pool_id = p->pool_id; /* pool ids are per incarnation */
        return pool;
    }
    pool = calloc(1, sizeof(*pool));
    if (pool != NULL) {
        pool->pool_id = p->pool_id;
        pool->page_size = p->page_size;
        pool->page_count = p->page_count;
        pool->refs = 1;
        cp_pool_set_key(pool, p);
    }
    return pool;
}

static struct cp_node *node_new(struct kvf_cps *st, const struct kvf_cps_node_hello *h,
                                const struct cp_node *older)
{
    struct cp_node *n = calloc(1, sizeof(*n));
    if (n == NULL)
        return NULL;
    n->pools = calloc(h->pool_count > 0 ? h->pool_count : 1, sizeof(*n->pools));
    if (n->pools == NULL)
        goto err_free_node;
    for (size_t i = 0; i < h->pool_count; i++) {
        n->pools[i] = cp_pool_new(older, &h->pools[i]);
        if (n->pools[i] == NULL)
            goto err_free_pools;
        n->npools++;
    }
    memcpy(n->id, h->node_id, strlen(h->node_id) + 1);
    n->incarnation = h->incarnation;
    n->serial = st->next_serial++;
    set_caps(st, n, h);
    cp_timer_init(&n->ttl, CP_TIMER_NODE_TTL);
    return n;

err_free_pools:
    for (uint32_t i = 0; i < n->npools; i++)
        cp_pool_free(n->pools[i]);
    free(n->pools);
err_free_node:
    free(n);
    return NULL;
}

/* Same incarnation again: merge the hello's pools (add or same-size replace),
 * refresh capabilities, re-send everything pending at once. */
static int reattach(struct kvf_cps *st, struct cp_node *node, const struct kvf_cps_node_hello *h,
                    kvf_time_ns now, struct kvf_error *err)
{
    size_t added = 0;
    for (size_t i = 0; i < h->pool_count; i++) {
        const struct cp_pool *old = cp_node_pool(node, h->pools[i].pool_id);
        int rc = cp_pool_check_key(old == NULL ? node->older : NULL, &h->pools[i], "pools", i, err);
        if (rc == 0)
            rc = cp_pool_check_unique(node, &h->pools[i], "pools", i, err);
        if (rc != 0)
            return rc;
        if (old != NULL && !cp_pool_key_fits(old, &h->pools[i]))
            return kvf_error_set(err, -EBUSY,
                                 "pools[%zu]: pool %" PRIu32 " has leases in memory '%s'; it "
                                 "cannot name other memory",
                                 i, old->pool_id, old->key);
        if (old == NULL) {
            added++;
        } else if (old->nleases > 0 && (old->page_size != h->pools[i].page_size ||
                                        old->page_count != h->pools[i].page_count)) {
            return kvf_error_set(err, -EBUSY,
                                 "pools[%zu]: pool %" PRIu32 " has leases; its size cannot change",
                                 i, old->pool_id);
        }
    }
    if (node->npools + added > st->opts.max_pools_per_node)
        return kvf_error_set(err, -E2BIG, "pools: node %s would have %zu pools, limit %" PRIu32,
                             node->id, node->npools + added, st->opts.max_pools_per_node);
    size_t pending = 0;
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next)
        pending += rn->notice_pending;
    for (struct cp_fence *f = node->fence_reqs; f != NULL; f = f->req_next)
        pending++;
    if (cp_fx_reserve(st, pending + 1) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    struct cp_pool **pools = realloc(node->pools, (node->npools + added + 1) * sizeof(*pools));
    if (pools == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    node->pools = pools;
    /* New pools go past npools; they count only once everything is in. */
    size_t nfresh = 0;
    for (size_t i = 0; i < h->pool_count; i++) {
        if (cp_node_pool(node, h->pools[i].pool_id) != NULL)
            continue;
        struct cp_pool *p = cp_pool_new(node->older, &h->pools[i]);
        if (p == NULL) {
            while (nfresh > 0)
                cp_pool_free(node->pools[node->npools + --nfresh]);
            return kvf_error_set(err, -ENOMEM, "out of memory");
        }
        node->pools[node->npools + nfresh++] = p;
    }
    /* Commit. */
    for (size_t i = 0; i < h->pool_count; i++) {
        struct cp_pool *p = cp_node_pool(node, h->pools[i].pool_id);
        if (p != NULL && p->nleases == 0 && p->page_count != h->pools[i].page_count) {
            free(p->pages);
            p->pages = NULL;
        }
        if (p != NULL) {
            p->page_size = h->pools[i].page_size;
            p->page_count = h->pools[i].page_count;
            cp_pool_set_key(p, &h->pools[i]);
        }
    }
    node->npools += (uint32_t)nfresh;
    set_caps(st, node, h);
    cp_heap_cancel(&st->timers, &node->ttl);
    if (node->state != KVF_CPS_NODE_ATTACHED)
        cp_node_set_state(st, node, KVF_CPS_NODE_ATTACHED, now);
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next) {
        if (rn->notice_pending)
            cp_notice_resend_now(st, rn, now);
        cp_room_update_reattach(st, rn);
    }
    for (struct cp_fence *f = node->fence_reqs; f != NULL; f = f->req_next)
        cp_fence_fire(st, f, now);
    return 0;
}

/*
 * A pool is the engines' memory, not the node process's: it outlives a node
 * restart. Leases that an older incarnation still holds (RELEASING until the
 * old incarnation is fenced) keep their pages out of every new lease, so the
 * new incarnation adopts the old pool object, page index and all. A pool with
 * such leases cannot come back with another size.
 */
static int check_adoptable_pools(const struct cp_node *old, const struct kvf_cps_node_hello *h,
                                 struct kvf_error *err)
{
    for (size_t i = 0; i < h->pool_count; i++) {
        if (key_set(h->pools[i].key)) {
            int rc = cp_pool_check_key(old, &h->pools[i], "pools", i, err);
            if (rc != 0)
                return rc;
            continue;
        }
        const struct cp_pool *p = cp_node_pool(old, h->pools[i].pool_id);
        if (p != NULL && p->nleases > 0 &&
            (p->page_size != h->pools[i].page_size || p->page_count != h->pools[i].page_count))
            return kvf_error_set(err, -EBUSY,
                                 "pools[%zu]: pool %" PRIu32 " of node %s still has leases of "
                                 "incarnation %" PRIu64 "; its size cannot change until they are "
                                 "released",
                                 i, p->pool_id, old->id, old->incarnation);
    }
    return 0;
}

/* A pool without a key is known by its id only (an older node): the pool of
 * the same id that the old incarnation's leases hold. Keyed pools were
 * matched by key in node_new. */
static void adopt_pools(struct cp_node *node, struct cp_node *old)
{
    for (uint32_t i = 0; i < node->npools; i++) {
        if (node->pools[i]->key[0] != '\0')
            continue;
        for (uint32_t j = 0; j < old->npools; j++) {
            struct cp_pool *p = old->pools[j];
            if (p->pool_id != node->pools[i]->pool_id || p->nleases == 0)
                continue;
            cp_pool_free(node->pools[i]);
            cp_pool_ref(p);
            node->pools[i] = p;
            break;
        }
    }
}

int kvf_cps_node_attach(struct kvf_cps *st, const struct kvf_cps_node_hello *hello, kvf_time_ns now,
                        uint32_t *version_p, struct kvf_error *err)
{
    int rc = validate_hello(st, hello, err);
    if (rc != 0)
        return rc;
    struct cp_node *old = cp_node_current(st, hello->node_id);
    if (old != NULL && hello->incarnation < old->incarnation)
        return kvf_error_set(err, -ESTALE,
                             "incarnation: node %s is at incarnation %" PRIu64 ", not %" PRIu64,
                             old->id, old->incarnation, hello->incarnation);
    if (old != NULL && hello->incarnation == old->incarnation) {
        if (old->state == KVF_CPS_NODE_LOST)
            return kvf_error_set(err, -ESTALE,
                                 "incarnation: node %s incarnation %" PRIu64
                                 " is LOST; restart with a new incarnation",
                                 old->id, old->incarnation);
        rc = reattach(st, old, hello, now, err);
        if (rc == 0 && hello->witnessed_gone != 0)
            cp_node_mark_gone(st, old, hello->witnessed_gone, now);
        if (rc == 0 && version_p != NULL)
            *version_p = old->version;
        return rc;
    }
    if (old != NULL) {
        rc = check_adoptable_pools(old, hello, err);
        if (rc != 0)
            return rc;
    }
    if (cp_map_reserve(&st->nodes, 1) != 0 || cp_fx_reserve(st, 2) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    struct cp_node *node = node_new(st, hello, old);
    if (node == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    if (old != NULL)
        adopt_pools(node, old);
    node->current = true;
    cp_map_put_str(&st->nodes, node->id, node);
    cp_node_set_state(st, node, KVF_CPS_NODE_ATTACHED, now);
    if (old != NULL) {
        old->current = false;
        node->older = old;
        cp_node_lose(st, old, now);
        /* Already LOST before: being replaced makes it dead, which may
         * complete barriers that waited for it. */
        for (struct cp_rnode *rn = old->rnodes; rn != NULL; rn = rn->node_next)
            cp_room_try_finish(st, rn->room, now);
        if (hello->witnessed_gone != 0)
            cp_node_mark_gone(st, node, hello->witnessed_gone, now);
        cp_node_maybe_free(st, old);
    }
    if (version_p != NULL)
        *version_p = node->version;
    return 0;
}

/* ---- witnesses ------------------------------------------------------------ */

void cp_node_mark_gone(struct kvf_cps *st, struct cp_node *node, uint64_t gone_inc, kvf_time_ns now)
{
    for (struct cp_node *n = node->older; n != NULL; n = n->older) {
        if (n->incarnation > gone_inc || n->gone)
            continue;
        n->gone = true;
        size_t need = 0;
        for (struct cp_rnode *rn = n->rnodes; rn != NULL; rn = rn->node_next)
            need += (size_t)rn->room->nparts + 2;
        (void)cp_fx_reserve(st, need); /* a failure is counted by cp_fx_push */
        for (struct cp_rnode *rn = n->rnodes; rn != NULL; rn = rn->node_next)
            cp_rnode_host_proof(st, rn, now);
    }
}

int kvf_cps_node_witness(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                         uint64_t gone_incarnation, kvf_time_ns now, struct kvf_error *err)
{
    struct cp_node *node;
    int rc = cp_node_for_report(st, node_id, incarnation, &node, err);
    if (rc != 0)
        return rc;
    if (gone_incarnation == 0 || gone_incarnation >= incarnation)
        return kvf_error_set(
            err, -EINVAL, "gone_incarnation: %" PRIu64 " is not an older incarnation than %" PRIu64,
            gone_incarnation, incarnation);
    cp_node_mark_gone(st, node, gone_incarnation, now);
    return 0;
}

int cp_node_for_call(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                     struct cp_node **node_p, struct kvf_error *err)
{
    if (!cp_node_id_valid(node_id))
        return kvf_error_set(err, -EINVAL, "node_id: must be 1..%d bytes", CP_NODE_ID_MAX);
    struct cp_node *node = cp_node_current(st, node_id);
    if (node == NULL)
        return kvf_error_set(err, -ENOENT, "node %s: unknown", node_id);
    if (node->incarnation != incarnation || node->state == KVF_CPS_NODE_LOST)
        return kvf_error_set(
            err, -ESTALE,
            "node %s: incarnation %" PRIu64 " is not current (current %" PRIu64 ", %s)", node_id,
            incarnation, node->incarnation, kvf_cps_node_state_name(node->state));
    *node_p = node;
    return 0;
}

int kvf_cps_node_detach(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                        kvf_time_ns now, struct kvf_error *err)
{
    struct cp_node *node = NULL;
    int rc = cp_node_for_call(st, node_id, incarnation, &node, err);
    if (rc != 0)
        return rc;
    if (node->state == KVF_CPS_NODE_SUSPECT)
        return 0;
    if (cp_heap_reserve(&st->timers, 1) != 0 || cp_fx_reserve(st, 1) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    cp_node_set_state(st, node, KVF_CPS_NODE_SUSPECT, now);
    cp_heap_arm(&st->timers, &node->ttl, now + st->opts.node_ttl);
    return 0;
}

int kvf_cps_node_set_pool(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                          const struct kvf_cps_pool *pool, struct kvf_error *err)
{
    struct cp_node *node = NULL;
    int rc = cp_node_for_call(st, node_id, incarnation, &node, err);
    if (rc != 0)
        return rc;
    if (node->state != KVF_CPS_NODE_ATTACHED)
        return kvf_error_set(err, -EPERM, "node %s is %s, not ATTACHED", node->id,
                             kvf_cps_node_state_name(node->state));
    if (pool == NULL)
        return kvf_error_set(err, -EINVAL, "pool: missing");
    rc = cp_pool_validate(pool, "pool", 0, err);
    if (rc != 0)
        return rc;
    struct cp_pool *p = cp_node_pool(node, pool->pool_id);
    rc = cp_pool_check_key(p == NULL ? node->older : NULL, pool, "pool", 0, err);
    if (rc == 0)
        rc = cp_pool_check_unique(node, pool, "pool", 0, err);
    if (rc != 0)
        return rc;
    if (p != NULL) {
        if (!cp_pool_key_fits(p, pool))
            return kvf_error_set(err, -EBUSY,
                                 "pool %" PRIu32 " of node %s has leases in memory '%s'; it "
                                 "cannot name other memory",
                                 p->pool_id, node->id, p->key);
        cp_pool_set_key(p, pool);
        bool same = p->page_size == pool->page_size && p->page_count == pool->page_count;
        if (same)
            return 0;
        if (p->nleases > 0)
            return kvf_error_set(err, -EBUSY,
                                 "pool %" PRIu32 " of node %s has %" PRIu32
                                 " leases; its size cannot change",
                                 p->pool_id, node->id, p->nleases);
        if (p->page_count != pool->page_count) {
            free(p->pages);
            p->pages = NULL;
        }
        p->page_size = pool->page_size;
        p->page_count = pool->page_count;
        return 0;
    }
    if (node->npools >= st->opts.max_pools_per_node)
        return kvf_error_set(err, -E2BIG, "pools: node %s has %" PRIu32 " pools, limit %" PRIu32,
                             node->id, node->npools, st->opts.max_pools_per_node);
    struct cp_pool **pools = realloc(node->pools, (node->npools + 1) * sizeof(*pools));
    if (pools == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    node->pools = pools;
    p = cp_pool_new(node->older, pool);
    if (p == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    node->pools[node->npools++] = p;
    return 0;
}

/* ---- fence reports ------------------------------------------------------- */

int kvf_cps_report_fenced(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                          const char *fenced_node, uint64_t fenced_incarnation, kvf_time_ns now,
                          struct kvf_error *err)
{
    if (!cp_node_id_valid(fenced_node))
        return kvf_error_set(err, -EINVAL, "fenced_node: must be 1..%d bytes", CP_NODE_ID_MAX);
    struct cp_node *fencer;
    int rc = cp_node_for_report(st, node_id, incarnation, &fencer, err);
    if (rc != 0)
        return rc;
    if (strcmp(fenced_node, node_id) == 0 && fenced_incarnation == incarnation)
        return kvf_error_set(err, -EINVAL, "fenced_node: a node cannot fence itself");
    struct cp_node *fenced = node_incarnation(st, fenced_node, fenced_incarnation);
    if (fenced == NULL) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -ENOENT, "fenced_node: %s incarnation %" PRIu64 " is unknown",
                             fenced_node, fenced_incarnation);
    }
    struct cp_fence *f = fence_find(fenced, fencer->serial);
    if (f != NULL && f->acked)
        return 0;
    if (f == NULL) {
        /* A node may fence on its own (it saw the peer die): record it. */
        f = fence_new(fenced, fencer);
        if (f == NULL)
            return kvf_error_set(err, -ENOMEM, "out of memory");
    }
    fence_settle(st, f, true);
    for (struct cp_rnode *rn = fenced->rnodes; rn != NULL; rn = rn->node_next)
        cp_room_try_finish(st, rn->room, now);
    cp_node_maybe_free(st, fenced);
    return 0;
}

int kvf_cps_admin_fence(struct kvf_cps *st, const char *node_id, kvf_time_ns now,
                        struct kvf_error *err)
{
    if (!cp_node_id_valid(node_id))
        return kvf_error_set(err, -EINVAL, "node_id: must be 1..%d bytes", CP_NODE_ID_MAX);
    struct cp_node *node = cp_node_current(st, node_id);
    if (node == NULL)
        return kvf_error_set(err, -ENOENT, "node %s: unknown", node_id);
    for (struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next) {
        if (cp_room_terminal(rn->room))
            continue;
        for (uint32_t i = 0; i < rn->room->nrnodes; i++)
            cp_fence_request(st, rn->room->rnodes[i]->node, node, now);
    }
    return 0;
}
