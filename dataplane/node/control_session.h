/*
 * control_session.h: the node's session with kvfence-control
 * (NodeSession/Attach), the whole control-plane protocol of the node: the
 * session thread that receives, the dispatch of each ControlMessage kind to
 * the owner, and every NodeMessage the node sends (Hello, heartbeats, Ack,
 * RoomUpdateAck, Drained, Completed, TransferFailed, PeerFenced, PoolUpdate,
 * Resync, Witness).
 *
 * The session reaches the owner (node.c) only through the table of struct
 * node_session_ops that node.c hands to node_session_start: it posts what it
 * received, and on the owner thread hands it the notices that change rooms
 * and peers. The owner and the modules it runs call the senders below
 * directly (they are below them).
 *
 * DESIGN (threads): the session thread only opens the stream, receives,
 * decodes and posts (ops->post_*), and on a refusal calls ops->refused.
 * Everything else here runs on the owner thread, which alone sends: the
 * reports for one room leave in the order the node decided them. The
 * session's fields live in struct kvf_node (node_types.h) and are written
 * here only, on the owner thread, except `reset_stream` (atomic).
 */
#ifndef KVF_NODE_CONTROL_SESSION_H
#define KVF_NODE_CONTROL_SESSION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"
#include "kvfence/v1/node.pb-c.h"

struct kvf_node;
struct kvf_rpc_client_stream;
struct node_member;
struct node_room;
struct node_xport_endpoint;

/* What the session thread tells the owner about its stream. */
enum node_session_event {
    NODE_SESSION_OPEN = 1, /* a stream is open: send Hello on it */
    NODE_SESSION_CLOSED,   /* it ended: stop sending on it */
    NODE_SESSION_LOST,     /* the control plane refused this incarnation as LOST */
};

/* The owner, as the session sees it. Every slot is set; `ctx` is passed back. */
struct node_session_ops {
    /* Session thread: posts a decoded message of stream `cs` to the owner,
     * which hands it back to node_session_on_message. 0: the owner owns `cm`;
     * otherwise it stays the caller's. */
    int (*post_message)(void *ctx, struct kvf_rpc_client_stream *cs,
                        Kvfence__V1__ControlMessage *cm);
    /* Session thread: posts `ev` and waits until the owner ran it
     * (node_session_opened / node_session_closed / the self-fence). False when
     * the owner is gone. */
    bool (*post_event)(void *ctx, enum node_session_event ev, struct kvf_rpc_client_stream *cs);
    /* Session thread: the control plane refused the node for good (`err`,
     * a negative errno): the node's fatal error. */
    void (*refused)(void *ctx, int err);
    /* Owner: the session was welcomed (readiness for kvf_node_wait_ready). */
    void (*welcomed)(void *ctx);
    /* Owner: the notices that change the node's rooms and peers. */
    void (*room_update)(void *ctx, const Kvfence__V1__RoomUpdate *ru);
    void (*abort_notice)(void *ctx, const Kvfence__V1__AbortNotice *an);
    void (*fence_peer)(void *ctx, const Kvfence__V1__FencePeer *fp);
    /* Owner: what the Hello announces of the transports (xport.h): their
     * feature names and endpoints, at most `max` of each; how many. */
    size_t (*features)(void *ctx, const char **out, size_t max);
    size_t (*endpoints)(void *ctx, struct node_xport_endpoint *out, size_t max);
    /* Owner: the session went silent for node_ttl: fence every peer, close
     * every lifetime, take a new incarnation (node_session_new_incarnation). */
    void (*self_fence)(void *ctx, const char *why);
};

/* Starts the session thread with the owner's table (kept, not copied).
 * 0, -EIO (no channel) or -EAGAIN (no thread). */
int node_session_start(struct kvf_node *n, const struct node_session_ops *ops, void *ctx);
/* Stops the session thread and frees the channel. Any thread but those two. */
void node_session_join(struct kvf_node *n);

/* ---- owner thread: the session's events and messages ------------------------- */

/* NODE_SESSION_OPEN: sends Hello on `cs` and says again the completions
 * reported while the session was down. */
void node_session_opened(struct kvf_node *n, struct kvf_rpc_client_stream *cs);
/* NODE_SESSION_CLOSED: nothing more is sent on `cs`. */
void node_session_closed(struct kvf_node *n, struct kvf_rpc_client_stream *cs);
/* Whether `cs` is the stream the owner sends on (messages of a stream a
 * self-fence gave up are dropped). */
bool node_session_is_current(const struct kvf_node *n, const struct kvf_rpc_client_stream *cs);
/* One message of the current stream: handled by kind (Welcome, ResyncRequest,
 * HeartbeatAck here; RoomUpdate, AbortNotice, FencePeer through the ops). */
void node_session_on_message(struct kvf_node *n, const Kvfence__V1__ControlMessage *cm);
/* Every turn of the owner loop: the heartbeat when it is due, the
 * self-fence once the session is gone for node_ttl. */
void node_session_tick(struct kvf_node *n, int64_t now_ms);
/* When node_session_tick will act next (node_now_ms time), INT64_MAX when it
 * has no deadline: the owner loop sleeps until then at most. */
int64_t node_session_next_ms(const struct kvf_node *n);
/* At the end of a stop: a last heartbeat, then the stream is half-closed
 * (the control plane deregisters the node). */
void node_session_goodbye(struct kvf_node *n);
/* The self-fence's two halves: nothing more is said as this incarnation
 * (the session thread drops its stream); then the new incarnation starts a
 * fresh session, and `old` is witnessed once its lifetimes drained. */
void node_session_give_up(struct kvf_node *n);
void node_session_new_incarnation(struct kvf_node *n, uint64_t old);
/* Whether a session is open and welcomed (health, readiness). */
bool node_session_up(const struct kvf_node *n);

/* ---- owner thread: reports ------------------------------------------------- */

/* Sends `m` on the current session: 0, -ENOTCONN (none), or the stream's
 * error. The fault hook may drop it (as if sent and lost). */
int node_session_send(struct kvf_node *n, const Kvfence__V1__NodeMessage *m);
/* Reports r's Drained with its token (under r's incarnation when this process
 * gave that one up). */
void node_session_send_drained(struct kvf_node *n, const struct node_room *r);
/* Sends Completed for local participant `m` (again after a re-attach);
 * decides nothing. */
void node_session_send_completed(struct kvf_node *n, const struct node_room *r,
                                 const struct node_member *m);
/* TransferFailed for (rank, role) of `r`, unless the room is aborting
 * already. */
void node_session_send_transfer_failed(struct kvf_node *n, const struct node_room *r, uint32_t rank,
                                       int role, const char *reason);
/* TransferFailed for room `key` that has no record here (a sink's word). */
void node_session_send_room_failed(struct kvf_node *n, kvf_room_key key, const char *reason);
void node_session_send_ack(struct kvf_node *n, uint64_t notice_id);
/* The update is applied: the control plane may now publish this node's
 * members of the room to the room's other nodes (node.proto RoomUpdateAck). */
void node_session_send_room_update_ack(struct kvf_node *n, kvf_room_key key, uint64_t version);
void node_session_send_peer_fenced(struct kvf_node *n, const char *node_id, uint64_t incarnation,
                                   uint64_t notice_id);
/* PoolUpdate: `added` upserted (NULL: none), or pool `removed_id` removed. */
void node_session_send_pool_added(struct kvf_node *n, const Kvfence__V1__Pool *added);
void node_session_send_pool_removed(struct kvf_node *n, uint32_t removed_id);
/* Sends Resync (every lifetime of this incarnation, fenced peers, pools). */
void node_session_send_resync(struct kvf_node *n, const char *why);
/* Once every lifetime of the incarnations this process gave up is drained,
 * sends Witness{gone_incarnation} on a welcomed session, once. */
void node_session_maybe_witness(struct kvf_node *n);

/* The Resync of the current incarnation handed to `send` (node_session_send;
 * a test's own): every lifetime to report (not DRAINED, or DRAINED by an abort
 * notice), the undrained first, newest first, in messages of at most
 * NODE_RESYNC_MAX lifetimes (at least one message); each carries the pools,
 * the first the fenced peers. 0, -ENOMEM, or the first failed send's error;
 * *lifetimes_p / *messages_p: what was sent. Owner thread. */
typedef int (*node_resync_send_fn)(struct kvf_node *n, const Kvfence__V1__NodeMessage *m);
int node_resync_emit(struct kvf_node *n, node_resync_send_fn send, size_t *lifetimes_p,
                     size_t *messages_p);

#endif /* KVF_NODE_CONTROL_SESSION_H */
