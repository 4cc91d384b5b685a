/*
 * faults.c: the node's fault injection (faults.h): the fault file, the
 * transport wrapper's knobs and the control-message / report drops.
 */
#include "faults.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "node_log.h"
#include "node_types.h"
#include "peer_channel.h"

#define FAULT_FILE_MAX 4096

struct node_faults {
    char path[512];
    struct node_fault_cfg cfg; /* drop_* count down as they fire */
    int64_t next_check_ms;
    bool peer_pending; /* peer faults loaded before the channel existed */
    bool rdma_applied; /* rdma_hold as last handed to the RDMA side */
    bool odd_applied;  /* rdma_hold_odd, the same */
    bool seen;         /* the file existed at the last check */
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    struct node_job *held, *held_tail; /* SubmitChunks requests (hold_stream) */
    uint64_t nheld;
    struct node_job *held_cm, *held_cm_tail; /* RoomUpdates (hold_room_update) */
    uint64_t nheld_cm;
    const struct node_fault_hooks *hooks; /* the owner's (faults.h) */
    void *hooks_ctx;
};

/* ---- parsing ------------------------------------------------------------------ */

struct fault_key {
    const char *name;
    size_t off;
    uint64_t max;
};

#define CFG_OFF(f) offsetof(struct node_fault_cfg, f)

static const struct fault_key fault_keys[] = {
    {"post_fail", CFG_OFF(xport.fail_post_nth), UINT64_MAX},
    {"op_error", CFG_OFF(xport.error_nth), UINT64_MAX},
    {"hold_stream", CFG_OFF(hold_stream), 1},
    {"hold_room_update", CFG_OFF(hold_room_update), 1},
    {"drop_room_update", CFG_OFF(drop_room_update), UINT64_MAX},
    {"ack_drop_room_update", CFG_OFF(ack_drop_room_update), UINT64_MAX},
    {"refuse_room_open", CFG_OFF(refuse_room_open), UINT64_MAX},
    {"stage_fail", CFG_OFF(stage_fail), UINT64_MAX},
    {"drop_abort", CFG_OFF(drop_abort), UINT64_MAX},
    {"drop_fence", CFG_OFF(drop_fence), UINT64_MAX},
    {"drop_drained", CFG_OFF(drop_drained), UINT64_MAX},
    {"drop_completed", CFG_OFF(drop_completed), UINT64_MAX},
    {"drop_peer_fenced", CFG_OFF(drop_peer_fenced), UINT64_MAX},
    {"peer_drop", CFG_OFF(peer_drop), UINT64_MAX},
    {"peer_dup", CFG_OFF(peer_dup), UINT64_MAX},
    {"peer_delay", CFG_OFF(peer_delay), UINT64_MAX},
    {"peer_delay_after", CFG_OFF(peer_delay_after), UINT32_MAX},
    {"rdma_hold", CFG_OFF(rdma_hold), 1},
    {"rdma_hold_odd", CFG_OFF(rdma_hold_odd), 1},
    {"rdma_bad_notice", CFG_OFF(rdma_bad_notice), UINT64_MAX},
    {"rdma_drop_hello", CFG_OFF(rdma_drop_hello), UINT64_MAX},
    {"rdma_wr_error", CFG_OFF(rdma_wr_error), UINT64_MAX},
};

static char *trim(char *s, char *end)
{
    while (s < end && isspace((unsigned char)*s))
        s++;
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    *end = '\0';
    return s;
}

int node_fault_parse(const char *text, struct node_fault_cfg *cfg, char *err, size_t errlen)
{
    struct node_fault_cfg c;
    memset(&c, 0, sizeof c);
    char line[256];
    unsigned lineno = 0;
    const char *p = text;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        lineno++;
        if (len >= sizeof line) {
            snprintf(err, errlen, "line %u: longer than %zu bytes", lineno, sizeof line - 1);
            return -EINVAL;
        }
        memcpy(line, p, len);
        line[len] = '\0';
        p = nl ? nl + 1 : p + len;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *s = trim(line, line + strlen(line));
        if (!*s)
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "line %u: '%s': want key=value", lineno, s);
            return -EINVAL;
        }
        *eq = '\0';
        char *key = trim(s, eq);
        char *val = trim(eq + 1, eq + 1 + strlen(eq + 1));
        char *vend = NULL;
        errno = 0;
        unsigned long long v = strtoull(val, &vend, 10);
        if (!*val || *vend || errno || val[0] == '-') {
            snprintf(err, errlen, "line %u: %s: '%s' is not a count", lineno, key, val);
            return -EINVAL;
        }
        if (strcmp(key, "hold") == 0) {
            if (v > 1) {
                snprintf(err, errlen, "line %u: hold: want 0 or 1", lineno);
                return -EINVAL;
            }
            c.xport.hold = v == 1;
            continue;
        }
        const struct fault_key *k = NULL;
        for (size_t i = 0; i < sizeof fault_keys / sizeof fault_keys[0]; i++)
            if (strcmp(fault_keys[i].name, key) == 0)
                k = &fault_keys[i];
        if (!k) {
            snprintf(err, errlen, "line %u: unknown key '%s'", lineno, key);
            return -EINVAL;
        }
        if (v > k->max) {
            snprintf(err, errlen, "line %u: %s: at most %" PRIu64, lineno, key, k->max);
            return -EINVAL;
        }
        memcpy((char *)&c + k->off, &(uint64_t){v}, sizeof(uint64_t));
        if (strncmp(key, "peer_", 5) == 0)
            c.peer_keys = true;
    }
    *cfg = c;
    return 0;
}

void node_fault_peer(const struct node_fault_cfg *cfg, struct kvf_peer_fault *out)
{
    memset(out, 0, sizeof *out);
    out->drop_nth = cfg->peer_drop;
    out->duplicate_nth = cfg->peer_dup;
    out->delay_nth = cfg->peer_delay;
    out->delay_after = (uint32_t)(cfg->peer_delay_after ? cfg->peer_delay_after : 1);
}

/* ---- the file ------------------------------------------------------------------ */

static void fault_log(void *ctx, const char *what, const struct kvf_xfer *x, int rc)
{
    (void)ctx;
    node_log(strcmp(what, "hold") == 0 ? "info" : "warn", &x->room,
             "fault: %s frame to peer %u (pool %u pages %u+%u)%s%s", what, x->peer, x->sink_pool,
             x->first_page, x->page_count, rc ? ": " : "", rc ? strerror(-rc) : "");
}

/* The peer channel starts after the first load: its faults wait for it. */
static void apply_peer(struct kvf_node *n)
{
    if (!n->faults->peer_pending || !n->peerch)
        return;
    n->faults->peer_pending = false;
    struct kvf_peer_fault pf;
    node_fault_peer(&n->faults->cfg, &pf);
    kvf_peer_channel_set_fault(n->peerch, &pf);
    node_log("info", NULL,
             "fault: peer channel faults set: drop_nth=%" PRIu64 " duplicate_nth=%" PRIu64
             " delay_nth=%" PRIu64 " delay_after=%u",
             pf.drop_nth, pf.duplicate_nth, pf.delay_nth, pf.delay_after);
}

static void apply(struct kvf_node *n, const struct node_fault_cfg *c, const char *why)
{
    n->faults->cfg = *c;
    node_log("info", NULL,
             "fault: config %s: hold=%d hold_stream=%" PRIu64 " hold_room_update=%" PRIu64
             " post_fail=%" PRIu64 " op_error=%" PRIu64 " drop_room_update=%" PRIu64
             " drop_abort=%" PRIu64 " drop_fence=%" PRIu64 " drop_drained=%" PRIu64
             " drop_completed=%" PRIu64 " drop_peer_fenced=%" PRIu64 " peer_drop=%" PRIu64
             " peer_dup=%" PRIu64 " peer_delay=%" PRIu64 " rdma_hold=%" PRIu64
             " rdma_bad_notice=%" PRIu64 " rdma_drop_hello=%" PRIu64 " rdma_wr_error=%" PRIu64
             " rdma_hold_odd=%" PRIu64 " refuse_room_open=%" PRIu64 " stage_fail=%" PRIu64,
             why, c->xport.hold, c->hold_stream, c->hold_room_update, c->xport.fail_post_nth,
             c->xport.error_nth, c->drop_room_update, c->drop_abort, c->drop_fence, c->drop_drained,
             c->drop_completed, c->drop_peer_fenced, c->peer_drop, c->peer_dup, c->peer_delay,
             c->rdma_hold, c->rdma_bad_notice, c->rdma_drop_hello, c->rdma_wr_error,
             c->rdma_hold_odd, c->refuse_room_open, c->stage_fail);
    kvf_transport_fault_set(n->tcp_io, &c->xport);
    if (n->faults->rdma_applied != (c->rdma_hold != 0)) {
        n->faults->rdma_applied = c->rdma_hold != 0;
        n->faults->hooks->rdma_hold(n->faults->hooks_ctx, n->faults->rdma_applied);
    }
    if (n->faults->odd_applied != (c->rdma_hold_odd != 0)) {
        n->faults->odd_applied = c->rdma_hold_odd != 0;
        n->faults->hooks->rdma_hold_odd(n->faults->hooks_ctx, n->faults->odd_applied);
    }
    n->faults->peer_pending = c->peer_keys;
    apply_peer(n);
}

static void reload(struct kvf_node *n)
{
    struct node_faults *f = n->faults;
    struct stat st;
    if (stat(f->path, &st) != 0) {
        if (f->seen) {
            f->seen = false;
            struct node_fault_cfg none;
            memset(&none, 0, sizeof none);
            apply(n, &none, "file removed");
        }
        return;
    }
    if (f->seen && st.st_dev == f->dev && st.st_ino == f->ino && st.st_size == f->size &&
        st.st_mtim.tv_sec == f->mtime.tv_sec && st.st_mtim.tv_nsec == f->mtime.tv_nsec)
        return;
    FILE *fp = fopen(f->path, "r");
    if (!fp)
        return; /* replaced meanwhile: the next check sees it */
    char buf[FAULT_FILE_MAX + 1];
    size_t len = fread(buf, 1, FAULT_FILE_MAX + 1, fp);
    fclose(fp);
    f->seen = true;
    f->dev = st.st_dev;
    f->ino = st.st_ino;
    f->size = st.st_size;
    f->mtime = st.st_mtim;
    if (len > FAULT_FILE_MAX) {
        node_log("error", NULL, "fault: %s: larger than %d bytes: ignored", f->path,
                 FAULT_FILE_MAX);
        return;
    }
    buf[len] = '\0';
    struct node_fault_cfg c;
    char err[160];
    if (node_fault_parse(buf, &c, err, sizeof err) != 0) {
        node_log("error", NULL, "fault: %s: %s: ignored", f->path, err);
        return;
    }
    apply(n, &c, "loaded");
}

int node_faults_start(struct kvf_node *n, const char *path, const struct node_fault_hooks *hooks,
                      void *ctx)
{
    struct node_faults *f = calloc(1, sizeof *f);
    if (!f)
        return -ENOMEM;
    f->hooks = hooks;
    f->hooks_ctx = ctx;
    snprintf(f->path, sizeof f->path, "%s", path);
    struct kvf_transport *w = kvf_transport_fault_create(n->tcp, fault_log, n);
    if (!w) {
        free(f);
        return -ENOMEM;
    }
    n->faults = f;
    n->tcp_io = w;
    node_log("info", NULL, "fault injection on: watching %s", f->path);
    reload(n);
    return 0;
}

/* hold_stream off, or the node stops: the held requests run, in order. */
static void release_held(struct kvf_node *n)
{
    struct node_faults *f = n->faults;
    if (!f->held || (f->cfg.hold_stream && !n->stop_requested))
        return;
    node_log("info", NULL, "fault: running %" PRIu64 " held SubmitChunks requests", f->nheld);
    while (f->held) {
        struct node_job *j = f->held;
        f->held = j->next;
        f->hooks->run_stream(f->hooks_ctx, j);
        f->hooks->job_free(f->hooks_ctx, j);
    }
    f->held_tail = NULL;
    f->nheld = 0;
}

/* hold_room_update off: the held RoomUpdates go back to the owner's queue,
 * in order (a stream given up meanwhile drops them there). */
static void release_held_cm(struct kvf_node *n)
{
    struct node_faults *f = n->faults;
    if (!f->held_cm || f->cfg.hold_room_update)
        return;
    node_log("info", NULL, "fault: letting %" PRIu64 " held RoomUpdates through", f->nheld_cm);
    while (f->held_cm) {
        struct node_job *j = f->held_cm;
        f->held_cm = j->next;
        j->kept = false;
        if (f->hooks->repost(f->hooks_ctx, j) != 0)
            f->hooks->job_free(f->hooks_ctx, j); /* the owner is exiting */
    }
    f->held_cm_tail = NULL;
    f->nheld_cm = 0;
}

bool node_fault_hold_control(struct kvf_node *n, struct node_job *j)
{
    struct node_faults *f = n->faults;
    if (!f || (!f->cfg.hold_room_update && !f->held_cm))
        return false;
    j->next = NULL;
    if (f->held_cm_tail)
        f->held_cm_tail->next = j;
    else
        f->held_cm = j;
    f->held_cm_tail = j;
    f->nheld_cm++;
    node_log("info", NULL, "fault: holding a RoomUpdate (%" PRIu64 " held)", f->nheld_cm);
    return true;
}

void node_faults_tick(struct kvf_node *n)
{
    if (!n->faults)
        return;
    release_held(n);
    int64_t now = node_now_ms();
    if (now < n->faults->next_check_ms)
        return;
    n->faults->next_check_ms = now + NODE_FAULT_CHECK_MS;
    reload(n);
    apply_peer(n);
    release_held(n);
    release_held_cm(n);
}

bool node_fault_hold_stream(struct kvf_node *n, struct node_job *j)
{
    struct node_faults *f = n->faults;
    /* While some are held, later ones queue behind them (request order). */
    if (!f || n->stop_requested || (!f->cfg.hold_stream && !f->held))
        return false;
    j->next = NULL;
    if (f->held_tail)
        f->held_tail->next = j;
    else
        f->held = j;
    f->held_tail = j;
    if (f->nheld++ == 0)
        node_log("info", NULL, "fault: holding SubmitChunks requests");
    return true;
}

static bool take(uint64_t *count)
{
    if (*count == 0)
        return false;
    (*count)--;
    return true;
}

bool node_fault_drop_control(struct kvf_node *n, int msg_case)
{
    if (!n->faults)
        return false;
    struct node_fault_cfg *c = &n->faults->cfg;
    const char *what = NULL;
    uint64_t *cnt = NULL;
    switch (msg_case) {
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE:
        what = "RoomUpdate";
        cnt = &c->drop_room_update;
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE:
        what = "AbortNotice";
        cnt = &c->drop_abort;
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER:
        what = "FencePeer";
        cnt = &c->drop_fence;
        break;
    default:
        return false;
    }
    if (!take(cnt))
        return false;
    node_log("warn", NULL, "fault: dropped a %s (%" PRIu64 " more to drop)", what, *cnt);
    return true;
}

bool node_fault_ack_drop_room_update(struct kvf_node *n)
{
    if (!n->faults || !take(&n->faults->cfg.ack_drop_room_update))
        return false;
    node_log("warn", NULL, "fault: acknowledged a RoomUpdate and dropped it (%" PRIu64 " more)",
             n->faults->cfg.ack_drop_room_update);
    return true;
}

bool node_fault_refuse_room_open(struct kvf_node *n)
{
    if (!n->faults || !take(&n->faults->cfg.refuse_room_open))
        return false;
    node_log("warn", NULL, "fault: refused to open a room (%" PRIu64 " more)",
             n->faults->cfg.refuse_room_open);
    return true;
}

bool node_fault_stage_fail(struct kvf_node *n)
{
    if (!n->faults || !take(&n->faults->cfg.stage_fail))
        return false;
    node_log("warn", NULL, "fault: a staging copy not started (%" PRIu64 " more)",
             n->faults->cfg.stage_fail);
    return true;
}

bool node_fault_drop_report(struct kvf_node *n, int msg_case)
{
    if (!n->faults)
        return false;
    struct node_fault_cfg *c = &n->faults->cfg;
    const char *what = NULL;
    uint64_t *cnt = NULL;
    switch (msg_case) {
    case KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED:
        what = "Drained";
        cnt = &c->drop_drained;
        break;
    case KVFENCE__V1__NODE_MESSAGE__MSG_COMPLETED:
        what = "Completed";
        cnt = &c->drop_completed;
        break;
    case KVFENCE__V1__NODE_MESSAGE__MSG_PEER_FENCED:
        what = "PeerFenced";
        cnt = &c->drop_peer_fenced;
        break;
    default:
        return false;
    }
    if (!take(cnt))
        return false;
    node_log("warn", NULL, "fault: did not send a %s report (%" PRIu64 " more to drop)", what,
             *cnt);
    return true;
}

void node_faults_unwrap(struct kvf_node *n)
{
    if (n->faults)
        kvf_transport_destroy(n->tcp_io);
    n->tcp_io = NULL;
}

int node_faults_wrap(struct kvf_node *n)
{
    if (!n->faults) {
        n->tcp_io = n->tcp;
        return 0;
    }
    struct kvf_transport *w = kvf_transport_fault_create(n->tcp, fault_log, n);
    if (!w) {
        n->tcp_io = n->tcp; /* no faults rather than no transport */
        return -ENOMEM;
    }
    n->tcp_io = w;
    /* The loaded configuration again (its counts start over), and the peer
     * keys for the new peer channel. */
    kvf_transport_fault_set(w, &n->faults->cfg.xport);
    n->faults->peer_pending = n->faults->cfg.peer_keys;
    apply_peer(n);
    return 0;
}

void node_faults_stop(struct kvf_node *n)
{
    if (!n->faults)
        return;
    struct node_faults *f = n->faults;
    while (f->held) { /* not run: the owner is gone (it runs them at stop) */
        struct node_job *j = f->held;
        f->held = j->next;
        f->hooks->job_free(f->hooks_ctx, j);
    }
    while (f->held_cm) {
        struct node_job *j = f->held_cm;
        f->held_cm = j->next;
        f->hooks->job_free(f->hooks_ctx, j);
    }
    kvf_transport_destroy(n->tcp_io);
    n->tcp_io = n->tcp;
    free(n->faults);
    n->faults = NULL;
}

bool node_fault_rdma_hold(const struct kvf_node *n)
{
    return n->faults && n->faults->cfg.rdma_hold != 0;
}

bool node_fault_rdma_take(struct kvf_node *n, enum node_fault_rdma which)
{
    if (!n->faults)
        return false;
    struct node_fault_cfg *c = &n->faults->cfg;
    static const char *const what[] = {"a bad ChunkNotice (pages outside the sink lease)",
                                       "a LinkHello dropped", "an RDMA chunk with a wrong rkey"};
    uint64_t *cnt = which == NODE_FAULT_RDMA_BAD_NOTICE   ? &c->rdma_bad_notice
                    : which == NODE_FAULT_RDMA_DROP_HELLO ? &c->rdma_drop_hello
                                                          : &c->rdma_wr_error;
    if (!take(cnt))
        return false;
    node_log("warn", NULL, "fault: %s (%" PRIu64 " more)", what[which], *cnt);
    return true;
}
