/*
 * lifetime.h: the node lifetime core (admission, in-flight accounting, drain).
 *
 * A node keeps one lifetime per room-generation. The lifetime decides whether a
 * new op may start (admission), counts every native op in flight by kind, and
 * says exactly once when the room is drained: admission closed and nothing in
 * flight, proven by completions. It
 * does no I/O and reads no clock; the transports and staging engines call in
 * when they post and when they reap. The rules are in docs/state-cores.md.
 *
 * DESIGN: the table (room key -> lifetime) and everything but admission and
 * retirement belong to one owner thread (the node's room thread, or a test).
 * kvf_lt_admit() and kvf_lt_op_retire() may be called from any thread: they
 * touch only the lifetime's own atomic word, never a lock or a word shared
 * between rooms, and an op carries its lifetime pointer so that retirement needs
 * no lookup. The owner learns of a drain through the return value of the call
 * that caused it (whichever thread made it) and must take the lifetime's
 * drained event with kvf_lt_take_drained() on its own thread. A lifetime is
 * freed only by kvf_lt_table_forget(), which refuses while ops are in flight.
 *
 * Errors: 0 or a negative errno (common/kvf_error.h).
 */
#ifndef KVF_LIFETIME_H
#define KVF_LIFETIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"

struct kvf_lt;
struct kvf_lt_table;

/* What kind of native work an op is (docs/design.md §1, "operation"). */
enum kvf_lt_op_kind {
    KVF_LT_OP_RDMA_WR = 0,   /* a posted RDMA work request */
    KVF_LT_OP_TCP_FRAME = 1, /* a TCP frame being written, or received into pages */
    KVF_LT_OP_CUDA_COPY = 2, /* a CUDA copy (gather/scatter) */
    KVF_LT_OP_STAGING = 3,   /* a staging buffer owned by the room */
    KVF_LT_OP_KIND_COUNT = 4,
};

enum kvf_lt_state {
    KVF_LT_OPEN = 1,        /* admission open */
    KVF_LT_CLOSED = 2,      /* admission shut; ops draining */
    KVF_LT_DRAINED = 3,     /* shut and nothing in flight: proven */
    KVF_LT_QUARANTINED = 4, /* shut, and an op failed without proof that it stopped */
};

/* How a native op ended, as its completion (or error return) says. */
enum kvf_lt_outcome {
    KVF_LT_DONE_OK = 1,      /* completed successfully */
    KVF_LT_DONE_ERROR = 2,   /* terminal error completion: the op has stopped */
    KVF_LT_DONE_FLUSHED = 3, /* flushed by a fence (QP in error): the op has stopped */
};

/*
 * One op in flight. The caller embeds it in its own tag (the struct a wr_id
 * points at, a frame descriptor, a copy record) and recovers the tag with
 * container_of. Fields are the core's; callers only read `lt`.
 */
struct kvf_lt_op {
    struct kvf_lt *lt;
    uint32_t peer; /* node-local peer index the op talks to (fencing) */
    uint8_t kind;  /* enum kvf_lt_op_kind */
    uint8_t quarantined;
    struct kvf_lt_op *qnext; /* quarantine list link */
    struct kvf_lt_op *qprev;
};

/*
 * A staging buffer used by one transfer: it goes back to its ring only when
 * both the transport op and the copy that use it completed (R9).
 */
struct kvf_lt_staging {
    struct kvf_lt_op op; /* counted as a KVF_LT_OP_STAGING op while owned */
    uint8_t transport_done;
    uint8_t copy_done;
};

/* ---- table ------------------------------------------------------------- */

/* Creates an empty table. NULL on out of memory. */
struct kvf_lt_table *kvf_lt_table_create(void);

/* Frees the table and every lifetime in it. Call only after
 * kvf_lt_table_can_teardown() said yes (ops still in flight would point at
 * freed memory); accepts NULL. */
void kvf_lt_table_destroy(struct kvf_lt_table *t);

/* Creates the lifetime of a room-generation, OPEN. -EEXIST if present,
 * -ESTALE if this generation is not newer than every generation of this id the
 * table knows (open or forgotten), or is at or below the table's late floor
 * (kvf_lt_table_is_late), -EINVAL for generation 0 or a room id above
 * KVF_ROOM_ID_MAX, -ENOMEM. Several generations of one id may be open at once
 * (an old one still draining while a newer one starts). `*lt_p` is written only
 * on success. */
int kvf_lt_table_open(struct kvf_lt_table *t, kvf_room_key key, struct kvf_lt **lt_p);

/* The lifetime of `key`, or NULL. */
struct kvf_lt *kvf_lt_table_find(struct kvf_lt_table *t, kvf_room_key key);

/* Frees a lifetime that is DRAINED (the control plane said the room is
 * terminal). -ENOENT if unknown; -EBUSY if it is not drained.
 * The generation is remembered so that later messages for it are recognised as
 * late (kvf_lt_table_is_late). */
int kvf_lt_table_forget(struct kvf_lt_table *t, kvf_room_key key);

/* True when `key` names a room-generation that this table has closed, drained or
 * forgotten, or an older generation than one it knows: a message for it is
 * late and must be dropped and counted. Also true for generation 0. The memory
 * of forgotten ids is bounded (65,536 ids with no open lifetime); older ones fold
 * into one floor generation, and any generation at or below it that is not open
 * is late (lifetime_table.c, "Forgotten memory"). A newer generation than any
 * known is not late. */
bool kvf_lt_table_is_late(const struct kvf_lt_table *t, kvf_room_key key);

/* Closes admission on every lifetime (node shutdown). Returns the number of
 * lifetimes that drained because of it. */
size_t kvf_lt_table_close_all(struct kvf_lt_table *t);

/* True when memory may be deregistered: every lifetime is DRAINED (none open,
 * closed with ops, or quarantined). */
bool kvf_lt_table_can_teardown(const struct kvf_lt_table *t);

/* The fence of `peer` completed (QPs in error and flushes reaped, or sockets
 * closed and receivers joined): every quarantined op towards that peer is
 * retired as stopped. Returns how many lifetimes drained because of it; their
 * drained events are taken with kvf_lt_take_drained(). The core does not hand
 * the retired ops back: the caller frees their tags from its own records of the
 * peer. A fenced op is marked, so a stray retire of it afterwards is ignored
 * (returns false) until it is admitted again. Non-quarantined ops towards the
 * peer are not touched: their flush completions retire them as usual. */
size_t kvf_lt_table_peer_fenced(struct kvf_lt_table *t, uint32_t peer);

/* Number of lifetimes in the table (any state). */
size_t kvf_lt_table_count(const struct kvf_lt_table *t);

/* ---- one lifetime --------------------------------------------------------- */

kvf_room_key kvf_lt_key(const struct kvf_lt *lt);
enum kvf_lt_state kvf_lt_state(const struct kvf_lt *lt);

/* True while admission is open. Any thread: it reads only the admission word
 * (kvf_lt_state also reads owner-thread fields once admission is shut). The
 * caller must keep the lifetime alive, e.g. by holding one of its ops. */
bool kvf_lt_is_open(const struct kvf_lt *lt);

/* Ops in flight in total, and of one kind. */
uint64_t kvf_lt_inflight(const struct kvf_lt *lt);
uint64_t kvf_lt_inflight_kind(const struct kvf_lt *lt, enum kvf_lt_op_kind kind);

/*
 * Admits one op of `kind` towards `peer`: fills `op` and counts it. Returns 0,
 * or -ECANCELED when admission is closed (the caller must not make the native
 * call), or -EINVAL for an unknown kind. Any thread. The caller makes the native
 * call only after 0.
 */
int kvf_lt_admit(struct kvf_lt *lt, struct kvf_lt_op *op, enum kvf_lt_op_kind kind, uint32_t peer);

/*
 * Retires an op whose completion arrived (ok, error or flush: each proves it
 * stopped), also a quarantined one. Any thread, except that a quarantined op
 * is retired on the owner thread (it sits on the owner's quarantine list). Returns true when this
 * call drained the lifetime: the caller then tells the owner thread, which takes the event with
 * kvf_lt_take_drained(). The call touches nothing of the lifetime after its last
 * decrement; `op->lt` stays readable by the caller (it is the caller's memory).
 */
bool kvf_lt_op_retire(struct kvf_lt_op *op, enum kvf_lt_outcome outcome);

/*
 * A native call for `op` failed in a way that does not prove it stopped (an
 * error return with work maybe still posted, a timeout). The op stays counted
 * and the lifetime is QUARANTINED until the op's terminal completion
 * (kvf_lt_op_retire) or a fence of its peer (kvf_lt_table_peer_fenced).
 * Owner thread. A failed op dooms the room, so this also shuts admission at
 * once (no drained event here: the op is still counted). A repeated call is
 * ignored. A STAGING op is never quarantined (the call is ignored): a fence
 * does not stop the copy into a staging buffer, so the buffer waits for both
 * of its done calls; quarantine the transport or copy op instead.
 */
void kvf_lt_op_quarantine(struct kvf_lt_op *op);

/*
 * Undoes an admission whose native call was never made or was refused in a way
 * that proves nothing was posted (e.g. the ops after ibv_post_send's bad_wr).
 * Same accounting as a retirement. Returns true when it drained the lifetime.
 */
bool kvf_lt_op_cancel(struct kvf_lt_op *op);

/*
 * Closes admission (abort notice, shutdown). Idempotent: a second close changes
 * nothing and returns false. Returns true when the lifetime drained right here
 * (nothing was in flight). Owner thread. (Chunks not yet posted are the node's:
 * its rules core refuses them once the room is closed; nothing is queued here.)
 */
bool kvf_lt_close(struct kvf_lt *lt);

/*
 * Owner thread: returns true exactly once over the lifetime's life, on the
 * first call after it became DRAINED. The node sends its drained report then.
 */
bool kvf_lt_take_drained(struct kvf_lt *lt);

/* ---- staging buffers ---------------------------------------------------- */

/* Takes ownership of a staging buffer for the room: admitted as a STAGING op.
 * -ECANCELED when admission is closed (late staging request: reject it). */
int kvf_lt_staging_acquire(struct kvf_lt *lt, struct kvf_lt_staging *s, uint32_t peer);

/* Marks the transport side (RDMA/TCP) or the copy side (CUDA) of a staging
 * buffer complete, in either order. Returns true when both are: the buffer may go
 * back to its ring now, and only now. `*drained_p` (may be NULL) is set to
 * whether that drained the lifetime. Reporting the same side twice is a caller
 * bug; the repeated call is ignored (returns false, `*drained_p` false). The two
 * calls for one buffer must not run concurrently: make both on the owner thread
 * (or on one poller thread). */
bool kvf_lt_staging_transport_done(struct kvf_lt_staging *s, bool *drained_p);
bool kvf_lt_staging_copy_done(struct kvf_lt_staging *s, bool *drained_p);

const char *kvf_lt_state_name(enum kvf_lt_state s);
const char *kvf_lt_op_kind_name(enum kvf_lt_op_kind k);

#endif /* KVF_LIFETIME_H */
