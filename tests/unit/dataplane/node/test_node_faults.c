/*
 * test_node_faults.c: the fault file's parser of kvfence-node
 * (dataplane/node/faults.h): every key, comments and blanks, and the
 * refusals (unknown key, bad value, no '='), which leave the caller's
 * configuration untouched.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "faults.h"
#include "peer_channel.h"

static void every_key_parses(void **state)
{
    (void)state;
    const char *text = "# race test\n"
                       "hold = 1\n"
                       "post_fail=2\n"
                       "op_error=3   # trailing comment\n"
                       "\n"
                       "hold_stream=1\n"
                       "hold_room_update=1\n"
                       "drop_room_update=4\n"
                       "drop_abort=5\n"
                       "drop_fence=6\n"
                       "drop_drained=7\n"
                       "drop_completed=8\n"
                       "drop_peer_fenced=9\n"
                       "peer_drop=10\n"
                       "peer_dup=11\n"
                       "peer_delay=12\n"
                       "rdma_hold=1\n"
                       "rdma_bad_notice=14\n"
                       "rdma_drop_hello=15\n"
                       "rdma_wr_error=16\n"
                       "rdma_hold_odd=1\n"
                       "refuse_room_open=17\n"
                       "stage_fail=18\n"
                       "peer_delay_after=13"; /* no final newline */
    struct node_fault_cfg c;
    char err[160] = "";
    assert_int_equal(node_fault_parse(text, &c, err, sizeof err), 0);
    assert_true(c.xport.hold);
    assert_int_equal(c.xport.fail_post_nth, 2);
    assert_int_equal(c.xport.error_nth, 3);
    assert_int_equal(c.hold_stream, 1);
    assert_int_equal(c.hold_room_update, 1);
    assert_int_equal(c.drop_room_update, 4);
    assert_int_equal(c.drop_abort, 5);
    assert_int_equal(c.drop_fence, 6);
    assert_int_equal(c.drop_drained, 7);
    assert_int_equal(c.drop_completed, 8);
    assert_int_equal(c.drop_peer_fenced, 9);
    assert_true(c.peer_keys);
    assert_int_equal(c.rdma_hold, 1);
    assert_int_equal(c.rdma_bad_notice, 14);
    assert_int_equal(c.rdma_drop_hello, 15);
    assert_int_equal(c.rdma_wr_error, 16);
    assert_int_equal(c.rdma_hold_odd, 1);
    assert_int_equal(c.refuse_room_open, 17);
    assert_int_equal(c.stage_fail, 18);
    struct kvf_peer_fault pf;
    node_fault_peer(&c, &pf);
    assert_int_equal(pf.drop_nth, 10);
    assert_int_equal(pf.duplicate_nth, 11);
    assert_int_equal(pf.delay_nth, 12);
    assert_int_equal(pf.delay_after, 13);
}

static void empty_text_is_no_fault(void **state)
{
    (void)state;
    struct node_fault_cfg c;
    memset(&c, 0xff, sizeof c);
    char err[160];
    assert_int_equal(node_fault_parse("", &c, err, sizeof err), 0);
    assert_false(c.xport.hold);
    assert_int_equal(c.xport.fail_post_nth, 0);
    assert_int_equal(c.drop_abort, 0);
    assert_int_equal(c.rdma_hold, 0);
    assert_int_equal(c.rdma_bad_notice, 0);
    assert_int_equal(c.rdma_wr_error, 0);
    assert_int_equal(c.rdma_hold_odd, 0);
    assert_int_equal(c.refuse_room_open, 0);
    assert_int_equal(c.stage_fail, 0);
    assert_int_equal(c.hold_stream, 0);
    assert_false(c.peer_keys); /* the channel's faults are left alone */
    struct kvf_peer_fault pf;
    node_fault_peer(&c, &pf);
    assert_int_equal(pf.drop_nth, 0);
    assert_int_equal(pf.delay_after, 1); /* the channel wants >= 1 */
}

static void bad_lines_are_refused_naming_line_and_key(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        const char *want;
    } cases[] = {
        {"hold=1\nnosuch=1\n", "line 2: unknown key 'nosuch'"},
        {"hold=2\n", "hold: want 0 or 1"},
        {"hold_stream=2\n", "hold_stream: at most 1"},
        {"hold_room_update=3\n", "hold_room_update: at most 1"},
        {"post_fail=-1\n", "post_fail: '-1' is not a count"},
        {"op_error=3x\n", "op_error: '3x' is not a count"},
        {"drop_abort=\n", "drop_abort: '' is not a count"},
        {"hold\n", "line 1: 'hold': want key=value"},
        {"peer_delay_after=4294967296\n", "peer_delay_after: at most 4294967295"},
        {"rdma_hold=2\n", "rdma_hold: at most 1"},
        {"rdma_hold_odd=2\n", "rdma_hold_odd: at most 1"},
        {"op_error=99999999999999999999999\n", "is not a count"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct node_fault_cfg c;
        memset(&c, 0, sizeof c);
        c.drop_fence = 42; /* must survive a refusal */
        char err[160] = "";
        assert_int_equal(node_fault_parse(cases[i].text, &c, err, sizeof err), -EINVAL);
        if (!strstr(err, cases[i].want))
            fail_msg("case %zu: error '%s' lacks '%s'", i, err, cases[i].want);
        assert_int_equal(c.drop_fence, 42);
        assert_false(c.xport.hold);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_key_parses),
        cmocka_unit_test(empty_text_is_no_fault),
        cmocka_unit_test(bad_lines_are_refused_naming_line_and_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
