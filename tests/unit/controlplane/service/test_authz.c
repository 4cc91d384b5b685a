/*
 * test_authz.c: certificate names -> roles (controlplane/service/authz.c),
 * the pure part of who may call what. The real server and clients over mutual
 * TLS are in tests/interop/test_tls.py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "authz.h"

static struct kvf_rpc_identity names(int n, ...)
{
    struct kvf_rpc_identity id;
    memset(&id, 0, sizeof id);
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++)
        snprintf(id.names[i], sizeof id.names[i], "%s", va_arg(ap, const char *));
    va_end(ap);
    id.n_names = (unsigned)n;
    id.verified = n > 0;
    return id;
}

static struct kvf_authz_peer classify(const struct kvf_authz_opts *o, struct kvf_rpc_identity id)
{
    struct kvf_authz_peer p;
    memset(&p, 0xa5, sizeof p);
    kvf_authz_classify(o, &id, &p);
    return p;
}

static void defaults_map_each_role(void **state)
{
    (void)state;
    struct kvf_authz_opts o = {.enforce = true};
    struct kvf_authz_peer p = classify(&o, names(1, "spiffe://kvfence/node/n1"));
    assert_int_equal(p.roles, KVF_AUTHZ_NODE);
    assert_string_equal(p.node_id, "n1");
    p = classify(&o, names(1, "spiffe://kvfence/engine/e7"));
    assert_int_equal(p.roles, KVF_AUTHZ_ENGINE);
    p = classify(&o, names(2, "kvfence test admin", "spiffe://kvfence/admin"));
    assert_int_equal(p.roles, KVF_AUTHZ_ADMIN);
    /* A prefix of the admin name is not the admin name. */
    p = classify(&o, names(1, "spiffe://kvfence/admin2"));
    assert_int_equal(p.roles, 0);
}

static void a_certificate_naming_two_nodes_names_none(void **state)
{
    (void)state;
    struct kvf_authz_opts o = {.enforce = true};
    struct kvf_authz_peer p =
        classify(&o, names(2, "spiffe://kvfence/node/n1", "spiffe://kvfence/node/n2"));
    assert_int_equal(p.roles, 0);
    assert_string_equal(p.node_id, "");
    /* The same node twice is still that node. */
    p = classify(&o, names(2, "spiffe://kvfence/node/n1", "spiffe://kvfence/node/n1"));
    assert_int_equal(p.roles, KVF_AUTHZ_NODE);
    assert_string_equal(p.node_id, "n1");
}

static void bad_node_ids_are_no_node(void **state)
{
    (void)state;
    struct kvf_authz_opts o = {.enforce = true};
    char long_id[200];
    memset(long_id, 'a', sizeof long_id);
    memcpy(long_id, "spiffe://kvfence/node/", 22);
    long_id[22 + 129] = '\0'; /* 129 characters: one too many */
    assert_int_equal(classify(&o, names(1, long_id)).roles, 0);
    assert_int_equal(classify(&o, names(1, "spiffe://kvfence/node/")).roles, 0);
    assert_int_equal(classify(&o, names(1, "spiffe://kvfence/node/a b")).roles, 0);
    long_id[22 + 128] = '\0'; /* 128: the most there may be */
    assert_int_equal(classify(&o, names(1, long_id)).roles, KVF_AUTHZ_NODE);
}

static void configured_names_and_no_enforcement(void **state)
{
    (void)state;
    struct kvf_authz_opts o = {.enforce = true,
                               .node_prefix = "dns:node-",
                               .engine_prefix = "",
                               .admin_names = "ops-a,,ops-b"};
    assert_int_equal(classify(&o, names(1, "dns:node-x")).roles, KVF_AUTHZ_NODE);
    assert_int_equal(classify(&o, names(1, "spiffe://kvfence/node/x")).roles, 0);
    assert_int_equal(classify(&o, names(1, "ops-b")).roles, KVF_AUTHZ_ADMIN);
    assert_int_equal(classify(&o, names(1, "ops-")).roles, 0);
    /* An empty engine prefix names no engine (not every name). */
    assert_int_equal(classify(&o, names(1, "anything")).roles, 0);
    /* Unverified names count for nothing. */
    struct kvf_rpc_identity id = names(1, "ops-a");
    id.verified = false;
    assert_int_equal(classify(&o, id).roles, 0);
    /* Without mutual TLS everyone may do everything (the INSECURE mode). */
    o.enforce = false;
    struct kvf_authz_peer p = classify(&o, names(0));
    assert_int_equal(p.roles, KVF_AUTHZ_NODE | KVF_AUTHZ_ENGINE | KVF_AUTHZ_ADMIN);
    assert_string_equal(p.node_id, "");
}

static void method_roles(void **state)
{
    (void)state;
    assert_int_equal(kvf_authz_method_roles("/kvfence.v1.Admin/FenceNode"), KVF_AUTHZ_ADMIN);
    assert_int_equal(kvf_authz_method_roles("/kvfence.v1.Control/JoinRoom"),
                     KVF_AUTHZ_ENGINE | KVF_AUTHZ_ADMIN);
    assert_int_equal(kvf_authz_method_roles("/kvfence.v1.NodeSession/Attach"), KVF_AUTHZ_NODE);
    assert_int_equal(kvf_authz_method_roles("/grpc.health.v1.Health/Check"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(defaults_map_each_role),
        cmocka_unit_test(a_certificate_naming_two_nodes_names_none),
        cmocka_unit_test(bad_node_ids_are_no_node),
        cmocka_unit_test(configured_names_and_no_enforcement),
        cmocka_unit_test(method_roles),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
