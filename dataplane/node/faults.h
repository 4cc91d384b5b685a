/*
 * faults.h: fault injection in kvfence-node, for the race tests (docs/node.md,
 * "Fault injection"). Compiled into every build; off unless the node was
 * started with --fault-file.
 *
 * The fault file holds `key=value` lines (blank lines and `#` comments
 * allowed). The owner thread stats it at most every NODE_FAULT_CHECK_MS and
 * reloads it when its inode, size or mtime changed; a test writes it
 * atomically (write a temporary file, rename it over). Every load replaces
 * the whole configuration (a key not in the file is off) and restarts the
 * counts; a file that does not parse is refused as a whole (logged) and the
 * previous configuration stays. A missing file means no faults.
 *
 * Keys (N >= 0; 0 turns the fault off):
 *   hold=0|1             transport: hold every posted frame until hold=0;
 *   post_fail=N          transport: the Nth post after the load returns -EIO;
 *   op_error=N           transport: the Nth post after the load completes ERROR;
 *   hold_stream=0|1      SubmitChunks requests reaching the owner are kept
 *                        back, in order, until hold_stream=0 (or the node
 *                        stops): they count as outstanding on their stream;
 *   hold_room_update=0|1 RoomUpdates are kept back, in order, until
 *                        hold_room_update=0 (other control messages pass);
 *   drop_room_update=N   drop the next N RoomUpdates (lost: the control
 *                        plane sends a room's update again only when it
 *                        changes or the node re-attaches);
 *   ack_drop_room_update=N  acknowledge the next N RoomUpdates (Ack and
 *                        RoomUpdateAck) and drop them unapplied: a node that
 *                        breaks the order, so that a peer's frame or envelope
 *                        reaches it for a room it does not know;
 *   refuse_room_open=N   the next N rooms this node would open (a RoomUpdate
 *                        or an AbortNotice for a room new here) are refused
 *                        as by the lifetime table out of memory;
 *   stage_fail=N         the next N staging copies (--staging host|cuda) fail
 *                        to start, -EIO, before the engine is called: their
 *                        frames end failed inside the SubmitChunk;
 *   drop_abort=N         drop the next N AbortNotice notices;
 *   drop_fence=N         drop the next N FencePeer notices;
 *   drop_drained=N       do not send the next N Drained reports;
 *   drop_completed=N     ... Completed reports;
 *   drop_peer_fenced=N   ... PeerFenced reports;
 *   rdma_hold=0|1        the fake RDMA fabric (--rdma fake) keeps every posted
 *                        WR outstanding until rdma_hold=0 (kvf_verbs_fake_fabric_hold);
 *   rdma_hold_odd=0|1    the same for QP 1 only (rooms with odd ids) of every
 *                        peer linked when it loads (kvf_verbs_fake_fabric_hold_qp);
 *   peer_drop=N, peer_dup=N, peer_delay=N, peer_delay_after=N
 *                        the ZeroMQ peer channel's faults (struct
 *                        kvf_peer_fault, kvf_peer_channel_set_fault): set
 *                        only by a load whose file names a peer_* key (so a
 *                        file without them leaves --peer-fault alone); the
 *                        channel counts its messages from its creation.
 * Every fault that fires is logged ("fault: ...").
 *
 * DESIGN: owner thread only (the file check runs in the owner loop; the
 * control messages and reports pass through the owner thread). The module
 * is a hook table's user: what it does to jobs and to the RDMA fabric goes
 * through the struct node_fault_hooks the owner gave it, so it sits below
 * every module it acts on.
 */
#ifndef KVF_NODE_FAULTS_H
#define KVF_NODE_FAULTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fault.h"

#define NODE_FAULT_CHECK_MS 10

struct kvf_node;
struct kvf_peer_fault;
struct node_job;

struct node_fault_cfg {
    struct kvf_fault_knobs xport;
    uint64_t hold_stream;      /* 0 or 1 */
    uint64_t hold_room_update; /* 0 or 1 */
    uint64_t drop_room_update, drop_abort, drop_fence;
    uint64_t ack_drop_room_update;
    uint64_t refuse_room_open;
    uint64_t stage_fail;
    uint64_t drop_drained, drop_completed, drop_peer_fenced;
    uint64_t peer_drop, peer_dup, peer_delay, peer_delay_after;
    uint64_t rdma_hold;     /* 0 or 1 */
    uint64_t rdma_hold_odd; /* 0 or 1 */
    /* Count down as they fire (rdma_link.c): the next N ChunkNotices name
     * pages outside the sink lease; the next N LinkHellos are not sent; the
     * next N RDMA chunks are posted with a wrong rkey (an error completion). */
    uint64_t rdma_bad_notice, rdma_drop_hello, rdma_wr_error;
    bool peer_keys; /* the file named a peer_* key */
};

/* Parses `text` (NUL-terminated). 0, or -EINVAL with a message naming the
 * line and the key in `err`; `*cfg` is written only on success. */
int node_fault_parse(const char *text, struct node_fault_cfg *cfg, char *err, size_t errlen);

/* The peer channel's share of `cfg`. */
void node_fault_peer(const struct node_fault_cfg *cfg, struct kvf_peer_fault *out);

/* Self-fence: the TCP transport is about to be replaced. unwrap destroys the
 * wrapper around the old one (n->tcp_io becomes NULL); wrap puts n->tcp_io on
 * the new n->tcp again, wrapped with the loaded configuration (its counts
 * start over) when fault injection is on. */
void node_faults_unwrap(struct kvf_node *n);
int node_faults_wrap(struct kvf_node *n);

/* What the fault module may do to the rest of the node, given by the owner
 * (node.c) at start: the module calls nothing above it directly. Every slot
 * is set; `ctx` is passed back. Owner thread. */
struct node_fault_hooks {
    /* Runs a held SubmitChunks request's job now (not freed). */
    void (*run_stream)(void *ctx, struct node_job *j);
    /* Puts a held job back on the owner's queue: 0, or -ESHUTDOWN (the owner
     * is exiting; the job stays the caller's). */
    int (*repost)(void *ctx, struct node_job *j);
    /* Frees a job and what it owns. */
    void (*job_free)(void *ctx, struct node_job *j);
    /* The fake RDMA fabric's hold switches, rdma_hold and rdma_hold_odd
     * (no-ops before RDMA started). */
    void (*rdma_hold)(void *ctx, bool on);
    void (*rdma_hold_odd)(void *ctx, bool on);
};

/* Wraps n->tcp in the fault transport and sets n->tcp_io to it; reads the
 * file once. `hooks` is kept (not copied). 0 or -ENOMEM. */
int node_faults_start(struct kvf_node *n, const char *path, const struct node_fault_hooks *hooks,
                      void *ctx);

/* Owner loop: reloads the file when it changed (at most every
 * NODE_FAULT_CHECK_MS). */
void node_faults_tick(struct kvf_node *n);

/* True when the control message of `msg_case` (Kvfence__V1__ControlMessage)
 * must be dropped (counts it). */
bool node_fault_drop_control(struct kvf_node *n, int msg_case);

/* True when the RoomUpdate must be acknowledged and dropped unapplied
 * (ack_drop_room_update; counts it). */
bool node_fault_ack_drop_room_update(struct kvf_node *n);

/* True when the room about to be opened must be refused (refuse_room_open;
 * counts it). */
bool node_fault_refuse_room_open(struct kvf_node *n);

/* True when the staging copy about to start must fail (stage_fail; counts
 * it). */
bool node_fault_stage_fail(struct kvf_node *n);

/* True when the SubmitChunks request's job `j` is kept back
 * (hold_stream): the job is then the fault module's until it runs. */
bool node_fault_hold_stream(struct kvf_node *n, struct node_job *j);

/* True when the RoomUpdate's job `j` (its poster asks only for RoomUpdates)
 * is kept back (hold_room_update): the job is then the fault module's; it
 * is posted again, in order, once the hold ends. */
bool node_fault_hold_control(struct kvf_node *n, struct node_job *j);

/* True when the report of `msg_case` (Kvfence__V1__NodeMessage) must not be
 * sent (counts it). */
bool node_fault_drop_report(struct kvf_node *n, int msg_case);

/* The loaded rdma_hold (false without --fault-file): the RDMA start applies it. */
bool node_fault_rdma_hold(const struct kvf_node *n);

enum node_fault_rdma {
    NODE_FAULT_RDMA_BAD_NOTICE,
    NODE_FAULT_RDMA_DROP_HELLO,
    NODE_FAULT_RDMA_WR_ERROR
};

/* True (and one less to fire, logged) when fault `which` fires now. */
bool node_fault_rdma_take(struct kvf_node *n, enum node_fault_rdma which);

/* Frees the wrapper (before n->tcp) and the state. */
void node_faults_stop(struct kvf_node *n);

#endif /* KVF_NODE_FAULTS_H */
