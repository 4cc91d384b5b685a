/*
 * authz.c: certificate names -> roles (authz.h). The rules are small on
 * purpose: a prefix for nodes and engines, an exact list for admins, so that
 * an operator can read off a certificate what it may do.
 */
#include "authz.h"

#include <string.h>

#define DEFAULT_NODE_PREFIX   "spiffe://kvfence/node/"
#define DEFAULT_ENGINE_PREFIX "spiffe://kvfence/engine/"
#define DEFAULT_ADMIN_NAMES   "spiffe://kvfence/admin"

static bool has_prefix(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Is `name` one of the comma-separated `list`? */
static bool in_list(const char *name, const char *list)
{
    size_t len = strlen(name);
    for (const char *p = list; *p != '\0';) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && n > 0 && memcmp(p, name, n) == 0)
            return true;
        if (!end)
            break;
        p = end + 1;
    }
    return false;
}

/* A node id as the core accepts one: 1..128 printable ASCII, no spaces. */
static bool node_id_ok(const char *id)
{
    size_t n = strlen(id);
    if (n == 0 || n > KVF_AUTHZ_NODE_ID_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (id[i] <= ' ' || id[i] > '~')
            return false;
    return true;
}

void kvf_authz_classify(const struct kvf_authz_opts *o, const struct kvf_rpc_identity *id,
                        struct kvf_authz_peer *peer_p)
{
    struct kvf_authz_peer peer = {0};
    if (!o->enforce) {
        peer.roles = KVF_AUTHZ_NODE | KVF_AUTHZ_ENGINE | KVF_AUTHZ_ADMIN;
        *peer_p = peer;
        return;
    }
    const char *node_prefix = o->node_prefix ? o->node_prefix : DEFAULT_NODE_PREFIX;
    const char *engine_prefix = o->engine_prefix ? o->engine_prefix : DEFAULT_ENGINE_PREFIX;
    const char *admins = o->admin_names ? o->admin_names : DEFAULT_ADMIN_NAMES;
    bool two_nodes = false;
    for (unsigned i = 0; id->verified && i < id->n_names; i++) {
        const char *name = id->names[i];
        if (in_list(name, admins))
            peer.roles |= KVF_AUTHZ_ADMIN;
        if (*engine_prefix != '\0' && has_prefix(name, engine_prefix))
            peer.roles |= KVF_AUTHZ_ENGINE;
        if (*node_prefix != '\0' && has_prefix(name, node_prefix)) {
            const char *node = name + strlen(node_prefix);
            if (!node_id_ok(node))
                continue;
            if (peer.roles & KVF_AUTHZ_NODE)
                two_nodes |= strcmp(peer.node_id, node) != 0;
            else
                strcpy(peer.node_id, node); /* length checked by node_id_ok */
            peer.roles |= KVF_AUTHZ_NODE;
        }
    }
    if (two_nodes) {
        peer.roles &= ~(unsigned)KVF_AUTHZ_NODE;
        peer.node_id[0] = '\0';
    }
    *peer_p = peer;
}

unsigned kvf_authz_method_roles(const char *method)
{
    if (has_prefix(method, "/kvfence.v1.Admin/"))
        return KVF_AUTHZ_ADMIN;
    if (has_prefix(method, "/kvfence.v1.Control/"))
        return KVF_AUTHZ_ENGINE | KVF_AUTHZ_ADMIN;
    if (has_prefix(method, "/kvfence.v1.NodeSession/"))
        return KVF_AUTHZ_NODE;
    return 0;
}

const char *kvf_authz_roles_name(unsigned roles)
{
    switch (roles) {
    case KVF_AUTHZ_NODE:
        return "node";
    case KVF_AUTHZ_ADMIN:
        return "admin";
    case KVF_AUTHZ_ENGINE | KVF_AUTHZ_ADMIN:
        return "engine or admin";
    default:
        return "none";
    }
}
