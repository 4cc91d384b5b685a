/*
 * local_svc.h: the NodeLocal server (RegisterPool, SubmitChunk) and the submit path: admission of a
 * chunk, its frames' completions, the one mapping of a rule's -errno to a gRPC status. Functions of
 * local_svc.c only; the shared types are node_types.h.
 */
#ifndef KVF_NODE_LOCAL_SVC_H
#define KVF_NODE_LOCAL_SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

struct kvf_completion;
struct node_frame;

/* Registers one more service of the NodeLocal server before it starts. */
typedef int (*node_local_register_fn)(struct kvf_node *n);
/* Starts the NodeLocal server: RegisterPool and SubmitChunk, then `extra`
 * (the other modules' services, in order), on the local socket and its fd
 * socket. 0 or -errno (logged). */
int node_local_start(struct kvf_node *n, const node_local_register_fn *extra, size_t nextra);
/* Stops the server (the services' state is freed by their modules after). */
void node_local_stop(struct kvf_node *n);
/* A SubmitChunk(s) request's outcome: 0 or a negative errno with the
 * message naming the field, and the status code node_local_status() maps
 * it to. */
struct node_submit_out {
    int code;
    char msg[256];
    int err;
};
/* The one place a rule's -errno becomes a gRPC status (docs/node.md):
 * EINVAL INVALID_ARGUMENT, ENOENT NOT_FOUND, EPERM PERMISSION_DENIED, EEXIST
 * ALREADY_EXISTS, EAGAIN UNAVAILABLE (retry), ECANCELED and ESTALE ABORTED
 * (the room is aborting, closed or late), EPROTO FAILED_PRECONDITION (the
 * room's state does not allow it), ENOMEM RESOURCE_EXHAUSTED, anything else
 * INTERNAL. Any thread. */
int node_local_status(int err);
/* Any thread: the request's shape (INVALID_ARGUMENT): NULL or why. */
const char *node_submit_shape(const Kvfence__V1__SubmitChunkRequest *r);
/* Owner: checks and admits one chunk of a request whose shape was checked;
 * 0 or o->code (both SubmitChunk and SubmitChunks answer from it). */
int node_submit_chunk(struct kvf_node *n, const Kvfence__V1__SubmitChunkRequest *req,
                      struct node_submit_out *o);
/* Owner: one transport completion (the table's `completion`, node_owner.h). */
void node_local_completion(struct kvf_node *n, const struct kvf_completion *c);
/* Owner: a frame ended (the table's `frame_end`, node_owner.h). */
void node_local_frame_end(struct kvf_node *n, struct node_frame *f, bool ok);

#endif /* KVF_NODE_LOCAL_SVC_H */
