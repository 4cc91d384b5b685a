/*
 * cp_pages.c: the per-pool page index that enforces docs/design.md §2.3, "a page is
 * in at most one write lease at a time, and never in a write lease of one room
 * and a read lease of another".
 *
 * Each pool of a node incarnation has one entry per page: the write lease that
 * holds it (or NULL) and how many read leases hold it. A lease holds its pages
 * from its grant until it is RELEASED; RELEASING leases keep holding them,
 * which is what keeps a source's pages locked until its room is proven
 * quiescent (R8). Checks and marks are O(pages of the request). Naming the
 * room of a read conflict walks the pool's lease list: error path only.
 *
 * Decided here: a page cannot be read and written at once even inside one room
 * (a source and a sink of one room on one pool naming the same page is a
 * malformed request, not a shared prefix), and no lease lists a page twice:
 * the ranges of a request must not overlap each other nor the ranges the
 * lease already holds (cp_pages_check_disjoint; INVALID_ARGUMENT).
 *
 * The index is allocated at the first lease of a pool, so a node that
 * registers large pools costs nothing until it is used.
 *
 * Messages name the request's field as the service gave it (`field`): NULL is
 * the old "ranges", indexed ("ranges[3]: ..."), and so is any name ending in
 * "ranges" ("page_set.ranges[3]"); a page set decoded from a bitmap or
 * deltas has no runs of its own, so its field is named alone
 * ("page_set.bitmap: page 70000 is outside ..."). A lease is kept as runs
 * whatever the request's form: a page set arrives ascending and coalesced,
 * so the disjointness check is one pass without a copy when the runs are
 * ascending (and, for an extension, above what the lease holds), and sorts a
 * copy only otherwise (an engine's own ranges, an extension below).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

const char *cp_pages_run_name(char buf[CP_RUN_NAME_MAX], const char *field, size_t i)
{
    if (field == NULL)
        field = "ranges";
    size_t len = strlen(field);
    if (len >= 6 && strcmp(field + len - 6, "ranges") == 0)
        snprintf(buf, CP_RUN_NAME_MAX, "%s[%zu]", field, i);
    else
        snprintf(buf, CP_RUN_NAME_MAX, "%s", field);
    return buf;
}

int cp_pages_check_bounds(const struct cp_node *node, const struct cp_pool *pool,
                          const struct kvf_cps_page_range *ranges, size_t n, const char *field,
                          struct kvf_error *err)
{
    char name[CP_RUN_NAME_MAX];
    for (size_t i = 0; i < n; i++) {
        const struct kvf_cps_page_range *r = &ranges[i];
        if (r->count == 0)
            return kvf_error_set(err, -EINVAL, "%s.count: must be > 0",
                                 cp_pages_run_name(name, field, i));
        uint64_t end = (uint64_t)r->first + r->count;
        if (end > pool->page_count) {
            uint32_t bad = r->first >= pool->page_count ? r->first : pool->page_count;
            return kvf_error_set(
                err, -EINVAL,
                "%s: page %" PRIu32 " is outside pool %" PRIu32 " of node %s (%" PRIu32 " pages)",
                cp_pages_run_name(name, field, i), bad, pool->pool_id, node->id, pool->page_count);
        }
    }
    return 0;
}

struct range_ref {
    uint32_t first, count;
    size_t index; /* in the request, or SIZE_MAX for a range the lease holds */
};

static int range_ref_cmp(const void *a, const void *b)
{
    const struct range_ref *x = a, *y = b;
    return x->first < y->first ? -1 : x->first > y->first ? 1 : 0;
}

/* Whether `v` is ascending and disjoint; *bad_p gets the first run that
 * overlaps the one before it when the runs are ascending but touch. */
static bool ascending_disjoint(const struct kvf_cps_page_range *v, size_t n, size_t *bad_p)
{
    for (size_t i = 1; i < n; i++) {
        if (v[i - 1].first > v[i].first)
            return false;
        if ((uint64_t)v[i - 1].first + v[i - 1].count > v[i].first) {
            *bad_p = i;
            return true;
        }
    }
    return true;
}

int cp_pages_check_disjoint(const struct cp_part *part, const struct kvf_cps_page_range *ranges,
                            size_t n, const char *field, struct kvf_error *err)
{
    size_t held = part != NULL ? part->nranges : 0;
    if (n + held < 2)
        return 0;
    char name[CP_RUN_NAME_MAX];
    /* The common case, a page set (ascending runs) joining or growing a lease
     * above what it holds: one pass, no copy. */
    size_t bad = SIZE_MAX;
    if (ascending_disjoint(ranges, n, &bad)) {
        if (bad != SIZE_MAX)
            return kvf_error_set(err, -EINVAL,
                                 "%s: page %" PRIu32 " is listed twice (ranges overlap)",
                                 cp_pages_run_name(name, field, bad), ranges[bad].first);
        size_t hbad = SIZE_MAX;
        bool held_ok =
            held == 0 || (ascending_disjoint(part->ranges, held, &hbad) && hbad == SIZE_MAX);
        if (held_ok && (held == 0 || n == 0 ||
                        (uint64_t)part->ranges[held - 1].first + part->ranges[held - 1].count <=
                            ranges[0].first))
            return 0;
    }
    struct range_ref *v = malloc((n + held) * sizeof(*v));
    if (v == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    for (size_t i = 0; i < held; i++)
        v[i] = (struct range_ref){part->ranges[i].first, part->ranges[i].count, SIZE_MAX};
    for (size_t i = 0; i < n; i++)
        v[held + i] = (struct range_ref){ranges[i].first, ranges[i].count, i};
    qsort(v, n + held, sizeof(*v), range_ref_cmp);
    int rc = 0;
    for (size_t i = 1; i < n + held && rc == 0; i++) {
        const struct range_ref *a = &v[i - 1], *b = &v[i];
        if ((uint64_t)a->first + a->count <= b->first)
            continue;
        size_t idx = b->index != SIZE_MAX ? b->index : a->index;
        rc = kvf_error_set(err, -EINVAL, "%s: page %" PRIu32 " is %s",
                           cp_pages_run_name(name, field, idx), b->first,
                           a->index == SIZE_MAX || b->index == SIZE_MAX
                               ? "already in this lease"
                               : "listed twice (ranges overlap)");
    }
    free(v);
    return rc;
}

static bool part_has_page(const struct cp_part *p, uint32_t page)
{
    for (uint32_t i = 0; i < p->nranges; i++) {
        if (page >= p->ranges[i].first && page - p->ranges[i].first < p->ranges[i].count)
            return true;
    }
    return false;
}

static const struct cp_part *find_reader(const struct cp_pool *pool, uint32_t page)
{
    for (const struct cp_part *p = pool->leases; p != NULL; p = p->pool_next) {
        if (p->role == KVF_CPS_ROLE_SOURCE && part_has_page(p, page))
            return p;
    }
    return NULL;
}

static void unmark(struct cp_pool *pool, const struct cp_part *part, uint32_t first, uint32_t end)
{
    for (uint32_t pg = first; pg < end; pg++) {
        struct cp_page *e = &pool->pages[pg];
        if (part->role == KVF_CPS_ROLE_SINK) {
            if (e->writer == part)
                e->writer = NULL;
        } else if (e->readers > 0) {
            e->readers--;
        }
    }
}

static int conflict(const struct cp_pool *pool, const struct cp_part *part, const char *field,
                    size_t i, uint32_t pg, struct kvf_error *err)
{
    const struct cp_page *e = &pool->pages[pg];
    char name[CP_RUN_NAME_MAX];
    cp_pages_run_name(name, field, i);
    const struct cp_part *other = e->writer;
    const char *how = "written";
    if (other == part)
        return kvf_error_set(err, -EBUSY,
                             "%s: page %" PRIu32 " is listed twice in write lease %" PRIu64, name,
                             pg, part->lease_id);
    if (other == NULL) {
        other = find_reader(pool, pg);
        how = "read";
    }
    if (other == NULL)
        return kvf_error_set(err, -EBUSY,
                             "%s: page %" PRIu32 " of pool %" PRIu32 " is held by another lease",
                             name, pg, pool->pool_id);
    return kvf_error_set(err, -EBUSY,
                         "%s: page %" PRIu32 " of pool %" PRIu32 " is %s by room %" PRIu64
                         ":%" PRIu64 " (lease %" PRIu64 ")",
                         name, pg, pool->pool_id, how, other->room->key.room_id,
                         other->room->key.generation, other->lease_id);
}

int cp_pages_acquire(struct cp_pool *pool, struct cp_part *part,
                     const struct kvf_cps_page_range *ranges, size_t n, const char *field,
                     struct kvf_error *err)
{
    if (n == 0)
        return 0;
    if (pool->pages == NULL) {
        pool->pages = calloc(pool->page_count, sizeof(*pool->pages));
        if (pool->pages == NULL)
            return kvf_error_set(err, -ENOMEM, "pool %" PRIu32 ": no memory for its page index",
                                 pool->pool_id);
    }
    bool write = part->role == KVF_CPS_ROLE_SINK;
    for (size_t i = 0; i < n; i++) {
        uint32_t first = ranges[i].first;
        uint32_t end = first + ranges[i].count;
        for (uint32_t pg = first; pg < end; pg++) {
            struct cp_page *e = &pool->pages[pg];
            bool busy = e->writer != NULL || (write && e->readers > 0);
            if (busy) {
                int rc = conflict(pool, part, field, i, pg, err);
                unmark(pool, part, first, pg);
                for (size_t j = 0; j < i; j++)
                    unmark(pool, part, ranges[j].first, ranges[j].first + ranges[j].count);
                return rc;
            }
            if (write)
                e->writer = part;
            else
                e->readers++;
        }
    }
    return 0;
}

void cp_pool_link(struct cp_pool *pool, struct cp_part *part)
{
    part->pool_prev = NULL;
    part->pool_next = pool->leases;
    if (pool->leases != NULL)
        pool->leases->pool_prev = part;
    pool->leases = part;
    pool->nleases++;
}

void cp_pages_release(struct cp_pool *pool, struct cp_part *part)
{
    if (pool->pages != NULL) {
        for (uint32_t i = 0; i < part->nranges; i++)
            unmark(pool, part, part->ranges[i].first,
                   part->ranges[i].first + part->ranges[i].count);
    }
    if (part->pool_prev != NULL)
        part->pool_prev->pool_next = part->pool_next;
    else
        pool->leases = part->pool_next;
    if (part->pool_next != NULL)
        part->pool_next->pool_prev = part->pool_prev;
    part->pool_prev = NULL;
    part->pool_next = NULL;
    pool->nleases--;
}

void cp_pool_ref(struct cp_pool *pool)
{
    pool->refs++;
}

void cp_pool_free(struct cp_pool *pool)
{
    if (pool == NULL || --pool->refs > 0)
        return;
    free(pool->pages);
    free(pool);
}

uint32_t kvf_cps_max_ranges(const struct kvf_cps *st)
{
    return st->opts.max_ranges_per_call;
}
