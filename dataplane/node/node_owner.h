/*
 * node_owner.h: the owner's API for the modules it runs (NodeLocal handlers,
 * Watch and SubmitChunks streams, the peer and RDMA links, the transports'
 * node side): post a job to the owner thread, and the read-only queries of
 * the owner's tables. It names no module above it: the owner runs the jobs
 * (node.c), the queue and the queries live in node_owner.c.
 */
#ifndef KVF_NODE_OWNER_H
#define KVF_NODE_OWNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"

struct kvf_node;
struct node_job;
struct node_member;
struct node_pool;
struct node_range;
struct node_room;

/* ---- posting to the owner (any thread) ------------------------------------------ */

/* Posts `j`. A synchronous job (j->sync) is waited for and stays the
 * caller's; an asynchronous one belongs to the owner from a 0 return on.
 * -ESHUTDOWN once the owner has exited (the job stays the caller's). */
int node_post(struct kvf_node *n, struct node_job *j);
/* Posts the asynchronous jobs head..tail (linked by next) with one wake-up.
 * -ESHUTDOWN once the owner has exited (the jobs stay the caller's). */
int node_post_list(struct kvf_node *n, struct node_job *head, struct node_job *tail);
/* Frees `j` and what it owns (decoded requests, a peer message, and what
 * j->release frees). NULL is fine. */
void node_job_free(struct node_job *j);

/* ---- read-only queries (owner thread, unless said) -------------------------------- */

/* The room of `key`, or NULL. The owner, or any thread holding rooms_lock. */
struct node_room *node_room_find(struct kvf_node *n, kvf_room_key key);
/* The room index's bucket of `key` among `cap` (a power of 2). */
size_t node_room_bucket(kvf_room_key key, size_t cap);
struct node_pool *node_pool_find(struct kvf_node *n, uint32_t id); /* NULL: not registered */
/* This incarnation's sink member of rank `rank` in `r`, or NULL. */
struct node_member *node_local_sink(struct node_room *r, uint32_t rank);
/* The peer slot of (node_id, incarnation): true and *idx_p, or false (none). */
bool node_find_peer(const struct kvf_node *n, const char *node_id, uint64_t incarnation,
                    uint32_t *idx_p);
/* Every page of [first, first + count) lies in one of the ranges. Any thread. */
bool node_ranges_cover(const struct node_range *rv, size_t nr, uint32_t first, uint32_t count);

#endif /* KVF_NODE_OWNER_H */
