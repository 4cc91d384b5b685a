/*
 * cp_state.c: the frame of the control-plane state core: options, create and
 * destroy, the effects queue, the random source (tokens, jitter), the timer
 * dispatch of kvf_cps_tick(), the read-only views, the stats and the names.
 *
 * The rules themselves live next to the objects they govern: nodes, fences
 * and incarnations in cp_node.c; rooms, leases, abort, reports and the drain
 * barrier in cp_room.c; the per-pool page index in cp_pages.c. The maps and
 * the heap are in cp_map.c and cp_timer.c.
 *
 * DESIGN: one thread owns a struct kvf_cps (see cp_state.h). Effects are
 * appended to one growing array; kvf_cps_effects_take() hands the array to the
 * caller and the next call that emits starts a new batch over the same memory.
 * If the array cannot grow, the effect is counted in fx_dropped; callers that
 * can fail cleanly reserve their effects before they change anything.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

void kvf_cps_opts_init(struct kvf_cps_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->join_timeout = 30 * KVF_NS_PER_S;
    opts->node_ttl = 10 * KVF_NS_PER_S;
    opts->drain_deadline = 60 * KVF_NS_PER_S;
    opts->tombstone_ttl = 600 * KVF_NS_PER_S;
    opts->resend_initial = 200 * KVF_NS_PER_MS;
    opts->resend_max = 5 * KVF_NS_PER_S;
    opts->max_participants = 1024;
    opts->max_ranges_per_call = 65536;
    opts->max_pools_per_node = 64;
    opts->protocol_min = KVF_PROTOCOL_MIN;
    opts->protocol_max = KVF_PROTOCOL_MAX;
}

bool cp_opts_valid(const struct kvf_cps_opts *o)
{
    return o->random_fn != NULL && o->join_timeout > 0 && o->node_ttl > 0 &&
           o->drain_deadline > 0 && o->tombstone_ttl > 0 && o->resend_initial > 0 &&
           o->resend_max >= o->resend_initial && o->max_participants >= 2 &&
           o->max_ranges_per_call > 0 && o->max_pools_per_node > 0 && o->protocol_min > 0 &&
           o->protocol_min <= o->protocol_max;
}

struct kvf_cps *kvf_cps_create(const struct kvf_cps_opts *opts)
{
    if (opts == NULL || !cp_opts_valid(opts))
        return NULL;
    struct kvf_cps *st = calloc(1, sizeof(*st));
    if (st == NULL)
        return NULL;
    st->opts = *opts;
    cp_map_init(&st->rooms, false);
    cp_map_init(&st->leases, false);
    cp_map_init(&st->nodes, true);
    cp_heap_init(&st->timers);
    st->next_lease_id = 1;
    st->next_serial = 1;
    return st;
}

/* Teardown frees objects directly: no effects, no map or heap upkeep. */
static void room_free_raw(struct cp_room *room)
{
    for (uint32_t i = 0; i < room->nparts; i++) {
        cp_pool_free(room->parts[i]->pool); /* drops the lease's reference */
        free(room->parts[i]->ranges);
        free(room->parts[i]);
    }
    for (uint32_t i = 0; i < room->nrnodes; i++)
        free(room->rnodes[i]);
    free(room->parts);
    free(room->rnodes);
    free(room);
}

static void node_free_raw(struct cp_node *node)
{
    while (node != NULL) {
        struct cp_node *older = node->older;
        for (uint32_t i = 0; i < node->npools; i++)
            cp_pool_free(node->pools[i]);
        free(node->pools);
        for (uint32_t i = 0; i < node->nfenced_by; i++)
            free(node->fenced_by[i]);
        free(node->fenced_by);
        free(node);
        node = older;
    }
}

void kvf_cps_destroy(struct kvf_cps *st)
{
    if (st == NULL)
        return;
    size_t pos = 0;
    struct cp_room *room;
    while ((room = cp_map_next(&st->rooms, &pos)) != NULL)
        room_free_raw(room);
    pos = 0;
    struct cp_node *node;
    while ((node = cp_map_next(&st->nodes, &pos)) != NULL)
        node_free_raw(node);
    cp_map_fini(&st->rooms);
    cp_map_fini(&st->leases);
    cp_map_fini(&st->nodes);
    cp_heap_fini(&st->timers);
    free(st->fx);
    free(st);
}

/* ---- effects ------------------------------------------------------------- */

static void fx_new_batch(struct kvf_cps *st)
{
    if (st->fx_taken) {
        st->nfx = 0;
        st->fx_taken = false;
    }
}

int cp_fx_reserve(struct kvf_cps *st, size_t n)
{
    fx_new_batch(st);
    if (st->nfx + n <= st->capfx)
        return 0;
    size_t cap = st->capfx == 0 ? 16 : st->capfx;
    while (cap < st->nfx + n)
        cap *= 2;
    struct kvf_cps_effect *fx = realloc(st->fx, cap * sizeof(*fx));
    if (fx == NULL)
        return -ENOMEM;
    st->fx = fx;
    st->capfx = cap;
    return 0;
}

struct kvf_cps_effect *cp_fx_push(struct kvf_cps *st, enum kvf_cps_effect_kind kind)
{
    struct kvf_cps_effect *fx;
    if (cp_fx_reserve(st, 1) != 0) {
        st->fx_dropped++;
        fx = &st->fx_scratch;
    } else {
        fx = &st->fx[st->nfx++];
    }
    memset(fx, 0, sizeof(*fx));
    fx->kind = kind;
    return fx;
}

void cp_fx_set_node(struct kvf_cps_effect *fx, const struct cp_node *node)
{
    memcpy(fx->node_id, node->id, sizeof(fx->node_id));
    fx->incarnation = node->incarnation;
}

const struct kvf_cps_effect *kvf_cps_effects_take(struct kvf_cps *st, size_t *count_p)
{
    if (st->fx_taken) {
        *count_p = 0;
        return st->fx;
    }
    *count_p = st->nfx;
    st->fx_taken = true;
    return st->fx;
}

size_t kvf_cps_effects_pending(const struct kvf_cps *st)
{
    return st->fx_taken ? 0 : st->nfx;
}

/* ---- randomness ---------------------------------------------------------- */

uint64_t cp_rand_u64(struct kvf_cps *st)
{
    uint64_t v = 0;
    st->opts.random_fn(st->opts.random_ctx, &v, sizeof(v));
    return v;
}

kvf_time_ns cp_backoff(struct kvf_cps *st, uint32_t attempt)
{
    kvf_time_ns base = st->opts.resend_initial;
    for (uint32_t i = 0; i < attempt && base < st->opts.resend_max; i++)
        base *= 2;
    if (base > st->opts.resend_max)
        base = st->opts.resend_max;
    /* Jitter only shortens, by at most a quarter: the cap holds and each
     * step (x2, then at most -25%) still grows until the cap. */
    kvf_time_ns jitter = cp_rand_u64(st) % (base / 4 + 1);
    kvf_time_ns delay = base - jitter;
    return delay > 0 ? delay : 1;
}

/* ---- time ---------------------------------------------------------------- */

void kvf_cps_tick(struct kvf_cps *st, kvf_time_ns now)
{
    struct cp_timer *t;
    while ((t = cp_heap_top(&st->timers)) != NULL && t->when <= now) {
        cp_heap_cancel(&st->timers, t);
        switch (t->kind) {
        case CP_TIMER_ROOM:
            cp_room_timer_fire(st, cp_container_of(t, struct cp_room, timer), now);
            break;
        case CP_TIMER_NODE_TTL:
            cp_node_ttl_fire(st, cp_container_of(t, struct cp_node, ttl), now);
            break;
        case CP_TIMER_NOTICE:
            cp_notice_fire(st, cp_container_of(t, struct cp_rnode, timer), now);
            break;
        case CP_TIMER_FENCE:
            cp_fence_fire(st, cp_container_of(t, struct cp_fence, timer), now);
            break;
        default:
            break;
        }
    }
}

kvf_time_ns kvf_cps_next_deadline(const struct kvf_cps *st)
{
    const struct cp_timer *t = cp_heap_top(&st->timers);
    return t != NULL ? t->when : UINT64_MAX;
}

/* ---- views --------------------------------------------------------------- */

static void room_view(const struct cp_room *room, struct kvf_cps_room_view *v)
{
    memset(v, 0, sizeof(*v));
    v->key = room->key;
    v->state = (enum kvf_cps_room_state)room->state;
    v->abort_reason = (enum kvf_cps_abort_reason)room->reason;
    v->token = room->token;
    v->expected_sources = room->expected_sources;
    v->expected_sinks = room->expected_sinks;
    v->protocol_version = room->nparts > 0 ? room->pmax : 0;
    v->created_at = room->created_at;
    v->state_since = room->state_since;
    v->escalated = room->escalated;
    v->participant_count = room->nparts;
}

int kvf_cps_room_get(const struct kvf_cps *st, kvf_room_key key, struct kvf_cps_room_view *view_p)
{
    const struct cp_room *room = cp_room_lookup(st, key);
    if (room == NULL)
        return -ENOENT;
    room_view(room, view_p);
    return 0;
}

int kvf_cps_room_participant(const struct kvf_cps *st, kvf_room_key key, size_t index,
                             struct kvf_cps_participant_view *view_p)
{
    const struct cp_room *room = cp_room_lookup(st, key);
    if (room == NULL)
        return -ENOENT;
    if (index >= room->nparts)
        return -ENOENT;
    const struct cp_part *p = room->parts[index];
    struct kvf_cps_participant_view *v = view_p;
    memset(v, 0, sizeof(*v));
    v->node_id = p->rn->node->id;
    v->incarnation = p->rn->node->incarnation;
    v->rank = p->rank;
    v->role = (enum kvf_cps_role)p->role;
    v->lease_id = p->lease_id;
    v->pool_id = p->pool->pool_id;
    v->pool_page_size = p->pool->page_size;
    v->pool_page_count = p->pool->page_count;
    v->lease_state = (enum kvf_cps_lease_state)p->lease_state;
    v->completed = p->completed;
    v->node_drained = p->rn->drained;
    v->node_fenced = cp_rnode_fenced(p->rn);
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        const struct cp_node *peer = room->rnodes[i]->node;
        if (peer != p->rn->node && cp_node_fenced_by(p->rn->node, peer))
            v->node_fences++;
    }
    /* `attempt` numbers the last notice sent from 0; a node that is owed one
     * (pending) or drained after one was sent attempt + 1 of them. */
    if (p->rn->notice_pending || p->rn->drained)
        v->notice_attempts = p->rn->attempt + 1;
    v->awaiting_host_proof = cp_part_awaiting(p);
    v->ranges = p->ranges;
    v->range_count = p->nranges;
    v->published = p->published;
    v->published_range_count = p->published ? p->pub_nranges : 0;
    return 0;
}

static void node_view(const struct cp_node *node, struct kvf_cps_node_view *view_p)
{
    memset(view_p, 0, sizeof(*view_p));
    view_p->node_id = node->id;
    view_p->incarnation = node->incarnation;
    view_p->state = (enum kvf_cps_node_state)node->state;
    view_p->protocol_version = node->version;
    view_p->features = node->features;
    view_p->pool_count = node->npools;
    view_p->room_count = node->room_count;
    view_p->gone = node->gone;
    view_p->protocol_min = node->pmin;
    view_p->state_since = node->state_since;
    view_p->protocol_max = node->pmax;
}

int kvf_cps_node_get(const struct kvf_cps *st, const char *node_id,
                     struct kvf_cps_node_view *view_p)
{
    if (node_id == NULL)
        return -ENOENT;
    const struct cp_node *node = cp_node_current(st, node_id);
    if (node == NULL)
        return -ENOENT;
    node_view(node, view_p);
    return 0;
}

int kvf_cps_node_detail_get(const struct kvf_cps *st, const char *node_id,
                            struct kvf_cps_node_detail *detail_p)
{
    const struct cp_node *node = node_id != NULL ? cp_node_current(st, node_id) : NULL;
    if (node == NULL)
        return -ENOENT;
    struct kvf_cps_node_detail d = {0};
    for (const struct cp_rnode *rn = node->rnodes; rn != NULL; rn = rn->node_next)
        d.notices_pending += rn->notice_pending;
    for (const struct cp_fence *f = node->fence_reqs; f != NULL; f = f->req_next)
        d.notices_pending++;
    for (uint32_t i = 0; i < node->nfenced_by; i++) {
        if (node->fenced_by[i]->acked)
            d.fenced_by++;
        else if (node->fenced_by[i]->fencer != NULL)
            d.fences_pending++;
    }
    *detail_p = d;
    return 0;
}

int kvf_cps_node_pool_get(const struct kvf_cps *st, const char *node_id, size_t index,
                          struct kvf_cps_pool *pool_p)
{
    const struct cp_node *node = node_id != NULL ? cp_node_current(st, node_id) : NULL;
    if (node == NULL || index >= node->npools)
        return -ENOENT;
    pool_p->pool_id = node->pools[index]->pool_id;
    pool_p->page_size = node->pools[index]->page_size;
    pool_p->page_count = node->pools[index]->page_count;
    pool_p->key = node->pools[index]->key;
    return 0;
}

int kvf_cps_node_foreach(const struct kvf_cps *st,
                         int (*fn)(void *ctx, const struct kvf_cps_node_view *view), void *ctx)
{
    size_t pos = 0;
    const struct cp_node *node;
    while ((node = cp_map_next(&st->nodes, &pos)) != NULL) {
        struct kvf_cps_node_view v;
        node_view(node, &v);
        int rc = fn(ctx, &v);
        if (rc != 0)
            return rc;
    }
    return 0;
}

void kvf_cps_stats_get(const struct kvf_cps *st, struct kvf_cps_stats *stats_p)
{
    *stats_p = st->stats;
}

int kvf_cps_room_foreach(const struct kvf_cps *st,
                         int (*fn)(void *ctx, const struct kvf_cps_room_view *view), void *ctx)
{
    size_t pos = 0;
    const struct cp_room *room;
    while ((room = cp_map_next(&st->rooms, &pos)) != NULL) {
        struct kvf_cps_room_view v;
        room_view(room, &v);
        int rc = fn(ctx, &v);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ---- names --------------------------------------------------------------- */

const char *kvf_cps_room_state_name(enum kvf_cps_room_state s)
{
    switch (s) {
    case KVF_CPS_ROOM_OPENING:
        return "OPENING";
    case KVF_CPS_ROOM_ACTIVE:
        return "ACTIVE";
    case KVF_CPS_ROOM_ABORTING:
        return "ABORTING";
    case KVF_CPS_ROOM_COMPLETED:
        return "COMPLETED";
    case KVF_CPS_ROOM_ABORTED:
        return "ABORTED";
    }
    return "UNKNOWN";
}

const char *kvf_cps_lease_state_name(enum kvf_cps_lease_state s)
{
    switch (s) {
    case KVF_CPS_LEASE_ACTIVE:
        return "ACTIVE";
    case KVF_CPS_LEASE_RELEASING:
        return "RELEASING";
    case KVF_CPS_LEASE_RELEASED:
        return "RELEASED";
    }
    return "UNKNOWN";
}

const char *kvf_cps_node_state_name(enum kvf_cps_node_state s)
{
    switch (s) {
    case KVF_CPS_NODE_ATTACHED:
        return "ATTACHED";
    case KVF_CPS_NODE_SUSPECT:
        return "SUSPECT";
    case KVF_CPS_NODE_LOST:
        return "LOST";
    }
    return "UNKNOWN";
}

const char *kvf_cps_abort_reason_name(enum kvf_cps_abort_reason r)
{
    switch (r) {
    case KVF_CPS_ABORT_ENGINE:
        return "ENGINE";
    case KVF_CPS_ABORT_ADMIN:
        return "ADMIN";
    case KVF_CPS_ABORT_JOIN_TIMEOUT:
        return "JOIN_TIMEOUT";
    case KVF_CPS_ABORT_TRANSFER_FAILED:
        return "TRANSFER_FAILED";
    case KVF_CPS_ABORT_NODE_LOST:
        return "NODE_LOST";
    case KVF_CPS_ABORT_CAPABILITY:
        return "CAPABILITY";
    }
    return "UNKNOWN";
}
