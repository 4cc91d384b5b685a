/*
 * cp_state_internal.h: the private structures of the control-plane state core,
 * shared by the files of controlplane/state/ and by nothing else.
 *
 * Ownership: struct kvf_cps owns three maps (room id -> current room, lease id
 * -> participant, node id -> current node incarnation), one timer heap and the
 * effects queue. A room owns its participants (each carries its lease) and its
 * room-node entries (one per distinct node of the room: the drain unit). A node
 * incarnation owns its pools (each with its page index) and the fence records
 * that say who fenced it. Older incarnations of a node id hang off the current
 * one (`older`) until nothing refers to them any more.
 *
 * Pointers between these objects stay valid because every object that a timer,
 * a list or another object points at is allocated on its own; arrays hold
 * pointers only.
 */
#ifndef CP_STATE_INTERNAL_H
#define CP_STATE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cp_map.h"
#include "cp_state.h"

#define CP_NODE_ID_MAX KVF_NODE_ID_MAX

#define cp_container_of(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

/* ---- timers (cp_timer.c) ------------------------------------------------- */

enum cp_timer_kind {
    CP_TIMER_ROOM = 1,     /* join timeout, drain deadline or tombstone (by room state) */
    CP_TIMER_NODE_TTL = 2, /* SUSPECT -> LOST */
    CP_TIMER_NOTICE = 3,   /* abort notice re-send of one (room, node) */
    CP_TIMER_FENCE = 4,    /* fence request re-send of one (fencer, fenced) */
};

#define CP_TIMER_IDLE UINT32_MAX

struct cp_timer {
    kvf_time_ns when;
    uint64_t seq; /* ties fire in arming order */
    uint32_t idx; /* position in the heap, CP_TIMER_IDLE when not armed */
    uint8_t kind; /* enum cp_timer_kind */
};

struct cp_heap {
    struct cp_timer **v;
    uint32_t n;
    uint32_t cap;
    uint64_t seq;
};

void cp_timer_init(struct cp_timer *t, enum cp_timer_kind kind);
static inline bool cp_timer_armed(const struct cp_timer *t)
{
    return t->idx != CP_TIMER_IDLE;
}
void cp_heap_init(struct cp_heap *h);
void cp_heap_fini(struct cp_heap *h);
int cp_heap_reserve(struct cp_heap *h, size_t extra);
/* Arms `t` at `when` (moves it if already armed). -ENOMEM only when growing. */
int cp_heap_arm(struct cp_heap *h, struct cp_timer *t, kvf_time_ns when);
/* Arms `t` at `when` with a given arming sequence (restore: keeps the order of
 * timers due at the same instant). The caller keeps seq <= h->seq. */
int cp_heap_restore(struct cp_heap *h, struct cp_timer *t, kvf_time_ns when, uint64_t seq);
void cp_heap_cancel(struct cp_heap *h, struct cp_timer *t);
struct cp_timer *cp_heap_top(const struct cp_heap *h);

/* ---- objects ------------------------------------------------------------- */

struct cp_part;

struct cp_page {
    struct cp_part *writer; /* the write lease holding the page, or NULL */
    uint32_t readers;       /* read leases holding it */
};

struct cp_pool {
    uint32_t pool_id;
    uint32_t page_size;
    uint32_t page_count;
    uint32_t nleases;       /* leases not yet RELEASED */
    uint32_t refs;          /* the nodes that list it, and every lease (any state) in it */
    struct cp_page *pages;  /* allocated at the first lease */
    struct cp_part *leases; /* list of those leases (error messages only) */
    char key[KVF_CPS_POOL_KEY_MAX + 1]; /* the memory's identity on its host; "" none */
};

/* "`fencer` fenced (or must fence) `fenced`": one per (fencer, fenced
 * incarnation), owned by the fenced node. The fencer is named by its serial so
 * that the record outlives the fencer's node object. */
struct cp_fence {
    struct cp_node *fenced;
    struct cp_node *fencer; /* while pending; NULL once acked or given up */
    uint64_t fencer_serial;
    bool acked;
    uint32_t attempt;
    struct cp_timer timer;
    struct cp_fence *req_prev; /* in fencer->fence_reqs while pending */
    struct cp_fence *req_next;
};

struct cp_rnode;

struct cp_node {
    char id[CP_NODE_ID_MAX + 1];
    uint64_t incarnation;
    uint64_t serial;     /* unique per node object, never reused */
    uint8_t state;       /* enum kvf_cps_node_state */
    bool current;        /* the node map points at this incarnation */
    bool gone;           /* witnessed gone on its host: its own pages are safe */
    uint32_t pmin, pmax; /* protocol range shared with the control plane */
    uint32_t version;
    uint32_t features;
    struct cp_pool **pools;
    uint32_t npools;
    struct cp_rnode *rnodes; /* this node's entries in rooms (any state) */
    uint32_t nrnodes;
    size_t room_count; /* non-terminal rooms */
    struct cp_timer ttl;
    struct cp_fence **fenced_by; /* who fenced / must fence this incarnation */
    uint32_t nfenced_by, capfenced_by;
    uint32_t fences_pending_as_fenced;
    struct cp_fence *fence_reqs; /* pending requests this node must carry out */
    struct cp_node *older;       /* older incarnations still referenced */
    /* When it entered `state` (admin views only); 0: unknown, for a node
     * restored from a snapshot (not in the image). */
    kvf_time_ns state_since;
};

/* One node of one room: the drain unit (docs/state-cores.md). */
struct cp_rnode {
    struct cp_room *room;
    struct cp_node *node;
    struct cp_rnode *node_prev, *node_next; /* in node->rnodes */
    uint32_t nparts;
    bool drained;
    bool notice_pending;
    uint32_t attempt; /* of the last notice sent */
    /* Room updates (docs/state-cores.md, "Ordered room updates"): the version
     * of the last update sent to this node and the last one it acknowledged.
     * Not in the snapshot: after a restore both are 0 and the update is asked
     * again when the node re-attaches. */
    uint64_t update_sent;
    uint64_t update_acked;
    struct cp_timer timer;
};

struct kvf_cps_page_range;

/* A participant and its lease. */
struct cp_part {
    struct cp_room *room;
    struct cp_rnode *rn;
    uint32_t rank;
    uint8_t role;        /* enum kvf_cps_role */
    uint8_t lease_state; /* enum kvf_cps_lease_state */
    bool completed;
    /* Known to the room's other nodes: its node acknowledged an update that
     * carried the lease, with its first `pub_nranges` ranges (a lease only
     * grows by appending ranges). Not in the snapshot (see update_sent). */
    bool published;
    uint32_t pub_nranges;
    uint64_t lease_id;
    struct cp_pool *pool;
    struct kvf_cps_page_range *ranges;
    uint32_t nranges, capranges;
    struct cp_part *pool_prev, *pool_next; /* in pool->leases while not RELEASED */
};

struct cp_room {
    kvf_room_key key;
    kvf_token token;
    uint8_t state;  /* enum kvf_cps_room_state */
    uint8_t reason; /* enum kvf_cps_abort_reason */
    bool escalated;
    uint32_t nawaiting; /* terminal, leases still RELEASING: waiting for a host proof */
    uint32_t expected_sources, expected_sinks;
    uint32_t nsources, nsinks, ncompleted;
    uint32_t pmin, pmax; /* common protocol range of the participants so far */
    kvf_time_ns created_at, state_since;
    uint64_t update_version; /* the last room update version minted */
    struct cp_timer timer;
    struct cp_part **parts;
    uint32_t nparts, capparts;
    struct cp_rnode **rnodes;
    uint32_t nrnodes, caprnodes;
};

struct kvf_cps {
    struct kvf_cps_opts opts;
    struct kvf_map rooms;  /* room id -> current struct cp_room */
    struct kvf_map leases; /* lease id -> struct cp_part */
    struct kvf_map nodes;  /* node id -> current struct cp_node */
    struct cp_heap timers;
    struct kvf_cps_effect *fx;
    size_t nfx, capfx;
    bool fx_taken; /* the next push starts a new batch */
    uint64_t fx_dropped;
    struct kvf_cps_effect fx_scratch;
    struct kvf_cps_stats stats;
    uint64_t next_lease_id;
    uint64_t next_serial;
};

/* ---- cp_state.c ---------------------------------------------------------- */

/* The checks of kvf_cps_create() on the options (restore applies them too). */
bool cp_opts_valid(const struct kvf_cps_opts *o);

/* Ensures `n` more effects fit without allocating. */
int cp_fx_reserve(struct kvf_cps *st, size_t n);
/* Appends a zeroed effect of `kind`; never NULL (counts a drop when out of memory). */
struct kvf_cps_effect *cp_fx_push(struct kvf_cps *st, enum kvf_cps_effect_kind kind);
void cp_fx_set_node(struct kvf_cps_effect *fx, const struct cp_node *node);
uint64_t cp_rand_u64(struct kvf_cps *st);
/* Delay before re-send number `attempt` + 1: doubling, capped, jittered down by up to 1/4. */
kvf_time_ns cp_backoff(struct kvf_cps *st, uint32_t attempt);

/* ---- cp_node.c ----------------------------------------------------------- */

struct cp_node *cp_node_current(const struct kvf_cps *st, const char *id);
/* 1..CP_NODE_ID_MAX bytes. */
bool cp_node_id_valid(const char *id);
/* Looks up the current incarnation a node's own call names: -EINVAL, -ENOENT
 * or -ESTALE (not current, or LOST) with a message. */
int cp_node_for_call(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                     struct cp_node **node_p, struct kvf_error *err);
/* -EINVAL naming `field`[i].page_size or .page_count when zero. */
int cp_pool_validate(const struct kvf_cps_pool *p, const char *field, size_t i,
                     struct kvf_error *err);
/* Looks up the reporting node; counts and explains an unknown or stale one. */
int cp_node_for_report(struct kvf_cps *st, const char *id, uint64_t incarnation,
                       struct cp_node **node_p, struct kvf_error *err);
struct cp_pool *cp_node_pool(const struct cp_node *node, uint32_t pool_id);
/* -EINVAL (key too long) or -EBUSY (the key names memory whose leases an
 * older incarnation of `older`'s chain still holds, with another geometry). */
int cp_pool_check_key(const struct cp_node *older, const struct kvf_cps_pool *p, const char *field,
                      size_t i, struct kvf_error *err);
/* A pool object for `p`: the one an older incarnation (from `older` down the
 * chain, NULL: none) still holds leases in under the same key, renamed to
 * p->pool_id with a new reference, or a new one. NULL when out of memory. */
struct cp_pool *cp_pool_new(const struct cp_node *older, const struct kvf_cps_pool *p);
/* -EEXIST when another pool of `node` (another id) has `p`'s key. */
int cp_pool_check_unique(const struct cp_node *node, const struct kvf_cps_pool *p,
                         const char *field, size_t i, struct kvf_error *err);
/* Whether `p`'s key may replace the key of `pool` (same key, or no leases). */
bool cp_pool_key_fits(const struct cp_pool *pool, const struct kvf_cps_pool *p);
void cp_pool_set_key(struct cp_pool *pool, const struct kvf_cps_pool *p);
/* Marks every incarnation of `node`'s chain older than it, up to `gone_inc`,
 * as witnessed gone, and releases what that proves. */
void cp_node_mark_gone(struct kvf_cps *st, struct cp_node *node, uint64_t gone_inc,
                       kvf_time_ns now);
void cp_node_lose(struct kvf_cps *st, struct cp_node *node, kvf_time_ns now);
/* Asks `fencer` to fence `fenced` unless it was asked already. */
void cp_fence_request(struct kvf_cps *st, struct cp_node *fencer, struct cp_node *fenced,
                      kvf_time_ns now);
bool cp_node_fenced_by(const struct cp_node *fenced, const struct cp_node *fencer);
void cp_node_ttl_fire(struct kvf_cps *st, struct cp_node *node, kvf_time_ns now);
void cp_fence_fire(struct kvf_cps *st, struct cp_fence *f, kvf_time_ns now);
/* Frees an old incarnation once nothing refers to it. */
void cp_node_maybe_free(struct kvf_cps *st, struct cp_node *node);
void cp_node_free(struct kvf_cps *st, struct cp_node *node);
void cp_node_link_rnode(struct cp_node *node, struct cp_rnode *rn);
void cp_node_unlink_rnode(struct cp_node *node, struct cp_rnode *rn);
void cp_node_set_state(struct kvf_cps *st, struct cp_node *node, enum kvf_cps_node_state s,
                       kvf_time_ns now);

/* ---- cp_room.c ----------------------------------------------------------- */

int cp_room_abort(struct kvf_cps *st, struct cp_room *room, enum kvf_cps_abort_reason reason,
                  kvf_time_ns now);
/* ABORTING and every node drained or fenced: ABORTED, leases RELEASED. */
void cp_room_try_finish(struct kvf_cps *st, struct cp_room *room, kvf_time_ns now);
bool cp_rnode_quiescent(const struct cp_rnode *rn);
bool cp_rnode_fenced(const struct cp_rnode *rn);
/* Whether the pages of `rn`'s node's leases in its room are proven safe on
 * their own host: drained with the token, or the incarnation witnessed gone. */
bool cp_rnode_host_proven(const struct cp_rnode *rn);
/* A proof from `rn`'s host came in: release its waiting leases (terminal room)
 * or try to finish the barrier (ABORTING). */
void cp_rnode_host_proof(struct kvf_cps *st, struct cp_rnode *rn, kvf_time_ns now);
/* A lease RELEASING in a terminal room: waiting for its host's proof. */
bool cp_part_awaiting(const struct cp_part *p);
void cp_room_timer_fire(struct kvf_cps *st, struct cp_room *room, kvf_time_ns now);
/* `rn`'s node re-attached: sends its room update again (a room that went
 * ACTIVE, still ACTIVE or ABORTING): the same version, or a new one when
 * none was sent since a restore. */
void cp_room_update_reattach(struct kvf_cps *st, struct cp_rnode *rn);
void cp_notice_fire(struct kvf_cps *st, struct cp_rnode *rn, kvf_time_ns now);
/* Sends the notice of `rn` now as the next attempt (re-attach). */
void cp_notice_resend_now(struct kvf_cps *st, struct cp_rnode *rn, kvf_time_ns now);
void cp_notice_cancel(struct kvf_cps *st, struct cp_rnode *rn);
void cp_room_free(struct kvf_cps *st, struct cp_room *room);
void cp_room_set_state(struct kvf_cps *st, struct cp_room *room, enum kvf_cps_room_state s,
                       kvf_time_ns now);
bool cp_room_terminal(const struct cp_room *room);
/* The room's entry for `node` (that incarnation), NULL if none. */
struct cp_rnode *cp_room_rnode(const struct cp_room *room, const struct cp_node *node);
struct cp_room *cp_room_lookup(const struct kvf_cps *st, kvf_room_key key);

/* ---- cp_pages.c ---------------------------------------------------------- */

/* How messages name run `i` of a request whose pages came in `field` (NULL:
 * "ranges"): "ranges[3]", "page_set.ranges[3]", or "page_set.bitmap" for a
 * form without runs of its own (cp_pages.c). Returns buf. */
#define CP_RUN_NAME_MAX 48
const char *cp_pages_run_name(char buf[CP_RUN_NAME_MAX], const char *field, size_t i);
/* Checks that the ranges of a request overlap neither each other nor the
 * ranges `part` already holds (NULL: a new lease). -EINVAL naming the page.
 * Copies and sorts only runs that are not ascending. */
int cp_pages_check_disjoint(const struct cp_part *part, const struct kvf_cps_page_range *ranges,
                            size_t n, const char *field, struct kvf_error *err);
/* Checks that every range is well formed and inside `pool` (-EINVAL). */
int cp_pages_check_bounds(const struct cp_node *node, const struct cp_pool *pool,
                          const struct kvf_cps_page_range *ranges, size_t n, const char *field,
                          struct kvf_error *err);
/* Marks the pages of `ranges` as held by `part` (its role decides read or
 * write). All or nothing: -EBUSY names the page and the other room, -ENOMEM. */
int cp_pages_acquire(struct cp_pool *pool, struct cp_part *part,
                     const struct kvf_cps_page_range *ranges, size_t n, const char *field,
                     struct kvf_error *err);
/* Unmarks every page of `part` and takes it off the pool's lease list. */
void cp_pages_release(struct cp_pool *pool, struct cp_part *part);
void cp_pool_link(struct cp_pool *pool, struct cp_part *part);
/* A pool is shared by the node incarnations that list it and by the leases
 * in it (a restarted node adopts the pools its old incarnation's leases still
 * hold): cp_pool_ref takes a reference, cp_pool_free drops one and frees the
 * pool with the last. */
void cp_pool_ref(struct cp_pool *pool);
void cp_pool_free(struct cp_pool *pool);

#endif /* CP_STATE_INTERNAL_H */
