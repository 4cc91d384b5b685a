/*
 * test_node_jobs.c: the owner's job queue (dataplane/node/node_owner.h) on
 * a node built by the test, with no owner thread: a job is a run function,
 * its argument and the argument's free function, and the argument is freed
 * exactly once whether the job is freed after running, refused by a node
 * whose owner exited, or posted as a unary call to such a node. The owner
 * loop itself (run, then free; drop at stop) runs in the integration tests.
 */
#include <errno.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "node_owner.h"
#include "node_types.h"
#include "transport.h"

/* What the test's jobs saw. */
struct arg {
    int runs;
    int frees;
};

static void count_run(struct kvf_node *n, void *a)
{
    (void)n;
    ((struct arg *)a)->runs++;
}

static void count_free(void *a)
{
    ((struct arg *)a)->frees++;
}

static struct kvf_node *node_new(void)
{
    struct kvf_node *n = calloc(1, sizeof *n);
    assert_non_null(n);
    assert_int_equal(pthread_mutex_init(&n->qlock, NULL), 0);
    assert_int_equal(pthread_cond_init(&n->qdone, NULL), 0);
    n->qwake = kvf_wake_open();
    assert_true(n->qwake >= 0);
    return n;
}

static void node_del(struct kvf_node *n)
{
    kvf_wake_close(n->qwake);
    pthread_cond_destroy(&n->qdone);
    pthread_mutex_destroy(&n->qlock);
    free(n);
}

static bool woken(const struct kvf_node *n)
{
    struct pollfd p = {.fd = n->qwake, .events = POLLIN};
    return poll(&p, 1, 0) == 1;
}

static void job_free_frees_its_argument_once(void **state)
{
    (void)state;
    struct arg a = {0};
    struct node_job *j = node_job_new(count_run, &a, count_free);
    assert_non_null(j);
    assert_ptr_equal(j->arg, &a);
    assert_false(j->sync);
    assert_null(j->hold);
    j->run(NULL, j->arg); /* what the owner does, then it frees the job */
    node_job_free(j);
    assert_int_equal(a.runs, 1);
    assert_int_equal(a.frees, 1);
    node_job_free(NULL);
    struct node_job *bare = node_job_new(count_run, NULL, NULL); /* nothing to free */
    assert_non_null(bare);
    node_job_free(bare);
}

static void posted_job_is_queued_and_wakes_the_owner(void **state)
{
    (void)state;
    struct kvf_node *n = node_new();
    struct arg a = {0}, b = {0};
    struct node_job *j1 = node_job_new(count_run, &a, count_free);
    struct node_job *j2 = node_job_new(count_run, &b, count_free);
    assert_int_equal(node_post(n, j1), 0);
    assert_true(woken(n)); /* the queue was empty */
    kvf_wake_clear(n->qwake);
    assert_int_equal(node_post(n, j2), 0);
    assert_false(woken(n)); /* not empty: the owner takes the whole queue at once */
    assert_ptr_equal(n->qhead, j1);
    assert_ptr_equal(j1->next, j2);
    assert_ptr_equal(n->qtail, j2);
    assert_int_equal(a.frees + b.frees, 0); /* the owner's now, not freed by a post */
    for (struct node_job *j = n->qhead, *next; j; j = next) {
        next = j->next;
        j->run(n, j->arg);
        node_job_free(j);
    }
    assert_int_equal(a.runs, 1);
    assert_int_equal(b.runs, 1);
    assert_int_equal(a.frees, 1);
    assert_int_equal(b.frees, 1);
    node_del(n);
}

static void refused_post_leaves_the_job_to_its_poster(void **state)
{
    (void)state;
    struct kvf_node *n = node_new();
    n->owner_exit = true;
    struct arg a = {0};
    struct node_job *j = node_job_new(count_run, &a, count_free);
    assert_int_equal(node_post(n, j), -ESHUTDOWN);
    assert_int_equal(node_post_list(n, j, j), -ESHUTDOWN);
    assert_null(n->qhead);
    assert_int_equal(a.frees, 0); /* still the poster's */
    node_job_free(j);
    assert_int_equal(a.runs, 0);
    assert_int_equal(a.frees, 1);

    /* A unary call's post frees the refused job: its free_arg answers. */
    struct arg c = {0};
    node_post_or_fail(n, node_job_new(count_run, &c, count_free));
    assert_int_equal(c.runs, 0);
    assert_int_equal(c.frees, 1);

    /* A synchronous job on the poster's stack: refused, never freed. */
    struct arg s = {0};
    struct node_job sj;
    memset(&sj, 0, sizeof sj);
    sj.run = count_run;
    sj.arg = &s;
    sj.free_arg = count_free;
    sj.sync = true;
    assert_int_equal(node_post(n, &sj), -ESHUTDOWN);
    assert_int_equal(s.frees, 0);
    node_del(n);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(job_free_frees_its_argument_once),
        cmocka_unit_test(posted_job_is_queued_and_wakes_the_owner),
        cmocka_unit_test(refused_post_leaves_the_job_to_its_poster),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
