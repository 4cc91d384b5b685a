/*
 * staging_fake.c: the fake staging engine (staging_fake.h). Held copies sit on
 * a doubly linked FIFO so the test can complete any one of them; completed
 * copies move to a done FIFO that poll drains. Nothing runs by itself.
 *
 * DESIGN: single-threaded (the test thread). spriv marks a copy as held
 * (points at the engine) so that completing a copy twice, or one the engine
 * never saw, is refused.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "staging_fake.h"
#include "staging_internal.h"

struct staging_fake {
    struct kvf_staging base;          /* first */
    struct kvf_stage_copy *held_head; /* FIFO linked by snext */
    size_t held;
    struct kvf_stage_copy *done_head; /* FIFO linked by snext */
    struct kvf_stage_copy *done_tail;
    unsigned submits;
    int fail_next;
};

static struct staging_fake *fake_of(const struct kvf_staging *s)
{
    return (struct staging_fake *)s;
}

static int fake_copy_async(struct kvf_staging *s, struct kvf_stage_copy *c)
{
    struct staging_fake *f = fake_of(s);
    f->submits++;
    if (f->fail_next != 0) {
        int rc = f->fail_next;
        f->fail_next = 0;
        return rc;
    }
    c->snext = NULL;
    c->spriv = f;
    struct kvf_stage_copy **pp = &f->held_head;
    while (*pp != NULL)
        pp = &(*pp)->snext;
    *pp = c;
    f->held++;
    return 0;
}

static int fake_poll(struct kvf_staging *s, unsigned max, struct kvf_stage_copy **done)
{
    struct staging_fake *f = fake_of(s);
    unsigned n = 0;
    while (n < max && f->done_head != NULL) {
        struct kvf_stage_copy *c = f->done_head;
        f->done_head = c->snext;
        if (f->done_head == NULL)
            f->done_tail = NULL;
        c->snext = NULL;
        done[n++] = c;
    }
    return (int)n;
}

static void fake_destroy(struct kvf_staging *s)
{
    free(fake_of(s)); /* the wrapper calls this only with nothing held or done */
}

static const struct kvf_staging_ops fake_ops = {
    .name = "fake",
    .copy_async = fake_copy_async,
    .poll = fake_poll,
    .destroy = fake_destroy,
};

struct kvf_staging *kvf_staging_fake_create(void)
{
    struct staging_fake *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    staging_base_init(&f->base, &fake_ops);
    return &f->base;
}

size_t kvf_staging_fake_held(const struct kvf_staging *s)
{
    return fake_of(s)->held;
}

unsigned kvf_staging_fake_submits(const struct kvf_staging *s)
{
    return fake_of(s)->submits;
}

int kvf_staging_fake_complete(struct kvf_staging *s, struct kvf_stage_copy *c, int status)
{
    struct staging_fake *f = fake_of(s);
    struct kvf_stage_copy **pp = &f->held_head;
    while (*pp != NULL && *pp != c)
        pp = &(*pp)->snext;
    if (*pp == NULL || c->spriv != f)
        return -ENOENT;
    *pp = c->snext;
    f->held--;
    c->spriv = NULL;
    if (status == 0)
        status = staging_host_copy(c);
    c->status = status;
    c->snext = NULL;
    if (f->done_tail != NULL)
        f->done_tail->snext = c;
    else
        f->done_head = c;
    f->done_tail = c;
    return 0;
}

size_t kvf_staging_fake_complete_all(struct kvf_staging *s, int status)
{
    struct staging_fake *f = fake_of(s);
    size_t n = 0;
    while (f->held_head != NULL) {
        kvf_staging_fake_complete(s, f->held_head, status);
        n++;
    }
    return n;
}

void kvf_staging_fake_fail_next_submit(struct kvf_staging *s, int neg_errno)
{
    fake_of(s)->fail_next = neg_errno;
}
