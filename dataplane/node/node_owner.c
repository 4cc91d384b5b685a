/*
 * node_owner.c: the owner's API for the modules it runs (node_owner.h): its
 * job queue, the read-only queries of its tables, and the calls to its
 * actions through the table node.c filled (struct node_owner_ops). node.c,
 * the owner thread, takes the jobs and runs them.
 *
 * DESIGN (threads): node_post and node_post_list run on any thread (under
 * qlock); the owner takes the whole queue at once, so only a post to an
 * empty queue wakes it (the qwake eventfd its poll(2) sleeps on). The
 * queries read owner state: owner thread, or a receiver holding rooms_lock
 * for node_room_find.
 */
#include "node_owner.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "node_types.h"
#include "transport.h"

/* ---- job queue ----------------------------------------------------------------- */

struct node_job *node_job_new(void (*run)(struct kvf_node *n, void *arg), void *arg,
                              void (*free_arg)(void *arg))
{
    struct node_job *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->run = run;
    j->arg = arg;
    j->free_arg = free_arg;
    return j;
}

void node_job_free(struct node_job *j)
{
    if (!j)
        return;
    if (j->free_arg)
        j->free_arg(j->arg);
    free(j);
}

/* Under qlock: appends head..tail (linked by next) to the owner's queue and
 * wakes it. -ESHUTDOWN once the owner has exited (nothing is queued). */
static int node_queue_locked(struct kvf_node *n, struct node_job *head, struct node_job *tail)
{
    if (n->owner_exit)
        return -ESHUTDOWN;
    tail->next = NULL;
    if (n->qtail) {
        n->qtail->next = head;
    } else {
        /* The owner takes the whole queue at once: it empties it, so a post
         * to an empty queue is the only one that must wake it. */
        n->qhead = head;
        kvf_wake_signal(n->qwake);
    }
    n->qtail = tail;
    return 0;
}

/* Posts `j`. A synchronous job (j->sync) is waited for and stays the
 * caller's; an asynchronous one belongs to the owner from a 0 return on.
 * -ESHUTDOWN once the owner has exited (the job stays the caller's). */
int node_post(struct kvf_node *n, struct node_job *j)
{
    pthread_mutex_lock(&n->qlock);
    int rc = node_queue_locked(n, j, j);
    if (rc == 0 && j->sync) {
        while (!j->done && !n->owner_exit)
            pthread_cond_wait(&n->qdone, &n->qlock);
        rc = j->done ? 0 : -ESHUTDOWN;
    }
    pthread_mutex_unlock(&n->qlock);
    return rc;
}

/* Posts the asynchronous jobs head..tail (linked by next) with one wake-up.
 * -ESHUTDOWN once the owner has exited (the jobs stay the caller's). */
int node_post_list(struct kvf_node *n, struct node_job *head, struct node_job *tail)
{
    pthread_mutex_lock(&n->qlock);
    int rc = node_queue_locked(n, head, tail);
    pthread_mutex_unlock(&n->qlock);
    return rc;
}

void node_post_or_fail(struct kvf_node *n, struct node_job *j)
{
    if (node_post(n, j) != 0)
        node_job_free(j); /* its free_arg fails the call it still holds */
}

/* ---- read-only queries --------------------------------------------------------- */

/* Any thread holding rooms_lock, or the owner. */
size_t node_room_bucket(kvf_room_key key, size_t cap)
{
    uint64_t h = key.room_id * 0x9e3779b97f4a7c15ull ^ key.generation * 0xc2b2ae3d27d4eb4full;
    return (size_t)(h ^ (h >> 32)) & (cap - 1);
}

struct node_room *node_room_find(struct kvf_node *n, kvf_room_key key)
{
    if (!n->room_index_cap)
        return NULL;
    for (struct node_room *r = n->room_index[node_room_bucket(key, n->room_index_cap)]; r;
         r = r->hnext)
        if (kvf_room_key_eq(r->key, key))
            return r;
    return NULL;
}

struct node_pool *node_pool_find(struct kvf_node *n, uint32_t id)
{
    for (uint32_t i = 0; i < n->npools; i++)
        if (n->pools[i].id == id)
            return &n->pools[i];
    return NULL;
}

struct node_member *node_local_sink(struct node_room *r, uint32_t rank)
{
    for (size_t i = 0; i < r->nmembers; i++) {
        struct node_member *m = &r->members[i];
        if (m->local && m->rank == rank && m->role == KVFENCE__V1__ROLE__ROLE_SINK)
            return m;
    }
    return NULL;
}

bool node_find_peer(const struct kvf_node *n, const char *node_id, uint64_t incarnation,
                    uint32_t *idx_p)
{
    return kvf_ncore_peer_find(n->core, node_id, incarnation, idx_p) == 0;
}

bool node_room_may_send(const struct node_room *r, const char *node_id, uint64_t incarnation)
{
    for (size_t i = 0; i < r->nmembers; i++)
        if (r->members[i].role == KVFENCE__V1__ROLE__ROLE_SOURCE &&
            r->members[i].incarnation == incarnation && strcmp(r->members[i].node_id, node_id) == 0)
            return true;
    for (size_t i = 0; i < r->nintro; i++)
        if (r->intro[i].incarnation == incarnation && strcmp(r->intro[i].node_id, node_id) == 0)
            return true;
    return false;
}

bool node_ranges_cover(const struct node_range *rv, size_t nr, uint32_t first, uint32_t count)
{
    /* Every page of [first, first + count) lies in one of the ranges. */
    uint64_t p = first, end = (uint64_t)first + count;
    while (p < end) {
        bool hit = false;
        for (size_t i = 0; i < nr; i++) {
            if (p >= rv[i].first && p < (uint64_t)rv[i].first + rv[i].count) {
                p = (uint64_t)rv[i].first + rv[i].count;
                hit = true;
                break;
            }
        }
        if (!hit)
            return false;
    }
    return true;
}

/* ---- the owner's actions, through its table -------------------------------------- */

void node_part_completed(struct kvf_node *n, struct node_room *r, struct node_member *m)
{
    n->owner_ops->part_completed(n, r, m);
}

void node_core_apply(struct kvf_node *n)
{
    n->owner_ops->core_apply(n);
}

void node_check_drained(struct kvf_node *n, struct node_room *r)
{
    n->owner_ops->check_drained(n, r);
}

void node_check_sink_complete(struct kvf_node *n, struct node_room *r, struct node_member *m)
{
    n->owner_ops->check_sink_complete(n, r, m);
}

void node_check_sinks(struct kvf_node *n, struct node_room *r)
{
    n->owner_ops->check_sinks(n, r);
}

void node_sink_landed(struct kvf_node *n, struct node_room *r, uint32_t rank, uint32_t first_page,
                      uint32_t page_count, uint64_t bytes)
{
    n->owner_ops->sink_landed(n, r, rank, first_page, page_count, bytes);
}

int node_ensure_peer(struct kvf_node *n, const char *node_id, uint64_t incarnation, uint32_t *idx_p)
{
    return n->owner_ops->ensure_peer(n, node_id, incarnation, idx_p);
}

void node_fail_unknown_room(struct kvf_node *n, kvf_room_key key, const char *why)
{
    n->owner_ops->fail_unknown_room(n, key, why);
}

void node_frame_end(struct kvf_node *n, struct node_frame *f, bool ok)
{
    n->owner_ops->frame_end(n, f, ok);
}

void node_completion(struct kvf_node *n, const struct kvf_completion *c)
{
    n->owner_ops->completion(n, c);
}
