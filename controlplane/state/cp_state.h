/*
 * cp_state.h: the control-plane state core (rooms, leases, tokens, nodes).
 *
 * This module owns every fact the control plane decides: which nodes are
 * attached, which room-generation owns which pages, which abort token is
 * current, which nodes of an aborting room have drained or been fenced, and when
 * a lease may be RELEASED. It does no I/O and reads no clock: callers pass
 * `now` (monotonic nanoseconds) into every call that may start or fire a timer,
 * and the random source for tokens and jitter comes in through the options.
 * What must happen in the world (a notice to send, an engine to tell) comes out
 * as effects that the caller drains with kvf_cps_effects_take() after each
 * call. The rules where docs/design.md is silent are in docs/state-cores.md.
 *
 * DESIGN: one kvf_cps object is owned by one thread (the control plane's state
 * thread, or a test). Nothing here is thread-safe and nothing blocks. Every
 * operation is O(1) or O(log n) in the number of rooms and leases, plus the size
 * of its own input (pages of a lease, participants of a room).
 *
 * Errors: functions return 0 or a negative errno (common/kvf_error.h) and,
 * when `err` is not NULL, a message naming the field or object at fault. A
 * failed call changes no state and emits no effect.
 */
#ifndef KVF_CP_STATE_H
#define KVF_CP_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"
#include "kvf_types.h"

struct kvf_cps;

/* ---- options ----------------------------------------------------------- */

/* Fills `buf` with `len` random bytes. Tokens and jitter come from here. */
typedef void (*kvf_cps_random_fn)(void *ctx, void *buf, size_t len);

struct kvf_cps_opts {
    kvf_cps_random_fn random_fn; /* required */
    void *random_ctx;
    kvf_time_ns join_timeout;     /* OPENING longer than this: abort. default 30 s */
    kvf_time_ns node_ttl;         /* SUSPECT longer than this: LOST. default 10 s */
    kvf_time_ns drain_deadline;   /* ABORTING longer than this: escalate + fence. default 60 s */
    kvf_time_ns tombstone_ttl;    /* terminal rooms kept this long. default 10 min */
    kvf_time_ns resend_initial;   /* first notice re-send delay. default 200 ms */
    kvf_time_ns resend_max;       /* re-send backoff cap. default 5 s */
    uint32_t max_participants;    /* per room. default 1024 */
    uint32_t max_ranges_per_call; /* page ranges per join/extend. default 65536 */
    uint32_t max_pools_per_node;  /* default 64 */
    uint32_t protocol_min;        /* the control plane's own range. default KVF_PROTOCOL_MIN */
    uint32_t protocol_max;        /* default KVF_PROTOCOL_MAX */
};

/* Fills `opts` with the defaults above (random_fn NULL: the caller sets it). */
void kvf_cps_opts_init(struct kvf_cps_opts *opts);

/* Creates an empty state. Returns NULL on a bad option or out of memory. */
struct kvf_cps *kvf_cps_create(const struct kvf_cps_opts *opts);

/* Frees everything. Accepts NULL. */
void kvf_cps_destroy(struct kvf_cps *st);

/* ---- nodes --------------------------------------------------------------- */

enum kvf_cps_node_state {
    KVF_CPS_NODE_ATTACHED = 1,
    KVF_CPS_NODE_SUSPECT = 2, /* session lost, ttl running */
    KVF_CPS_NODE_LOST = 3,    /* ttl passed or replaced by a new incarnation */
};

/* The longest pool key (bytes, without the terminating NUL). */
#define KVF_CPS_POOL_KEY_MAX 256

/* A KV pool a node serves (registered by an engine on that host). */
struct kvf_cps_pool {
    uint32_t pool_id;    /* unique per node incarnation */
    uint32_t page_size;  /* bytes, > 0 */
    uint32_t page_count; /* > 0 */
    /* The memory's identity on its host, stable across node restarts (the
     * node derives it from the shm name, offset and size, or the engine names
     * it): NULL or "" for none, else at most KVF_CPS_POOL_KEY_MAX bytes. A pool
     * registered by a new incarnation with the key of a pool whose leases an
     * older incarnation still holds is that pool: its page index, and the
     * pages those leases hold, carry over (docs/state-cores.md, "Pools
     * outlive node processes"). */
    const char *key;
};

struct kvf_cps_node_hello {
    const char *node_id;  /* non-empty, at most 128 bytes */
    uint64_t incarnation; /* > 0; a node restart picks a new, larger one */
    uint32_t protocol_min;
    uint32_t protocol_max;
    uint32_t features; /* enum kvf_feature bits */
    const struct kvf_cps_pool *pools;
    size_t pool_count;
    /* The node's witness from its own host: every incarnation of this node id
     * up to and including this one is gone (this process took the node's
     * exclusive host lock, which the kernel frees only when its holder dies).
     * 0: none. Must be below `incarnation`. See kvf_cps_node_witness(). */
    uint64_t witnessed_gone;
};

/*
 * A node session says hello. Same id and incarnation as a known SUSPECT or
 * ATTACHED node: it is ATTACHED again and every pending notice and fence
 * request for it is emitted at once. A new incarnation: the old one is LOST now
 * (its rooms abort, its peers are asked to fence it) and the new one is a new
 * node. An older incarnation than the current one: -ESTALE.
 * No overlap of protocol ranges: -ENOTSUP. On success *version_p is the
 * negotiated (highest common) version.
 * Re-attach with the same incarnation adds or replaces the hello's pools (the
 * rules of kvf_cps_node_set_pool) and keeps pools it does not name.
 */
int kvf_cps_node_attach(struct kvf_cps *st, const struct kvf_cps_node_hello *hello, kvf_time_ns now,
                        uint32_t *version_p, struct kvf_error *err);

/*
 * Node `node_id` at its current `incarnation` (ATTACHED) reports, from its own
 * host, that every older incarnation up to and including `gone_incarnation`
 * can touch nothing any more: its process is dead (a new process took the
 * node's host lock), or this same process gave it up and every lifetime it
 * had is drained with admission shut for good. That is the proof for the
 * pages on the node's own host that peers' fences cannot give: a RELEASING
 * lease of such an incarnation in a terminal room is RELEASED now. Idempotent;
 * incarnations the control plane no longer knows are ignored.
 * Errors: -EINVAL (gone_incarnation 0 or not below `incarnation`), and those
 * of a report from an unknown or stale node (-ENOENT, -ESTALE).
 */
int kvf_cps_node_witness(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                         uint64_t gone_incarnation, kvf_time_ns now, struct kvf_error *err);

/* The node's session ended: ATTACHED -> SUSPECT; the ttl starts. */
int kvf_cps_node_detach(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                        kvf_time_ns now, struct kvf_error *err);

/* Adds or replaces one pool of an attached node. A pool with leases keeps its
 * size: changing it is -EBUSY. */
int kvf_cps_node_set_pool(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                          const struct kvf_cps_pool *pool, struct kvf_error *err);

/* Removes one pool of an attached node (NodeLocal.UnregisterPool, Resync).
 * -ENOENT (unknown pool), -EBUSY (a lease in it is not RELEASED yet). */
int kvf_cps_node_remove_pool(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                             uint32_t pool_id, struct kvf_error *err);

/* A node's PoolUpdate as one change: `up` added or resized (the rules of
 * kvf_cps_node_set_pool), `rm` removed (those of kvf_cps_node_remove_pool).
 * All or nothing: -EINVAL (a bad pool, an id repeated or both upserted and
 * removed), -ENOENT, -EBUSY, -E2BIG (max_pools_per_node) or -ENOMEM change
 * nothing. */
int kvf_cps_node_update_pools(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                              const struct kvf_cps_pool *up, size_t nup, const uint32_t *rm,
                              size_t nrm, struct kvf_error *err);

/* A node-side lifetime state, as node.proto's LifetimeState numbers it. */
enum kvf_cps_lifetime_state {
    KVF_CPS_LT_OPEN = 1,
    KVF_CPS_LT_CLOSED = 2,
    KVF_CPS_LT_DRAINED = 3,
    KVF_CPS_LT_QUARANTINED = 4,
};

struct kvf_cps_resync_lifetime {
    kvf_room_key key; /* exact generation */
    enum kvf_cps_lifetime_state state;
    kvf_token token; /* zero: closed without a notice, or still open */
    uint64_t ops_in_flight;
};

struct kvf_cps_resync_peer {
    const char *node_id;
    uint64_t incarnation;
};

/* A node's full state (node.proto Resync). */
struct kvf_cps_resync {
    const struct kvf_cps_resync_lifetime *lifetimes;
    size_t lifetime_count;
    const struct kvf_cps_resync_peer *fenced;
    size_t fenced_count;
    const struct kvf_cps_pool *pools;
    size_t pool_count;
};

/* What a resync changed, for the log and tests. */
struct kvf_cps_resync_result {
    uint32_t drained;        /* DRAINED lifetimes with the room's current token: counted */
    uint32_t notices;        /* abort notices emitted for terminal or forgotten rooms */
    uint32_t ignored;        /* lifetimes with nothing to reconcile */
    uint32_t fenced;         /* fenced peers recorded (or already known) */
    uint32_t fenced_unknown; /* fenced peers the control plane does not know */
    uint32_t pools_upserted; /* added or resized */
    uint32_t pools_refused;  /* a new size for a pool with leases (kept as it was) */
    uint32_t pools_removed;
    uint32_t pools_kept; /* missing from the list but still leased: kept */
};

/*
 * Reconciles the full state a node reports (after re-attaching with the same
 * incarnation, or when asked). Per lifetime:
 *  - an ABORTING room of this node whose current token the DRAINED lifetime
 *    carries: counts as Drained (kvf_cps_report_drained);
 *  - a lifetime that is not DRAINED, of a room that is terminal (a tombstone)
 *    or forgotten: an abort notice is emitted once (not kept pending: there is
 *    nothing left to wait for) with the token of an ABORTED room, or a zero
 *    token for a COMPLETED or forgotten room (the node closes admission and
 *    has nothing to prove);
 *  - anything else is ignored: a live room's notices and updates follow their
 *    own rules (re-sent on re-attach), a stale token proves nothing.
 * Each fenced peer counts as PeerFenced (kvf_cps_report_fenced). Each pool is
 * upserted (kvf_cps_node_set_pool's rules; a size change on a leased pool is
 * refused and counted) and every pool of the node missing from the list is
 * removed, unless it still has leases (kept, counted).
 * Errors (nothing changes): -EINVAL (a field; a repeated pool id), -E2BIG
 * (more pools than max_pools_per_node), -ENOENT / -ESTALE (the node is not
 * the current ATTACHED incarnation), -EPERM (not ATTACHED), -ENOMEM.
 */
int kvf_cps_node_resync(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                        const struct kvf_cps_resync *rs, kvf_time_ns now,
                        struct kvf_cps_resync_result *result_p, struct kvf_error *err);

/* ---- rooms and leases ---------------------------------------------------- */

enum kvf_cps_room_state {
    KVF_CPS_ROOM_OPENING = 1,
    KVF_CPS_ROOM_ACTIVE = 2,
    KVF_CPS_ROOM_ABORTING = 3,
    KVF_CPS_ROOM_COMPLETED = 4,
    KVF_CPS_ROOM_ABORTED = 5,
};

enum kvf_cps_role {
    KVF_CPS_ROLE_SOURCE = 1, /* prefill side: its lease is read */
    KVF_CPS_ROLE_SINK = 2,   /* decode side: its lease is written */
};

enum kvf_cps_lease_state {
    KVF_CPS_LEASE_ACTIVE = 1,
    KVF_CPS_LEASE_RELEASING = 2,
    KVF_CPS_LEASE_RELEASED = 3,
};

enum kvf_cps_abort_reason {
    KVF_CPS_ABORT_ENGINE = 1,          /* an engine called AbortRoom */
    KVF_CPS_ABORT_ADMIN = 2,           /* an operator */
    KVF_CPS_ABORT_JOIN_TIMEOUT = 3,    /* OPENING past join_timeout */
    KVF_CPS_ABORT_TRANSFER_FAILED = 4, /* a node reported a failed transfer */
    KVF_CPS_ABORT_NODE_LOST = 5,       /* a participant's node is LOST */
    KVF_CPS_ABORT_CAPABILITY = 6,      /* a joiner lacked a feature or version */
};

/* A run of pages [first, first + count). */
struct kvf_cps_page_range {
    uint32_t first;
    uint32_t count; /* > 0 */
};

struct kvf_cps_join {
    uint64_t room_id;          /* 1 .. KVF_ROOM_ID_MAX */
    uint32_t expected_sources; /* the room's shape; > 0, equal in every join */
    uint32_t expected_sinks;   /* > 0 */
    const char *node_id;       /* the participant's node (ATTACHED) */
    uint32_t rank;             /* engine rank; (node, rank, role) unique in the room */
    enum kvf_cps_role role;
    uint32_t engine_protocol_min; /* the engine's own capability set */
    uint32_t engine_protocol_max;
    uint32_t engine_features;
    uint32_t pool_id;                        /* a pool of that node */
    const struct kvf_cps_page_range *ranges; /* may be empty (a dummy rank) */
    size_t range_count;
    /* How messages name the pages: NULL is "ranges", indexed ("ranges[3]");
     * a name ending in "ranges" is indexed too ("page_set.ranges[3]"); any
     * other ("page_set.deltas") names the whole field: the request's pages
     * came decoded from a form without runs of its own. */
    const char *pages_field;
    /* Optional: the address of the caller's malloc'd array behind `ranges`.
     * A join that succeeds keeps that array as the lease's own runs instead
     * of copying it, and sets *ranges_adopt_p to NULL; a join that fails
     * leaves it to the caller. NULL: the core copies `ranges`. */
    struct kvf_cps_page_range **ranges_adopt_p;
};

struct kvf_cps_join_result {
    kvf_room_key key;
    uint64_t lease_id;
    enum kvf_cps_room_state room_state; /* after this join */
};

/*
 * A participant joins a room with its lease. Creates the room (next generation
 * when the id is free or only a tombstone), checks the shape, the node's and
 * the engine's capabilities, the pool bounds and overlaps, then grants the
 * lease. The last expected join makes the room ACTIVE and emits a room update
 * for every node of the room. Errors: -EINVAL (a field), -ENOENT (node or
 * pool), -ENOTSUP (capability: the room is aborted too), -EBUSY (overlap),
 * -E2BIG (limits), -ECANCELED (room is aborting), -EEXIST (same participant,
 * other lease), -EAGAIN (the node is SUSPECT: retry once its session is back;
 * nothing changes). A LOST node is -ENOENT. The -ENOTSUP abort applies to a
 * room that exists; a refused first joiner creates nothing. A page may not be
 * read and written at once, even by two participants of one room.
 */
int kvf_cps_join(struct kvf_cps *st, const struct kvf_cps_join *join, kvf_time_ns now,
                 struct kvf_cps_join_result *result_p, struct kvf_error *err);

/* Adds pages to a lease (chunked prefill). The room must be OPENING or ACTIVE
 * and `key` current (generation 0 is -EINVAL here). Emits a room update to the
 * room's nodes when ACTIVE. max_ranges_per_call also bounds the lease's total
 * number of ranges. */
int kvf_cps_lease_extend(struct kvf_cps *st, kvf_room_key key, uint64_t lease_id,
                         const struct kvf_cps_page_range *ranges, size_t range_count,
                         kvf_time_ns now, struct kvf_error *err);
/* The same, with messages naming the pages as `field` does (kvf_cps_join's
 * pages_field; NULL: "ranges"). */
int kvf_cps_lease_extend_named(struct kvf_cps *st, kvf_room_key key, uint64_t lease_id,
                               const struct kvf_cps_page_range *ranges, size_t range_count,
                               const char *field, kvf_time_ns now, struct kvf_error *err);

/* The most runs of pages one lease may hold (opts.max_ranges_per_call): what
 * a page-set decoder may produce for one request. */
uint32_t kvf_cps_max_ranges(const struct kvf_cps *st);

/*
 * Aborts a room-generation (generation 0: the current generation of the id).
 * The first abort moves the room to ABORTING, mints the token, marks its leases
 * RELEASING and emits an abort notice to each of its nodes. A later abort
 * returns the same token and changes nothing. An aborted or completed room:
 * returns its token (all zero for COMPLETED) with -EPERM for COMPLETED.
 */
int kvf_cps_room_abort(struct kvf_cps *st, kvf_room_key key, enum kvf_cps_abort_reason reason,
                       kvf_time_ns now, kvf_token *token_p, struct kvf_error *err);

/* ---- node reports ----------------------------------------------------------- */

/* A node reports that one of its participants finished all its ops well. When
 * every participant completed, the room is COMPLETED and its leases RELEASED. */
int kvf_cps_report_completed(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                             kvf_room_key key, uint32_t rank, enum kvf_cps_role role,
                             kvf_time_ns now, struct kvf_error *err);

/*
 * Node `node_id` applied the room update of `key` (exact generation) with
 * `version` (kvf_cps_effect.version of its KVF_CPS_FX_ROOM_UPDATE). When that
 * is the newest update the node was sent and the room is ACTIVE, the node's
 * leases as that update carried them are published: every other node of the
 * room is sent a new update that includes them. Until then an update to
 * another node leaves them out (participant view `published`), so no source
 * learns sink pages that the sink's node does not know yet, and no node
 * learns a member before its node knows the room (docs/state-cores.md,
 * "Ordered room updates"). A duplicate, an ack of an update a newer one
 * replaced, or one for a room no longer ACTIVE: 0, nothing changes, counted
 * (stats acks_ignored). A version never sent to that node: -ESTALE; a room
 * the node is not in: -ENOENT; both counted like other refused reports.
 */
int kvf_cps_room_update_acked(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                              kvf_room_key key, uint64_t version, kvf_time_ns now,
                              struct kvf_error *err);

/* A node reports a failed transfer: the room aborts (all or nothing). */
int kvf_cps_report_failed(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                          kvf_room_key key, kvf_time_ns now, kvf_token *token_p,
                          struct kvf_error *err);

/*
 * A node reports that its lifetime for `key` is drained, with the token of the
 * abort notice. Counts only with the current token of the current generation,
 * from the current incarnation of a node of that room: else -ESTALE (stale or
 * foreign token or generation), -EINVAL (no token), -ENOENT (unknown room) and
 * the report is counted in the stats. A repeated valid report returns 0 and
 * changes nothing. A node that is not in the room: -ENOENT, counted as unknown.
 */
int kvf_cps_report_drained(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                           kvf_room_key key, kvf_token token, kvf_time_ns now,
                           struct kvf_error *err);

/*
 * The same, for a lifetime of an older incarnation `lifetime_incarnation` of
 * the reporting node (a process that self-fenced keeps its old lifetimes and
 * reports them under its new incarnation). The token proves it: only that
 * incarnation was sent it. `lifetime_incarnation` equal to `incarnation` is
 * kvf_cps_report_drained(). An unknown older incarnation: -ENOENT, counted.
 */
int kvf_cps_report_drained_of(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                              uint64_t lifetime_incarnation, kvf_room_key key, kvf_token token,
                              kvf_time_ns now, struct kvf_error *err);

/* Node `node_id` reports that it fenced `fenced_node` at `fenced_incarnation`. */
int kvf_cps_report_fenced(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                          const char *fenced_node, uint64_t fenced_incarnation, kvf_time_ns now,
                          struct kvf_error *err);

/* An operator asks every node that shares a room with `node_id` to fence it. */
int kvf_cps_admin_fence(struct kvf_cps *st, const char *node_id, kvf_time_ns now,
                        struct kvf_error *err);

/* ---- time --------------------------------------------------------------- */

/* Fires every timer due at `now`: join timeouts, node ttl, notice re-sends,
 * drain deadlines, tombstone expiry. */
void kvf_cps_tick(struct kvf_cps *st, kvf_time_ns now);

/* The earliest pending deadline, or UINT64_MAX when none: the caller sleeps
 * until then (or until its next input). */
kvf_time_ns kvf_cps_next_deadline(const struct kvf_cps *st);

/* ---- effects ------------------------------------------------------------- */

enum kvf_cps_effect_kind {
    KVF_CPS_FX_ROOM_UPDATE = 1,    /* to node: the room's leases (read them with kvf_cps_room_get:
                                      its own all, other nodes' as far as `published`), `version` */
    KVF_CPS_FX_ABORT_NOTICE = 2,   /* to node: AbortNotice{key, token}; attempt counts re-sends */
    KVF_CPS_FX_FENCE_PEER = 3,     /* to node: fence peer_node at peer_incarnation */
    KVF_CPS_FX_LEASE_RELEASED = 4, /* tell the engine: lease_id of key is RELEASED */
    KVF_CPS_FX_ROOM_STATE = 5,     /* watchers: key moved old_state -> new_state */
    KVF_CPS_FX_NODE_STATE = 6,     /* node moved to new_state */
    KVF_CPS_FX_ESCALATION = 7,     /* key's node has not drained by the deadline */
};

struct kvf_cps_effect {
    enum kvf_cps_effect_kind kind;
    kvf_room_key key;
    char node_id[129];    /* the addressee (notices, fences) or the subject */
    uint64_t incarnation; /* of node_id */
    char peer_node[129];  /* FENCE_PEER: the node to fence */
    uint64_t peer_incarnation;
    kvf_token token;   /* ABORT_NOTICE */
    uint32_t attempt;  /* ABORT_NOTICE, FENCE_PEER: 0 first send, then re-sends */
    uint64_t lease_id; /* LEASE_RELEASED */
    uint64_t version;  /* ROOM_UPDATE: the node answers kvf_cps_room_update_acked with it */
    uint32_t rank;     /* LEASE_RELEASED: the lease's participant */
    enum kvf_cps_role role;
    int old_state; /* ROOM_STATE / NODE_STATE */
    int new_state;
    /* ROOM_STATE: when the room entered old_state (0 for a new room) and when
     * it left it, in the core's time: ABORTING -> ABORTED gives the abort ->
     * released latency with no bookkeeping outside the core. */
    kvf_time_ns old_since;
    kvf_time_ns since;
    enum kvf_cps_abort_reason reason; /* ROOM_STATE into ABORTING */
};

/* Hands the caller every effect emitted since the last take. The array stays
 * valid until the next call into `st`. */
const struct kvf_cps_effect *kvf_cps_effects_take(struct kvf_cps *st, size_t *count_p);

/* How many effects the next take would hand over (0 if none), without taking
 * them: a command that emitted none and failed changed nothing. */
size_t kvf_cps_effects_pending(const struct kvf_cps *st);

/* ---- views (admin, room updates, tests) ----------------------------------- */

struct kvf_cps_participant_view {
    const char *node_id;
    uint64_t incarnation;
    uint32_t rank;
    enum kvf_cps_role role;
    uint64_t lease_id;
    uint32_t pool_id;
    uint32_t pool_page_size; /* the pool's geometry, for room updates */
    uint32_t pool_page_count;
    enum kvf_cps_lease_state lease_state;
    bool completed;
    bool node_drained; /* its node reported drained with the token */
    bool node_fenced;  /* every other node of the room fenced its node (or is lost) */
    /* How many of the room's other nodes fenced its node (acknowledged): 0
     * when no fence happened, also where node_fenced holds because there is
     * no other live node to ask (a single-node room). */
    uint32_t node_fences;
    /* Abort notices sent to its node for the room, the first included; 0: none. */
    uint32_t notice_attempts;
    /* RELEASING in a terminal room: its node is LOST and its host has not
     * proven yet that the lost incarnation stopped (its Drained, or its death
     * witnessed there). Peers' fences prove nothing here; no timer ends it. */
    bool awaiting_host_proof;
    const struct kvf_cps_page_range *ranges; /* valid until the next mutating call */
    size_t range_count;
    /* What the room's other nodes may be told of this lease: its node
     * acknowledged an update that carried it, with its first
     * `published_range_count` ranges (kvf_cps_room_update_acked). */
    bool published;
    size_t published_range_count;
};

struct kvf_cps_room_view {
    kvf_room_key key;
    enum kvf_cps_room_state state;
    enum kvf_cps_abort_reason abort_reason; /* when ABORTING / ABORTED */
    kvf_token token;                        /* zero until aborted */
    uint32_t expected_sources;
    uint32_t expected_sinks;
    uint32_t protocol_version; /* common version, 0 while none joined */
    kvf_time_ns created_at;
    kvf_time_ns state_since;
    bool escalated; /* drain deadline passed */
    size_t participant_count;
};

/* Looks up a room-generation (generation 0: current). -ENOENT if unknown
 * (including an expired tombstone). */
int kvf_cps_room_get(const struct kvf_cps *st, kvf_room_key key, struct kvf_cps_room_view *view_p);

/* Fills the view of participant `index` (0 .. participant_count - 1). */
int kvf_cps_room_participant(const struct kvf_cps *st, kvf_room_key key, size_t index,
                             struct kvf_cps_participant_view *view_p);

struct kvf_cps_node_view {
    const char *node_id;
    uint64_t incarnation;
    enum kvf_cps_node_state state;
    uint32_t protocol_version;
    uint32_t features;
    size_t pool_count;
    size_t room_count;     /* non-terminal rooms with a participant on it */
    bool gone;             /* witnessed gone on its host (kvf_cps_node_witness) */
    uint32_t protocol_min; /* the range it advertised at attach */
    /* When it entered its state; 0: unknown (restored from a snapshot). */
    kvf_time_ns state_since;
    uint32_t protocol_max;
};

/* Current incarnation of a node id; -ENOENT if unknown. */
int kvf_cps_node_get(const struct kvf_cps *st, const char *node_id,
                     struct kvf_cps_node_view *view_p);

/* What an operator asks about one node beyond its view (Admin GetNode,
 * ListNodes); walks the node's rooms and fences, so not for hot paths. */
struct kvf_cps_node_detail {
    uint32_t notices_pending; /* abort notices and fence requests addressed to it, unacked */
    uint32_t fenced_by;       /* peers that fenced this incarnation (acknowledged) */
    uint32_t fences_pending;  /* fences of it requested from peers, not acknowledged yet */
};

/* The detail of the current incarnation of `node_id`; -ENOENT if unknown. */
int kvf_cps_node_detail_get(const struct kvf_cps *st, const char *node_id,
                            struct kvf_cps_node_detail *detail_p);

struct kvf_cps_stats {
    uint64_t rooms_by_state[6];  /* indexed by enum kvf_cps_room_state; tombstones count */
    uint64_t leases_by_state[4]; /* indexed by enum kvf_cps_lease_state */
    uint64_t nodes_by_state[4];  /* indexed by enum kvf_cps_node_state */
    uint64_t notices_pending;    /* abort notices + fence requests not yet acknowledged */
    uint64_t notices_sent;       /* first sends */
    uint64_t notices_resent;
    uint64_t reports_stale; /* stale generation / token / incarnation */
    uint64_t reports_tokenless;
    uint64_t reports_unknown;     /* unknown room or node */
    uint64_t rooms_past_deadline; /* ABORTING rooms past their drain deadline now */
    uint64_t fences_requested;
    uint64_t generation; /* the last generation minted */
    /* RELEASING leases of terminal rooms, waiting for a proof from their
     * node's host (participant view awaiting_host_proof). */
    uint64_t leases_awaiting_host_proof;
    /* Room update acks that changed nothing: duplicates, acks of an update a
     * newer one replaced, acks for a room no longer ACTIVE. Not in the
     * snapshot. */
    uint64_t acks_ignored;
};

void kvf_cps_stats_get(const struct kvf_cps *st, struct kvf_cps_stats *stats_p);

/* Visits every non-expired room (any state). Order unspecified. Stop early by
 * returning non-zero from `fn`, which is then returned. */
int kvf_cps_room_foreach(const struct kvf_cps *st,
                         int (*fn)(void *ctx, const struct kvf_cps_room_view *view), void *ctx);

/* Pool `index` (0 .. pool_count - 1) of the current incarnation of a node.
 * -ENOENT if the node or the index is unknown. */
int kvf_cps_node_pool_get(const struct kvf_cps *st, const char *node_id, size_t index,
                          struct kvf_cps_pool *pool_p);

/* Visits the current incarnation of every known node id. Order unspecified.
 * Stop early by returning non-zero from `fn`, which is then returned. The view
 * is valid during the call only. */
int kvf_cps_node_foreach(const struct kvf_cps *st,
                         int (*fn)(void *ctx, const struct kvf_cps_node_view *view), void *ctx);

/* Names for logs and admin output. */
const char *kvf_cps_room_state_name(enum kvf_cps_room_state s);
const char *kvf_cps_lease_state_name(enum kvf_cps_lease_state s);
const char *kvf_cps_node_state_name(enum kvf_cps_node_state s);
const char *kvf_cps_abort_reason_name(enum kvf_cps_abort_reason r);

/* ---- snapshot and restore --------------------------------------------------- */

/*
 * Writes an image of the whole state to `write_fn`, in pieces of at most 4 KiB,
 * for the store's periodic snapshots (controlplane/store/store.h). The image is
 * binary, little-endian and fixed-width: the magic "KVFCPS", a format version,
 * the counters (last generation, next lease id, node serials, timer sequence),
 * the stats, the pools (sizes), every node incarnation still referenced (state,
 * capabilities, pools, fence records with acked / pending and attempts), every
 * room including tombstones (key, state, reason, token, escalation, shape,
 * protocol range, participants with their leases, page ranges and completion,
 * room-nodes with drained / notice pending / attempt), the order of the lists
 * the rules walk, and a trailer. Times are re-based: created_at and state_since
 * are written as ages at `now`, and every armed timer as its remaining time at
 * `now` (negative when overdue), because a monotonic clock does not survive a
 * restart. The options are not in the image (restore takes the caller's), and
 * neither are pending effects (the caller drains them after every call). The
 * same state at the same `now` gives the same bytes.
 *
 * `write_fn` returns 0, or a negative errno that stops the snapshot and is
 * returned (a positive value is returned as -EIO). Other errors: -EINVAL (a
 * NULL argument), -ENOMEM (the snapshot indexes the state in temporary tables).
 * The state is not changed and no effect is emitted. O(n log n) in the number
 * of rooms and nodes plus the size of the leases.
 */
int kvf_cps_snapshot(const struct kvf_cps *st, kvf_time_ns now,
                     int (*write_fn)(void *ctx, const void *buf, size_t len), void *ctx);

/*
 * Rebuilds a state from an image of kvf_cps_snapshot() at `now`: the maps, the
 * page index of every pool (writers and readers of every lease not RELEASED)
 * and the timer heap, with each deadline at `now` plus the remaining time the
 * image recorded (overdue timers fire at the next kvf_cps_tick()). `opts` is
 * checked as by kvf_cps_create() and replaces the options of the snapshotted
 * state; the random source starts where the caller's is.
 *
 * Every count, index, enum and cross-reference is checked against the image and
 * its length, and the state must be consistent (stats against the objects, one
 * lease per page writer, lease states against room states, ...): a malformed,
 * truncated or other-version image, or trailing bytes, is -EBADMSG with the
 * byte offset in the message. Other errors: -EINVAL (NULL or invalid options,
 * NULL image), -ENOMEM. On error it returns NULL, sets `err` (when not NULL)
 * and leaves nothing allocated; it never returns a half-built state. The
 * caller frees the result with kvf_cps_destroy().
 *
 * Nodes keep their states: a node that was ATTACHED is still ATTACHED, though
 * no session survives a restart. The service therefore calls
 * kvf_cps_node_detach() for every ATTACHED node right after restore, before it
 * accepts sessions: the node ttl starts, and a node that comes back within it
 * re-attaches with the same incarnation and gets its pending notices and fence
 * requests again at once. (A SUSPECT node keeps its remaining ttl; a LOST one
 * stays LOST.)
 */
struct kvf_cps *kvf_cps_restore(const struct kvf_cps_opts *opts, const void *image, size_t len,
                                kvf_time_ns now, struct kvf_error *err);

#endif /* KVF_CP_STATE_H */
