/*
 * rdma.h: the RDMA transport (struct kvf_transport_ops "rdma").
 *
 * Writes go out as RDMA WRITE work requests on reliable-connected QPs, two QPs
 * per peer (as Mooncake does), each QP with at most KVF_RDMA_MAX_WR_PER_QP WRs
 * outstanding. Every verbs call goes through a provider table (verbs.h): the
 * real libibverbs one, or the fake one that tests use.
 *
 * One xfer = one WR = one lifetime op (kind KVF_LT_OP_RDMA_WR). The transport
 * does not split: an xfer is at most KVF_RDMA_MAX_SLICE bytes (64 KiB, the
 * Mooncake slice) and the caller splits a transfer into slices, admitting each
 * slice in the room's lifetime before posting it. Admission is therefore per
 * slice: an abort between two slices of one transfer stops the later ones.
 *
 * Which QP: a peer's writes for one room always use the same QP
 * (room_id % 2), so the writes of a room to a peer complete in post order; the
 * writes of two rooms may go to different QPs and are not ordered with each
 * other.
 *
 * Outcomes (each WR is signaled and completes exactly once through poll):
 *   IBV_WC_SUCCESS        -> KVF_LT_DONE_OK
 *   IBV_WC_WR_FLUSH_ERR   -> KVF_LT_DONE_FLUSHED (status -ECANCELED)
 *   any other status      -> KVF_LT_DONE_ERROR (status -EIO): an error
 *                            completion proves the WR stopped. The QP is in
 *                            ERR now; the WRs behind it come back FLUSHED and
 *                            later posts to that QP fail with -EIO.
 *
 * post_send failures (kvf_transport_rdma_post_chain):
 *   - bad_wr inside the chain: the WRs before it were posted and will complete;
 *     those from it on were not (that is proof): the call returns -errno and
 *     *posted_p, and the CALLER cancels the admissions of the unposted ones
 *     with kvf_lt_op_cancel (as for any failed post_write, transport.h).
 *   - bad_wr NULL or outside the chain: the fate of every WR of the chain is
 *     unknown. The transport keeps them all as outstanding, quarantines their
 *     ops (kvf_lt_op_quarantine: the lifetime stays QUARANTINED) and returns 0
 *     as if posted: each one completes through poll, or a fence proves it
 *     stopped. The caller must not cancel them.
 *
 * Fence (fence_peer): both QPs of the peer go to IBV_QPS_ERR, then a marker WR
 * is posted to each (it is flushed at once; completions of a QP come in order,
 * so the marker's flush proves that every WR posted before it has produced its
 * completion: the ib_drain_sq method). The CQ is reaped until both markers are
 * back. Only then does fence_peer return 0; the reaped completions wait in
 * poll (FLUSHED unless they had finished). An outstanding WR still unreported
 * after the marker was never posted (an ambiguous post_send) and comes back
 * FLUSHED too. If the markers are not back within opts.fence_timeout_ms,
 * fence_peer returns -ETIMEDOUT: nothing is pretended, the outstanding WRs stay
 * counted and are quarantined; a later fence_peer or poll picks up where it
 * stopped. After a fence that returned 0, the node may call
 * kvf_lt_table_peer_fenced(peer).
 *
 * DESIGN (threads): unlike tcp, the RDMA transport has one owner thread: the
 * node's data-plane thread, which also owns the lifetime table (quarantine
 * and the retirement of quarantined ops are owner-thread calls). post_write,
 * post_chain, poll, fence_peer, the setup calls and destroy are all made on
 * that thread; nothing here takes a lock. poll never blocks: it reaps the CQ
 * in batches of KVF_RDMA_POLL_BATCH. fence_peer busy-polls the CQ (with short
 * sleeps) until its proof arrives or its timeout passes.
 */
#ifndef KVF_TRANSPORT_RDMA_H
#define KVF_TRANSPORT_RDMA_H

#include <stdbool.h>
#include <stdint.h>

#include "kvf_error.h"
#include "transport.h"
#include "verbs.h"

#define KVF_RDMA_QPS_PER_PEER  2u
#define KVF_RDMA_MAX_WR_PER_QP 256u
#define KVF_RDMA_MAX_SLICE     (64u * 1024u)
#define KVF_RDMA_POLL_BATCH    16u

/* What one side tells the other to connect a peer's QPs (exchanged by the
 * caller, e.g. in a peer.proto message). */
struct kvf_rdma_conn_info {
    uint16_t lid;
    uint8_t gid[16];
    uint32_t qp_num[KVF_RDMA_QPS_PER_PEER];
    uint32_t psn[KVF_RDMA_QPS_PER_PEER]; /* 24 bits */
};

struct kvf_transport_rdma_opts {
    const struct kvf_verbs_ops *verbs; /* required: &kvf_verbs_real_ops or the fake */
    void *verbs_prov;                  /* the provider instance (fake), NULL for real */
    const char *device;                /* NULL: the first device */
    uint8_t port;                      /* default 1 */
    int gid_index;                     /* -1 (default): route by LID (IB); >= 0: RoCE GID */
    uint32_t max_peers;                /* peer indices are < max_peers; default 64 */
    uint32_t max_pools;                /* local and per-peer remote pools; default 64 */
    uint32_t fence_timeout_ms;         /* default 5000 */
    uint32_t psn_seed;                 /* 0: from the clock */
};

struct kvf_transport_rdma_stats {
    uint64_t wrs_posted;      /* WRs the provider took (ambiguous ones included) */
    uint64_t wrs_ok;          /* completed OK */
    uint64_t wrs_error;       /* error completions */
    uint64_t wrs_flushed;     /* flushed (by a fence, or behind an error) */
    uint64_t posts_failed;    /* post_send errors with a precise bad_wr */
    uint64_t posts_unknown;   /* post_send errors that left WRs of unknown fate */
    uint64_t wrs_quarantined; /* ops this transport quarantined */
    uint64_t fences_done;     /* fence_peer calls that returned 0 */
    uint64_t fences_timed_out;
    uint64_t peer_resets; /* reset_peer calls that returned 0 */
};

void kvf_transport_rdma_opts_init(struct kvf_transport_rdma_opts *opts);

/*
 * Opens the device, allocates the PD and the CQ. NULL on failure, with the
 * reason in `err` (may be NULL): -ENODEV when there is no such device (the
 * real provider on a machine without RDMA), -EINVAL for a bad option, or the
 * provider's errno. Destroy with kvf_transport_destroy.
 */
struct kvf_transport *kvf_transport_rdma_create(const struct kvf_transport_rdma_opts *opts,
                                                struct kvf_error *err);

/*
 * Registers a local pool (the memory WRs read from, or peers write into):
 * local write, remote write and remote read access. `*rkey_p` is the key to
 * give peers. -EEXIST, -E2BIG (max_pools), -EINVAL, or the provider's errno.
 */
int kvf_transport_rdma_add_pool(struct kvf_transport *t, uint32_t pool_id, void *base,
                                uint32_t page_size, uint32_t page_count, uint32_t *rkey_p);

/* Names pool `pool_id` of peer `peer`: its address there, geometry and rkey.
 * -ENOENT (peer index out of range), -EEXIST, -E2BIG, -EINVAL. */
int kvf_transport_rdma_add_remote_pool(struct kvf_transport *t, uint32_t peer, uint32_t pool_id,
                                       uint64_t remote_addr, uint32_t page_size,
                                       uint32_t page_count, uint32_t rkey);

/*
 * Creates the peer's QPs if needed (to INIT) and writes what the peer needs to
 * connect them. -ENOENT (index out of range), -ESTALE (fenced), or the
 * provider's errno (the half-made QPs are destroyed).
 */
int kvf_transport_rdma_local_info(struct kvf_transport *t, uint32_t peer,
                                  struct kvf_rdma_conn_info *info_p);

/*
 * Connects the peer's QPs to `remote` (INIT -> RTR -> RTS). Call after
 * local_info. -ENOENT (no local_info yet), -EEXIST (connected), -ESTALE
 * (fenced), -EINVAL, or the provider's errno (the QPs stay where they got).
 */
int kvf_transport_rdma_connect(struct kvf_transport *t, uint32_t peer,
                               const struct kvf_rdma_conn_info *remote);

/*
 * Posts `n` xfers (1..KVF_RDMA_MAX_WR_PER_QP) as one chain of WRs with one
 * post_send call. All must go to one peer and room (one QP). 0: all are owned
 * by the transport (see "post_send failures" above). -EAGAIN: the QP has not
 * room for all n (nothing posted; *posted_p = 0). Other -errno: xfers
 * [0, *posted_p) were posted and will complete; [*posted_p, n) were not:
 * the caller cancels their admissions. Validation errors (-EINVAL, -ENOENT,
 * -ESTALE, -EIO) post nothing.
 */
int kvf_transport_rdma_post_chain(struct kvf_transport *t, struct kvf_xfer *const *xs, unsigned n,
                                  unsigned *posted_p);

/* Deregisters local pool `pool_id`. -ENOENT; -EBUSY while a WR that reads from it is outstanding.
 */
int kvf_transport_rdma_remove_pool(struct kvf_transport *t, uint32_t pool_id);
/* Forgets remote pool `pool_id` of `peer`. -ENOENT. Posts to it fail with -ENOENT afterwards. */
int kvf_transport_rdma_remove_remote_pool(struct kvf_transport *t, uint32_t peer, uint32_t pool_id);

/*
 * After an error completion (a QP of the peer is broken: in ERR for good),
 * the link can be made again with fresh QPs: reset_peer moves both QPs to
 * ERR and waits like fence_peer (at most fence_timeout_ms) until every WR
 * posted to them came back (the completions wait for poll), then destroys
 * them. The next local_info creates new QPs (new numbers and PSNs) for
 * connect; remote pools stay. Unlike a fence it is not permanent. 0 (also
 * with no QPs), -ENOENT, -ESTALE (fenced); any other error (the move to ERR
 * failed, -ETIMEDOUT with the open WRs quarantined, a poll error) leaves the
 * peer fenced for good: a caller then uses another transport for it.
 */
int kvf_transport_rdma_reset_peer(struct kvf_transport *t, uint32_t peer);

/* True when a QP of `peer` got an error completion (posts to it fail -EIO
 * until reset_peer). */
bool kvf_transport_rdma_peer_broken(const struct kvf_transport *t, uint32_t peer);

/* WRs outstanding on QP `qp` (0 or 1) of `peer` (0 if none). */
unsigned kvf_transport_rdma_outstanding(const struct kvf_transport *t, uint32_t peer, unsigned qp);

void kvf_transport_rdma_stats(const struct kvf_transport *t, struct kvf_transport_rdma_stats *out);

#endif /* KVF_TRANSPORT_RDMA_H */
