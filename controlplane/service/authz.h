/*
 * authz.h: who may call what on kvfence-control.
 *
 * With mutual TLS on (a client CA configured), every caller is who its
 * verified client certificate says, and that decides its roles:
 *
 *   node    a name "<node_prefix><node id>" (default
 *           "spiffe://kvfence/node/n1"): may open NodeSession/Attach, and
 *           only as that node id; everything a session reports (Hello,
 *           Drained, Completed, TransferFailed, PeerFenced, PoolUpdate,
 *           Resync) is taken as that node's word.
 *   engine  a name starting with <engine_prefix> (default
 *           "spiffe://kvfence/engine/"): may call Control (JoinRoom,
 *           AbortRoom, WatchLeases, ...).
 *   admin   one of the exact names in <admin_names> (comma-separated; default
 *           "spiffe://kvfence/admin"): may call Admin, and Control too.
 *
 * Names are the certificate's subject alternative names (URI, DNS, ...) and
 * its common name. A certificate that names two different nodes names none.
 * Without mutual TLS nobody is verified, and the port is open to anyone who
 * reaches it: the daemon says so loudly at start and in a metric
 * (docs/security.md).
 *
 * Pure: no I/O, no gRPC; the service hands it the names gRPC verified.
 */
#ifndef KVF_AUTHZ_H
#define KVF_AUTHZ_H

#include <stdbool.h>

#include "kvf_types.h"
#include "rpc_server.h"

enum kvf_authz_role {
    KVF_AUTHZ_NODE = 1u << 0,
    KVF_AUTHZ_ENGINE = 1u << 1,
    KVF_AUTHZ_ADMIN = 1u << 2,
};

struct kvf_authz_opts {
    bool enforce;              /* mutual TLS on: every call is checked */
    const char *node_prefix;   /* NULL: "spiffe://kvfence/node/" */
    const char *engine_prefix; /* NULL: "spiffe://kvfence/engine/" */
    const char *admin_names;   /* comma-separated; NULL: "spiffe://kvfence/admin" */
};

#define KVF_AUTHZ_NODE_ID_MAX KVF_NODE_ID_MAX

/* What one caller may do. */
struct kvf_authz_peer {
    unsigned roles;                          /* KVF_AUTHZ_* bits */
    char node_id[KVF_AUTHZ_NODE_ID_MAX + 1]; /* with KVF_AUTHZ_NODE: the node it is */
};

/* The roles of the peer that `id` describes. With enforce off every caller
 * holds every role and no node id (the node id of a Hello is then taken on
 * its word). */
void kvf_authz_classify(const struct kvf_authz_opts *o, const struct kvf_rpc_identity *id,
                        struct kvf_authz_peer *peer_p);

/* The roles a unary or stream method needs, by its full name
 * ("/kvfence.v1.Admin/FenceNode"): one of them is enough. 0 for a method
 * anyone may call (health, reflection). */
unsigned kvf_authz_method_roles(const char *method);

/* "node", "engine or admin", ...: for refusals. */
const char *kvf_authz_roles_name(unsigned roles);

#endif
