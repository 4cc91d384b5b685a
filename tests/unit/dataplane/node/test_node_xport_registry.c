/*
 * test_node_xport_registry.c: the node's transport registry
 * (dataplane/node/xport_registry.h) is complete: every class fills every
 * slot (post_chunk may be NULL: the submit path posts its frames), names are
 * unique, and the routing order puts the same-node transport first and the
 * transport that takes every remote sink (TCP) last, so that an RDMA link
 * that is up is preferred to it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "xport_registry.h"

static size_t count(void)
{
    size_t k = 0;
    while (node_xport_classes[k])
        k++;
    return k;
}

static void test_every_slot_is_set(void **state)
{
    (void)state;
    size_t k = count();
    assert_true(k >= 3);
    for (size_t i = 0; i < k; i++) {
        const struct node_xport_class *c = node_xport_classes[i];
        assert_non_null(c->name);
        assert_non_null(c->start);
        assert_non_null(c->stop);
        assert_non_null(c->add_pool);
        assert_non_null(c->remove_pool);
        assert_non_null(c->route);
        assert_non_null(c->fence_peer);
        assert_non_null(c->renew);
        assert_non_null(c->poll);
        assert_non_null(c->waker);
        assert_non_null(c->next_ms);
        assert_non_null(c->feature);
        assert_non_null(c->endpoint);
        for (size_t j = 0; j < i; j++)
            assert_string_not_equal(node_xport_classes[j]->name, c->name);
    }
}

static void test_routing_order(void **state)
{
    (void)state;
    size_t k = count();
    assert_ptr_equal(node_xport_classes[0], &node_xport_local_class);
    assert_ptr_equal(node_xport_classes[k - 1], &node_xport_tcp_class);
    size_t rdma = k;
    for (size_t i = 0; i < k; i++)
        if (node_xport_classes[i] == &node_xport_rdma_class)
            rdma = i;
    assert_true(rdma > 0 && rdma < k - 1);
    /* Only a transport that queues its chunks says how it posts them. */
    assert_non_null(node_xport_rdma_class.post_chunk);
    assert_null(node_xport_tcp_class.post_chunk);
    assert_null(node_xport_local_class.post_chunk);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_slot_is_set),
        cmocka_unit_test(test_routing_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
