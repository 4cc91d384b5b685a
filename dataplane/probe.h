/*
 * probe.h: `kvfence-node --probe`, the node's own health probe. It calls
 * grpc.health.v1.Health/Check (service "", the whole node) on the node's
 * unix socket, for an exec probe: the kubelet cannot reach a unix socket
 * with its gRPC probe (deploy/README.md, "Probes").
 */
#ifndef KVF_NODE_PROBE_H
#define KVF_NODE_PROBE_H

#include <stdint.h>

/*
 * One Check on unix:`local_socket`, `timeout_ms` from now. Prints one line
 * on stdout ("SERVING", "NOT_SERVING") or on stderr (why it failed).
 * Returns 0 when SERVING, 1 otherwise (NOT_SERVING, no answer, an error):
 * the process's exit status.
 */
int kvf_node_probe(const char *local_socket, int64_t timeout_ms);

#endif /* KVF_NODE_PROBE_H */
