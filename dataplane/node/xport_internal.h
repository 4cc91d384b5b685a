/*
 * xport_internal.h: the data path's state (struct node_xport, n->xp), shared
 * by xport.c (staging, the registry walk) and xport_local.c (the local
 * transport). Owner thread only.
 */
#ifndef KVF_NODE_XPORT_INTERNAL_H
#define KVF_NODE_XPORT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "staging.h"
#include "transport.h"
#include "xport.h"

struct node_xport {
    /* The local transport (xport_local.c). */
    struct kvf_transport *local;
    bool self_known;
    uint32_t self_peer;
    bool held;
    uint64_t held_written; /* last count written to <hold file>.queued, +1 */
    /* Staging (xport.c). */
    struct kvf_staging *eng;
    struct kvf_staging_ring *ring;
    void *ring_mem; /* pinned, for the CUDA engine */
    bool staging_cuda;
    struct node_frame *pend_head, *pend_tail;
};

#endif /* KVF_NODE_XPORT_INTERNAL_H */
