/*
 * world_internal.h: the simulated cluster's state, shared by world.c (the
 * engines, the control plane's effects, the invariants, the step and the
 * quiesce phase) and world_node.c (the node agent, the lives of node
 * processes, node -> node frames and the control plane's crash). Nothing
 * outside tests/explorer includes it.
 */
#ifndef KVF_EXPLORER_WORLD_INTERNAL_H
#define KVF_EXPLORER_WORLD_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cp_state.h"
#include "lifetime.h"
#include "node_core.h"
#include "world.h"

#define NODES      5 /* n0..n3, and n4 which may lack QUIESCE_V1 */
#define OLD_NODE   4
#define POOL_PAGES 64
#define MAX_ROOMS  4096
#define ROOM_IDS   6
#define MAX_PARTS  6
#define MAX_RANGES 4
#define MAX_OPS    256
#define MAX_LIVES  1024
#define MAX_CHUNKS 256
#define QCAP       1024
#define RXCAP      32 /* frames one node's sockets hold */
#define MAX_SLOTS  64 /* peer slots of a node core (its max_peers, the daemon's default) */
#define RETAIN     4  /* terminal rooms a node core keeps (small: forgetting is exercised) */

enum msg_type {
    M_ROOM_UPDATE,
    M_ABORT,
    M_FENCE,
    R_DRAINED,
    R_COMPLETED,
    R_FAILED,
    R_FENCED,
    R_UPDATE_ACK, /* RoomUpdateAck{key, version} */
};

struct msg {
    uint8_t type;
    kvf_room_key key;
    kvf_token token;
    uint32_t rank;
    int role;
    int peer;
    uint64_t peer_inc;
    uint64_t inc;       /* sender's incarnation (reports) */
    uint64_t version;   /* M_ROOM_UPDATE, R_UPDATE_ACK */
    uint32_t published; /* M_ROOM_UPDATE: sim parts whose leases it carries (bit p) */
};

struct queue {
    struct msg m[QCAP];
    unsigned head, len;
};

struct spart {
    int node;
    uint64_t inc; /* its node's incarnation when it joined */
    uint32_t rank;
    enum kvf_cps_role role;
    bool joined, refused, released;
    uint64_t lease_id;
    struct kvf_cps_page_range ranges[MAX_RANGES];
    int nranges;
    int chunks_planned, chunks_sent, chunks_queued;
    int frames_expected, frames_in; /* sink: TCP frames sent to it, and landed */
    bool failed, completed_sent;
};

struct sroom {
    bool used, dead, has_old;
    uint64_t room_id;
    kvf_room_key key; /* generation 0 until a join succeeded */
    int nsrc, nsink, nparts;
    struct spart parts[MAX_PARTS];
    bool have_token;
    kvf_token token;
    int state;              /* last state announced by a ROOM_STATE effect, 0 before */
    bool abort_seen[NODES]; /* the node processed an abort notice of this room */
};

/* The node's room: the node core's record (which holds the lifetime) and
 * what the node agent hangs on it. */
struct nlife {
    bool used;
    uint64_t inc; /* the node incarnation that opened it */
    kvf_room_key key;
    struct kvf_ncore_room cr;
    bool have_update;             /* a room update arrived (not only an abort) */
    uint64_t pair_seq[MAX_PARTS]; /* per sink part: the last chunk_seq admitted */
    uint32_t known_parts;         /* parts whose leases a room update told it (bit p) */
    uint32_t peer_refs[NODES];    /* peer slots the room references */
    int npeer_refs;
    bool rereport_muted; /* MUT_NO_REREPORT: this notice's Drained is dropped */
};

/* A chunk in a source node's staging queue (the daemon's local_svc queue):
 * it holds its room in the node core until it starts or is dropped. */
struct schunk {
    bool used;
    int node, room, part, sink;
    struct nlife *life;
};

/* A frame on a node -> node connection: written by a source's TCP op, in the
 * sink's kernel socket buffer until the sink's receiver takes it. */
struct frame {
    int room, src, sink, from;
    uint64_t from_inc; /* the sender's incarnation: its stream */
    uint64_t seq;      /* per room, sending node and receiving node, from 1 (I8) */
    uint64_t conn_seq; /* per stream, from 1: what the transport checks */
};

struct snode {
    char name[16];
    uint64_t inc;
    bool alive, connected, old;
    bool paused;              /* SIGSTOP: the process takes no step */
    bool down;                /* its session is gone (it knows, or will on resume) */
    bool racing;              /* resumed past its self-fence margin, not fenced yet */
    kvf_time_ns down_since;   /* by the node's own clock */
    uint64_t pending_witness; /* self-fenced: this incarnation and older are
                               * witnessed once their lifetimes drained */
    uint64_t phantom_inc;     /* MUT_PAUSED_WITNESSED: an incarnation the core
                               * knows and no process runs */
    struct frame rx[RXCAP];
    int nrx;
    /* Its connections to peers (one TCP stream each way, numbered as the
     * transport numbers its frames): the next sequence number a sender
     * writes, the next one a receiver expects, and whether the receiver
     * closed the stream on a bad sequence (frames after it are lost). */
    uint64_t conn_tx[NODES], conn_rx[NODES];
    uint64_t conn_tx_inc[NODES], conn_rx_inc[NODES]; /* the peer incarnation of each stream */
    bool conn_broken[NODES];                         /* receiver side, per sending peer */
    struct kvf_ncore *core;   /* the node's rules: rooms, lifetimes, peer slots */
    struct kvf_lt_table *tab; /* the core's lifetime table */
    int slot_node[MAX_SLOTS]; /* the core's peer slots: node + 1 (0 = not taken here) */
    uint64_t slot_inc[MAX_SLOTS];
    struct nlife lives[MAX_LIVES];
    struct queue inbox, outbox;
    uint32_t page_owner[POOL_PAGES]; /* room * MAX_PARTS + part + 1, 0 = free */
    uint64_t fenced_inc[NODES];      /* this node fenced peer i at this incarnation */
};

struct sop {
    bool used, quarantined;
    bool recv;        /* a receive in progress: a frame landing in the sink's pages */
    bool unaccounted; /* MUT_RECV_NOT_OP: not admitted through its lifetime */
    struct kvf_lt_op op;
    enum kvf_lt_op_kind kind;
    int node, peer, room, src_part, sink_part;
    uint64_t peer_inc; /* the peer's incarnation when the op was posted */
    bool neutral[NODES];
};

/* A snapshot image of the control-plane core (what its log recovers). */
struct image {
    unsigned char *buf;
    size_t len, cap;
};

struct world {
    uint64_t rng;
    struct kvf_cps *cps;
    kvf_time_ns now;
    struct snode nodes[NODES];
    struct sroom rooms[MAX_ROOMS];
    int nrooms;
    int current[ROOM_IDS + 1]; /* room_id -> latest sim room index, -1 */
    struct sop ops[MAX_OPS];
    struct schunk chunks[MAX_CHUNKS];
    uint64_t next_bad_id;
    bool failed, trace;
    enum world_mutation mutation;
    struct kvf_cps_opts co;
    struct image img, img_old, img_older; /* crash recovery; MUT_ACK_EARLY keeps two */
    uint64_t seq_sent[MAX_ROOMS][NODES][NODES];
    uint64_t seq_landed[MAX_ROOMS][NODES][NODES];
    char failure[512];
    struct world_stats stats;
};

/* ---- shared between world.c and world_node.c ------------------------------ */

/* Records the first invariant violation (later ones are dropped). */
__attribute__((format(printf, 2, 3))) void fail(struct world *w, const char *fmt, ...);

bool q_push(struct queue *q, const struct msg *m);
int room_by_key(const struct world *w, kvf_room_key key);
void op_free(struct sop *o);
void op_retire(struct world *w, struct sop *o, enum kvf_lt_outcome outcome);
void route_effects(struct world *w);
void check_completion(struct world *w, int room);
struct sop *op_alloc(struct world *w);
struct sop *admit_op(struct world *w, int node, int ri, int src, int sink, enum kvf_lt_op_kind kind,
                     int peer, uint64_t peer_inc);
struct nlife *life_find(struct snode *n, kvf_room_key key);
void report(struct snode *n, const struct msg *m);
void node_take_drains(struct world *w, int node);
void node_apply(struct world *w, int node);
void node_collect(struct world *w, int node);
void frame_send(struct world *w, const struct sop *o);
int node_peer_slot(struct world *w, int node, int peer, uint64_t inc, uint32_t *idx_p);
void node_handle(struct world *w, int node, const struct msg *m);
void node_kill(struct world *w, int node);
void node_start(struct world *w, int node);
void act_reconnect(struct world *w, int node);
kvf_time_ns self_fence_after(const struct world *w);
void node_down(struct world *w, int node);
void node_pause(struct world *w, int node);
void node_resume(struct world *w, int node);
void node_self_fence(struct world *w, int node);
void node_maybe_witness(struct world *w, int node);
void phantom_start(struct world *w, int node);
void node_recv(struct world *w, int node, bool any, uint32_t pick);
int image_take(struct world *w, struct image *im);
void cp_crash(struct world *w, uint32_t back_at_once);

#endif /* KVF_EXPLORER_WORLD_INTERNAL_H */
