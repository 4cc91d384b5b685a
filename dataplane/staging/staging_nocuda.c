/*
 * staging_nocuda.c: the CUDA staging entry points of a node built without
 * CUDA (KVF_HAVE_CUDA off): the engine cannot be created and pinned memory
 * cannot be allocated, so such a node does not advertise CUDA_STAGING.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "staging.h"
#include "kvf_log.h"

void kvf_staging_cuda_opts_init(struct kvf_staging_cuda_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->streams = 2;
}

struct kvf_staging *kvf_staging_cuda_create(const struct kvf_staging_cuda_opts *opts)
{
    (void)opts;
    kvf_log("error", "kvf_staging_cuda_create: this node was built without CUDA");
    return NULL;
}

int kvf_staging_cuda_host_alloc(size_t size, void **mem_p)
{
    (void)size;
    (void)mem_p;
    return -ENOTSUP;
}

void kvf_staging_cuda_host_free(void *mem)
{
    (void)mem;
}
