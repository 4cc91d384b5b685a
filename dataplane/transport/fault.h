/*
 * fault.h: a fault-injecting transport (kvf_transport_fault_*) that wraps any
 * struct kvf_transport, for tests of the node's race handling. It is compiled
 * into every build and does nothing until knobs are set.
 *
 * Knobs (struct kvf_fault_knobs, replaced as a whole; the post counter starts
 * again from 0 at every kvf_transport_fault_set):
 *   hold           every post is accepted (it stays counted in its lifetime)
 *                  and kept back, not handed to the inner transport, until
 *                  hold is cleared; then the held ops are posted in order;
 *   fail_post_nth  the Nth post returns -EIO: nothing posted, the caller
 *                  cancels the admission (a native post refused; with N > 1
 *                  inside one chunk, a submission that fails part-way);
 *   error_nth      the Nth post is accepted and completes ERROR (-EIO) at the
 *                  next poll without reaching the inner transport (a native
 *                  write that failed after it was posted).
 * error_nth and fail_post_nth win over hold for the post they name.
 *
 * The contract of transport.h holds: every accepted op completes exactly once;
 * fence_peer completes the ops held for that peer FLUSHED (they wait in poll)
 * before it fences the inner transport, and later posts to that peer fail
 * with -ESTALE. An op the inner transport refuses when hold is cleared
 * completes ERROR with the inner's error.
 *
 * DESIGN: one mutex guards the wrapper's state; the inner transport is called
 * under it (post_write, poll and fence_peer of tcp.c and rdma.c never call
 * back into their caller). Held ops are released by kvf_transport_fault_set
 * and by poll. destroy retires the held and unreported ops FLUSHED and frees
 * the wrapper, NOT the inner transport (it stays its creator's, destroyed
 * after the wrapper).
 *
 * Errors: 0 or a negative errno (common/kvf_error.h).
 */
#ifndef KVF_TRANSPORT_FAULT_H
#define KVF_TRANSPORT_FAULT_H

#include <stdbool.h>
#include <stdint.h>

#include "transport.h"

struct kvf_fault_knobs {
    bool hold;
    uint64_t fail_post_nth; /* 0: off */
    uint64_t error_nth;     /* 0: off */
};

struct kvf_fault_stats {
    uint64_t posts;       /* post_write calls since the last set */
    uint64_t held;        /* ops held now */
    uint64_t released;    /* held ops handed to the inner transport, ever */
    uint64_t failed_post; /* posts refused by fail_post_nth, ever */
    uint64_t errored;     /* ops completed ERROR by error_nth, ever */
    uint64_t flushed;     /* held ops completed FLUSHED by a fence, ever */
};

/* Called (under the wrapper's lock: it must not call the wrapper) when a
 * fault fires: `what` is "hold", "release", "fail_post", "error" or "flush";
 * `x` the op, `rc` the error involved (0 for none). */
typedef void (*kvf_fault_log_fn)(void *ctx, const char *what, const struct kvf_xfer *x, int rc);

/* Wraps `inner` (not owned). `log` may be NULL. NULL on out of memory. */
struct kvf_transport *kvf_transport_fault_create(struct kvf_transport *inner, kvf_fault_log_fn log,
                                                 void *log_ctx);

/* Replaces the knobs; resets the post counter; releases the held ops when
 * hold is off. Any thread. */
void kvf_transport_fault_set(struct kvf_transport *t, const struct kvf_fault_knobs *k);

void kvf_transport_fault_stats(struct kvf_transport *t, struct kvf_fault_stats *s);

/* True when `t` is a fault wrapper. */
bool kvf_transport_is_fault(const struct kvf_transport *t);

#endif /* KVF_TRANSPORT_FAULT_H */
