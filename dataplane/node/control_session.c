/*
 * control_session.c: the node's session with kvfence-control
 * (NodeSession/Attach), the receive side.
 *
 * The session thread opens the bidirectional stream, hands it to the owner
 * thread (which sends Hello and everything after it: only the owner sends),
 * then receives ControlMessages and posts each one to the owner in arrival
 * order. When the stream ends it tells the owner to stop sending on it, waits
 * for that to be done, frees the stream and reconnects with backoff (100 ms,
 * doubling, capped at 2 s), re-sending Hello with the same incarnation. A
 * refusal with FAILED_PRECONDITION (no common protocol, an older incarnation)
 * cannot be cured by retrying: it is logged and made the node's fatal error,
 * and main exits non-zero.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvf_error.h"
#include "kvf_types.h"
#include "kvf_version.h"
#include "node_internal.h"
#include "xport.h"

#define RECV_SLICE_MS  200
#define BACKOFF_MIN_MS 100
#define BACKOFF_MAX_MS 2000

int node_session_send_hello(struct kvf_node *n, struct kvf_rpc_client_stream *cs)
{
    (void)cs; /* n->session is cs: node_ctl_send uses it */
    const char *features[8];
    const char *rdma_ep;
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = KVF_PROTOCOL_MIN;
    caps.protocol_max = KVF_PROTOCOL_MAX;
    caps.n_features = node_xport_features(n, features, 8, &rdma_ep);
    caps.features = (char **)features;

    char data_addr[96];
    snprintf(data_addr, sizeof data_addr, "%s:%u", n->data_host, n->data_port);
    char local_addr[300];
    snprintf(local_addr, sizeof local_addr, "unix:%s", n->local_socket);
    Kvfence__V1__Endpoint ep[4];
    Kvfence__V1__Endpoint *eps[4];
    for (size_t i = 0; i < 4; i++) {
        kvfence__v1__endpoint__init(&ep[i]);
        eps[i] = &ep[i];
    }
    size_t nep = 0;
    ep[nep].kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_DATA_TCP;
    ep[nep++].address = data_addr;
    ep[nep].kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_NODE_LOCAL;
    ep[nep++].address = local_addr;
    if (n->peer_ep[0]) {
        ep[nep].kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_PEER_ZMQ;
        ep[nep++].address = n->peer_ep;
    }
    if (rdma_ep[0]) { /* only with a device */
        ep[nep].kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_DATA_RDMA;
        ep[nep++].address = (char *)rdma_ep;
    }

    Kvfence__V1__Pool pv[NODE_MAX_POOLS];
    Kvfence__V1__Pool *pp[NODE_MAX_POOLS];
    node_pools_to_wire(n, pv, pp);

    Kvfence__V1__Hello h = KVFENCE__V1__HELLO__INIT;
    h.node_id = n->node_id;
    h.incarnation = n->incarnation;
    h.capabilities = &caps;
    h.n_endpoints = nep;
    h.endpoints = eps;
    h.n_pools = n->npools;
    h.pools = pp;
    h.software_version = (char *)KVF_VERSION_STRING;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HELLO;
    m.hello = &h;
    int rc = node_ctl_send(n, &m);
    if (rc != 0)
        node_log("warn", NULL, "hello not sent: %s", strerror(-rc));
    return rc;
}

static void sleep_interruptible(struct kvf_node *n, int ms)
{
    while (ms > 0 && !atomic_load(&n->stopping)) {
        int step = ms < 50 ? ms : 50;
        struct timespec ts = {0, (long)step * 1000000L};
        nanosleep(&ts, NULL);
        ms -= step;
    }
}

/* Posts a synchronous session job; false when the owner is gone. */
static bool post_session_job(struct kvf_node *n, enum node_job_kind kind,
                             struct kvf_rpc_client_stream *cs)
{
    struct node_job j;
    memset(&j, 0, sizeof j);
    j.kind = kind;
    j.stream = cs;
    j.sync = true;
    return node_post(n, &j) == 0;
}

static void *session_main(void *arg)
{
    struct kvf_node *n = arg;
    int backoff = BACKOFF_MIN_MS;
    while (!atomic_load(&n->stopping)) {
        struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(
            n->channel, "/kvfence.v1.NodeSession/Attach", KVF_RPC_NO_TIMEOUT);
        if (!cs) {
            sleep_interruptible(n, backoff);
            continue;
        }
        if (!post_session_job(n, JOB_SESSION_OPEN, cs)) {
            kvf_rpc_client_stream_close(cs);
            break;
        }
        bool cancelled = false;
        struct kvf_rpc_status st;
        memset(&st, 0, sizeof st);
        for (;;) {
            uint8_t *bytes = NULL;
            size_t len = 0;
            int rc = kvf_rpc_client_stream_recv(cs, RECV_SLICE_MS, &bytes, &len, &st);
            if (rc == -ETIMEDOUT) {
                if (atomic_load(&n->stopping) && !cancelled) {
                    kvf_rpc_client_stream_cancel(cs);
                    cancelled = true;
                }
                continue;
            }
            if (rc != 0)
                break;
            static const uint8_t empty[1];
            Kvfence__V1__ControlMessage *cm =
                kvfence__v1__control_message__unpack(NULL, len, bytes ? bytes : empty);
            free(bytes);
            if (!cm) {
                node_log("error", NULL, "undecodable control message: dropping the session");
                kvf_rpc_client_stream_cancel(cs);
                cancelled = true;
                continue;
            }
            if (cm->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME)
                backoff = BACKOFF_MIN_MS;
            struct node_job *j = calloc(1, sizeof *j);
            if (!j) {
                kvfence__v1__control_message__free_unpacked(cm, NULL);
                continue; /* the control plane re-sends notices */
            }
            j->kind = JOB_CONTROL_MSG;
            j->cm = cm;
            if (node_post(n, j) != 0)
                node_job_free(j);
        }
        bool owner_alive = post_session_job(n, JOB_SESSION_CLOSED, cs);
        kvf_rpc_client_stream_close(cs);
        if (st.code == KVF_GRPC_FAILED_PRECONDITION) {
            node_log("error", NULL, "control plane refused the node: %s", st.message);
            atomic_store(&n->fatal, -EPERM);
            pthread_mutex_lock(&n->qlock);
            pthread_cond_broadcast(&n->qdone);
            pthread_mutex_unlock(&n->qlock);
            break;
        }
        if (!owner_alive || atomic_load(&n->stopping))
            break;
        node_log("warn", NULL, "control session ended (%s: %s): reconnecting in %d ms",
                 kvf_grpc_code_name((enum kvf_grpc_code)st.code), st.message, backoff);
        sleep_interruptible(n, backoff);
        backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
    }
    return NULL;
}

int node_session_start(struct kvf_node *n)
{
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    n->channel = kvf_rpc_channel_create(n->opts.control_addr, &co);
    if (!n->channel)
        return -EIO;
    if (pthread_create(&n->session_thread, NULL, session_main, n) != 0) {
        kvf_rpc_channel_destroy(n->channel);
        n->channel = NULL;
        return -EAGAIN;
    }
    n->session_started = true;
    return 0;
}

void node_session_join(struct kvf_node *n)
{
    atomic_store(&n->stopping, true);
    if (n->session_started) {
        pthread_join(n->session_thread, NULL);
        n->session_started = false;
    }
    kvf_rpc_channel_destroy(n->channel);
    n->channel = NULL;
}
