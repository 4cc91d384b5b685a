/*
 * explorer.c: the seeded random schedule explorer.
 *
 * For each seed it draws a schedule of actions (joins, lease grants, submits,
 * completions in any order with success, error or flush, quarantines, aborts
 * from any participant and from operators, delivered / dropped / duplicated
 * notices and reports, stale and tokenless reports, overlapping joins, node
 * disconnects, kills and restarts, fences and timer ticks) and plays it on a
 * simulated cluster built around the real control-plane core and the real
 * lifetime tables (world.c), which checks every invariant after every step.
 * Each schedule ends with a quiesce phase that checks liveness: every room
 * terminal, every lease released exactly once.
 *
 * On a violation it prints the seed, then shrinks the schedule (removing
 * chunks of actions while the replay still fails) and prints the shortest
 * schedule it found, which `--replay-seed S` reproduces.
 *
 * usage: kvf_explorer [--steps N] [--steps-per-seed K] [--first-seed S]
 *                     [--replay-seed S] [--quiet]
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "world.h"

/* How often each action is drawn, out of the sum. */
static const unsigned weights[ACT_KIND_COUNT] = {
    [ACT_JOIN] = 120,       [ACT_EXTEND] = 20,        [ACT_SUBMIT] = 140,
    [ACT_SINK_OP] = 30,     [ACT_COMPLETE_OK] = 130,  [ACT_COMPLETE_ERR] = 12,
    [ACT_QUARANTINE] = 12,  [ACT_ABORT] = 10,         [ACT_ADMIN_ABORT] = 2,
    [ACT_DELIVER_CP] = 150, [ACT_DELIVER_NODE] = 150, [ACT_DROP_CP] = 15,
    [ACT_DUP_NODE] = 15,    [ACT_STALE_REPORT] = 15,  [ACT_BAD_JOIN] = 10,
    [ACT_DISCONNECT] = 10,  [ACT_RECONNECT] = 25,     [ACT_KILL] = 3,
    [ACT_RESTART] = 10,     [ACT_ADMIN_FENCE] = 2,    [ACT_TICK] = 80,
    [ACT_PAUSE] = 3,        [ACT_RESUME] = 12,        [ACT_RECV] = 70,
    [ACT_DUP_FRAME] = 6,    [ACT_DROP_NODE] = 10,     [ACT_REORDER_CP] = 15,
    [ACT_SELF_FENCE] = 10,  [ACT_CP_CRASH] = 2,
};

static bool g_trace;                   /* trace the final replay of a shrunk schedule */
static enum world_mutation g_mutation; /* --mutate: a rule taken out of the simulation */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void draw_schedule(uint64_t seed, struct action *acts, size_t n)
{
    unsigned total = 0;
    for (int k = 0; k < ACT_KIND_COUNT; k++)
        total += weights[k];
    uint64_t s = seed ^ 0xa5a5a5a5deadbeefull;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_next(&s);
        unsigned pick = (unsigned)(r % total);
        int k = 0;
        while (pick >= weights[k]) {
            pick -= weights[k];
            k++;
        }
        uint64_t r2 = rng_next(&s);
        acts[i] = (struct action){.kind = (uint8_t)k,
                                  .a = (uint32_t)(r >> 32),
                                  .b = (uint32_t)r2,
                                  .c = (uint32_t)(r2 >> 32)};
    }
}

/* Plays `acts` (those with keep[i]) on a fresh world; returns the failure
 * message (static copy) or NULL. */
static const char *play(uint64_t seed, bool old_node, const struct action *acts, const bool *keep,
                        size_t n, size_t *steps_p)
{
    static char msg[512];
    struct world_opts o = {.with_old_node = old_node, .trace = g_trace, .mutation = g_mutation};
    struct world *w = world_create(seed, &o);
    if (w == NULL) {
        fprintf(stderr, "explorer: out of memory\n");
        exit(2);
    }
    size_t steps = 0;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        if (keep == NULL || keep[i]) {
            ok = world_step(w, &acts[i]);
            steps++;
        }
    }
    if (ok)
        ok = world_quiesce(w);
    const char *f = NULL;
    if (!ok) {
        snprintf(msg, sizeof(msg), "%s", world_failure(w));
        f = msg;
    }
    if (steps_p != NULL)
        *steps_p = steps;
    world_destroy(w);
    return f;
}

/* Shrinks the kept set while the replay still fails (delta debugging on
 * chunks, halving down to single actions). */
/* Two failures are the same when they name the same invariant (the text
 * before the first ':'). */
static bool same_failure(const char *a, const char *b)
{
    if (a == NULL || b == NULL)
        return false;
    size_t la = strcspn(a, ":"), lb = strcspn(b, ":");
    return la == lb && strncmp(a, b, la) == 0;
}

static size_t shrink(uint64_t seed, bool old_node, const struct action *acts, bool *keep, size_t n,
                     const char *failure)
{
    size_t kept = n;
    int budget = 4000;
    for (size_t chunk = n / 2; chunk >= 1 && budget > 0; chunk /= 2) {
        bool progress = true;
        while (progress && budget > 0) {
            progress = false;
            for (size_t start = 0; start < n && budget > 0; start += chunk) {
                bool changed = false;
                bool saved[chunk];
                for (size_t i = 0; i < chunk && start + i < n; i++) {
                    saved[i] = keep[start + i];
                    changed = changed || keep[start + i];
                    keep[start + i] = false;
                }
                if (!changed)
                    continue;
                budget--;
                if (same_failure(play(seed, old_node, acts, keep, n, NULL), failure)) {
                    progress = true;
                } else {
                    for (size_t i = 0; i < chunk && start + i < n; i++)
                        keep[start + i] = saved[i];
                }
            }
        }
        if (chunk == 1)
            break;
    }
    kept = 0;
    for (size_t i = 0; i < n; i++)
        kept += keep[i];
    return kept;
}

static int report_failure(uint64_t seed, bool old_node, struct action *acts, size_t n,
                          const char *failure)
{
    printf("explorer: FAILED seed %" PRIu64 "%s: %s\n", seed, old_node ? " (old node)" : "",
           failure);
    bool *keep = malloc(n * sizeof(*keep));
    if (keep == NULL)
        return 1;
    for (size_t i = 0; i < n; i++)
        keep[i] = true;
    size_t kept = shrink(seed, old_node, acts, keep, n, failure);
    g_trace = true;
    const char *f = play(seed, old_node, acts, keep, n, NULL);
    printf("explorer: shortest schedule found: %zu of %zu actions, then quiesce; it fails with: "
           "%s\n",
           kept, n, f ? f : "(no failure: shrinking lost it)");
    for (size_t i = 0; i < n; i++) {
        if (keep[i])
            printf("  #%zu %s a=%u b=%u c=%u\n", i, act_name(acts[i].kind), acts[i].a, acts[i].b,
                   acts[i].c);
    }
    printf("explorer: reproduce with: kvf_explorer --replay-seed %" PRIu64 "\n", seed);
    free(keep);
    return 1;
}

int main(int argc, char **argv)
{
    uint64_t total_steps = 200000, per_seed = 2000, first_seed = 1;
    bool quiet = false, replay = false, expect_violation = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            total_steps = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--steps-per-seed") == 0 && i + 1 < argc)
            per_seed = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--first-seed") == 0 && i + 1 < argc)
            first_seed = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--replay-seed") == 0 && i + 1 < argc) {
            first_seed = strtoull(argv[++i], NULL, 10);
            replay = true;
        } else if (strcmp(argv[i], "--quiet") == 0)
            quiet = true;
        else if (strcmp(argv[i], "--mutate") == 0 && i + 1 < argc) {
            int m = world_mutation_by_name(argv[++i]);
            if (m < 0) {
                fprintf(stderr, "%s: unknown mutation '%s'\n", argv[0], argv[i]);
                return 2;
            }
            g_mutation = (enum world_mutation)m;
        } else if (strcmp(argv[i], "--expect-violation") == 0)
            expect_violation = true;
        else {
            fprintf(stderr,
                    "usage: %s [--steps N] [--steps-per-seed K] [--first-seed S] "
                    "[--replay-seed S] [--quiet] [--mutate NAME [--expect-violation]]\n",
                    argv[0]);
            return 2;
        }
    }
    if (per_seed == 0)
        per_seed = 1;
    struct action *acts = malloc(per_seed * sizeof(*acts));
    if (acts == NULL)
        return 2;
    uint64_t done = 0, seeds = 0;
    struct world_stats sum = {0};
    for (uint64_t seed = first_seed; done < total_steps || (replay && seeds == 0); seed++) {
        bool old_node = seed % 4 == 0;
        draw_schedule(seed, acts, per_seed);
        struct world_opts o = {.with_old_node = old_node, .mutation = g_mutation};
        struct world *w = world_create(seed, &o);
        if (w == NULL)
            return 2;
        bool ok = true;
        size_t i;
        for (i = 0; i < per_seed && ok; i++)
            ok = world_step(w, &acts[i]);
        if (ok)
            ok = world_quiesce(w);
        struct world_stats st;
        world_stats(w, &st);
        sum.rooms_created += st.rooms_created;
        sum.rooms_completed += st.rooms_completed;
        sum.rooms_aborted += st.rooms_aborted;
        sum.ops_admitted += st.ops_admitted;
        sum.ops_refused += st.ops_refused;
        sum.leases_released += st.leases_released;
        sum.reports_rejected += st.reports_rejected;
        sum.joins_refused += st.joins_refused;
        sum.fences += st.fences;
        sum.pauses += st.pauses;
        sum.frames_landed += st.frames_landed;
        sum.frames_dropped += st.frames_dropped;
        sum.self_fences += st.self_fences;
        sum.cp_crashes += st.cp_crashes;
        sum.chunks_refused += st.chunks_refused;
        sum.rooms_forgotten += st.rooms_forgotten;
        sum.late_answers += st.late_answers;
        sum.peers_recycled += st.peers_recycled;
        if (!ok && expect_violation) {
            /* The mutation was caught: that is the pass of this run. */
            printf("explorer: mutation %s caught after %" PRIu64 " steps (seed %" PRIu64
                   ", step %zu of it): %s\n",
                   world_mutation_name(g_mutation), done + i, seed, i, world_failure(w));
            printf("explorer: reproduce with: kvf_explorer --mutate %s --replay-seed %" PRIu64 "\n",
                   world_mutation_name(g_mutation), seed);
            world_destroy(w);
            free(acts);
            return 0;
        }
        if (!ok) {
            char failure[512];
            snprintf(failure, sizeof(failure), "%s", world_failure(w));
            world_destroy(w);
            int rc = report_failure(seed, old_node, acts, per_seed, failure);
            free(acts);
            return rc;
        }
        world_destroy(w);
        done += i;
        seeds++;
        if (!quiet && seeds % 25 == 0)
            printf("explorer: %" PRIu64 " seeds, %" PRIu64 " steps\n", seeds, done);
        if (replay)
            break;
    }
    free(acts);
    if (expect_violation) {
        printf("explorer: mutation %s was NOT caught in %" PRIu64 " steps over %" PRIu64 " seeds\n",
               world_mutation_name(g_mutation), done, seeds);
        return 1;
    }
    printf("explorer: %" PRIu64 " steps over %" PRIu64 " seeds (from %" PRIu64
           "), every invariant checked after every step\n",
           done, seeds, first_seed);
    printf(
        "explorer: rooms %" PRIu64 " created, %" PRIu64 " completed, %" PRIu64
        " aborted; ops %" PRIu64 " admitted, %" PRIu64 " refused after close; leases %" PRIu64
        " released; reports %" PRIu64 " rejected; joins %" PRIu64 " refused; fences %" PRIu64 "\n",
        sum.rooms_created, sum.rooms_completed, sum.rooms_aborted, sum.ops_admitted,
        sum.ops_refused, sum.leases_released, sum.reports_rejected, sum.joins_refused, sum.fences);
    printf("explorer: pauses %" PRIu64 "; frames %" PRIu64 " landed, %" PRIu64
           " dropped (closed, late, out of order, duplicate); self-fences %" PRIu64
           "; control-plane crashes %" PRIu64 "\n",
           sum.pauses, sum.frames_landed, sum.frames_dropped, sum.self_fences, sum.cp_crashes);
    printf("explorer: node cores: %" PRIu64 " chunks refused, %" PRIu64 " rooms forgotten, %" PRIu64
           " notices for a forgotten room answered, %" PRIu64 " peer slots recycled\n",
           sum.chunks_refused, sum.rooms_forgotten, sum.late_answers, sum.peers_recycled);
    /* The plain closing line CI reads. */
    printf("%" PRIu64 " passed, 0 failed\n", seeds);
    return 0;
}
