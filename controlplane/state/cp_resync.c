/*
 * cp_resync.c: a node's full-state report (node.proto Resync) reconciled with
 * what the control plane knows, and pool removal.
 *
 * A Resync arrives after the node re-attached with the same incarnation, or
 * after the control plane asked for it (it recovered from its log). Reports
 * sent while the session was down may be lost; the Resync says again what
 * they said: a drained lifetime, a fenced peer, the pools. It also shows what
 * the control plane can no longer see: a lifetime still open for a room that
 * ended, or that the control plane forgot. Those get an abort notice so that
 * the node closes their admission (docs/control-plane.md, "Resync").
 *
 * DESIGN: all checks come first, then every allocation (effects, the pool
 * table, new pool objects), then the changes, which cannot fail: a refused
 * Resync changes nothing.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

static void pool_remove_at(struct cp_node *node, uint32_t i)
{
    cp_pool_free(node->pools[i]);
    memmove(&node->pools[i], &node->pools[i + 1], (node->npools - i - 1) * sizeof(*node->pools));
    node->npools--;
}

static int attached_node(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                         struct cp_node **node_p, struct kvf_error *err)
{
    int rc = cp_node_for_call(st, node_id, incarnation, node_p, err);
    if (rc == 0 && (*node_p)->state != KVF_CPS_NODE_ATTACHED)
        rc = kvf_error_set(err, -EPERM, "node %s is %s, not ATTACHED", node_id,
                           kvf_cps_node_state_name((*node_p)->state));
    return rc;
}

static int validate(const struct kvf_cps *st, const struct kvf_cps_resync *rs,
                    struct kvf_error *err)
{
    if (rs == NULL)
        return kvf_error_set(err, -EINVAL, "resync: missing");
    if ((rs->lifetime_count > 0 && rs->lifetimes == NULL) ||
        (rs->fenced_count > 0 && rs->fenced == NULL) || (rs->pool_count > 0 && rs->pools == NULL))
        return kvf_error_set(err, -EINVAL, "resync: a list is missing");
    for (size_t i = 0; i < rs->lifetime_count; i++) {
        const struct kvf_cps_resync_lifetime *l = &rs->lifetimes[i];
        if (l->key.room_id == 0 || l->key.room_id > KVF_ROOM_ID_MAX || l->key.generation == 0)
            return kvf_error_set(err, -EINVAL, "lifetimes[%zu].room: bad room key", i);
        if (l->state < KVF_CPS_LT_OPEN || l->state > KVF_CPS_LT_QUARANTINED)
            return kvf_error_set(err, -EINVAL, "lifetimes[%zu].state: %d is not a lifetime state",
                                 i, (int)l->state);
    }
    for (size_t i = 0; i < rs->fenced_count; i++) {
        if (!cp_node_id_valid(rs->fenced[i].node_id))
            return kvf_error_set(err, -EINVAL, "fenced_peers[%zu].node_id: must be 1..%d bytes", i,
                                 CP_NODE_ID_MAX);
    }
    if (rs->pool_count > st->opts.max_pools_per_node)
        return kvf_error_set(err, -E2BIG, "pools: %zu pools, limit %" PRIu32, rs->pool_count,
                             st->opts.max_pools_per_node);
    for (size_t i = 0; i < rs->pool_count; i++) {
        int rc = cp_pool_validate(&rs->pools[i], "pools", i, err);
        if (rc != 0)
            return rc;
        for (size_t j = 0; j < i; j++) {
            if (rs->pools[j].pool_id == rs->pools[i].pool_id)
                return kvf_error_set(err, -EINVAL, "pools[%zu].pool_id: %" PRIu32 " repeated", i,
                                     rs->pools[i].pool_id);
        }
    }
    return 0;
}

int kvf_cps_node_update_pools(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                              const struct kvf_cps_pool *up, size_t nup, const uint32_t *rm,
                              size_t nrm, struct kvf_error *err)
{
    struct cp_node *node;
    int rc = attached_node(st, node_id, incarnation, &node, err);
    if (rc != 0)
        return rc;
    if ((nup > 0 && up == NULL) || (nrm > 0 && rm == NULL))
        return kvf_error_set(err, -EINVAL, "pools: missing");
    /* Checks first: a refused update changes nothing. */
    size_t nnew = 0;
    for (size_t i = 0; i < nup; i++) {
        rc = cp_pool_validate(&up[i], "upserted", i, err);
        if (rc != 0)
            return rc;
        for (size_t j = 0; j < i; j++)
            if (up[j].pool_id == up[i].pool_id)
                return kvf_error_set(err, -EINVAL, "upserted[%zu].pool_id: %" PRIu32 " repeated", i,
                                     up[i].pool_id);
        for (size_t j = 0; j < nrm; j++)
            if (rm[j] == up[i].pool_id)
                return kvf_error_set(err, -EINVAL,
                                     "upserted[%zu].pool_id: %" PRIu32 " is also removed", i,
                                     up[i].pool_id);
        const struct cp_pool *p = cp_node_pool(node, up[i].pool_id);
        rc = cp_pool_check_key(p == NULL ? node->older : NULL, &up[i], "upserted", i, err);
        if (rc == 0)
            rc = cp_pool_check_unique(node, &up[i], "upserted", i, err);
        if (rc != 0)
            return rc;
        for (size_t j = 0; j < i; j++)
            if (up[i].key != NULL && up[i].key[0] != '\0' && up[j].key != NULL &&
                strcmp(up[j].key, up[i].key) == 0)
                return kvf_error_set(err, -EINVAL, "upserted[%zu].key: '%s' repeated", i,
                                     up[i].key);
        if (p != NULL && !cp_pool_key_fits(p, &up[i]))
            return kvf_error_set(err, -EBUSY,
                                 "pool %" PRIu32 " of node %s has leases in memory '%s'; it "
                                 "cannot name other memory",
                                 p->pool_id, node->id, p->key);
        if (p == NULL)
            nnew++;
        else if (p->nleases > 0 &&
                 (p->page_size != up[i].page_size || p->page_count != up[i].page_count))
            return kvf_error_set(err, -EBUSY,
                                 "pool %" PRIu32 " of node %s has %" PRIu32
                                 " leases; its size cannot change",
                                 p->pool_id, node->id, p->nleases);
    }
    for (size_t i = 0; i < nrm; i++) {
        for (size_t j = 0; j < i; j++)
            if (rm[j] == rm[i])
                return kvf_error_set(err, -EINVAL, "removed_pool_ids[%zu]: %" PRIu32 " repeated", i,
                                     rm[i]);
        const struct cp_pool *p = cp_node_pool(node, rm[i]);
        if (p == NULL)
            return kvf_error_set(err, -ENOENT, "pool %" PRIu32 " of node %s: unknown", rm[i],
                                 node_id);
        if (p->nleases > 0)
            return kvf_error_set(err, -EBUSY,
                                 "pool %" PRIu32 " of node %s has %" PRIu32
                                 " leases not RELEASED; it cannot be removed",
                                 rm[i], node_id, p->nleases);
    }
    if (node->npools + nnew - nrm > st->opts.max_pools_per_node)
        return kvf_error_set(err, -E2BIG, "pools: node %s would have %zu pools, limit %" PRIu32,
                             node_id, node->npools + nnew - nrm, st->opts.max_pools_per_node);
    /* Then every allocation. */
    struct cp_pool **table = realloc(node->pools, (node->npools + nnew + 1) * sizeof(*node->pools));
    if (table == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    node->pools = table;
    size_t nfresh = 0;
    for (size_t i = 0; i < nup; i++) {
        if (cp_node_pool(node, up[i].pool_id) != NULL)
            continue;
        struct cp_pool *p = cp_pool_new(node->older, &up[i]);
        if (p == NULL) {
            while (nfresh > 0)
                cp_pool_free(node->pools[node->npools + --nfresh]);
            return kvf_error_set(err, -ENOMEM, "out of memory");
        }
        node->pools[node->npools + nfresh++] = p;
    }
    /* Then the changes, which cannot fail: resize the known ones, take the new
     * ones in, remove. */
    for (size_t i = 0; i < nup; i++) {
        struct cp_pool *p = cp_node_pool(node, up[i].pool_id);
        if (p != NULL)
            cp_pool_set_key(p, &up[i]);
        if (p == NULL || (p->page_size == up[i].page_size && p->page_count == up[i].page_count))
            continue;
        if (p->page_count != up[i].page_count) {
            free(p->pages);
            p->pages = NULL;
        }
        p->page_size = up[i].page_size;
        p->page_count = up[i].page_count;
    }
    node->npools += (uint32_t)nfresh;
    for (size_t i = 0; i < nrm; i++)
        for (uint32_t k = 0; k < node->npools; k++)
            if (node->pools[k]->pool_id == rm[i]) {
                pool_remove_at(node, k);
                break;
            }
    return 0;
}

int kvf_cps_node_remove_pool(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                             uint32_t pool_id, struct kvf_error *err)
{
    return kvf_cps_node_update_pools(st, node_id, incarnation, NULL, 0, &pool_id, 1, err);
}

/* One lifetime; the effects it may push were reserved. */
static void resync_lifetime(struct kvf_cps *st, struct cp_node *node,
                            const struct kvf_cps_resync_lifetime *l, kvf_time_ns now,
                            struct kvf_cps_resync_result *res)
{
    struct cp_room *room = cp_map_get(&st->rooms, l->key.room_id);
    bool known = room != NULL && room->key.generation == l->key.generation;
    struct cp_rnode *rn = known ? cp_room_rnode(room, node) : NULL;
    if (known && rn == NULL) {
        res->ignored++; /* not a room of this node incarnation */
        return;
    }
    if (known && room->state == KVF_CPS_ROOM_ABORTING) {
        if (l->state == KVF_CPS_LT_DRAINED && !kvf_token_is_zero(l->token) &&
            kvf_token_eq(l->token, room->token) && !rn->drained) {
            rn->drained = true;
            cp_notice_cancel(st, rn);
            cp_rnode_host_proof(st, rn, now);
            res->drained++;
        } else {
            res->ignored++; /* the pending notice is re-sent by its own rules */
        }
        return;
    }
    if (known && !cp_room_terminal(room)) {
        res->ignored++; /* OPENING / ACTIVE: the room update rules apply */
        return;
    }
    if (l->state == KVF_CPS_LT_DRAINED) {
        res->ignored++;
        return;
    }
    /* Terminal or forgotten, and the node still holds it open: close it. */
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_ABORT_NOTICE);
    cp_fx_set_node(fx, node);
    fx->key = l->key;
    if (known && room->state == KVF_CPS_ROOM_ABORTED)
        fx->token = room->token;
    res->notices++;
}

int kvf_cps_node_resync(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                        const struct kvf_cps_resync *rs, kvf_time_ns now,
                        struct kvf_cps_resync_result *result_p, struct kvf_error *err)
{
    struct kvf_cps_resync_result res;
    memset(&res, 0, sizeof(res));
    struct cp_node *node;
    int rc = attached_node(st, node_id, incarnation, &node, err);
    if (rc == 0)
        rc = validate(st, rs, err);
    for (size_t i = 0; rc == 0 && i < rs->pool_count; i++) {
        const struct cp_pool *p = cp_node_pool(node, rs->pools[i].pool_id);
        rc = cp_pool_check_key(p == NULL ? node->older : NULL, &rs->pools[i], "pools", i, err);
        if (rc == 0)
            rc = cp_pool_check_unique(node, &rs->pools[i], "pools", i, err);
    }
    if (rc != 0)
        return rc;

    /* Allocate everything first. A drain may finish a room (state, releases,
     * one effect per lease and room) and a notice is one effect: reserve
     * generously so that nothing is dropped. */
    size_t fx_need = rs->lifetime_count * 4 + 4;
    for (size_t i = 0; i < rs->lifetime_count; i++) {
        struct cp_room *room = cp_map_get(&st->rooms, rs->lifetimes[i].key.room_id);
        if (room != NULL)
            fx_need += room->nparts + room->nrnodes;
    }
    if (cp_fx_reserve(st, fx_need) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    size_t nnew = 0;
    for (size_t i = 0; i < rs->pool_count; i++)
        nnew += cp_node_pool(node, rs->pools[i].pool_id) == NULL;
    struct cp_pool **table = realloc(node->pools, (node->npools + nnew + 1) * sizeof(*node->pools));
    if (table == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    node->pools = table;
    size_t nfresh = 0;
    for (size_t i = 0; i < rs->pool_count; i++) {
        if (cp_node_pool(node, rs->pools[i].pool_id) != NULL)
            continue;
        struct cp_pool *p = cp_pool_new(node->older, &rs->pools[i]);
        if (p == NULL) {
            while (nfresh > 0)
                cp_pool_free(node->pools[node->npools + --nfresh]);
            return kvf_error_set(err, -ENOMEM, "out of memory");
        }
        node->pools[node->npools + nfresh++] = p;
    }

    /* Pools: resize the listed ones, remove the unlisted (the new ones sit
     * past npools and are neither), then take the new ones in. */
    for (uint32_t i = node->npools; i-- > 0;) {
        struct cp_pool *p = node->pools[i];
        const struct kvf_cps_pool *want = NULL;
        for (size_t k = 0; k < rs->pool_count && want == NULL; k++)
            if (rs->pools[k].pool_id == p->pool_id)
                want = &rs->pools[k];
        if (want == NULL) {
            if (p->nleases > 0) {
                res.pools_kept++;
                continue;
            }
            /* Keep the fresh ones right after the table's live part. */
            cp_pool_free(p);
            memmove(&node->pools[i], &node->pools[i + 1],
                    (node->npools - i - 1 + nfresh) * sizeof(*node->pools));
            node->npools--;
            res.pools_removed++;
            continue;
        }
        if (!cp_pool_key_fits(p, want)) {
            res.pools_refused++; /* leases in other memory: it cannot be renamed */
            continue;
        }
        cp_pool_set_key(p, want);
        if (p->page_size == want->page_size && p->page_count == want->page_count)
            continue;
        if (p->nleases > 0) {
            res.pools_refused++;
            continue;
        }
        if (p->page_count != want->page_count) {
            free(p->pages);
            p->pages = NULL;
        }
        p->page_size = want->page_size;
        p->page_count = want->page_count;
        res.pools_upserted++;
    }
    node->npools += (uint32_t)nfresh;
    res.pools_upserted += (uint32_t)nfresh;

    for (size_t i = 0; i < rs->fenced_count; i++) {
        if (kvf_cps_report_fenced(st, node_id, incarnation, rs->fenced[i].node_id,
                                  rs->fenced[i].incarnation, now, NULL) == 0)
            res.fenced++;
        else
            res.fenced_unknown++;
    }
    for (size_t i = 0; i < rs->lifetime_count; i++)
        resync_lifetime(st, node, &rs->lifetimes[i], now, &res);
    if (result_p != NULL)
        *result_p = res;
    return 0;
}
