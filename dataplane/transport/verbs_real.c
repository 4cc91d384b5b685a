/*
 * verbs_real.c: the real verbs provider, thin wrappers over libibverbs.
 *
 * Each slot of kvf_verbs_real_ops makes one ibv_* call and turns the verbs
 * conventions (NULL + errno, positive errno returns) into the house one (0 or
 * a negative errno, outputs written only on success). `prov` is unused. This
 * file is compiled into every build: on a machine without an RDMA device,
 * open_device answers -ENODEV, which the unit tests check.
 *
 * DESIGN: no state of its own; the calls are made on the thread that drives
 * the transport.
 */
#include "verbs.h"

#include <errno.h>
#include <string.h>

/* errno after a failed verbs call, as a negative value that is never 0. */
static int neg_errno(int fallback)
{
    return errno > 0 ? -errno : fallback;
}

static int real_open_device(void *prov, const char *dev_name, struct ibv_context **ctx_p)
{
    (void)prov;
    int num = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list)
        return -ENODEV; /* no verbs support at all (ENOSYS) or no device */
    struct ibv_device *dev = NULL;
    for (int i = 0; i < num && !dev; i++) {
        if (!dev_name || strcmp(ibv_get_device_name(list[i]), dev_name) == 0)
            dev = list[i];
    }
    int rc = -ENODEV;
    if (dev) {
        struct ibv_context *ctx = ibv_open_device(dev);
        if (ctx) {
            *ctx_p = ctx;
            rc = 0;
        } else {
            rc = neg_errno(-ENODEV);
        }
    }
    ibv_free_device_list(list);
    return rc;
}

static void real_close_device(void *prov, struct ibv_context *ctx)
{
    (void)prov;
    (void)ibv_close_device(ctx);
}

static int real_query_port(void *prov, struct ibv_context *ctx, uint8_t port,
                           struct ibv_port_attr *attr_p)
{
    (void)prov;
    struct ibv_port_attr attr;
    memset(&attr, 0, sizeof(attr));
    int rc = ibv_query_port(ctx, port, &attr);
    if (rc != 0)
        return rc > 0 ? -rc : -EIO;
    *attr_p = attr;
    return 0;
}

static int real_query_gid(void *prov, struct ibv_context *ctx, uint8_t port, int index,
                          union ibv_gid *gid_p)
{
    (void)prov;
    union ibv_gid gid;
    if (ibv_query_gid(ctx, port, index, &gid) != 0)
        return neg_errno(-EIO);
    *gid_p = gid;
    return 0;
}

static int real_alloc_pd(void *prov, struct ibv_context *ctx, struct ibv_pd **pd_p)
{
    (void)prov;
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    if (!pd)
        return neg_errno(-ENOMEM);
    *pd_p = pd;
    return 0;
}

static void real_dealloc_pd(void *prov, struct ibv_pd *pd)
{
    (void)prov;
    (void)ibv_dealloc_pd(pd);
}

static int real_reg_mr(void *prov, struct ibv_pd *pd, void *addr, size_t length, int access,
                       struct ibv_mr **mr_p)
{
    (void)prov;
    struct ibv_mr *mr = ibv_reg_mr(pd, addr, length, access);
    if (!mr)
        return neg_errno(-ENOMEM);
    *mr_p = mr;
    return 0;
}

static void real_dereg_mr(void *prov, struct ibv_mr *mr)
{
    (void)prov;
    (void)ibv_dereg_mr(mr);
}

static int real_create_cq(void *prov, struct ibv_context *ctx, int cqe, struct ibv_cq **cq_p)
{
    (void)prov;
    struct ibv_cq *cq = ibv_create_cq(ctx, cqe, NULL, NULL, 0);
    if (!cq)
        return neg_errno(-ENOMEM);
    *cq_p = cq;
    return 0;
}

static void real_destroy_cq(void *prov, struct ibv_cq *cq)
{
    (void)prov;
    (void)ibv_destroy_cq(cq);
}

static int real_create_qp(void *prov, struct ibv_pd *pd, struct ibv_qp_init_attr *init,
                          struct ibv_qp **qp_p)
{
    (void)prov;
    struct ibv_qp *qp = ibv_create_qp(pd, init);
    if (!qp)
        return neg_errno(-ENOMEM);
    *qp_p = qp;
    return 0;
}

static int real_modify_qp(void *prov, struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    (void)prov;
    int rc = ibv_modify_qp(qp, attr, attr_mask);
    return rc == 0 ? 0 : rc > 0 ? -rc : -EIO;
}

static int real_destroy_qp(void *prov, struct ibv_qp *qp)
{
    (void)prov;
    int rc = ibv_destroy_qp(qp);
    return rc == 0 ? 0 : rc > 0 ? -rc : -EIO;
}

static int real_post_send(void *prov, struct ibv_qp *qp, struct ibv_send_wr *wr,
                          struct ibv_send_wr **bad_wr)
{
    (void)prov;
    *bad_wr = NULL;
    int rc = ibv_post_send(qp, wr, bad_wr);
    return rc == 0 ? 0 : rc > 0 ? -rc : -EIO;
}

static int real_poll_cq(void *prov, struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    (void)prov;
    int n = ibv_poll_cq(cq, num_entries, wc);
    return n >= 0 ? n : -EIO;
}

const struct kvf_verbs_ops kvf_verbs_real_ops = {
    .name = "verbs",
    .open_device = real_open_device,
    .close_device = real_close_device,
    .query_port = real_query_port,
    .query_gid = real_query_gid,
    .alloc_pd = real_alloc_pd,
    .dealloc_pd = real_dealloc_pd,
    .reg_mr = real_reg_mr,
    .dereg_mr = real_dereg_mr,
    .create_cq = real_create_cq,
    .destroy_cq = real_destroy_cq,
    .create_qp = real_create_qp,
    .modify_qp = real_modify_qp,
    .destroy_qp = real_destroy_qp,
    .post_send = real_post_send,
    .poll_cq = real_poll_cq,
};
