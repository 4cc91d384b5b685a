/*
 * node_core.h: the node's rules, as a pure state core (no I/O, no clock, no
 * threads, no gRPC codes).
 *
 * The core owns the lifetime table (dataplane/lifetime) and decides, in one
 * place each:
 *   - when a room is drained (its lifetime proven drained) and what that
 *     means: the DRAINED watch event, the Drained report of an aborted room
 *     (with its abort token), nothing more for a room that ended well;
 *   - when a local sink is complete (every lease page covered, every landed
 *     byte named by an ok TransferStatus, no receive in flight) and when a
 *     room's local participants are all complete (admission closes then);
 *   - how an abort notice closes a room (admission shut, peer channel closed,
 *     Drained once proven, again for a repeated notice);
 *   - how long a room that ended stays known: terminal rooms are retained for
 *     a bounded count (`retain_max`, never a clock) and then forgotten, the
 *     lifetime with them; the caller frees what it hung on the room when the
 *     core says so (KVF_NCORE_FX_ROOM_FREE);
 *   - which peer slot (transport peer index) a peer incarnation uses: a slot
 *     of a fenced incarnation that no room references is recycled, so that
 *     FencePeer never fails for lack of slots while rooms come and go.
 * What follows from a decision is emitted as effects into a queue that the
 * caller drains with kvf_ncore_fx_take() (the control plane's core works the
 * same way, docs/state-cores.md). A refused call returns a negative errno and
 * sets a short reason (kvf_ncore_reason()); it changes nothing and emits
 * nothing.
 *
 * DESIGN: one owner thread (the node's owner thread, or a test stepping it
 * by hand) makes every call. Rooms are records the caller embeds in its own
 * room struct (struct kvf_ncore_room, like struct kvf_lt_op): the caller
 * reads their fields and writes none of them; the core links them into its
 * retention queue. The lifetime's admission and retirement stay callable
 * from any thread as lifetime.h says.
 */
#ifndef KVF_NODE_CORE_H
#define KVF_NODE_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"
#include "lifetime.h"

struct kvf_ncore;

struct kvf_ncore_opts {
    /* Terminal rooms kept known (watch snapshots, Resync, repeated notices)
     * before the oldest is forgotten. Default 1024; 0 forgets at once. */
    size_t retain_max;
    /* Peer slots (transport peer indices are < max_peers). Default 64. */
    uint32_t max_peers;
};

void kvf_ncore_opts_init(struct kvf_ncore_opts *o);

/* NULL on out of memory or bad options (max_peers 0). */
struct kvf_ncore *kvf_ncore_create(const struct kvf_ncore_opts *o);

/* Frees the core and its lifetime table; rooms still linked are only
 * unlinked (the caller frees its own). Accepts NULL. */
void kvf_ncore_destroy(struct kvf_ncore *c);

/* The lifetime table (the core owns it; callers use it as lifetime.h says). */
struct kvf_lt_table *kvf_ncore_lts(struct kvf_ncore *c);

/* The reason of the last refused call ("" if none): a short phrase naming
 * what was wrong, for the edge to put in its status message. */
const char *kvf_ncore_reason(const struct kvf_ncore *c);

/* ---- effects ----------------------------------------------------------------- */

enum kvf_ncore_fx_kind {
    KVF_NCORE_FX_ROOM_DRAINED = 1, /* the lifetime is proven drained (once per room) */
    KVF_NCORE_FX_SEND_DRAINED,     /* report Drained{room, token, notice_id} */
    KVF_NCORE_FX_SEND_COMPLETED,   /* report Completed{room, rank, role} */
    KVF_NCORE_FX_CLOSE_PEERS,      /* the peer channel must answer LATE for the room */
    KVF_NCORE_FX_ROOM_ABORTING,    /* the room entered ABORTING here (watch event) */
    KVF_NCORE_FX_ROOM_FREE,        /* the room is forgotten: free what `user` owns */
    KVF_NCORE_FX_PEER_RECYCLE,     /* slot `peer` is given to a new incarnation */
    KVF_NCORE_FX_SEND_FAILED,      /* report TransferFailed{room, rank, role, reason} */
};

struct kvf_ncore_fx {
    enum kvf_ncore_fx_kind kind;
    kvf_room_key room;
    void *user; /* the room's user pointer (room effects) */
    uint32_t rank;
    bool sink; /* SEND_COMPLETED: the role */
    uint32_t peer;
    bool fence;       /* PEER_RECYCLE: the old incarnation was never fenced here: fence it first */
    char reason[128]; /* SEND_FAILED */
};

/* Takes the oldest pending effect into *fx_p: true, or false when none. */
bool kvf_ncore_fx_take(struct kvf_ncore *c, struct kvf_ncore_fx *fx_p);
size_t kvf_ncore_fx_pending(const struct kvf_ncore *c);

/* ---- rooms ------------------------------------------------------------------- */

/* The core's record of one room-generation, embedded in the caller's room.
 * Fields are the core's; the caller reads them. */
struct kvf_ncore_room {
    kvf_room_key key;
    void *user;
    struct kvf_lt *lt;
    kvf_token token;      /* the abort token, zero until an abort notice */
    uint64_t notice_id;   /* the abort notice's id */
    uint32_t local_parts; /* local participants (kvf_ncore_room_members) */
    uint32_t local_done;  /* of them complete */
    uint32_t holds;       /* caller records that point at the room (kvf_ncore_room_hold) */
    bool aborting;        /* an abort notice with a token arrived */
    bool drained_seen;    /* ROOM_DRAINED was emitted */
    bool drained_sent;    /* SEND_DRAINED was emitted at least once */
    bool peers_closed;    /* CLOSE_PEERS was emitted */
    bool ended;           /* its outcome is settled here (see kvf_ncore_room_terminal) */
    bool retained;        /* in the retention queue */
    struct kvf_ncore_room *rnext, *rprev;
};

/* Opens the room's lifetime (OPEN) and fills `r`. -ESTALE for a late
 * generation, -EEXIST, -EINVAL, -ENOMEM as kvf_lt_table_open; then `r` is
 * untouched. */
int kvf_ncore_room_open(struct kvf_ncore *c, struct kvf_ncore_room *r, kvf_room_key key,
                        void *user);

/* A RoomUpdate named `nlocal` local participants of which `ndone` are
 * already complete (progress carried over). Emits nothing by itself. */
void kvf_ncore_room_members(struct kvf_ncore *c, struct kvf_ncore_room *r, uint32_t nlocal,
                            uint32_t ndone);

/* THE drain decision. If the room's lifetime is DRAINED: ROOM_DRAINED (first
 * time only, with CLOSE_PEERS if not yet), SEND_DRAINED if the room is
 * aborting and Drained was not sent yet; the room becomes terminal when it
 * ended (queued for retention). Otherwise nothing. */
void kvf_ncore_room_check(struct kvf_ncore *c, struct kvf_ncore_room *r);

/* An abort notice with a non-zero token: closes admission, CLOSE_PEERS and
 * ROOM_ABORTING the first time, keeps the (latest) token and notice id, and
 * if drained emits ROOM_DRAINED (once) and SEND_DRAINED (again for every
 * repeated notice). The room has ended. */
void kvf_ncore_room_abort(struct kvf_ncore *c, struct kvf_ncore_room *r, kvf_token token,
                          uint64_t notice_id);

/* A tokenless abort notice (the room completed or is unknown to the control
 * plane): closes admission; nothing to report. The room has ended. */
void kvf_ncore_room_end(struct kvf_ncore *c, struct kvf_ncore_room *r);

/* True when the room is terminal: ended and proven drained. */
bool kvf_ncore_room_terminal(const struct kvf_ncore_room *r);

/* ---- sink completion ------------------------------------------------------------ */

/* A local sink's progress, as the caller counts it. */
struct kvf_ncore_sink {
    uint64_t pages;        /* pages in its lease */
    uint64_t pages_landed; /* distinct lease pages covered by whole-page frames */
    uint64_t bytes_landed; /* payload bytes of frames that landed */
    uint64_t status_bytes; /* bytes named by ok TransferStatus messages */
    uint32_t rx_inflight;  /* receives admitted whose bytes may still be landing */
};

/* THE completion rule of a sink: every lease page covered, every landed byte
 * accounted for by a source's ok status, no receive in flight. */
bool kvf_ncore_sink_ready(const struct kvf_ncore_sink *s);

/* Local participant `rank` (`sink`: its role) of `r` is complete (a sink
 * that kvf_ncore_sink_ready said yes to, a source whose pairs all finished):
 * SEND_COMPLETED; once every local participant is complete, admission
 * closes (CLOSE_PEERS) and the room has ended (and may drain right here).
 * -ECANCELED (nothing emitted) for an aborting room. */
int kvf_ncore_part_completed(struct kvf_ncore *c, struct kvf_ncore_room *r, uint32_t rank,
                             bool sink);

/* ---- chunk admission ------------------------------------------------------------- */

/* What the caller's room says about a SubmitChunk (its members and pairs). */
struct kvf_ncore_chunk {
    bool have_update;   /* a RoomUpdate arrived */
    bool src_local;     /* a source participant of src_rank is on this node */
    bool src_completed; /* ... and it reported Completed */
    bool src_failed;    /* ... and it reported TransferFailed already */
    bool sink_known;    /* a sink participant (sink_node, sink_rank) is in the room */
    /* Not known, but sink_node is a node the room's update introduced and
     * none of its members is known here yet: the control plane publishes them
     * once that node acknowledged its own update (retry, -EAGAIN). */
    bool sink_unpublished;
    bool pair_exists;         /* the pair (src_rank, sink) had a chunk */
    bool pair_last_submitted; /* ... and its last one */
    uint64_t pair_last_seq;
    uint64_t seq;
    uint32_t src_rank;
    uint32_t sink_rank;
    const char *sink_node;
};

/* A chunk for a room this node does not have: -ESTALE (late: forgotten,
 * older, or the node is stopping) or -EAGAIN (its RoomUpdate is not here
 * yet: retry). Sets the reason; emits nothing. */
int kvf_ncore_chunk_no_room(struct kvf_ncore *c, kvf_room_key key, bool stopping);

/* The room's state rules for a chunk, before the lease geometry the caller
 * checks: 0, or -ECANCELED (aborting; closed), -EAGAIN (no RoomUpdate yet),
 * -EPROTO (no local source of that rank; no such sink; the source completed),
 * with the reason naming the field. A chunk for a pair the source never had,
 * after the source reported Completed, also fails the room: SEND_FAILED for
 * the source (once: not when src_failed), so that the room ends through the
 * token path instead of staying ACTIVE with a sink that cannot complete. */
int kvf_ncore_chunk_state(struct kvf_ncore *c, struct kvf_ncore_room *r,
                          const struct kvf_ncore_chunk *q);

/* The pair's order: 0, -EPROTO after the pair's last chunk, -EEXIST for a
 * chunk_seq not above the last one admitted. */
int kvf_ncore_chunk_order(struct kvf_ncore *c, const struct kvf_ncore_chunk *q);

/* ---- retention ---------------------------------------------------------------- */

/* Forgets the oldest terminal rooms beyond retain_max (a held one is
 * skipped and stays until a later call): each one's lifetime
 * is forgotten (later messages for it are late) and ROOM_FREE is emitted
 * for it; after this call the record is unlinked and the caller may free
 * its room. Call at a point where no room pointer is held (the end of a
 * turn of the owner loop). Returns how many were forgotten. */
size_t kvf_ncore_collect(struct kvf_ncore *c);

/* A caller record (a chunk in a staging queue, say) points at the room:
 * the room is not forgotten while held. */
void kvf_ncore_room_hold(struct kvf_ncore_room *r);
void kvf_ncore_room_release(struct kvf_ncore_room *r);

/* Unlinks `r` from the retention queue (the caller frees a room on its own,
 * e.g. at shutdown). */
void kvf_ncore_room_unlink(struct kvf_ncore *c, struct kvf_ncore_room *r);

/* ---- peer slots --------------------------------------------------------------- */

/* The slot of (node_id, incarnation): 0 and *idx_p, or -ENOENT. */
int kvf_ncore_peer_find(const struct kvf_ncore *c, const char *node_id, uint64_t incarnation,
                        uint32_t *idx_p);

/* The slot of (node_id, incarnation), taken if new: a free slot, else the
 * lowest slot that no room references: first one of a fenced incarnation,
 * then one of an older incarnation of the same node (it restarted or fenced
 * itself; no room will name it again), then any (a peer no live room talks
 * to; it gets a slot again when a room names it). PEER_RECYCLE is emitted
 * for it first: the caller drops the old peer's transport state before it
 * uses the slot, and fences it first when fx.fence says it was not fenced. *fresh_p (may be NULL):
 * the slot is new to this incarnation. -EINVAL for an empty or overlong id, -E2BIG when every slot
 * is live or referenced. */
int kvf_ncore_peer_get(struct kvf_ncore *c, const char *node_id, uint64_t incarnation,
                       uint32_t *idx_p, bool *fresh_p);

/* The slot's incarnation was fenced (its ops are stopped). */
void kvf_ncore_peer_fenced(struct kvf_ncore *c, uint32_t idx);
bool kvf_ncore_peer_is_fenced(const struct kvf_ncore *c, uint32_t idx);

/* A room names the slot's incarnation (ref) or stopped naming it (unref):
 * a referenced slot is never recycled. */
void kvf_ncore_peer_ref(struct kvf_ncore *c, uint32_t idx);
void kvf_ncore_peer_unref(struct kvf_ncore *c, uint32_t idx);

/* Every slot is free again (a self-fence: the new incarnation starts with no
 * peers; the caller dropped every room's references first). No effect. */
void kvf_ncore_peers_reset(struct kvf_ncore *c);

/* ---- counters ----------------------------------------------------------------- */

struct kvf_ncore_stats {
    size_t retained;          /* terminal rooms kept */
    uint64_t rooms_opened;    /* every kvf_ncore_room_open that succeeded */
    uint64_t rooms_forgotten; /* by kvf_ncore_collect */
    size_t lifetimes;         /* in the lifetime table */
    uint32_t peers_used;      /* slots holding an incarnation */
    uint64_t peers_recycled;
    size_t fx_cap;       /* the effect queue's capacity (it never shrinks) */
    uint64_t fx_dropped; /* effects lost because the queue could not grow */
};

void kvf_ncore_stats(const struct kvf_ncore *c, struct kvf_ncore_stats *s_p);

#endif /* KVF_NODE_CORE_H */
