/*
 * health.c: the registry behind grpc.health.v1.Health.
 *
 * The registry is two small arrays: the services with their status (a handful
 * of names, searched linearly) and the active watches (one per open Watch
 * stream). Requests and responses are encoded with the protobuf-c code
 * generated from grpc/health/v1/health.proto; a response is one varint, so it
 * is packed into a buffer on the stack for watches.
 *
 * DESIGN: one mutex guards both arrays and the shutdown flag. kvf_health_set()
 * and kvf_health_shutdown() come from the server's main and shutdown paths,
 * kvf_health_check() and the watch calls from RPC threads. Watch callbacks are
 * called with the mutex held, by the thread whose call caused them (set,
 * shutdown, or watch_add for the first status), so every watcher sees the
 * current status first and then each change in the order the changes were
 * made, and kvf_health_watch_remove() can promise that the callback is not
 * running once it returns. The price: callbacks must not call back into the
 * registry (health.h says so).
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "health.h"
#include "kvf_error.h"
#include "kvf_log.h"

struct health_service {
    char *name;
    enum kvf_health_status status;
};

struct health_watch {
    char *service;
    kvf_health_watch_fn cb;
    void *ctx;
};

struct kvf_health {
    pthread_mutex_t mu;
    bool shut_down;
    struct health_service *svcs;
    size_t n_svcs, cap_svcs;
    struct health_watch *watches;
    size_t n_watches, cap_watches;
};

/* A packed HealthCheckResponse is at most a tag and a 10-byte varint. */
#define HEALTH_RESP_MAX 16

static size_t encode_status(enum kvf_health_status status, uint8_t *buf)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    return grpc__health__v1__health_check_response__pack(&resp, buf);
}

static struct health_service *find_service(struct kvf_health *h, const char *name)
{
    for (size_t i = 0; i < h->n_svcs; i++)
        if (strcmp(h->svcs[i].name, name) == 0)
            return &h->svcs[i];
    return NULL;
}

/* Caller holds h->mu. */
static void notify(struct kvf_health *h, const char *service, enum kvf_health_status status)
{
    uint8_t buf[HEALTH_RESP_MAX];
    size_t len = encode_status(status, buf);
    for (size_t i = 0; i < h->n_watches; i++)
        if (strcmp(h->watches[i].service, service) == 0)
            h->watches[i].cb(h->watches[i].ctx, buf, len);
}

/* Caller holds h->mu. */
static int set_locked(struct kvf_health *h, const char *service, enum kvf_health_status status)
{
    struct health_service *s = find_service(h, service);
    if (s) {
        if (s->status != status) {
            s->status = status;
            notify(h, service, status);
        }
        return 0;
    }
    if (h->n_svcs == h->cap_svcs) {
        size_t ncap = h->cap_svcs ? h->cap_svcs * 2 : 8;
        struct health_service *ns = realloc(h->svcs, ncap * sizeof(*ns));
        if (!ns)
            return -ENOMEM;
        h->svcs = ns;
        h->cap_svcs = ncap;
    }
    char *name = strdup(service);
    if (!name)
        return -ENOMEM;
    h->svcs[h->n_svcs++] = (struct health_service){.name = name, .status = status};
    notify(h, service, status);
    return 0;
}

struct kvf_health *kvf_health_create(void)
{
    struct kvf_health *h = calloc(1, sizeof(*h));
    if (!h)
        goto err_nomem;
    if (pthread_mutex_init(&h->mu, NULL) != 0) {
        free(h);
        goto err_nomem;
    }
    if (set_locked(h, "", KVF_HEALTH_SERVING) != 0) {
        kvf_health_destroy(h);
        goto err_nomem;
    }
    return h;

err_nomem:
    kvf_log("error", "kvfence introspect: health: out of memory creating the registry");
    return NULL;
}

void kvf_health_destroy(struct kvf_health *h)
{
    if (!h)
        return;
    for (size_t i = 0; i < h->n_svcs; i++)
        free(h->svcs[i].name);
    free(h->svcs);
    for (size_t i = 0; i < h->n_watches; i++)
        free(h->watches[i].service);
    free(h->watches);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

int kvf_health_set(struct kvf_health *h, const char *service, enum kvf_health_status status)
{
    if (!h || !service || (status != KVF_HEALTH_SERVING && status != KVF_HEALTH_NOT_SERVING))
        return -EINVAL;
    pthread_mutex_lock(&h->mu);
    int rc = h->shut_down ? -EPERM : set_locked(h, service, status);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

void kvf_health_shutdown(struct kvf_health *h)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    h->shut_down = true;
    for (size_t i = 0; i < h->n_svcs; i++) {
        if (h->svcs[i].status != KVF_HEALTH_NOT_SERVING) {
            h->svcs[i].status = KVF_HEALTH_NOT_SERVING;
            notify(h, h->svcs[i].name, KVF_HEALTH_NOT_SERVING);
        }
    }
    pthread_mutex_unlock(&h->mu);
}

static Grpc__Health__V1__HealthCheckRequest *decode_request(const uint8_t *req, size_t len)
{
    static const uint8_t empty[1];
    if (!req && len)
        return NULL;
    return grpc__health__v1__health_check_request__unpack(NULL, len, req ? req : empty);
}

int kvf_health_check(struct kvf_health *h, const uint8_t *req, size_t len, uint8_t **resp_p,
                     size_t *resp_len_p, int *grpc_code_p)
{
    if (!h || !resp_p || !resp_len_p || !grpc_code_p)
        return -EINVAL;
    Grpc__Health__V1__HealthCheckRequest *rq = decode_request(req, len);
    if (!rq)
        return -EINVAL;

    pthread_mutex_lock(&h->mu);
    const struct health_service *s = find_service(h, rq->service);
    enum kvf_health_status status = s ? s->status : KVF_HEALTH_SERVICE_UNKNOWN;
    pthread_mutex_unlock(&h->mu);
    grpc__health__v1__health_check_request__free_unpacked(rq, NULL);

    if (!s) {
        *resp_p = NULL;
        *resp_len_p = 0;
        *grpc_code_p = KVF_GRPC_NOT_FOUND;
        return 0;
    }
    uint8_t *buf = malloc(HEALTH_RESP_MAX);
    if (!buf)
        return -ENOMEM;
    *resp_len_p = encode_status(status, buf);
    *resp_p = buf;
    *grpc_code_p = KVF_GRPC_OK;
    return 0;
}

int kvf_health_watch_add(struct kvf_health *h, const char *service, kvf_health_watch_fn cb,
                         void *ctx)
{
    if (!h || !service || !cb)
        return -EINVAL;
    char *name = strdup(service);
    if (!name)
        return -ENOMEM;

    pthread_mutex_lock(&h->mu);
    if (h->n_watches == h->cap_watches) {
        size_t ncap = h->cap_watches ? h->cap_watches * 2 : 8;
        struct health_watch *nw = realloc(h->watches, ncap * sizeof(*nw));
        if (!nw) {
            pthread_mutex_unlock(&h->mu);
            free(name);
            return -ENOMEM;
        }
        h->watches = nw;
        h->cap_watches = ncap;
    }
    h->watches[h->n_watches++] = (struct health_watch){.service = name, .cb = cb, .ctx = ctx};
    const struct health_service *s = find_service(h, service);
    uint8_t buf[HEALTH_RESP_MAX];
    size_t len = encode_status(s ? s->status : KVF_HEALTH_SERVICE_UNKNOWN, buf);
    cb(ctx, buf, len);
    pthread_mutex_unlock(&h->mu);
    return 0;
}

int kvf_health_watch_add_request(struct kvf_health *h, const uint8_t *req, size_t len,
                                 kvf_health_watch_fn cb, void *ctx)
{
    Grpc__Health__V1__HealthCheckRequest *rq = decode_request(req, len);
    if (!rq)
        return -EINVAL;
    int rc = kvf_health_watch_add(h, rq->service, cb, ctx);
    grpc__health__v1__health_check_request__free_unpacked(rq, NULL);
    return rc;
}

int kvf_health_watch_remove(struct kvf_health *h, kvf_health_watch_fn cb, void *ctx)
{
    if (!h)
        return -EINVAL;
    int rc = -ENOENT;
    pthread_mutex_lock(&h->mu);
    size_t out = 0;
    for (size_t i = 0; i < h->n_watches; i++) {
        if (h->watches[i].cb == cb && h->watches[i].ctx == ctx) {
            free(h->watches[i].service);
            rc = 0;
            continue;
        }
        h->watches[out++] = h->watches[i];
    }
    h->n_watches = out;
    pthread_mutex_unlock(&h->mu);
    return rc;
}
