/*
 * fake_node.h: a fake kvfence-node for integration tests. It holds one
 * kvfence.v1.NodeSession/Attach stream to the control plane (kvf_rpc client
 * stream), says Hello with one pool {pool_id 1, page_size 4096, page_count
 * 1024}, waits for Welcome, then receives ControlMessages and sends the
 * reports a node sends. Blocking; one thread per node.
 */
#ifndef KVF_TEST_FAKE_NODE_H
#define KVF_TEST_FAKE_NODE_H

#include <stddef.h>
#include <stdint.h>

#include "kvfence/v1/node.pb-c.h"
#include "rpc_client.h"

#define FAKE_NODE_POOL_ID    1u
#define FAKE_NODE_PAGE_SIZE  4096u
#define FAKE_NODE_PAGE_COUNT 1024u

struct fake_node;

/* What the Hello says. */
struct fake_node_hello {
    const char *node_id;
    uint64_t incarnation;
    const char *const *features; /* feature names */
    size_t n_features;
    uint32_t protocol_min; /* 0 and 0: {1, 1} */
    uint32_t protocol_max;
    uint16_t data_port;      /* not 0: a DATA_TCP endpoint tcp://127.0.0.1:<data_port> */
    const uint8_t *peer_key; /* not NULL: Hello.peer_key, 32 bytes */
};

/* Opens the stream on `ch`, sends Hello and waits up to `timeout_ms` for the
 * first reply. Returns 0 with *node_p when it was Welcome (its copy in
 * *welcome_p when not NULL: free it with kvfence__v1__welcome__free_unpacked);
 * KVF_RPC_STREAM_END when the control plane ended the stream (its status in
 * `st`); -ETIMEDOUT; -EPROTO when the first reply was not a Welcome; another
 * negative errno on local failure. On any error nothing is left open. */
int fake_node_open(struct kvf_rpc_channel *ch, const struct fake_node_hello *hello,
                   int64_t timeout_ms, struct fake_node **node_p, Kvfence__V1__Welcome **welcome_p,
                   struct kvf_rpc_status *st);

/* fake_node_open() with features QUIESCE_V1, FENCE_V1, TCP and protocol
 * {1, 1}, 5 s. Returns the node, or NULL after logging why. */
struct fake_node *fake_node_attach(struct kvf_rpc_channel *ch, const char *node_id,
                                   uint64_t incarnation);

const char *fake_node_id(const struct fake_node *n);
uint64_t fake_node_incarnation(const struct fake_node *n);

/* Waits up to `timeout_ms` for the next ControlMessage. Returns 0 with *msg_p
 * (free with kvfence__v1__control_message__free_unpacked), -ETIMEDOUT,
 * KVF_RPC_STREAM_END (status in `st`, may be NULL), -EPROTO (undecodable), or
 * another negative errno. */
int fake_node_recv(struct fake_node *n, int64_t timeout_ms, Kvfence__V1__ControlMessage **msg_p,
                   struct kvf_rpc_status *st);

/* Reports. `token` NULL sends a Drained without a token. Return 0 or the
 * kvf_rpc_client_stream_send() error. */
int fake_node_send_drained(struct fake_node *n, uint64_t room_id, uint64_t generation,
                           const Kvfence__V1__AbortToken *token);
int fake_node_send_completed(struct fake_node *n, uint64_t room_id, uint64_t generation,
                             uint32_t rank, Kvfence__V1__Role role);
int fake_node_send_transfer_failed(struct fake_node *n, uint64_t room_id, uint64_t generation,
                                   uint32_t rank, Kvfence__V1__Role role, const char *reason);
int fake_node_send_peer_fenced(struct fake_node *n, const char *peer_node_id,
                               uint64_t peer_incarnation);
/* Sends any NodeMessage. */
int fake_node_send(struct fake_node *n, const Kvfence__V1__NodeMessage *m);

/* A goodbye: half-closes, then closes the stream, and frees the node.
 * Accepts NULL. */
void fake_node_close(struct fake_node *n);

/* Disappears without a goodbye: cancels the stream and frees the node.
 * Accepts NULL. */
void fake_node_vanish(struct fake_node *n);

#endif /* KVF_TEST_FAKE_NODE_H */
