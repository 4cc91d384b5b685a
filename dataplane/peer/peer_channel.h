/*
 * peer_channel.h: the node-to-node peer channel of the data plane (ZeroMQ).
 *
 * A node talks to the other nodes of its rooms through one channel: it binds
 * one PULL socket that every peer pushes to, and connects one PUSH socket per
 * peer endpoint it sends to. Every ZeroMQ message is exactly one frame holding
 * one serialized kvfence.v1.PeerFrame (api/kvfence/v1/peer.proto).
 *
 * What the channel guarantees (docs/design.md §2.8, races R10, R11, R13):
 * - Frames of two messages never interleave: only the channel's owner thread
 *   touches its sockets; other threads hand it whole, packed messages.
 * - Every envelope carries a sequence number per (room-generation, sender,
 *   receiver), from 1, assigned under the channel's lock in the order the
 *   messages enter the queue, so sequence order is queue order is wire order.
 * - Only introduced peers get in (issue 13; docs/security.md, "Data
 *   channels"). Every connection is ZeroMQ CURVE: the receiving socket is a
 *   CURVE server with this incarnation's key pair (peer_keys.h), and the
 *   channel's ZAP handler admits a client only when its public key is one
 *   introduced with kvf_peer_channel_introduce(); the sending sockets are CURVE
 *   clients that require the server key introduced for the receiver, so a
 *   message never goes to an impostor. CURVE encrypts and authenticates every
 *   message. The ZAP handler names each connection after the incarnation it
 *   authenticated ("<incarnation>:<node id>", ZeroMQ's User-Id), and a message
 *   whose sender fields name anyone else, or an incarnation forgotten since
 *   (kvf_peer_channel_forget_peer: a fence), is dropped as UNAUTHENTICATED:
 *   an introduced peer cannot speak for another.
 * - A received envelope is delivered only if it comes from the incarnation its
 *   connection authenticated as, is addressed to this node's id and
 *   incarnation, the node's admission callback accepts its room-generation and
 *   sender, and its seq is exactly the next one expected. Everything else is
 *   dropped and counted (struct kvf_peer_stats), never delivered out of order.
 *
 * DESIGN (threads). One owner thread per channel, started by create and joined
 * by destroy, owns the ZeroMQ sockets and the receive-side sequence state. Any
 * thread may call kvf_peer_send(), kvf_peer_send_link(),
 * kvf_peer_forget_room(), kvf_peer_channel_set_fault() and
 * kvf_peer_channel_stats(); they take the channel's mutex briefly and wake the
 * owner through an eventfd. The callbacks run on the owner thread, without the
 * channel's lock: they may call kvf_peer_send() and kvf_peer_forget_room(),
 * never kvf_peer_channel_destroy().
 *
 * Errors: 0 or a negative errno (common/kvf_error.h); constructors return NULL
 * and log why on stderr.
 */
#ifndef KVF_PEER_CHANNEL_H
#define KVF_PEER_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"
#include "kvfence/v1/peer.pb-c.h"
#include "peer_keys.h"

struct kvf_peer_channel;

/* The node's answer to "may a message of this room-generation from this sender
 * be delivered?", from its lifetime table (kvf_lt_table_find/_is_late) and the
 * incarnations the control plane announced for the room. */
enum kvf_peer_verdict {
    KVF_PEER_ACCEPT = 0,  /* an open room of ours, and the sender is its announced incarnation */
    KVF_PEER_LATE = 1,    /* the room-generation is closed, aborted or terminal (R10, R13) */
    KVF_PEER_UNKNOWN = 2, /* a room-generation or sender incarnation this node does not know */
};

/* Why a received frame was dropped (kvf_peer_channel_opts.on_drop). */
enum kvf_peer_drop_reason {
    KVF_PEER_DROP_MALFORMED = 1,       /* not one decodable PeerFrame, or fields missing */
    KVF_PEER_DROP_WRONG_RECEIVER = 2,  /* receiver id or incarnation not ours */
    KVF_PEER_DROP_LATE = 3,            /* the admission callback said LATE */
    KVF_PEER_DROP_UNKNOWN = 4,         /* the admission callback said UNKNOWN */
    KVF_PEER_DROP_DUPLICATE = 5,       /* seq at or below the last delivered one */
    KVF_PEER_DROP_OUT_OF_ORDER = 6,    /* seq beyond the next expected: a message is missing */
    KVF_PEER_DROP_UNAUTHENTICATED = 7, /* the sender is not the introduced incarnation its
                                          connection authenticated as (or was forgotten) */
};

/* Delivers one accepted envelope, in seq order per (room, sender). Owner
 * thread. `env` (and everything it points at) belongs to the channel and is
 * freed when the callback returns. */
typedef void (*kvf_peer_message_fn)(void *ctx, const Kvfence__V1__PeerEnvelope *env);

/* Admission of a room-generation from a sender (node id, incarnation). Owner
 * thread, once per received envelope addressed to this node. */
typedef enum kvf_peer_verdict (*kvf_peer_accept_fn)(void *ctx, kvf_room_key key,
                                                    const char *sender_node_id,
                                                    uint64_t sender_incarnation);

/* Optional: a received link message addressed to this node's id and
 * incarnation. Owner thread; `msg` is freed when the callback returns. */
typedef void (*kvf_peer_link_fn)(void *ctx, const Kvfence__V1__LinkMessage *msg);

/* Optional: an envelope was dropped. `env` is NULL for MALFORMED. The node
 * reports TransferFailed for the room on OUT_OF_ORDER (a lost message, see
 * peer.proto). Owner thread. */
typedef void (*kvf_peer_drop_fn)(void *ctx, enum kvf_peer_drop_reason reason,
                                 const Kvfence__V1__PeerEnvelope *env);

/*
 * Fault injection for tests (compiled in, off by default). `n` counts the
 * messages this channel accepted in kvf_peer_send()/kvf_peer_send_link(), from
 * 1 since create; 0 disables a fault. A fault fires once.
 * - drop_nth: the message is never sent (its seq is used: the receiver sees a gap).
 * - duplicate_nth: the message is sent twice, back to back.
 * - delay_nth: the message is held back and sent after the next `delay_after`
 *   (>= 1) messages to the same peer; if none follow it is discarded at destroy.
 */
struct kvf_peer_fault {
    uint64_t drop_nth;
    uint64_t duplicate_nth;
    uint64_t delay_nth;
    uint32_t delay_after;
};

struct kvf_peer_channel_opts {
    const char *node_id;            /* this node (copied); required, non-empty */
    uint64_t incarnation;           /* this node's incarnation; required, >= 1 */
    const uint8_t *public_key;      /* this incarnation's key pair (KVF_PEER_KEY_SIZE bytes each, */
    const uint8_t *secret_key;      /* copied; peer_keys.h); required */
    const char *bind_endpoint;      /* e.g. "tcp://127.0.0.1:0" (copied); required */
    kvf_peer_message_fn on_message; /* required */
    kvf_peer_accept_fn accept;      /* required */
    kvf_peer_link_fn on_link;       /* optional; link frames are counted and dropped without it */
    kvf_peer_drop_fn on_drop;       /* optional */
    void *ctx;                      /* passed to every callback */
    size_t queue_max;            /* messages queued and not yet handed to ZeroMQ; default 65,536 */
    size_t max_message_bytes;    /* largest frame received; default 4 MiB */
    struct kvf_peer_fault fault; /* default: none */
};

/* Counters. Written by the owner thread, published under the lock once per
 * loop turn, so a snapshot is consistent but may lag by one turn. */
struct kvf_peer_stats {
    uint64_t queued;          /* messages accepted by kvf_peer_send/_send_link */
    uint64_t sent;            /* frames handed to ZeroMQ (injected duplicates included) */
    uint64_t delivered;       /* envelopes passed to on_message */
    uint64_t links;           /* link messages received for us */
    uint64_t malformed;       /* undecodable frames, multipart messages, missing fields */
    uint64_t wrong_receiver;  /* receiver id or incarnation not ours */
    uint64_t late;            /* admission said LATE */
    uint64_t unknown;         /* admission said UNKNOWN */
    uint64_t duplicate;       /* seq at or below the last delivered */
    uint64_t out_of_order;    /* seq beyond the next expected */
    uint64_t unauthenticated; /* envelopes and link messages whose sender is not their
                                 connection's authenticated incarnation (or a forgotten one) */
    uint64_t zap_refused;     /* CURVE clients refused: a public key not introduced */
    uint64_t send_failed;     /* frames ZeroMQ refused with an error other than EAGAIN */
    uint64_t discarded;       /* messages still queued or held when the channel stopped */
    uint64_t forgotten;       /* kvf_peer_forget_room requests the owner has carried out */
    uint64_t fault_dropped;
    uint64_t fault_duplicated;
    uint64_t fault_delayed;
};

/* Fills `o` with the defaults (no callbacks, no endpoint, no faults). */
void kvf_peer_channel_opts_init(struct kvf_peer_channel_opts *o);

/*
 * Creates the channel: binds its receiving socket and starts its owner thread.
 * Returns NULL (and logs why) on bad options, a failed bind or out of memory.
 * Any thread.
 */
struct kvf_peer_channel *kvf_peer_channel_create(const struct kvf_peer_channel_opts *o);

/*
 * Stops the owner thread, discards whatever is still queued (counted as
 * discarded), closes every socket with linger 0 and terminates the ZeroMQ
 * context. Never waits for peers. Accepts NULL. Any thread but the owner (not
 * from a callback); no other call on `ch` may run concurrently or follow.
 */
void kvf_peer_channel_destroy(struct kvf_peer_channel *ch);

/* The endpoint the channel is bound to, with the port ZeroMQ chose for ":0"
 * ("tcp://127.0.0.1:40123"). Valid until destroy. Any thread. */
const char *kvf_peer_channel_endpoint(const struct kvf_peer_channel *ch);

/*
 * Introduces a peer incarnation: `public_key` (KVF_PEER_KEY_SIZE bytes, its
 * Hello's peer key as the control plane handed it over) is admitted as
 * (`node_id`, `incarnation`) on the receiving socket, and is the server key
 * required of whatever answers at the endpoints messages to that incarnation
 * are sent to. One key per incarnation: -EEXIST when the incarnation has
 * another key already (the same one again: 0). -EINVAL (empty or too long id,
 * incarnation 0, no key), -ENOMEM, -E2BIG (PEER_INTRO_MAX introductions).
 * Any thread.
 */
int kvf_peer_channel_introduce(struct kvf_peer_channel *ch, const char *node_id,
                               uint64_t incarnation, const uint8_t *public_key);

/*
 * Forgets an introduced incarnation (it was fenced): new connections with its
 * key are refused, and messages on its connections still open are dropped as
 * UNAUTHENTICATED from the owner's next message on. 0 or -ENOENT. Any thread.
 */
int kvf_peer_channel_forget_peer(struct kvf_peer_channel *ch, const char *node_id,
                                 uint64_t incarnation);

/*
 * Queues one envelope for the peer at `peer_endpoint`. The channel packs a copy
 * of `env` in which it sets sender_node_id and sender_incarnation to its own and
 * seq to the next number of (env->room, env->receiver_node_id,
 * env->receiver_incarnation); the caller's `env` is not modified and may be
 * freed on return. Returns 0, -EINVAL (no room, room id 0 or above
 * KVF_ROOM_ID_MAX, generation 0, empty receiver id, no body, bad endpoint),
 * -ENOKEY (the receiver incarnation was not introduced), -EAGAIN (queue_max messages queued, or the
 * channel is stopping; no seq was used), -ENOMEM. Any thread.
 */
int kvf_peer_send(struct kvf_peer_channel *ch, const char *peer_endpoint,
                  const Kvfence__V1__PeerEnvelope *env);

/* Queues one link message for the peer at `peer_endpoint`, with the sender
 * fields set to this node's. Same returns as kvf_peer_send (-EINVAL for an
 * empty receiver id or no body, -ENOKEY for a receiver not introduced). Any
 * thread. */
int kvf_peer_send_link(struct kvf_peer_channel *ch, const char *peer_endpoint,
                       const Kvfence__V1__LinkMessage *msg);

/*
 * Forgets the sequence state of a terminal room-generation, both directions:
 * the send side at once, the receive side when the owner thread reaches the
 * request in the queue (after every message queued before it). Later messages
 * for `key` start again from seq 1; the admission callback must say LATE for
 * them. Returns 0, -EAGAIN (stopping) or -ENOMEM. Any thread.
 */
int kvf_peer_forget_room(struct kvf_peer_channel *ch, kvf_room_key key);

/* Replaces the fault settings (counts still from create). Any thread. */
void kvf_peer_channel_set_fault(struct kvf_peer_channel *ch, const struct kvf_peer_fault *f);

/* Copies the counters into `*stats_p`. Any thread. */
void kvf_peer_channel_stats(struct kvf_peer_channel *ch, struct kvf_peer_stats *stats_p);

const char *kvf_peer_drop_reason_name(enum kvf_peer_drop_reason r);

#endif /* KVF_PEER_CHANNEL_H */
