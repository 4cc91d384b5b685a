/*
 * node_health.h: grpc.health.v1 on the NodeLocal socket: SERVING while the session is welcomed and
 * the node is not stopping. Functions of node_health.c only; the shared types are node_types.h.
 */
#ifndef KVF_NODE_NODE_HEALTH_H
#define KVF_NODE_NODE_HEALTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"

int node_health_register(struct kvf_node *n);  /* before the NodeLocal server starts */
void node_health_update(struct kvf_node *n);   /* owner: after each turn of its loop */
void node_health_shutdown(struct kvf_node *n); /* at stop: NOT_SERVING for good */
void node_health_free(struct kvf_node *n);     /* after the server stopped */

#endif /* KVF_NODE_NODE_HEALTH_H */
