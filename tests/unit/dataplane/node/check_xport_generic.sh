#!/bin/sh
# check_xport_generic.sh SOURCE_DIR: the node's generic data-path code
# (dataplane/node/xport.c and xport.h: the router, the Hello's features and
# endpoints, the owner's polling and wake descriptors, pools and fences)
# names no transport: every transport is reached through the registry
# (xport_registry.h). Prints each offending line and exits 1 when one does.
set -u
dir=${1:?usage: check_xport_generic.sh SOURCE_DIR}
pattern='kvf_transport_(tcp|local|rdma)_|node_rdma_|tcp_io|->tcp\b|"(TCP|RDMA|LOCAL)"|#include "(tcp|local|rdma|rdma_link)\.h"'
if grep -nE "$pattern" "$dir/dataplane/node/xport.c" "$dir/dataplane/node/xport.h"; then
    echo "check_xport_generic: the lines above name a transport in generic node code" >&2
    exit 1
fi
exit 0
