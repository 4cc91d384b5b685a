/*
 * peer_link.h: kvfence-node's use of the ZeroMQ peer channel: pairs of a source and a sink rank,
 * AuxData, TransferStatus and ChunkNotice envelopes, delivered messages handled on the owner
 * thread. Functions of peer_link.c only; the shared types are node_types.h.
 */
#ifndef KVF_NODE_PEER_LINK_H
#define KVF_NODE_PEER_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

int node_peer_start(struct kvf_node *n);
void node_peer_stop(struct kvf_node *n); /* after the owner exited */
/* Owner, self-fencing: a new channel for the node's new incarnation (the old
 * one is destroyed). 0 or -errno (then no channel). */
int node_peer_renew(struct kvf_node *n);
/* Owner: learns a peer's PEER_ZMQ endpoint from a RoomUpdate. */
void node_peer_learn(struct kvf_node *n, struct node_peer *p, const Kvfence__V1__PeerNode *pn);
/* Owner: the peer channel must now say LATE for `r`. */
void node_peer_close_room(struct kvf_node *n, struct node_room *r);
/* Owner: queues `env` (room, receiver filled in here) for the pair's sink node. */
int node_peer_send_env(struct kvf_node *n, struct node_room *r, const struct node_pair *p,
                       Kvfence__V1__PeerEnvelope *env);
/* Owner: the pair (src, sink) of `r`; created when `create`. NULL if absent
 * or out of memory. */
struct node_pair *node_pair_get(struct node_room *r, uint32_t src_rank,
                                const struct node_member *sink, bool create);
/* Owner: a chunk of the pair finished; after the last one, sends AuxData and
 * TransferStatus to the sink node (never for an aborting room). */
void node_pair_chunk_done(struct kvf_node *n, struct node_room *r, struct node_pair *p,
                          uint64_t seq, bool ok, const char *error);
/* Owner: every pair of local source `rank` finished (and at least one exists). */
bool node_pairs_done(const struct node_room *r, uint32_t rank);
void node_pairs_free(struct node_room *r);
/* Owner: sink `m` is about to report Completed: the transfer_done events held
 * for it go out now, in arrival order. */
void node_peer_sink_done(struct kvf_node *n, struct node_room *r, const struct node_member *m);

#endif /* KVF_NODE_PEER_LINK_H */
