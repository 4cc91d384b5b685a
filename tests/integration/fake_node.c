/*
 * fake_node.c: see fake_node.h.
 */
#include "fake_node.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NODE_ID_MAX 128

struct fake_node {
    struct kvf_rpc_client_stream *cs;
    char node_id[NODE_ID_MAX + 1];
    uint64_t incarnation;
};

const char *fake_node_id(const struct fake_node *n)
{
    return n->node_id;
}

uint64_t fake_node_incarnation(const struct fake_node *n)
{
    return n->incarnation;
}

int fake_node_send(struct fake_node *n, const Kvfence__V1__NodeMessage *m)
{
    size_t len = kvfence__v1__node_message__get_packed_size(m);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        return -ENOMEM;
    }
    kvfence__v1__node_message__pack(m, buf);
    int rc = kvf_rpc_client_stream_send(n->cs, buf, len);
    free(buf);
    return rc;
}

static int recv_raw(struct kvf_rpc_client_stream *cs, int64_t timeout_ms,
                    Kvfence__V1__ControlMessage **msg_p, struct kvf_rpc_status *st)
{
    struct kvf_rpc_status local;
    uint8_t *bytes = NULL;
    size_t len = 0;
    int rc = kvf_rpc_client_stream_recv(cs, timeout_ms, &bytes, &len, st ? st : &local);
    if (rc != 0) {
        return rc;
    }
    static const uint8_t empty[1];
    *msg_p = kvfence__v1__control_message__unpack(NULL, len, bytes ? bytes : empty);
    free(bytes);
    return *msg_p ? 0 : -EPROTO;
}

int fake_node_recv(struct fake_node *n, int64_t timeout_ms, Kvfence__V1__ControlMessage **msg_p,
                   struct kvf_rpc_status *st)
{
    int rc = recv_raw(n->cs, timeout_ms, msg_p, st);
    if (rc == 0 && (*msg_p)->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE &&
        (*msg_p)->room_update->room) {
        /* As a real node does once it applied the update: without it the
         * control plane never tells the room's other nodes this node's
         * members (node.proto RoomUpdateAck). */
        Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
        k.room_id = (*msg_p)->room_update->room->room_id;
        k.generation = (*msg_p)->room_update->room->generation;
        Kvfence__V1__RoomUpdateAck a = KVFENCE__V1__ROOM_UPDATE_ACK__INIT;
        a.room = &k;
        a.version = (*msg_p)->room_update->version;
        Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
        m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_ROOM_UPDATE_ACK;
        m.room_update_ack = &a;
        (void)fake_node_send(n, &m); /* a closed stream shows at the next recv */
    }
    return rc;
}

int fake_node_open(struct kvf_rpc_channel *ch, const struct fake_node_hello *hello,
                   int64_t timeout_ms, struct fake_node **node_p, Kvfence__V1__Welcome **welcome_p,
                   struct kvf_rpc_status *st)
{
    struct kvf_rpc_status local;
    if (!st) {
        st = &local;
    }
    memset(st, 0, sizeof *st);
    *node_p = NULL;
    if (welcome_p) {
        *welcome_p = NULL;
    }
    if (!hello->node_id || strlen(hello->node_id) > NODE_ID_MAX) {
        return -EINVAL;
    }
    struct fake_node *n = calloc(1, sizeof *n);
    if (!n) {
        return -ENOMEM;
    }
    snprintf(n->node_id, sizeof n->node_id, "%s", hello->node_id);
    n->incarnation = hello->incarnation;
    n->cs = kvf_rpc_client_stream_open(ch, "/kvfence.v1.NodeSession/Attach", KVF_RPC_NO_TIMEOUT);
    if (!n->cs) {
        free(n);
        return -EIO;
    }

    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = hello->protocol_min ? hello->protocol_min : 1;
    caps.protocol_max = hello->protocol_max ? hello->protocol_max : 1;
    caps.n_features = hello->n_features;
    caps.features = (char **)hello->features;
    Kvfence__V1__Pool pool = KVFENCE__V1__POOL__INIT;
    pool.pool_id = FAKE_NODE_POOL_ID;
    pool.kind = KVFENCE__V1__POOL_KIND__POOL_KIND_HOST_SHM;
    pool.page_size = FAKE_NODE_PAGE_SIZE;
    pool.page_count = FAKE_NODE_PAGE_COUNT;
    Kvfence__V1__Pool *pools[1] = {&pool};
    Kvfence__V1__Endpoint ep = KVFENCE__V1__ENDPOINT__INIT;
    char addr[64];
    snprintf(addr, sizeof addr, "tcp://127.0.0.1:%u", 7100u + (unsigned)(hello->incarnation % 100));
    ep.kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_PEER_ZMQ;
    ep.address = addr;
    Kvfence__V1__Endpoint data_ep = KVFENCE__V1__ENDPOINT__INIT;
    char data_addr[64];
    snprintf(data_addr, sizeof data_addr, "tcp://127.0.0.1:%u", (unsigned)hello->data_port);
    data_ep.kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_DATA_TCP;
    data_ep.address = data_addr;
    Kvfence__V1__Endpoint *eps[2] = {&ep, &data_ep};
    Kvfence__V1__Hello h = KVFENCE__V1__HELLO__INIT;
    h.node_id = n->node_id;
    h.incarnation = hello->incarnation;
    h.capabilities = &caps;
    h.n_endpoints = hello->data_port ? 2 : 1;
    h.endpoints = eps;
    if (hello->peer_key) {
        h.peer_key.data = (uint8_t *)hello->peer_key;
        h.peer_key.len = 32;
    }
    h.n_pools = 1;
    h.pools = pools;
    h.software_version = "fake-node";
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HELLO;
    m.hello = &h;

    int rc = fake_node_send(n, &m);
    if (rc == -ECANCELED) {
        rc = 0; /* the stream ended already: recv gives the status */
    }
    Kvfence__V1__ControlMessage *cm = NULL;
    if (rc == 0) {
        rc = recv_raw(n->cs, timeout_ms, &cm, st);
    }
    if (rc == 0 && cm->msg_case != KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME) {
        fprintf(stderr, "fake_node %s: first reply is message case %d, not welcome\n", n->node_id,
                (int)cm->msg_case);
        rc = -EPROTO;
    }
    if (rc != 0) {
        if (cm) {
            kvfence__v1__control_message__free_unpacked(cm, NULL);
        }
        kvf_rpc_client_stream_close(n->cs);
        free(n);
        return rc;
    }
    if (welcome_p) {
        *welcome_p = cm->welcome;
        cm->welcome = NULL;
        cm->msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG__NOT_SET;
    }
    kvfence__v1__control_message__free_unpacked(cm, NULL);
    *node_p = n;
    return 0;
}

struct fake_node *fake_node_attach(struct kvf_rpc_channel *ch, const char *node_id,
                                   uint64_t incarnation)
{
    static const char *const features[] = {"QUIESCE_V1", "FENCE_V1", "TCP"};
    struct fake_node_hello h = {
        .node_id = node_id,
        .incarnation = incarnation,
        .features = features,
        .n_features = 3,
    };
    struct fake_node *n = NULL;
    struct kvf_rpc_status st;
    int rc = fake_node_open(ch, &h, 5000, &n, NULL, &st);
    if (rc != 0) {
        fprintf(stderr, "fake_node %s: attach failed: %d (status %d: %s)\n", node_id, rc, st.code,
                st.message);
        return NULL;
    }
    return n;
}

static Kvfence__V1__RoomKey room_key(uint64_t room_id, uint64_t generation)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = room_id;
    k.generation = generation;
    return k;
}

int fake_node_send_drained(struct fake_node *n, uint64_t room_id, uint64_t generation,
                           const Kvfence__V1__AbortToken *token)
{
    Kvfence__V1__RoomKey key = room_key(room_id, generation);
    Kvfence__V1__AbortToken tok = KVFENCE__V1__ABORT_TOKEN__INIT;
    Kvfence__V1__Drained d = KVFENCE__V1__DRAINED__INIT;
    d.room = &key;
    if (token) {
        tok.hi = token->hi;
        tok.lo = token->lo;
        d.token = &tok;
    }
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED;
    m.drained = &d;
    return fake_node_send(n, &m);
}

int fake_node_send_completed(struct fake_node *n, uint64_t room_id, uint64_t generation,
                             uint32_t rank, Kvfence__V1__Role role)
{
    Kvfence__V1__RoomKey key = room_key(room_id, generation);
    Kvfence__V1__Completed c = KVFENCE__V1__COMPLETED__INIT;
    c.room = &key;
    c.rank = rank;
    c.role = role;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_COMPLETED;
    m.completed = &c;
    return fake_node_send(n, &m);
}

int fake_node_send_transfer_failed(struct fake_node *n, uint64_t room_id, uint64_t generation,
                                   uint32_t rank, Kvfence__V1__Role role, const char *reason)
{
    Kvfence__V1__RoomKey key = room_key(room_id, generation);
    Kvfence__V1__TransferFailed t = KVFENCE__V1__TRANSFER_FAILED__INIT;
    t.room = &key;
    t.rank = rank;
    t.role = role;
    t.reason = (char *)(reason ? reason : "");
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_TRANSFER_FAILED;
    m.transfer_failed = &t;
    return fake_node_send(n, &m);
}

int fake_node_send_peer_fenced(struct fake_node *n, const char *peer_node_id,
                               uint64_t peer_incarnation)
{
    Kvfence__V1__PeerFenced p = KVFENCE__V1__PEER_FENCED__INIT;
    p.node_id = (char *)peer_node_id;
    p.incarnation = peer_incarnation;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_PEER_FENCED;
    m.peer_fenced = &p;
    return fake_node_send(n, &m);
}

void fake_node_close(struct fake_node *n)
{
    if (!n) {
        return;
    }
    kvf_rpc_client_stream_half_close(n->cs);
    kvf_rpc_client_stream_close(n->cs);
    free(n);
}

void fake_node_vanish(struct fake_node *n)
{
    if (!n) {
        return;
    }
    kvf_rpc_client_stream_cancel(n->cs);
    kvf_rpc_client_stream_close(n->cs);
    free(n);
}
