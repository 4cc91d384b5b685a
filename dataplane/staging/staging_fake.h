/*
 * staging_fake.h: the fake staging engine of the tests. It plugs into the same
 * ops table as the host and CUDA engines, but runs nothing by itself: every
 * submitted copy is held until the test completes it (doing the memcpy then,
 * or failing it), so a test can keep a copy "in flight" across an abort and
 * finish copies and transports in any order. Built as kvf_dp_staging_fake,
 * never linked into the node.
 *
 * DESIGN: single-threaded; the test thread is the owner thread.
 */
#ifndef KVF_STAGING_FAKE_H
#define KVF_STAGING_FAKE_H

#include <stddef.h>

#include "staging.h"

/* NULL on out of memory. Destroy with kvf_staging_destroy(). */
struct kvf_staging *kvf_staging_fake_create(void);

/* Copies submitted and not yet completed by the test. */
size_t kvf_staging_fake_held(const struct kvf_staging *s);

/* Submissions that reached the engine (the fake's "native calls"), failed
 * ones included. */
unsigned kvf_staging_fake_submits(const struct kvf_staging *s);

/* Completes a held copy: with status 0 the bytes are copied now; with a
 * -errno nothing is copied and the copy comes back as an error. It is handed
 * back by the next poll. -ENOENT when `c` is not held. */
int kvf_staging_fake_complete(struct kvf_staging *s, struct kvf_stage_copy *c, int status);

/* Completes every held copy, oldest first, with `status`; returns how many. */
size_t kvf_staging_fake_complete_all(struct kvf_staging *s, int status);

/* The next submission fails with `neg_errno` (posting nothing). */
void kvf_staging_fake_fail_next_submit(struct kvf_staging *s, int neg_errno);

#endif /* KVF_STAGING_FAKE_H */
