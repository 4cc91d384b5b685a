/*
 * test_node_resync.c: kvfence-node's Resync builder (node_resync_emit,
 * dataplane/node/control_session.c) over a node state made here: rooms with
 * real lifetimes (dataplane/lifetime), no threads, no session. The messages
 * it would send are captured and decoded.
 *
 * Checked: more lifetimes than one message holds (NODE_RESYNC_MAX) go out in
 * several messages, none left out and none twice; the undrained ones first,
 * newest first, then the DRAINED ones closed by an abort notice (with their
 * token); DRAINED lifetimes never aborted and an older incarnation's are not
 * reported; every message carries the pools, the first the fenced peers; a
 * failed send stops the Resync and says so; an empty node sends one message.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "control_session.h"
#include "node_types.h"

#define INC 7u

/* What the builder handed to send, decoded. */
#define MAX_MSGS 8
static struct {
    Kvfence__V1__NodeMessage *msgs[MAX_MSGS];
    size_t n;
    int fail_at; /* the send of this message (1-based) fails; 0: none */
} cap;

static int capture(struct kvf_node *n, const Kvfence__V1__NodeMessage *m)
{
    (void)n;
    if (cap.fail_at && (int)cap.n + 1 == cap.fail_at)
        return -EPIPE;
    assert_true(cap.n < MAX_MSGS);
    size_t len = kvfence__v1__node_message__get_packed_size(m);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    kvfence__v1__node_message__pack(m, buf);
    cap.msgs[cap.n] = kvfence__v1__node_message__unpack(NULL, len, buf);
    free(buf);
    assert_non_null(cap.msgs[cap.n]);
    assert_int_equal(cap.msgs[cap.n]->msg_case, KVFENCE__V1__NODE_MESSAGE__MSG_RESYNC);
    cap.n++;
    return 0;
}

static void cap_reset(void)
{
    for (size_t i = 0; i < cap.n; i++)
        kvfence__v1__node_message__free_unpacked(cap.msgs[i], NULL);
    memset(&cap, 0, sizeof cap);
}

/* A room of incarnation `inc`, opened (room_id, 1) and linked newest first. */
static struct node_room *add_room(struct kvf_node *n, uint64_t room_id, uint64_t inc)
{
    struct node_room *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->key = (kvf_room_key){room_id, 1};
    r->incarnation = inc;
    assert_int_equal(kvf_ncore_room_open(n->core, &r->core, r->key, r), 0);
    r->next = n->rooms;
    n->rooms = r;
    return r;
}

/* Drained through the rules core: by an abort notice with a token, or by a
 * tokenless close. Its effects are not applied (no session here). */
static void close_room(struct kvf_node *n, struct node_room *r, bool aborted)
{
    if (aborted)
        kvf_ncore_room_abort(n->core, &r->core, (kvf_token){r->key.room_id, ~r->key.room_id}, 0);
    else
        kvf_ncore_room_end(n->core, &r->core);
    assert_int_equal(kvf_lt_state(r->core.lt), KVF_LT_DRAINED);
    struct kvf_ncore_fx fx;
    while (kvf_ncore_fx_take(n->core, &fx))
        ;
}

static struct kvf_node *node_new(void)
{
    struct kvf_node *n = calloc(1, sizeof *n);
    assert_non_null(n);
    n->incarnation = INC;
    struct kvf_ncore_opts o;
    kvf_ncore_opts_init(&o);
    o.retain_max = SIZE_MAX; /* every room stays: the builder sees them all */
    n->core = kvf_ncore_create(&o);
    assert_non_null(n->core);
    n->lts = kvf_ncore_lts(n->core);
    return n;
}

static void node_free(struct kvf_node *n)
{
    kvf_ncore_destroy(n->core); /* unlinks the rooms it retained */
    while (n->rooms) {
        struct node_room *r = n->rooms;
        n->rooms = r->next;
        free(r);
    }
    free(n);
}

/* Room ids 1..NOPEN+NDRAINED of this incarnation: ids 1..NDRAINED drained by
 * an abort, every third of them never aborted (not reported), the rest
 * open; one room of an older incarnation. Newer ids are newer rooms. */
#define NDRAINED 1500u
#define NOPEN    (NODE_RESYNC_MAX + 300u)

static void over_the_cap_every_lifetime_once_in_order(void **state)
{
    (void)state;
    cap_reset();
    struct kvf_node *n = node_new();
    struct node_room *old = add_room(n, 100000, INC - 1);
    (void)old;
    size_t want_drained = 0;
    for (uint64_t id = 1; id <= NOPEN + NDRAINED; id++) {
        struct node_room *r = add_room(n, id, INC);
        if (id <= NDRAINED) {
            bool aborted = id % 3 != 0;
            close_room(n, r, aborted);
            want_drained += aborted;
        }
    }
    n->npeers = 2;
    snprintf(n->peers[0].node_id, sizeof n->peers[0].node_id, "p0");
    n->peers[0].incarnation = 3;
    n->peers[0].fenced = true;
    snprintf(n->peers[1].node_id, sizeof n->peers[1].node_id, "p1"); /* not fenced */

    size_t nlt = 0, nmsg = 0;
    assert_int_equal(node_resync_emit(n, capture, &nlt, &nmsg), 0);
    size_t want = NOPEN + want_drained;
    assert_int_equal(nlt, want);
    assert_int_equal(nmsg, (want + NODE_RESYNC_MAX - 1) / NODE_RESYNC_MAX);
    assert_int_equal(cap.n, nmsg);
    assert_true(nmsg >= 2);

    /* In order: open ids newest first (NOPEN+NDRAINED down to NDRAINED+1),
     * then the aborted drained ones newest first. */
    uint64_t expect_id = NOPEN + NDRAINED;
    bool drained_part = false;
    size_t seen = 0;
    for (size_t m = 0; m < cap.n; m++) {
        const Kvfence__V1__Resync *rs = cap.msgs[m]->resync;
        assert_true(rs->n_lifetimes <= NODE_RESYNC_MAX);
        assert_true(rs->n_lifetimes > 0);
        assert_int_equal(rs->n_pools, 0); /* this node has none: every message says so */
        if (m == 0) {
            assert_int_equal(rs->n_fenced_peers, 1);
            assert_string_equal(rs->fenced_peers[0]->node_id, "p0");
            assert_int_equal(rs->fenced_peers[0]->incarnation, 3);
        } else {
            assert_int_equal(rs->n_fenced_peers, 0);
        }
        for (size_t i = 0; i < rs->n_lifetimes; i++, seen++) {
            const Kvfence__V1__LifetimeInfo *li = rs->lifetimes[i];
            if (!drained_part && expect_id == NDRAINED) {
                drained_part = true;
                while (expect_id % 3 == 0)
                    expect_id--;
            }
            if (li->room->room_id != expect_id)
                fail_msg("message %zu lifetime %zu: room %llu, want %llu", m, i,
                         (unsigned long long)li->room->room_id, (unsigned long long)expect_id);
            assert_int_equal(li->room->generation, 1);
            if (drained_part) {
                assert_int_equal(li->state, KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_DRAINED);
                assert_non_null(li->token);
                assert_int_equal(li->token->hi, expect_id);
                assert_int_equal(li->token->lo, ~expect_id);
                do
                    expect_id--;
                while (expect_id % 3 == 0 && expect_id > 0);
            } else {
                assert_int_equal(li->state, KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_OPEN);
                assert_null(li->token);
                expect_id--;
            }
        }
    }
    assert_int_equal(seen, want);
    assert_true(drained_part);
    assert_int_equal(expect_id, 0); /* down to room 1: nothing left out */
    cap_reset();

    /* A failed send stops there and says how much went. */
    cap.fail_at = 2;
    assert_int_equal(node_resync_emit(n, capture, &nlt, &nmsg), -EPIPE);
    assert_int_equal(nmsg, 1);
    assert_int_equal(nlt, NODE_RESYNC_MAX);
    cap_reset();
    node_free(n);
}

static void empty_node_sends_one_message(void **state)
{
    (void)state;
    cap_reset();
    struct kvf_node *n = node_new();
    size_t nlt = 9, nmsg = 9;
    assert_int_equal(node_resync_emit(n, capture, &nlt, &nmsg), 0);
    assert_int_equal(nlt, 0);
    assert_int_equal(nmsg, 1);
    assert_int_equal(cap.n, 1);
    assert_int_equal(cap.msgs[0]->resync->n_lifetimes, 0);
    cap_reset();
    node_free(n);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(over_the_cap_every_lifetime_once_in_order),
        cmocka_unit_test(empty_node_sends_one_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
