/*
 * watch.h: NodeLocal.Watch: the streams and the events the owner and the links emit (room state,
 * chunks, aux, transfer done). Functions of watch.c only; the shared types are node_types.h.
 */
#ifndef KVF_NODE_WATCH_H
#define KVF_NODE_WATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

int node_watch_register(struct kvf_node *n);  /* before the NodeLocal server starts */
void node_watch_snapshot(struct kvf_node *n); /* owner: a new watcher's job */
void node_watch_end_all(struct kvf_node *n);  /* after the owner exited */
void node_watch_free_all(struct kvf_node *n); /* after the server stopped */
/* Owner: events. */
void node_watch_room_state(struct kvf_node *n, struct node_room *r);
/* transport: Kvfence__V1__TransportKind, how the chunk's bytes travelled. */
void node_watch_chunk_done(struct kvf_node *n, struct node_room *r, uint32_t src_rank,
                           uint32_t sink_rank, uint64_t seq, bool ok, const char *error,
                           int transport);
void node_watch_aux(struct kvf_node *n, struct node_room *r, const struct node_peer_msg *pm);
void node_watch_transfer_done(struct kvf_node *n, struct node_room *r,
                              const struct node_peer_msg *pm);

#endif /* KVF_NODE_WATCH_H */
