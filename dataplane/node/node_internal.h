/*
 * node_internal.h: every declaration of dataplane/node/ in one include, for
 * the unit tests that reach inside the node (test_node_resync). The node's
 * own files include node_types.h and the headers of the modules they call,
 * and nothing else: each module's header declares only its functions
 * (docs/node.md, "Module structure").
 */
#ifndef KVF_NODE_INTERNAL_H
#define KVF_NODE_INTERNAL_H

#include "control_session.h"
#include "local_svc.h"
#include "node_health.h"
#include "node_log.h"
#include "node_owner.h"
#include "node_types.h"
#include "peer_link.h"
#include "pool_admin.h"
#include "submit_stream.h"
#include "watch.h"

#endif /* KVF_NODE_INTERNAL_H */
