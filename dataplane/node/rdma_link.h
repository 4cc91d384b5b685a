/*
 * rdma_link.h: the RDMA transport in kvfence-node's data path (rdma_link.c):
 * which device (--rdma auto|off|fake), the pools as memory regions, the link
 * per peer (queue pairs and pool rkeys exchanged over the peer channel:
 * LinkHello / LinkAccept / LinkReady / LinkPools, peer.proto), the slices of
 * a chunk posted as RDMA WRITE chains, ChunkNotice at the source and its
 * checks at the sink, fences and the self-fence renewal.
 *
 * DESIGN (threads): the RDMA transport has one owner thread (rdma.h): every
 * function here runs on the node's owner thread (or, for start and stop,
 * while it does not run). The peer channel's thread only packs a received
 * link message into a job for the owner.
 */
#ifndef KVF_NODE_RDMA_LINK_H
#define KVF_NODE_RDMA_LINK_H

#include <stdbool.h>
#include <stdint.h>

#include "node_types.h"

struct node_chunk;
struct node_route;

/* Start (after the local transport): with --rdma auto a real device if one
 * is found, with fake the fake fabric, with off (or --staging) nothing.
 * 0, or -errno when --rdma fake cannot start. n->rdma stays NULL when off. */
int node_rdma_start(struct kvf_node *n);

/* After the owner stopped and the lifetimes drained: logs the counters and
 * frees the transport (and the fake device). */
void node_rdma_stop(struct kvf_node *n);

/* A pool was registered / is being removed: its memory region (and the
 * announcement to the linked peers); a multi-buffer pool of host buffers
 * gets one region per buffer (NODE_RDMA_SUB_ID), all or none. Never fails
 * the pool: a region that cannot be registered only keeps RDMA away from it
 * (logged). */
void node_rdma_add_pool(struct kvf_node *n, const struct node_pool *p);
void node_rdma_remove_pool(struct kvf_node *n, uint32_t pool_id);

/* Route towards peer `peer` (not this node): true when the chunk goes over
 * RDMA (both ends have it, the link is up, the sink pool is known there);
 * otherwise starts the link when it can and answers false (TCP). */
bool node_rdma_route(struct kvf_node *n, uint32_t peer, const struct node_member *sink,
                     struct node_route *rt);

/* A buffer of a multi-buffer pool is an RDMA region of its own (docs/node.md,
 * "Pools"), named in LinkPools and in the WRs by this id: bit 31 set, the
 * buffer index in bits 20..29, the pool's id below (pools with an id below
 * NODE_RDMA_SUB_POOL_LIMIT only). */
#define NODE_RDMA_SUB_POOL_LIMIT (1u << 20)
#define NODE_RDMA_SUB_BUFFERS    1024u
#define NODE_RDMA_SUB_ID(id, b)  (0x80000000u | ((uint32_t)(b) << 20) | (uint32_t)(id))
#define NODE_RDMA_IS_SUB(id)     (((id)&0x80000000u) != 0)
#define NODE_RDMA_SUB_PARENT(id) (NODE_RDMA_IS_SUB(id) ? (id)&0xfffffu : (id))
#define NODE_RDMA_SUB_BUF(id)    (((id) >> 20) & 0x3ffu)

/* Route of a chunk from multi-buffer pool `src` to pool `sink_pool_id` of
 * peer `peer`: true (RDMA, one WR per buffer and run of pages) when the link
 * is up and the peer announced a region for each buffer of its pool with
 * the same slot sizes, no more, each slot at most an RDMA slice; else false
 * (TCP, which checks the layout itself). */
bool node_rdma_route_buffers(struct kvf_node *n, uint32_t peer, uint32_t sink_pool_id,
                             const struct kvf_pool *src, struct node_route *rt);

/* Queues the slices of `ch` (kind RDMA_WR, all filled in) and posts what
 * the queue pairs take; each slice is admitted right before its post. */
void node_rdma_post_chunk(struct kvf_node *n, struct node_chunk *ch);

/* Owner loop: completions, queued slices, link messages due. */
void node_rdma_poll(struct kvf_node *n);

/* FencePeer / self-fence: the peer's QPs to ERR and every WR back (rdma.h
 * fence_peer); the link is dead for good. 0 or -errno (not fenced). */
int node_rdma_fence_peer(struct kvf_node *n, uint32_t peer);

/* Stop (owner thread, lifetimes drained): LinkClose to every linked peer,
 * best effort (waits at most 200 ms for the channel to send them). */
void node_rdma_close_all(struct kvf_node *n, const char *why);

/* Self-fence: fences every peer, then replaces the transport by a fresh one
 * (new PD, regions and rkeys) with the same pools and no links. */
int node_rdma_renew(struct kvf_node *n);

/* Fault file rdma_hold: the fake fabric keeps posted WRs outstanding. */
void node_rdma_set_hold(struct kvf_node *n, bool hold);

/* Fault file rdma_hold_odd: the same for QP 1 (rooms with odd ids) of every
 * peer linked now; QP 0 runs (a test of the per-QP slice FIFOs). */
void node_rdma_set_hold_odd(struct kvf_node *n, bool hold);

/* Owner: a link message the peer channel delivered (a packed LinkMessage in
 * pm->data, pm->len bytes); peer_link.c's job calls it through
 * n->link_msg_in. */
void node_rdma_link_msg(struct kvf_node *n, const struct node_peer_msg *pm);

/* How the bytes of `ch` travel (Kvfence__V1__TransportKind): RDMA, LOCAL
 * (same node) or TCP. */
int node_chunk_transport(const struct node_chunk *ch);

/* Source: every slice of `ch` completed OK: ChunkNotice to the sink (before
 * the pair's AuxData / TransferStatus). 0 or -errno. */
int node_rdma_send_notice(struct kvf_node *n, struct node_chunk *ch);

/* Sink: a ChunkNotice for local sink `m` (checked, then counted like landed
 * TCP frames). */
void node_rdma_notice_in(struct kvf_node *n, struct node_room *r, struct node_member *m,
                         const struct node_peer_msg *pm);

/* The RDMA transport, NULL when RDMA is off (the owner loop's wake
 * descriptors). */
struct kvf_transport *node_rdma_transport(struct kvf_node *n);

/* Owner loop: by when RDMA needs a turn without a descriptor waking the
 * owner (node_now_ms time): at once-ish while work requests are outstanding
 * or queued (no completion channel: the CQs are reaped), soon while a link
 * message is due; INT64_MAX when idle. */
int64_t node_rdma_next_ms(struct kvf_node *n, int64_t now);

#endif /* KVF_NODE_RDMA_LINK_H */
