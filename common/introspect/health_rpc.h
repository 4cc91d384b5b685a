/*
 * health_rpc.h: grpc.health.v1.Health (Check and Watch) served from a
 * kvf_health registry (health.h) on a kvf_rpc server (common/rpc). This is
 * the glue both daemons share: kvfence-control on its gRPC port,
 * kvfence-node on its unix socket. What is SERVING is the caller's business
 * (kvf_health_set); this file only answers.
 *
 * Threads: the handlers run on the server's CQ threads and only call the
 * registry, which has its own mutex (health.h).
 */
#ifndef KVF_HEALTH_RPC_H
#define KVF_HEALTH_RPC_H

#include "health.h"
#include "rpc_server.h"

/*
 * Registers /grpc.health.v1.Health/Check and /grpc.health.v1.Health/Watch on
 * `srv` (before kvf_rpc_server_start), answering from `h`. `h` must outlive
 * the server: destroy it after kvf_rpc_server_destroy(). Returns 0 or the
 * first negative errno kvf_rpc_server_add_* returned.
 */
int kvf_health_rpc_register(struct kvf_rpc_server *srv, struct kvf_health *h);

#endif /* KVF_HEALTH_RPC_H */
