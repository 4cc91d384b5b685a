/*
 * submit_stream.h: NodeLocal.SubmitChunks: one stream of chunk requests, each admitted on the owner
 * thread like a SubmitChunk. Functions of submit_stream.c only; the shared types are node_types.h.
 */
#ifndef KVF_NODE_SUBMIT_STREAM_H
#define KVF_NODE_SUBMIT_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

int node_substream_register(struct kvf_node *n);   /* adds SubmitChunks */
void node_substream_put(struct node_substream *s); /* drops a job's reference */
void node_substream_end_all(struct kvf_node *n);   /* after the owner exited */

#endif /* KVF_NODE_SUBMIT_STREAM_H */
