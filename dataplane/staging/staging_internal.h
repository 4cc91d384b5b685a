/*
 * staging_internal.h: the engine base every staging engine embeds first.
 * Private to dataplane/staging/ (and the fake engine of the tests).
 */
#ifndef KVF_STAGING_INTERNAL_H
#define KVF_STAGING_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "staging.h"

struct kvf_staging {
    const struct kvf_staging_ops *ops;
    _Atomic uint64_t inflight; /* submitted, not yet polled (kept by the wrappers) */
};

static inline void staging_base_init(struct kvf_staging *s, const struct kvf_staging_ops *ops)
{
    s->ops = ops;
    atomic_init(&s->inflight, 0);
}

/* The host-memory copy of the host and fake engines: memcpy, or kvf_pool_read
 * for a source in a device pool (staging.h). 0 or -errno. */
int staging_host_copy(struct kvf_stage_copy *c);

#endif /* KVF_STAGING_INTERNAL_H */
