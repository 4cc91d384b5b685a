/*
 * fault.c: the fault-injecting transport wrapper (fault.h).
 */
#include "fault.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#define FAULT_MAX_FENCED 256 /* peers whose fence the wrapper remembers */

struct fault_list {
    struct kvf_xfer *head, *tail;
};

struct fault_transport {
    struct kvf_transport base;
    struct kvf_transport *inner;
    kvf_fault_log_fn log;
    void *log_ctx;
    pthread_mutex_t lock;
    struct kvf_fault_knobs k;
    struct kvf_fault_stats st;
    struct fault_list held; /* accepted, not yet given to the inner transport */
    struct fault_list done; /* completed here, waiting for poll */
    uint64_t fenced[FAULT_MAX_FENCED / 64];
};

static const struct kvf_transport_ops fault_ops;

static struct fault_transport *ft_of(struct kvf_transport *t)
{
    return (struct fault_transport *)t;
}

static void list_push(struct fault_list *l, struct kvf_xfer *x)
{
    x->tnext = NULL;
    if (l->tail)
        l->tail->tnext = x;
    else
        l->head = x;
    l->tail = x;
}

static struct kvf_xfer *list_pop(struct fault_list *l)
{
    struct kvf_xfer *x = l->head;
    if (x) {
        l->head = x->tnext;
        if (!l->head)
            l->tail = NULL;
        x->tnext = NULL;
    }
    return x;
}

static bool is_fenced(const struct fault_transport *t, uint32_t peer)
{
    return peer < FAULT_MAX_FENCED && (t->fenced[peer / 64] >> (peer % 64)) & 1u;
}

static void note(struct fault_transport *t, const char *what, const struct kvf_xfer *x, int rc)
{
    if (t->log)
        t->log(t->log_ctx, what, x, rc);
}

static void complete_here(struct fault_transport *t, struct kvf_xfer *x, enum kvf_lt_outcome o,
                          int status)
{
    x->toutcome = (uint8_t)o;
    x->tstatus = status;
    list_push(&t->done, x);
}

/* Hands the held ops to the inner transport, in order. Under the lock. */
static void release_held(struct fault_transport *t)
{
    struct kvf_xfer *x;
    while ((x = list_pop(&t->held)) != NULL) {
        t->st.held--;
        t->st.released++;
        int rc = kvf_transport_post_write(t->inner, x);
        note(t, "release", x, rc);
        if (rc != 0)
            complete_here(t, x, KVF_LT_DONE_ERROR, rc); /* accepted: it must complete */
    }
}

static int fault_post_write(struct kvf_transport *base, struct kvf_xfer *x)
{
    struct fault_transport *t = ft_of(base);
    int rc = 0;
    pthread_mutex_lock(&t->lock);
    uint64_t nth = ++t->st.posts;
    if (t->k.fail_post_nth && nth == t->k.fail_post_nth) {
        t->st.failed_post++;
        rc = -EIO;
        note(t, "fail_post", x, rc);
    } else if (is_fenced(t, x->peer)) {
        rc = -ESTALE;
    } else if (t->k.error_nth && nth == t->k.error_nth) {
        t->st.errored++;
        complete_here(t, x, KVF_LT_DONE_ERROR, -EIO);
        note(t, "error", x, -EIO);
    } else if (t->k.hold || t->held.head) {
        /* Behind held ops too: posts to one peer keep their order. */
        list_push(&t->held, x);
        t->st.held++;
        note(t, "hold", x, 0);
    } else {
        rc = kvf_transport_post_write(t->inner, x);
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

static int fault_poll(struct kvf_transport *base, unsigned max, struct kvf_completion *out)
{
    struct fault_transport *t = ft_of(base);
    unsigned got = 0;
    pthread_mutex_lock(&t->lock);
    if (!t->k.hold && t->held.head)
        release_held(t);
    while (got < max && t->done.head) {
        struct kvf_xfer *x = list_pop(&t->done);
        enum kvf_lt_outcome o = (enum kvf_lt_outcome)x->toutcome;
        int status = x->tstatus;
        out[got].xfer = x;
        out[got].outcome = o;
        out[got].status = status;
        out[got].drained = kvf_lt_op_retire(&x->op, o);
        got++;
    }
    int rc = 0;
    if (got < max)
        rc = kvf_transport_poll(t->inner, max - got, out + got);
    pthread_mutex_unlock(&t->lock);
    if (rc < 0)
        return got ? (int)got : rc;
    return (int)got + rc;
}

static int fault_fence_peer(struct kvf_transport *base, uint32_t peer)
{
    struct fault_transport *t = ft_of(base);
    pthread_mutex_lock(&t->lock);
    struct fault_list keep = {NULL, NULL};
    struct kvf_xfer *x;
    while ((x = list_pop(&t->held)) != NULL) {
        if (x->peer == peer) {
            t->st.held--;
            t->st.flushed++;
            note(t, "flush", x, -ECANCELED);
            complete_here(t, x, KVF_LT_DONE_FLUSHED, -ECANCELED);
        } else {
            list_push(&keep, x);
        }
    }
    t->held = keep;
    int rc = kvf_transport_fence_peer(t->inner, peer);
    if (rc == 0 && peer < FAULT_MAX_FENCED)
        t->fenced[peer / 64] |= 1ull << (peer % 64);
    pthread_mutex_unlock(&t->lock);
    return rc;
}

static void fault_destroy(struct kvf_transport *base)
{
    if (!base)
        return;
    struct fault_transport *t = ft_of(base);
    struct kvf_xfer *x;
    while ((x = list_pop(&t->held)) != NULL)
        (void)kvf_lt_op_retire(&x->op, KVF_LT_DONE_FLUSHED);
    while ((x = list_pop(&t->done)) != NULL)
        (void)kvf_lt_op_retire(&x->op, (enum kvf_lt_outcome)x->toutcome);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

/* The inner transport's: ops completed here (error_nth, a fence's flush)
 * are produced on the poller's own thread, which polls after every post
 * and fence anyway. */
static int fault_wake_fd(struct kvf_transport *base)
{
    return kvf_transport_wake_fd(ft_of(base)->inner);
}

static void fault_wake_ack(struct kvf_transport *base)
{
    kvf_transport_wake_ack(ft_of(base)->inner);
}

/* Pools are the inner transport's: faults touch only the ops. */
static int fault_add_pool(struct kvf_transport *base, const struct kvf_transport_pool *p,
                          uint64_t *key_p)
{
    return kvf_transport_add_pool(ft_of(base)->inner, p, key_p);
}

static int fault_remove_pool(struct kvf_transport *base, uint32_t pool_id)
{
    return kvf_transport_remove_pool(ft_of(base)->inner, pool_id);
}

static const struct kvf_transport_ops fault_ops = {
    .name = "fault",
    .post_write = fault_post_write,
    .poll = fault_poll,
    .fence_peer = fault_fence_peer,
    .destroy = fault_destroy,
    .wake_fd = fault_wake_fd,
    .wake_ack = fault_wake_ack,
    .add_pool = fault_add_pool,
    .remove_pool = fault_remove_pool,
};

struct kvf_transport *kvf_transport_fault_create(struct kvf_transport *inner, kvf_fault_log_fn log,
                                                 void *log_ctx)
{
    if (!inner)
        return NULL;
    struct fault_transport *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->base.ops = &fault_ops;
    t->inner = inner;
    t->log = log;
    t->log_ctx = log_ctx;
    pthread_mutex_init(&t->lock, NULL);
    return &t->base;
}

void kvf_transport_fault_set(struct kvf_transport *base, const struct kvf_fault_knobs *k)
{
    struct fault_transport *t = ft_of(base);
    pthread_mutex_lock(&t->lock);
    t->k = *k;
    t->st.posts = 0;
    if (!t->k.hold && t->held.head)
        release_held(t);
    pthread_mutex_unlock(&t->lock);
}

void kvf_transport_fault_stats(struct kvf_transport *base, struct kvf_fault_stats *s)
{
    struct fault_transport *t = ft_of(base);
    pthread_mutex_lock(&t->lock);
    *s = t->st;
    pthread_mutex_unlock(&t->lock);
}

bool kvf_transport_is_fault(const struct kvf_transport *t)
{
    return t && t->ops == &fault_ops;
}
