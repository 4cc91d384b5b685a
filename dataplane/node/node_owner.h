/*
 * node_owner.h: the owner's API for the modules it runs (NodeLocal handlers,
 * Watch and SubmitChunks streams, the peer and RDMA links, the transports'
 * node side): post a job to the owner thread, the read-only queries of the
 * owner's tables, and the owner's actions for the handlers it runs on its
 * thread. It names no module above it: the owner runs the jobs and fills the
 * table of its actions (node.c); the queue, the queries and the calls
 * through the table live in node_owner.c.
 */
#ifndef KVF_NODE_OWNER_H
#define KVF_NODE_OWNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"

struct kvf_completion;
struct kvf_node;
struct node_frame;
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
/* Posts a unary NodeLocal call's job; on shutdown frees it, and its
 * free_arg fails the call UNAVAILABLE ("node shutting down"). */
void node_post_or_fail(struct kvf_node *n, struct node_job *j);
/* A new asynchronous job: the owner calls run(n, arg), then free_arg(arg)
 * (NULL: nothing to free). NULL when out of memory: `arg` stays the
 * caller's. */
struct node_job *node_job_new(void (*run)(struct kvf_node *n, void *arg), void *arg,
                              void (*free_arg)(void *arg));
/* Frees `j` and its argument (free_arg), whether it ran or not: a job that
 * is dropped or refused is freed here too. NULL is fine. */
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
/* True when (node_id, incarnation) may send data into `r`'s sinks here: a
 * source member of the room on that node, or a node the room's update
 * introduced, which may send before its members are published here (its node
 * learned this node's sink once this node acknowledged, possibly before the
 * control plane had that node's own ack; docs/node.md, "Ordered room
 * updates"). The sink lease checks still apply. Owner, or under rooms_lock. */
bool node_room_may_send(const struct node_room *r, const char *node_id, uint64_t incarnation);
/* Every page of [first, first + count) lies in one of the ranges. Any thread. */
bool node_ranges_cover(const struct node_range *rv, size_t nr, uint32_t first, uint32_t count);

/* ---- the owner's actions (owner thread) ------------------------------------------ */

/* What the owner does for the handlers it runs on its thread (a chunk
 * submitted, a frame or a completion landed, a peer envelope delivered).
 * node.c fills the table at start (struct kvf_node.owner_ops); the
 * functions below call through it, so that no module names node.c. */
struct node_owner_ops {
    void (*part_completed)(struct kvf_node *n, struct node_room *r, struct node_member *m);
    void (*core_apply)(struct kvf_node *n);
    void (*check_drained)(struct kvf_node *n, struct node_room *r);
    void (*check_sink_complete)(struct kvf_node *n, struct node_room *r, struct node_member *m);
    void (*check_sinks)(struct kvf_node *n, struct node_room *r);
    void (*sink_landed)(struct kvf_node *n, struct node_room *r, uint32_t rank, uint32_t first_page,
                        uint32_t page_count, uint64_t bytes);
    int (*ensure_peer)(struct kvf_node *n, const char *node_id, uint64_t incarnation,
                       uint32_t *idx_p);
    void (*fail_unknown_room)(struct kvf_node *n, kvf_room_key key, const char *why);
    /* The submit path's completion handlers (local_svc.c): what the
     * transports' node side hands back. */
    void (*frame_end)(struct kvf_node *n, struct node_frame *f, bool ok);
    void (*completion)(struct kvf_node *n, const struct kvf_completion *c);
};

/* Local participant `m` is complete: the core decides what follows (the
 * report, closing the room once every local participant is). */
void node_part_completed(struct kvf_node *n, struct node_room *r, struct node_member *m);
/* Applies every effect the rules core emitted (node_core.h); call after each
 * core call (node_check_drained does). */
void node_core_apply(struct kvf_node *n);
/* Tells the core that `r` may have drained, and applies what follows. */
void node_check_drained(struct kvf_node *n, struct node_room *r);
/* A local sink whose lease is full and accounted for, with no receive in
 * flight, is complete (kvf_ncore_sink_ready decides). */
void node_check_sink_complete(struct kvf_node *n, struct node_room *r, struct node_member *m);
/* node_check_sink_complete for every local sink of `r`. */
void node_check_sinks(struct kvf_node *n, struct node_room *r);
/* `bytes` landed in pages [first_page, first_page + page_count) of local sink
 * `rank`'s lease (local transport, RDMA); may complete it. */
void node_sink_landed(struct kvf_node *n, struct node_room *r, uint32_t rank, uint32_t first_page,
                      uint32_t page_count, uint64_t bytes);
/* The slot of (node_id, incarnation), added to the TCP transport if new; a
 * slot of a fenced incarnation no room names is recycled (node_core.h).
 * 0, -E2BIG (every slot live or named), or the transport's error. */
int node_ensure_peer(struct kvf_node *n, const char *node_id, uint64_t incarnation,
                     uint32_t *idx_p);
/* A frame or peer envelope for a room this node has no update for: the
 * control plane's order (a member is published only after its node
 * acknowledged it) makes that a protocol violation. Sends TransferFailed for
 * the room at once, unless the room is closed here (late) or known by now. */
void node_fail_unknown_room(struct kvf_node *n, kvf_room_key key, const char *why);
/* A frame ended (its ops retired, its buffer returned); frees the chunk after
 * its last frame. A transport's frame that never went out ends here too. */
void node_frame_end(struct kvf_node *n, struct node_frame *f, bool ok);
/* One completion of a transport: the frame's op retires, a local sink may
 * land pages, the chunk may end. */
void node_completion(struct kvf_node *n, const struct kvf_completion *c);

#endif /* KVF_NODE_OWNER_H */
