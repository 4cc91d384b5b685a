/*
 * svc_convert.c: conversions between the state core's views and the wire
 * messages that more than one handler builds (a lease with its ranges, a
 * capability set), and the pages of a request (ranges or a page set). Every
 * function here runs on the state thread, except kvf_svc_pages_check and the
 * kvf_svc_check_* helpers, which validators call on CQ threads.
 *
 * Page sets (types.proto PageSet) are decoded here, at the edge, into the
 * runs the core keeps (common/kvf_pageset.h); the core never sees the wire
 * form. The nodes and WatchLeases still receive a lease as ranges (Lease in
 * types.proto): docs/control-plane.md, "Page sets", has the sizes.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_pageset.h"
#include "service_internal.h"

uint32_t kvf_svc_features_from_names(char *const *names, size_t n)
{
    uint32_t bits = 0;
    for (size_t i = 0; i < n; i++)
        bits |= kvf_feature_from_name(names[i]); /* unknown names: 0, ignored */
    return bits;
}

size_t kvf_svc_features_to_names(uint32_t bits, char *names[KVF_FEATURE_COUNT])
{
    size_t n = 0;
    for (unsigned i = 0; i < KVF_FEATURE_COUNT; i++) {
        if (bits & (1u << i))
            names[n++] = (char *)kvf_feature_name(1u << i);
    }
    return n;
}

int kvf_svc_lease_fill(struct kvf_svc_lease_buf *b, kvf_room_key key,
                       const struct kvf_cps_participant_view *pv)
{
    kvfence__v1__lease__init(&b->lease);
    kvfence__v1__participant__init(&b->part);
    kvfence__v1__room_key__init(&b->key);
    size_t n = pv->range_count;
    b->rv = calloc(n ? n : 1, sizeof(*b->rv));
    b->rp = calloc(n ? n : 1, sizeof(*b->rp));
    if (b->rv == NULL || b->rp == NULL) {
        kvf_svc_lease_free(b);
        return -ENOMEM;
    }
    for (size_t r = 0; r < n; r++) {
        kvfence__v1__page_range__init(&b->rv[r]);
        b->rv[r].first = pv->ranges[r].first;
        b->rv[r].count = pv->ranges[r].count;
        b->rp[r] = &b->rv[r];
    }
    b->key.room_id = key.room_id;
    b->key.generation = key.generation;
    b->part.node_id = (char *)pv->node_id;
    b->part.rank = pv->rank;
    b->part.role = (Kvfence__V1__Role)pv->role;
    b->lease.lease_id = pv->lease_id;
    b->lease.room = &b->key;
    b->lease.participant = &b->part;
    b->lease.pool_id = pv->pool_id;
    b->lease.n_ranges = n;
    b->lease.ranges = b->rp;
    b->lease.mode = pv->role == KVF_CPS_ROLE_SOURCE ? KVFENCE__V1__LEASE_MODE__LEASE_MODE_READ
                                                    : KVFENCE__V1__LEASE_MODE__LEASE_MODE_WRITE;
    b->lease.state = (Kvfence__V1__LeaseState)pv->lease_state;
    b->lease.awaiting_host_proof = pv->awaiting_host_proof;
    return 0;
}

void kvf_svc_lease_free(struct kvf_svc_lease_buf *b)
{
    free(b->rv);
    free(b->rp);
    b->rv = NULL;
    b->rp = NULL;
}

int kvf_svc_find_lease(const struct kvf_cps *cps, kvf_room_key key, uint64_t lease_id,
                       struct kvf_cps_participant_view *pv_p)
{
    struct kvf_cps_room_view view;
    if (kvf_cps_room_get(cps, key, &view) != 0)
        return -ENOENT;
    for (size_t i = 0; i < view.participant_count; i++) {
        if (kvf_cps_room_participant(cps, view.key, i, pv_p) == 0 && pv_p->lease_id == lease_id)
            return 0;
    }
    return -ENOENT;
}

int kvf_svc_check_room_id(const char *field, uint64_t room_id, struct kvf_error *err)
{
    if (room_id == 0 || room_id > KVF_ROOM_ID_MAX)
        return kvf_error_set(err, -EINVAL, "%s: must be 1 .. 2^63-1, got %" PRIu64, field, room_id);
    return 0;
}

int kvf_svc_check_room_key(const Kvfence__V1__RoomKey *room, bool need_generation,
                           struct kvf_error *err)
{
    if (room == NULL)
        return kvf_error_set(err, -EINVAL, "room: required");
    int rc = kvf_svc_check_room_id("room.room_id", room->room_id, err);
    if (rc == 0 && need_generation && room->generation == 0)
        rc = kvf_error_set(err, -EINVAL, "room.generation: required (> 0)");
    return rc;
}

int kvf_svc_check_len(const char *field, const char *s, size_t max, struct kvf_error *err)
{
    if (s != NULL && strnlen(s, max + 1) > max) {
        return kvf_error_set(err, -EINVAL, "%s: longer than %zu bytes", field, max);
    }
    return 0;
}

/* ---- the pages of a request ------------------------------------------------------ */

static int check_ranges(const char *field, Kvfence__V1__PageRange *const *ranges, size_t n,
                        struct kvf_error *err)
{
    for (size_t i = 0; i < n; i++) {
        if (!ranges[i] || ranges[i]->count == 0)
            return kvf_error_set(err, -EINVAL, "%s[%zu].count: must be > 0", field, i);
        if ((uint64_t)ranges[i]->first + ranges[i]->count > UINT32_MAX + 1ull)
            return kvf_error_set(err, -EINVAL, "%s[%zu]: first + count overflows 2^32", field, i);
    }
    return 0;
}

int kvf_svc_pages_check(Kvfence__V1__PageRange *const *ranges, size_t n_ranges,
                        const Kvfence__V1__PageSet *ps, struct kvf_error *err)
{
    if (ps == NULL)
        return check_ranges("ranges", ranges, n_ranges, err);
    if (n_ranges > 0)
        return kvf_error_set(err, -EINVAL,
                             "page_set: set either ranges or page_set, not both (%zu ranges "
                             "given)",
                             n_ranges);
    unsigned forms = (ps->n_ranges > 0) + (ps->bitmap.len > 0) + (ps->deltas.len > 0);
    if (forms == 0)
        return kvf_error_set(err, -EINVAL,
                             "page_set: names no page (set one of page_set.ranges, "
                             "page_set.bitmap, page_set.deltas; leave page_set out for no page)");
    if (forms > 1)
        return kvf_error_set(err, -EINVAL,
                             "page_set: %u forms given; exactly one of page_set.ranges, "
                             "page_set.bitmap and page_set.deltas",
                             forms);
    if (ps->bitmap_first != 0 && ps->bitmap.len == 0)
        return kvf_error_set(err, -EINVAL, "page_set.bitmap_first: only with page_set.bitmap");
    return check_ranges("page_set.ranges", ps->ranges, ps->n_ranges, err);
}

static int copy_ranges(Kvfence__V1__PageRange *const *ranges, size_t n, struct kvf_svc_pages *out,
                       struct kvf_error *err)
{
    if (n == 0)
        return 0;
    out->v = malloc(n * sizeof(*out->v));
    if (out->v == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        out->v[i] = (struct kvf_cps_page_range){ranges[i]->first, ranges[i]->count};
    out->n = n;
    return 0;
}

int kvf_svc_pages_decode(Kvfence__V1__PageRange *const *ranges, size_t n_ranges,
                         const Kvfence__V1__PageSet *ps, size_t max_runs,
                         struct kvf_svc_pages *pages_p, struct kvf_error *err)
{
    struct kvf_svc_pages out = {0};
    int rc = kvf_svc_pages_check(ranges, n_ranges, ps, err);
    if (rc < 0)
        return rc;
    if (ps == NULL) {
        rc = copy_ranges(ranges, n_ranges, &out, err);
    } else if (ps->n_ranges > 0) {
        out.field = "page_set.ranges";
        rc = copy_ranges(ps->ranges, ps->n_ranges, &out, err);
    } else {
        struct kvf_page_run *runs = NULL;
        size_t nruns = 0;
        if (ps->bitmap.len > 0) {
            out.field = "page_set.bitmap";
            rc = kvf_pageset_decode_bitmap(ps->bitmap.data, ps->bitmap.len, ps->bitmap_first,
                                           max_runs, out.field, &runs, &nruns, err);
        } else {
            out.field = "page_set.deltas";
            rc = kvf_pageset_decode_deltas(ps->deltas.data, ps->deltas.len, max_runs, out.field,
                                           &runs, &nruns, err);
        }
        if (rc == 0) {
            /* The decoder's runs become the core's ranges in place (the same
             * two fields): each run is read before its bytes are rewritten
             * with the core's type, so no second array is allocated. */
            _Static_assert(sizeof(struct kvf_page_run) == sizeof(struct kvf_cps_page_range),
                           "one layout for a run");
            out.v = (struct kvf_cps_page_range *)(void *)runs;
            for (size_t i = 0; i < nruns; i++) {
                struct kvf_page_run r = runs[i];
                out.v[i] = (struct kvf_cps_page_range){r.first, r.count};
            }
            out.n = nruns;
        }
    }
    if (rc < 0) {
        kvf_svc_pages_free(&out);
        return rc;
    }
    *pages_p = out;
    return 0;
}

void kvf_svc_pages_free(struct kvf_svc_pages *pages)
{
    free(pages->v);
    pages->v = NULL;
    pages->n = 0;
}
