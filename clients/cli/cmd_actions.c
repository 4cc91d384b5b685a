/*
 * cmd_actions.c: the kvfence CLI's commands that act or follow (docs/cli.md):
 * abort and fence (Admin), watch (Control/WatchLeases, a server stream until
 * Ctrl-C or --count events) and health (grpc.health.v1.Health/Check).
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "grpc/health/v1/health.pb-c.h"
#include "kvf_error.h"
#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"

/* ---- abort --------------------------------------------------------------- */

int cli_cmd_abort(struct cli *c)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = c->room_id;
    key.generation = c->generation;
    Kvfence__V1__AdminAbortRoomRequest rq = KVFENCE__V1__ADMIN_ABORT_ROOM_REQUEST__INIT;
    rq.room = &key;
    rq.detail = c->reason ? (char *)c->reason : "kvfence abort";
    ProtobufCMessage *m = NULL;
    int rc = cli_call_view(c, "/kvfence.v1.Admin/AdminAbortRoom", &rq.base,
                           &kvfence__v1__abort_room_response__descriptor, &m);
    if (rc != EXIT_OK || cli_doc(c)) {
        return rc;
    }
    const Kvfence__V1__AbortRoomResponse *r = (const Kvfence__V1__AbortRoomResponse *)m;
    char b[64], tb[64];
    static const char *const h[] = {"ROOM",   "GENERATION",       "STATE",
                                    "REASON", "ALREADY_ABORTING", "TOKEN"};
    struct cli_table t;
    cli_table_init(&t, 6, h);
    cli_table_cell(&t, "%" PRIu64, r->room ? r->room->room_id : c->room_id);
    cli_table_cell(&t, "%" PRIu64, r->room ? r->room->generation : 0);
    cli_table_cell(&t, "%s", ROOM_STATE_NAME(r->state, b));
    cli_table_cell(&t, "%s", r->reason ? REASON_NAME(r->reason, b) : "-");
    cli_table_cell(&t, "%s", r->already_aborting ? "yes" : "no");
    cli_table_cell(&t, "%s", cli_fmt_token(r->token, tb, sizeof tb));
    rc = cli_finish_table(c, &t);
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- fence --------------------------------------------------------------- */

int cli_cmd_fence(struct cli *c)
{
    Kvfence__V1__FenceNodeRequest rq = KVFENCE__V1__FENCE_NODE_REQUEST__INIT;
    rq.node_id = (char *)c->args[0];
    ProtobufCMessage *m = NULL;
    int rc = cli_call_view(c, "/kvfence.v1.Admin/FenceNode", &rq.base,
                           &kvfence__v1__fence_node_response__descriptor, &m);
    if (rc != EXIT_OK || cli_doc(c)) {
        return rc;
    }
    const Kvfence__V1__FenceNodeResponse *r = (const Kvfence__V1__FenceNodeResponse *)m;
    static const char *const h[] = {"NODE", "INCARNATION", "FENCERS"};
    struct cli_table t;
    cli_table_init(&t, 3, h);
    cli_table_cell(&t, "%s", c->args[0]);
    cli_table_cell(&t, "%" PRIu64, r->incarnation);
    cli_table_cell(&t, "%u", r->fencers);
    rc = cli_finish_table(c, &t);
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- watch --------------------------------------------------------------- */

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void print_event_line(const Kvfence__V1__LeaseEvent *ev, const struct timespec *ts)
{
    char b[64], b2[64], tb[64];
    struct tm tm;
    localtime_r(&ts->tv_sec, &tm);
    char when[32];
    strftime(when, sizeof when, "%H:%M:%S", &tm);
    printf("%s.%03ld ", when, ts->tv_nsec / 1000000);
    switch (ev->event_case) {
    case KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED: {
        const Kvfence__V1__Lease *l = ev->released;
        const Kvfence__V1__Participant *p = l->participant;
        printf("released lease=%" PRIu64 " room=%" PRIu64 " generation=%" PRIu64
               " node=%s rank=%u role=%s pool=%u pages=%" PRIu64 "\n",
               l->lease_id, l->room ? l->room->room_id : 0, l->room ? l->room->generation : 0,
               p ? p->node_id : "-", p ? p->rank : 0, ROLE_NAME(p ? p->role : 0, b), l->pool_id,
               cli_lease_pages(l));
        break;
    }
    case KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE: {
        const Kvfence__V1__RoomStateChange *s = ev->room_state;
        printf("room_state room=%" PRIu64 " generation=%" PRIu64 " %s -> %s",
               s->room ? s->room->room_id : 0, s->room ? s->room->generation : 0,
               ROOM_STATE_NAME(s->old_state, b), ROOM_STATE_NAME(s->new_state, b2));
        if (s->reason) {
            printf(" reason=%s", REASON_NAME(s->reason, b));
        }
        if (s->token) {
            printf(" token=%s", cli_fmt_token(s->token, tb, sizeof tb));
        }
        printf("\n");
        break;
    }
    case KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED:
        printf("synced replayed=%" PRIu64 "\n", ev->synced->replayed);
        break;
    default:
        printf("unknown event\n");
        break;
    }
}

/* One event: a line, or a JSON document per line / a YAML document with the
 * time it was received first (receivedUnixMs, a string like every 64-bit
 * integer). */
static void print_event(const struct cli *c, const Kvfence__V1__LeaseEvent *ev)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (cli_doc(c)) {
        char ms[32];
        snprintf(ms, sizeof ms, "%" PRIu64,
                 (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000);
        struct cli_pb_extra extra = {.key = "receivedUnixMs", .value = ms};
        if (c->form == CLI_FORM_YAML) {
            fputs("---\n", stdout);
        }
        (void)cli_print_doc(c, &ev->base, &extra);
    } else {
        print_event_line(ev, &ts);
    }
    fflush(stdout);
}

int cli_cmd_watch(struct cli *c)
{
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    rq.node_id = c->node ? (char *)c->node : "";
    rq.include_room_states = c->room_states;
    size_t len = kvfence__v1__watch_leases_request__get_packed_size(&rq);
    uint8_t buf[1024];
    if (len > sizeof buf) {
        return cli_usage_error(c, "watch: filter too long");
    }
    kvfence__v1__watch_leases_request__pack(&rq, buf);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(c->ch, "/kvfence.v1.Control/WatchLeases", KVF_RPC_NO_TIMEOUT);
    if (!cs) {
        fprintf(stderr, "%s: cannot open the watch stream\n", cli_progname);
        return EXIT_SERVER;
    }
    int rc = kvf_rpc_client_stream_send(cs, buf, len);
    if (rc == 0) {
        rc = kvf_rpc_client_stream_half_close(cs);
    }
    int exit_code = EXIT_OK;
    uint64_t seen = 0;
    /* A send that failed because the stream ended: recv reports the status. */
    while (!interrupted && (c->count == 0 || seen < c->count)) {
        uint8_t *msg = NULL;
        size_t mlen = 0;
        struct kvf_rpc_status st = {0};
        rc = kvf_rpc_client_stream_recv(cs, 200, &msg, &mlen, &st);
        if (rc == -ETIMEDOUT) {
            continue;
        }
        if (rc == KVF_RPC_STREAM_END) {
            if (st.code != KVF_GRPC_OK) {
                exit_code = cli_report_status(&st);
            } else {
                fprintf(stderr, "%s: the server ended the watch\n", cli_progname);
                exit_code = EXIT_UNREACHABLE;
            }
            break;
        }
        if (rc != 0) {
            fprintf(stderr, "%s: watch: receive failed (%s)\n", cli_progname, strerror(-rc));
            exit_code = EXIT_SERVER;
            break;
        }
        Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
        free(msg);
        if (!ev) {
            fprintf(stderr, "%s: watch: undecodable event\n", cli_progname);
            exit_code = EXIT_SERVER;
            break;
        }
        print_event(c, ev);
        if (ev->event_case != KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED) {
            seen++;
        }
        kvfence__v1__lease_event__free_unpacked(ev, NULL);
    }
    kvf_rpc_client_stream_close(cs);
    return exit_code;
}

/* ---- health -------------------------------------------------------------- */

/*
 * grpc.health.v1.Health/Check of --service (default "": the server as a
 * whole). SERVING: prints it, exit 0. NOT_SERVING (recovering, shutting
 * down) or UNKNOWN: nothing on stdout, the status on stderr, exit 3, as for a
 * server that cannot be reached. A service the server does not know:
 * NOT_FOUND, exit 4.
 */
int cli_cmd_health(struct cli *c)
{
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = c->service ? (char *)c->service : "";
    ProtobufCMessage *m = NULL;
    int rc = cli_call(c, "/grpc.health.v1.Health/Check", &rq.base,
                      &grpc__health__v1__health_check_response__descriptor, &m);
    if (rc != EXIT_OK) {
        return rc;
    }
    const Grpc__Health__V1__HealthCheckResponse *r =
        (const Grpc__Health__V1__HealthCheckResponse *)m;
    char b[64];
    const char *name =
        cli_enum_name(&grpc__health__v1__health_check_response__serving_status__descriptor, "",
                      r->status, b, sizeof b);
    if (r->status != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING) {
        fprintf(stderr, "%s: %s: health of '%s'\n", cli_progname, name, rq.service);
        rc = EXIT_UNREACHABLE;
    } else if (cli_doc(c)) {
        rc = cli_print_doc(c, m, NULL);
    } else {
        printf("%s\n", name);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}
