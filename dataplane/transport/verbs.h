/*
 * verbs.h: the seam between the RDMA transport (rdma.c) and libibverbs.
 *
 * The transport makes every verbs call through a `const struct
 * kvf_verbs_ops` table, with a provider instance pointer (`prov`) as the
 * first argument. Two providers plug into it:
 *
 *   kvf_verbs_real_ops   thin wrappers over ibv_* (verbs_real.c); `prov` is
 *                        unused (NULL). Compiled into every build, so the real
 *                        code path builds and runs (to -ENODEV) even on
 *                        machines without an RDMA device.
 *   kvf_verbs_fake_ops   a software provider (verbs_fake.c); `prov` is a
 *                        struct kvf_verbs_fake. It keeps the WRs posted to
 *                        each QP in a queue and holds them until the test says
 *                        how they end (success, error or flush), enforces the
 *                        QP state machine and the attribute masks of
 *                        rc_pingpong, records every transition, and fails
 *                        chosen calls on command.
 *
 * Every slot of both tables is set (STYLE.md rule 8). The objects passed
 * around are the libibverbs types; the transport reads only qp->qp_num,
 * mr->lkey and mr->rkey from them, and never calls ibv_* directly.
 *
 * Errors: 0 or a negative errno; output arguments (`_p`) are written only on
 * success. poll_cq returns the number of completions (>= 0) or -errno.
 *
 * Fabric mode (kvf_verbs_fake_create_fabric): the fake is one end of a
 * software fabric that really moves bytes, between processes of one host and
 * between fakes of one process. It models an RC device over RoCE:
 *   - each device has a unique GID (pid, a per-process counter, randomness) at
 *     gid index 0; port 1 is active, link layer Ethernet, LID 0. Its address
 *     is an abstract Unix socket named from the fabric name and the GID,
 *     served by a responder thread the device starts.
 *   - INIT -> RTR must carry ah_attr.is_global with grh.dgid (else -EINVAL, as
 *     on RoCE); the QP remembers the remote GID and dest_qp_num.
 *   - an RDMA WRITE posted to a QP in RTS is sent by the device's sender
 *     thread (one WR of a QP at a time, strictly in post order) over one cached
 *     SOCK_STREAM connection per remote device: sender GID and QP, dest QP,
 *     rkey, remote address, length and the payload read from the local SGE
 *     (which must lie in an MR of the QP's PD with that lkey, else
 *     IBV_WC_LOC_PROT_ERR). The responder checks under its device lock that
 *     the dest QP exists, is in RTR or RTS and is connected to (sender GID,
 *     sender QP), and that an MR of that QP's PD with that rkey has
 *     IBV_ACCESS_REMOTE_WRITE and holds [remote_addr, remote_addr + length);
 *     then copies and acks. The sender completes the WR: IBV_WC_SUCCESS;
 *     IBV_WC_REM_ACCESS_ERR (bad rkey, access or bounds);
 *     IBV_WC_RETRY_EXC_ERR (dest QP missing, not RTR/RTS or not connected to
 *     us; device unreachable; connection broken: no ack, as RC gives up).
 *     An error completion moves the QP to ERR and the WRs behind it flush.
 *   - modify_qp to ERR (the fence), destroy_qp and dereg_mr take the lock the
 *     responder holds while it checks and copies: once they return, no write
 *     to that QP/MR is being copied and none will be. A QP in ERR flushes
 *     its outstanding WRs in order; a WR already on the wire when its QP went
 *     to ERR completes SUCCESS if the remote acked it, else FLUSH (never
 *     lost, never twice), and the flushes behind it follow it.
 *   - the device runs threads (an acceptor, one per incoming connection, a
 *     sender): create it after any fork. Bytes it copied into an MR are seen
 *     by a thread that learned of them through the device (a completion, or
 *     kvf_verbs_fake_fabric_stats: both take the device lock) or through a
 *     message sent after the write completed.
 *   - control calls in fabric mode: kvf_verbs_fake_complete returns 0 and
 *     kvf_verbs_fake_complete_at -EINVAL (the fabric completes WRs); all the
 *     other kvf_verbs_fake_* calls work as in the single-process fake.
 *
 * DESIGN: the transport drives a provider instance from one thread. The fake
 * keeps its state under one mutex per device, so its ops and control calls
 * are safe against its own fabric threads (and against another thread).
 */
#ifndef KVF_TRANSPORT_VERBS_H
#define KVF_TRANSPORT_VERBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <infiniband/verbs.h>

struct kvf_verbs_ops {
    const char *name;

    /* Opens device `dev_name` (NULL: the first one). -ENODEV when there is no
     * such device (or none at all). */
    int (*open_device)(void *prov, const char *dev_name, struct ibv_context **ctx_p);
    void (*close_device)(void *prov, struct ibv_context *ctx);
    int (*query_port)(void *prov, struct ibv_context *ctx, uint8_t port,
                      struct ibv_port_attr *attr_p);
    int (*query_gid)(void *prov, struct ibv_context *ctx, uint8_t port, int index,
                     union ibv_gid *gid_p);

    int (*alloc_pd)(void *prov, struct ibv_context *ctx, struct ibv_pd **pd_p);
    void (*dealloc_pd)(void *prov, struct ibv_pd *pd);

    int (*reg_mr)(void *prov, struct ibv_pd *pd, void *addr, size_t length, int access,
                  struct ibv_mr **mr_p);
    void (*dereg_mr)(void *prov, struct ibv_mr *mr);

    int (*create_cq)(void *prov, struct ibv_context *ctx, int cqe, struct ibv_cq **cq_p);
    void (*destroy_cq)(void *prov, struct ibv_cq *cq);

    int (*create_qp)(void *prov, struct ibv_pd *pd, struct ibv_qp_init_attr *init,
                     struct ibv_qp **qp_p);
    int (*modify_qp)(void *prov, struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
    /* 0 when the QP is gone (the hardware no longer touches memory for it). */
    int (*destroy_qp)(void *prov, struct ibv_qp *qp);

    /* ibv_post_send: 0, or -errno with *bad_wr set as the provider set it (the
     * first WR not posted; NULL or outside the chain when it cannot tell). */
    int (*post_send)(void *prov, struct ibv_qp *qp, struct ibv_send_wr *wr,
                     struct ibv_send_wr **bad_wr);
    int (*poll_cq)(void *prov, struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
};

extern const struct kvf_verbs_ops kvf_verbs_real_ops;
extern const struct kvf_verbs_ops kvf_verbs_fake_ops;

/* ---- the fake provider ---------------------------------------------------- */

struct kvf_verbs_fake;

/* Calls the fake can be told to fail (kvf_verbs_fake_fail_call). */
enum kvf_verbs_fake_call {
    KVF_FAKE_OPEN_DEVICE = 0,
    KVF_FAKE_ALLOC_PD,
    KVF_FAKE_REG_MR,
    KVF_FAKE_CREATE_CQ,
    KVF_FAKE_CREATE_QP,
    KVF_FAKE_MODIFY_QP,
    KVF_FAKE_POLL_CQ,
    KVF_FAKE_CALL_COUNT,
};

/* One modify_qp call the fake accepted: the attributes and mask as given. */
struct kvf_verbs_fake_transition {
    enum ibv_qp_state from;
    struct ibv_qp_attr attr;
    int mask;
};

/* One posted WR as the fake saw it. */
struct kvf_verbs_fake_wr {
    uint64_t wr_id;
    enum ibv_wr_opcode opcode;
    unsigned send_flags;
    uint64_t local_addr;
    uint32_t length;
    uint32_t lkey;
    uint64_t remote_addr;
    uint32_t rkey;
};

struct kvf_verbs_fake_stats {
    uint64_t post_calls;   /* post_send calls */
    uint64_t wrs_posted;   /* WRs accepted by post_send (the native work) */
    uint64_t wrs_refused;  /* WRs post_send did not take */
    uint64_t completions;  /* work completions queued (all statuses) */
    uint64_t flushes;      /* of those, IBV_WC_WR_FLUSH_ERR */
    uint64_t objects_live; /* contexts + PDs + MRs + CQs + QPs not yet freed */
};

/* A fake device (named "fake0", LID 7, GID ::7, port 1 active, MTU 4096). */
struct kvf_verbs_fake *kvf_verbs_fake_create(void);
/* Frees the fake and any QPs and CQs still alive (accepts NULL). */
void kvf_verbs_fake_destroy(struct kvf_verbs_fake *f);

/* The `nth` next call (1 = the next one) of kind `call` fails with `err`
 * (negative errno). One-shot. */
void kvf_verbs_fake_fail_call(struct kvf_verbs_fake *f, enum kvf_verbs_fake_call call, unsigned nth,
                              int err);

/* The next post_send call posts the first `n` WRs of its chain and fails with
 * `err` (negative), *bad_wr pointing at WR n (a proof that it and the ones
 * after it were not posted). With `ambiguous`, *bad_wr is NULL instead: the
 * caller cannot tell which WRs were posted (the first `n` were). One-shot; a
 * chain of n WRs or fewer is posted whole and disarms it. */
void kvf_verbs_fake_fail_post_after(struct kvf_verbs_fake *f, unsigned n, int err, bool ambiguous);

/* Completes the `n` oldest outstanding WRs of QP `qp_num` with `status`
 * (IBV_WC_SUCCESS, an error, or IBV_WC_WR_FLUSH_ERR). An error status moves
 * the QP to ERR, as on hardware; the WRs behind it stay held until flushed
 * (kvf_verbs_fake_set_qp_error). Returns how many were completed. */
unsigned kvf_verbs_fake_complete(struct kvf_verbs_fake *f, uint32_t qp_num, unsigned n,
                                 enum ibv_wc_status status);

/* Completes outstanding WR number `index` (0 = oldest) of QP `qp_num` out of
 * order. -ENOENT when there is none. */
int kvf_verbs_fake_complete_at(struct kvf_verbs_fake *f, uint32_t qp_num, unsigned index,
                               enum ibv_wc_status status);

/* Moves QP `qp_num` to ERR (as a fatal error would) and flushes every
 * outstanding WR, unless flushes are held. Also used to flush the WRs left
 * behind an error completion. -ENOENT for an unknown QP. */
int kvf_verbs_fake_set_qp_error(struct kvf_verbs_fake *f, uint32_t qp_num);

/* While held, a QP in ERR keeps its outstanding WRs (and WRs posted to it)
 * instead of flushing them: a fence has to wait. Releasing delivers the
 * flushes of a QP in ERR. -ENOENT for an unknown QP. */
int kvf_verbs_fake_hold_flushes(struct kvf_verbs_fake *f, uint32_t qp_num, bool hold);

/* WRs posted to `qp_num` and not completed yet (0 for an unknown QP). */
unsigned kvf_verbs_fake_outstanding(const struct kvf_verbs_fake *f, uint32_t qp_num);

/* Outstanding WR `index` (0 = oldest) of `qp_num`. -ENOENT if none. */
int kvf_verbs_fake_peek_wr(const struct kvf_verbs_fake *f, uint32_t qp_num, unsigned index,
                           struct kvf_verbs_fake_wr *out);

/* The state of `qp_num` (IBV_QPS_UNKNOWN for an unknown QP). */
enum ibv_qp_state kvf_verbs_fake_qp_state(const struct kvf_verbs_fake *f, uint32_t qp_num);

/* Copies up to `max` recorded transitions of `qp_num`, oldest first; returns
 * how many the QP has (may be more than `max`). */
unsigned kvf_verbs_fake_transitions(const struct kvf_verbs_fake *f, uint32_t qp_num,
                                    struct kvf_verbs_fake_transition *out, unsigned max);

void kvf_verbs_fake_stats(const struct kvf_verbs_fake *f, struct kvf_verbs_fake_stats *out);

/* ---- fabric mode (see the top of this file) ---------------------------------- */

/* A fake device that is one end of a software fabric between processes (and
 * between fakes of one process): posted WRs complete by themselves. NULL on
 * failure with -errno in *err_p (may be NULL). `fabric` names the fabric
 * (fakes only reach fakes of the same name); NULL or "" = "kvf". */
struct kvf_verbs_fake *kvf_verbs_fake_create_fabric(const char *fabric, int *err_p);
/* Fabric mode: while held, posted WRs stay outstanding (not sent); releasing sends them in order.
 */
void kvf_verbs_fake_fabric_hold(struct kvf_verbs_fake *f, bool hold);
/* Fabric mode: the same for one QP only (its WRs stay outstanding, the other
 * QPs of the device run; a WR already on the wire completes). A QP moved to
 * ERR still flushes them. 0 or -ENOENT. */
int kvf_verbs_fake_fabric_hold_qp(struct kvf_verbs_fake *f, uint32_t qp_num, bool hold);
/* Fabric mode, responder side counters. */
struct kvf_verbs_fake_fabric_stats {
    uint64_t writes_in;
    uint64_t bytes_in;
    uint64_t refused_in; /* bad rkey/bounds/QP state */
    uint64_t writes_out;
    uint64_t bytes_out;
};
void kvf_verbs_fake_fabric_stats(const struct kvf_verbs_fake *f,
                                 struct kvf_verbs_fake_fabric_stats *out);

#endif /* KVF_TRANSPORT_VERBS_H */
