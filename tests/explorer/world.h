/*
 * world.h: a simulated kvfence cluster for the schedule explorer.
 *
 * The world holds one real control-plane core (kvf_cps) and, per simulated
 * node, one real node rules core (kvf_ncore, which owns the node's lifetime
 * table). Around them it simulates what has no real part in a unit test: the
 * engines (page allocators that free pages only when told RELEASED), the node
 * agents (what kvfence-node feeds its core and does with its effects), the
 * native ops in flight (each one holding real kvf_lt_op accounting), and the
 * unreliable links between nodes and the control plane (messages dropped,
 * duplicated or delayed).
 *
 * A schedule is a list of actions. Each action carries raw random numbers that
 * the world maps onto whatever exists at that moment (the k-th live op, the
 * j-th open room), so that removing actions from a schedule still replays into
 * something meaningful: that is what lets the explorer shrink a failing
 * schedule. The world checks the invariants of DESIGN.md §2 after every action
 * and records the first violation.
 */
#ifndef KVF_EXPLORER_WORLD_H
#define KVF_EXPLORER_WORLD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum act_kind {
    ACT_JOIN,         /* an engine joins (creates a room when needed) */
    ACT_EXTEND,       /* a source extends its lease (chunked prefill) */
    ACT_SUBMIT,       /* a source node admits a transfer op */
    ACT_SINK_OP,      /* a sink node admits a local op (CUDA scatter, TCP receive) */
    ACT_COMPLETE_OK,  /* a live op completes successfully */
    ACT_COMPLETE_ERR, /* a live op completes with an error (it stopped) */
    ACT_QUARANTINE,   /* a native call fails without proving the op stopped */
    ACT_ABORT,        /* an engine (any participant) aborts its room */
    ACT_ADMIN_ABORT,  /* an operator aborts a room */
    ACT_DELIVER_CP,   /* deliver the next control-plane -> node message */
    ACT_DELIVER_NODE, /* deliver the next node -> control-plane report */
    ACT_DROP_CP,      /* lose the next control-plane -> node message */
    ACT_DUP_NODE,     /* duplicate the next node -> control-plane report */
    ACT_STALE_REPORT, /* a stale, tokenless or foreign drained report */
    ACT_BAD_JOIN,     /* a join that overlaps another room's pages */
    ACT_DISCONNECT,   /* a node's session drops (the node keeps running) */
    ACT_RECONNECT,    /* a node's session comes back */
    ACT_KILL,         /* a node process dies (kill -9) */
    ACT_RESTART,      /* a dead or lost node starts with a new incarnation */
    ACT_ADMIN_FENCE,  /* an operator fences a node */
    ACT_TICK,         /* time passes (small, large or huge steps) */
    ACT_PAUSE,        /* a node process is paused (SIGSTOP, cgroup freeze, frozen VM) */
    ACT_RESUME,       /* a paused node process runs again */
    ACT_RECV,         /* a sink's receiver takes a frame off its socket (maybe not the first) */
    ACT_DUP_FRAME,    /* a node -> node frame is delivered twice */
    ACT_DROP_NODE,    /* lose the next node -> control-plane report */
    ACT_REORDER_CP,   /* deliver a control-plane -> node message out of order */
    ACT_SELF_FENCE,   /* a node whose session is down past its margin fences itself */
    ACT_CP_CRASH,     /* the control plane crashes and recovers its state */
    ACT_KIND_COUNT
};

struct action {
    uint8_t kind;
    uint32_t a, b, c;
};

struct world;

/*
 * Mutations: one rule of the node agent or of the deployment taken out, in the
 * simulation only (never in the cores: a rule of a core is taken out by
 * changing what the simulation feeds it or does with its effects), to show that a fault mode
 * matters: with the mutation the explorer must find a violation within its CI budget, without it
 * none (ctest explorer_mut_*). Each names the fault mode it needs.
 */
enum world_mutation {
    MUT_NONE = 0,
    MUT_PAUSED_WITNESSED,  /* pause: a paused node is taken for dead and a new
                            * incarnation witnesses it (a pid probe instead of
                            * the host lock) while the old process lives */
    MUT_RECV_NOT_OP,       /* node -> node frames: a receive in progress is not
                            * an op (checked open, then lands uncounted) */
    MUT_NO_SEQ,            /* node -> node reordering and duplication: frames
                            * land without the transport's sequence check */
    MUT_ABORT_NO_OPEN,     /* control-plane -> node reordering: an abort notice
                            * for a room the node has no lifetime of is answered
                            * Drained without opening (and closing) one */
    MUT_NO_REREPORT,       /* node -> control-plane loss: a drained room ignores
                            * a repeated notice (the node core's Drained for it
                            * is dropped) instead of re-reporting */
    MUT_ACK_EARLY,         /* control-plane crash: effects leave before they are
                            * durable (recovery loses the last step) */
    MUT_WITNESS_EARLY,     /* self-fencing: the Witness of the old incarnation is
                            * sent before its lifetimes drained */
    MUT_SINK_RX_UNCOUNTED, /* node -> node frames: the node core's sink rule is
                            * not told of the receives in flight (its input
                            * rx_inflight is 0) */
    MUT_COUNT
};

struct world_opts {
    bool with_old_node; /* one node lacks QUIESCE_V1: its rooms must be refused */
    bool trace;         /* print every action and effect (for --replay-seed) */
    enum world_mutation mutation;
};

/* The mutation called `name` (as --mutate takes it), or -1. */
int world_mutation_by_name(const char *name);
const char *world_mutation_name(enum world_mutation m);

struct world *world_create(uint64_t seed, const struct world_opts *opts);
void world_destroy(struct world *w);

/* Applies one action, then checks every invariant. Returns false once an
 * invariant failed (world_failure says which); later calls do nothing. */
bool world_step(struct world *w, const struct action *act);

/* Stops the faults and brings every room to a terminal state: nodes come back,
 * every message is delivered, every op completes, engines abort what is still
 * open, time passes. Then checks the end-state invariants (every room
 * terminal, every lease released exactly once, every page back with its
 * engine, every lifetime drained). Returns false on a violation. */
bool world_quiesce(struct world *w);

const char *world_failure(const struct world *w);

/* Counters for the explorer's summary. */
struct world_stats {
    uint64_t rooms_created, rooms_completed, rooms_aborted;
    uint64_t ops_admitted, ops_refused, leases_released;
    uint64_t reports_rejected, joins_refused, fences;
    uint64_t pauses, frames_landed, frames_dropped, self_fences, cp_crashes;
    /* The node cores: chunks they refused, rooms they forgot, notices for a
     * forgotten room answered Drained, peer slots recycled. */
    uint64_t chunks_refused, rooms_forgotten, late_answers, peers_recycled;
};
void world_stats(const struct world *w, struct world_stats *out);

const char *act_name(enum act_kind k);

#endif
