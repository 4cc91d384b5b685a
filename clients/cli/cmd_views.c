/*
 * cmd_views.c: the kvfence CLI's read-only commands (docs/cli.md): nodes,
 * node, rooms, room, leases, stats. Each calls the Admin service and prints
 * the reply as it came (-o json / yaml: the reply message, or a listing's
 * pages as one reply) or as a table (-o wide: more columns). Table cells that
 * the reply leaves unset print as "-".
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kvfence/v1/control.pb-c.h"

/* ---- nodes / node -------------------------------------------------------- */

static const char *ms_cell(uint64_t ms, char *b, size_t len)
{
    if (ms == 0) {
        snprintf(b, len, "-");
        return b;
    }
    return cli_fmt_duration(ms, b, len);
}

/* A string cell: the string, "-" when unset or empty. */
static const char *str_cell(const char *s)
{
    return s && s[0] ? s : "-";
}

/* A number cell where 0 means unset: "-". */
static void u32_cell(struct cli_table *t, uint32_t v)
{
    if (v) {
        cli_table_cell(t, "%u", v);
    } else {
        cli_table_cell(t, "-");
    }
}

/* Appends item `k` (`s`) to the comma-separated list in b, *off long so
 * far; a list cut short at `len` stays a string. */
static void list_append(char *b, size_t len, size_t *off, size_t k, const char *s)
{
    if (*off >= len) {
        return;
    }
    int w = snprintf(b + *off, len - *off, "%s%s", k ? "," : "", s);
    *off += w > 0 ? (size_t)w : 0;
}

static const char *features_cell(const Kvfence__V1__NodeInfo *n, char *b, size_t len)
{
    size_t off = 0;
    b[0] = '\0';
    for (size_t k = 0; n->capabilities && k < n->capabilities->n_features; k++) {
        list_append(b, len, &off, k, n->capabilities->features[k]);
    }
    return str_cell(b);
}

static const char *endpoints_cell(const Kvfence__V1__NodeInfo *n, char *b, size_t len)
{
    size_t off = 0;
    b[0] = '\0';
    for (size_t k = 0; k < n->n_endpoints; k++) {
        list_append(b, len, &off, k, n->endpoints[k]->address);
    }
    return str_cell(b);
}

int cli_cmd_nodes(struct cli *c)
{
    Kvfence__V1__ListNodesRequest rq = KVFENCE__V1__LIST_NODES_REQUEST__INIT;
    struct cli_pages pg = {0};
    int rc = cli_call_paged_view(c, "ListNodes", &rq.base, &rq.page_token,
                                 &kvfence__v1__list_nodes_response__descriptor, "nodes", &pg);
    if (rc != EXIT_OK || cli_doc(c)) {
        goto out;
    }
    bool wide = c->form == CLI_FORM_WIDE;
    static const char *const h[] = {
        "NODE",      "INCARNATION", "STATE",     "PROTO",    "ROOMS",     "POOLS",  "NOTICES",
        "STATE_AGE", "LAST_SEEN",   "FENCED_BY", "FEATURES", "ENDPOINTS", "VERSION"};
    struct cli_table t;
    cli_table_init(&t, wide ? 13 : 9, h);
    char b[64], big[512];
    for (size_t p = 0; p < pg.n; p++) {
        const Kvfence__V1__ListNodesResponse *r = (const Kvfence__V1__ListNodesResponse *)pg.v[p];
        for (size_t i = 0; i < r->n_nodes; i++) {
            const Kvfence__V1__NodeInfo *n = r->nodes[i];
            cli_table_cell(&t, "%s", n->node_id);
            cli_table_cell(&t, "%" PRIu64, n->incarnation);
            cli_table_cell(&t, "%s", NODE_STATE_NAME(n->state, b));
            u32_cell(&t, n->protocol_version);
            cli_table_cell(&t, "%u", n->room_count);
            cli_table_cell(&t, "%zu", n->n_pools);
            cli_table_cell(&t, "%u", n->notices_pending);
            cli_table_cell(&t, "%s", ms_cell(n->state_age_ms, b, sizeof b));
            cli_table_cell(&t, "%s", ms_cell(n->last_seen_ms, b, sizeof b));
            if (wide) {
                cli_table_cell(&t, "%u", n->fenced_by);
                cli_table_cell(&t, "%s", features_cell(n, big, sizeof big));
                cli_table_cell(&t, "%s", endpoints_cell(n, big, sizeof big));
                cli_table_cell(&t, "%s", str_cell(n->software_version));
            }
        }
    }
    rc = cli_finish_table(c, &t);
out:
    cli_pages_free(&pg);
    return rc;
}

/* The RELEASING leases of `node` (their pages in *pg), fetched before
 * anything is printed: a failed call leaves stdout empty. */
static int node_releasing_leases(struct cli *c, const char *node, struct cli_pages *pg)
{
    Kvfence__V1__ListLeasesRequest rq = KVFENCE__V1__LIST_LEASES_REQUEST__INIT;
    rq.node_id = (char *)node;
    Kvfence__V1__LeaseState releasing = KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASING;
    rq.n_states = 1;
    rq.states = &releasing;
    return cli_call_paged(c, "ListLeases", &rq.base, &rq.page_token,
                          &kvfence__v1__list_leases_response__descriptor, pg);
}

/* Those of the leases that wait for a proof from the node's host, as a table. */
static int print_waiting_leases(const struct cli *c, const struct cli_pages *pg)
{
    static const char *const h[] = {"LEASE", "ROOM", "GENERATION", "RANK", "ROLE", "POOL", "PAGES"};
    struct cli_table t;
    cli_table_init(&t, 7, h);
    size_t rows = 0;
    char b[64];
    for (size_t p = 0; p < pg->n; p++) {
        const Kvfence__V1__ListLeasesResponse *r =
            (const Kvfence__V1__ListLeasesResponse *)pg->v[p];
        for (size_t i = 0; i < r->n_leases; i++) {
            const Kvfence__V1__Lease *l = r->leases[i];
            if (!l->awaiting_host_proof) {
                continue;
            }
            rows++;
            cli_table_cell(&t, "%" PRIu64, l->lease_id);
            cli_table_cell(&t, "%" PRIu64, l->room ? l->room->room_id : 0);
            cli_table_cell(&t, "%" PRIu64, l->room ? l->room->generation : 0);
            cli_table_cell(&t, "%u", l->participant ? l->participant->rank : 0);
            cli_table_cell(&t, "%s", ROLE_NAME(l->participant ? l->participant->role : 0, b));
            cli_table_cell(&t, "%u", l->pool_id);
            cli_table_cell(&t, "%" PRIu64, cli_lease_pages(l));
        }
    }
    printf("\nleases waiting for a proof from its host: %zu\n", rows);
    if (!rows) {
        cli_table_free(&t);
        return EXIT_OK;
    }
    return cli_finish_table(c, &t);
}

int cli_cmd_node(struct cli *c)
{
    Kvfence__V1__GetNodeRequest rq = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    rq.node_id = (char *)c->args[0];
    ProtobufCMessage *m = NULL;
    int rc = cli_call_view(c, "/kvfence.v1.Admin/GetNode", &rq.base,
                           &kvfence__v1__node_info__descriptor, &m);
    if (rc != EXIT_OK || cli_doc(c)) {
        return rc;
    }
    const Kvfence__V1__NodeInfo *n = (const Kvfence__V1__NodeInfo *)m;
    struct cli_pages leases = {0};
    rc = node_releasing_leases(c, n->node_id, &leases);
    if (rc != EXIT_OK) {
        cli_pages_free(&leases);
        protobuf_c_message_free_unpacked(m, NULL);
        return rc;
    }
    char b[64], big[512];
    struct cli_table kv;
    cli_table_init(&kv, 2, NULL);
    cli_table_cell(&kv, "node:");
    cli_table_cell(&kv, "%s", n->node_id);
    cli_table_cell(&kv, "incarnation:");
    cli_table_cell(&kv, "%" PRIu64, n->incarnation);
    cli_table_cell(&kv, "state:");
    cli_table_cell(&kv, "%s", NODE_STATE_NAME(n->state, b));
    cli_table_cell(&kv, "state age:");
    cli_table_cell(&kv, "%s", ms_cell(n->state_age_ms, b, sizeof b));
    cli_table_cell(&kv, "session:");
    if (n->last_seen_ms) {
        cli_table_cell(&kv, "attached, last message %s ago", ms_cell(n->last_seen_ms, b, sizeof b));
    } else {
        cli_table_cell(&kv, "none");
    }
    cli_table_cell(&kv, "software version:");
    cli_table_cell(&kv, "%s", str_cell(n->software_version));
    cli_table_cell(&kv, "protocol:");
    if (n->capabilities) {
        cli_table_cell(&kv, "%u (advertised %u..%u)", n->protocol_version,
                       n->capabilities->protocol_min, n->capabilities->protocol_max);
    } else {
        cli_table_cell(&kv, "%u", n->protocol_version);
    }
    cli_table_cell(&kv, "features:");
    cli_table_cell(&kv, "%s", features_cell(n, big, sizeof big));
    cli_table_cell(&kv, "endpoints:");
    cli_table_cell(&kv, "%s", endpoints_cell(n, big, sizeof big));
    cli_table_cell(&kv, "rooms:");
    cli_table_cell(&kv, "%u", n->room_count);
    cli_table_cell(&kv, "notices pending:");
    cli_table_cell(&kv, "%u", n->notices_pending);
    cli_table_cell(&kv, "fenced by:");
    cli_table_cell(&kv, "%u peers (%u fences pending)", n->fenced_by, n->fences_pending);
    rc = cli_finish_table(c, &kv);
    if (rc == EXIT_OK) {
        static const char *const h[] = {"POOL", "PAGE_SIZE", "PAGE_COUNT", "KEY"};
        struct cli_table t;
        cli_table_init(&t, 4, h);
        for (size_t i = 0; i < n->n_pools; i++) {
            const Kvfence__V1__Pool *pl = n->pools[i];
            cli_table_cell(&t, "%u", pl->pool_id);
            cli_table_cell(&t, "%u", pl->page_size);
            cli_table_cell(&t, "%u", pl->page_count);
            cli_table_cell(&t, "%s", str_cell(pl->pool_key));
        }
        printf("\n");
        rc = cli_finish_table(c, &t);
    }
    if (rc == EXIT_OK) {
        rc = print_waiting_leases(c, &leases);
    }
    cli_pages_free(&leases);
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- rooms / room -------------------------------------------------------- */

int cli_cmd_rooms(struct cli *c)
{
    Kvfence__V1__ListRoomsRequest rq = KVFENCE__V1__LIST_ROOMS_REQUEST__INIT;
    rq.n_states = c->nstates;
    rq.states = (Kvfence__V1__RoomState *)c->states;
    rq.node_id = c->node ? (char *)c->node : "";
    rq.min_age_ms = c->min_age_ms;
    struct cli_pages pg = {0};
    int rc = cli_call_paged_view(c, "ListRooms", &rq.base, &rq.page_token,
                                 &kvfence__v1__list_rooms_response__descriptor, "rooms", &pg);
    if (rc != EXIT_OK || cli_doc(c)) {
        goto out;
    }
    bool wide = c->form == CLI_FORM_WIDE;
    static const char *const h[] = {"ROOM",  "GENERATION", "STATE",  "PARTICIPANTS",
                                    "AGE",   "STATE_AGE",  "REASON", "PAST_DEADLINE",
                                    "TOKEN", "SOURCES",    "SINKS",  "PROTO"};
    struct cli_table t;
    cli_table_init(&t, wide ? 12 : 9, h);
    char b[64];
    for (size_t p = 0; p < pg.n; p++) {
        const Kvfence__V1__ListRoomsResponse *r = (const Kvfence__V1__ListRoomsResponse *)pg.v[p];
        for (size_t i = 0; i < r->n_rooms; i++) {
            const Kvfence__V1__RoomInfo *ri = r->rooms[i];
            cli_table_cell(&t, "%" PRIu64, ri->room ? ri->room->room_id : 0);
            cli_table_cell(&t, "%" PRIu64, ri->room ? ri->room->generation : 0);
            cli_table_cell(&t, "%s", ROOM_STATE_NAME(ri->state, b));
            cli_table_cell(&t, "%u/%u", ri->participant_count,
                           ri->expected_sources + ri->expected_sinks);
            cli_table_cell(&t, "%s", cli_fmt_duration(ri->age_ms, b, sizeof b));
            cli_table_cell(&t, "%s", cli_fmt_duration(ri->state_age_ms, b, sizeof b));
            cli_table_cell(&t, "%s", ri->abort_reason ? REASON_NAME(ri->abort_reason, b) : "-");
            cli_table_cell(&t, "%s", ri->past_drain_deadline ? "yes" : "no");
            cli_table_cell(&t, "%s", cli_fmt_token(ri->token, b, sizeof b));
            if (wide) {
                cli_table_cell(&t, "%u", ri->expected_sources);
                cli_table_cell(&t, "%u", ri->expected_sinks);
                u32_cell(&t, ri->protocol_version);
            }
        }
    }
    rc = cli_finish_table(c, &t);
out:
    cli_pages_free(&pg);
    return rc;
}

static void room_block(struct cli_table *kv, const Kvfence__V1__RoomInfo *r)
{
    char b[64];
    cli_table_cell(kv, "room:");
    cli_table_cell(kv, "%" PRIu64, r->room ? r->room->room_id : 0);
    cli_table_cell(kv, "generation:");
    cli_table_cell(kv, "%" PRIu64, r->room ? r->room->generation : 0);
    cli_table_cell(kv, "state:");
    cli_table_cell(kv, "%s", ROOM_STATE_NAME(r->state, b));
    cli_table_cell(kv, "abort reason:");
    cli_table_cell(kv, "%s", r->abort_reason ? REASON_NAME(r->abort_reason, b) : "-");
    cli_table_cell(kv, "token:");
    cli_table_cell(kv, "%s", cli_fmt_token(r->token, b, sizeof b));
    cli_table_cell(kv, "participants:");
    cli_table_cell(kv, "%u of %u (%u sources, %u sinks)", r->participant_count,
                   r->expected_sources + r->expected_sinks, r->expected_sources, r->expected_sinks);
    cli_table_cell(kv, "protocol version:");
    u32_cell(kv, r->protocol_version);
    cli_table_cell(kv, "age:");
    cli_table_cell(kv, "%s", cli_fmt_duration(r->age_ms, b, sizeof b));
    cli_table_cell(kv, "state age:");
    cli_table_cell(kv, "%s", cli_fmt_duration(r->state_age_ms, b, sizeof b));
    cli_table_cell(kv, "past drain deadline:");
    cli_table_cell(kv, "%s", r->past_drain_deadline ? "yes" : "no");
}

int cli_cmd_room(struct cli *c)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = c->room_id;
    key.generation = c->generation;
    Kvfence__V1__GetRoomRequest rq = KVFENCE__V1__GET_ROOM_REQUEST__INIT;
    rq.room = &key;
    ProtobufCMessage *m = NULL;
    int rc = cli_call_view(c, "/kvfence.v1.Admin/GetRoom", &rq.base,
                           &kvfence__v1__room_info__descriptor, &m);
    if (rc != EXIT_OK || cli_doc(c)) {
        return rc;
    }
    const Kvfence__V1__RoomInfo *r = (const Kvfence__V1__RoomInfo *)m;
    struct cli_table kv;
    cli_table_init(&kv, 2, NULL);
    room_block(&kv, r);
    rc = cli_finish_table(c, &kv);
    if (rc == EXIT_OK) {
        bool wide = c->form == CLI_FORM_WIDE;
        static const char *const h[] = {
            "NODE",  "INCARNATION", "RANK",    "ROLE",   "LEASE",   "LEASE_STATE", "POOL",
            "PAGES", "COMPLETED",   "DRAINED", "FENCED", "NOTICES", "MODE",        "RANGES"};
        struct cli_table t;
        cli_table_init(&t, wide ? 14 : 12, h);
        char b[64], sb[96], rb[256];
        for (size_t i = 0; i < r->n_participants; i++) {
            const Kvfence__V1__ParticipantInfo *p = r->participants[i];
            const Kvfence__V1__Participant *pp = p->participant;
            cli_table_cell(&t, "%s", pp ? pp->node_id : "-");
            cli_table_cell(&t, "%" PRIu64, p->node_incarnation);
            cli_table_cell(&t, "%u", pp ? pp->rank : 0);
            cli_table_cell(&t, "%s", ROLE_NAME(pp ? pp->role : 0, b));
            cli_table_cell(&t, "%" PRIu64, p->lease ? p->lease->lease_id : 0);
            cli_table_cell(&t, "%s", cli_lease_state_cell(p->lease, sb, sizeof sb));
            cli_table_cell(&t, "%u", p->lease ? p->lease->pool_id : 0);
            cli_table_cell(&t, "%" PRIu64, cli_lease_pages(p->lease));
            cli_table_cell(&t, "%s", p->completed ? "yes" : "no");
            cli_table_cell(&t, "%s", p->drained ? "yes" : "no");
            cli_table_cell(&t, "%s", p->fenced ? "yes" : "no");
            cli_table_cell(&t, "%u", p->notice_attempts);
            if (wide) {
                cli_table_cell(&t, "%s", LEASE_MODE_NAME(p->lease ? p->lease->mode : 0, b));
                if (p->lease) {
                    cli_fmt_ranges(p->lease, rb, sizeof rb);
                } else {
                    snprintf(rb, sizeof rb, "-");
                }
                cli_table_cell(&t, "%s", rb);
            }
        }
        printf("\n");
        rc = cli_finish_table(c, &t);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- leases -------------------------------------------------------------- */

int cli_cmd_leases(struct cli *c)
{
    Kvfence__V1__ListLeasesRequest rq = KVFENCE__V1__LIST_LEASES_REQUEST__INIT;
    rq.node_id = c->node ? (char *)c->node : "";
    rq.n_states = c->nstates;
    rq.states = (Kvfence__V1__LeaseState *)c->states;
    rq.room_id = c->room_id;
    struct cli_pages pg = {0};
    int rc = cli_call_paged_view(c, "ListLeases", &rq.base, &rq.page_token,
                                 &kvfence__v1__list_leases_response__descriptor, "leases", &pg);
    if (rc != EXIT_OK || cli_doc(c)) {
        goto out;
    }
    bool wide = c->form == CLI_FORM_WIDE;
    static const char *const h[] = {"LEASE", "ROOM", "GENERATION", "NODE",  "RANK",   "ROLE",
                                    "POOL",  "MODE", "STATE",      "PAGES", "RANGES", "HOST_PROOF"};
    struct cli_table t;
    cli_table_init(&t, wide ? 12 : 11, h);
    char b[64], rb[96], sb[96];
    for (size_t p = 0; p < pg.n; p++) {
        const Kvfence__V1__ListLeasesResponse *r = (const Kvfence__V1__ListLeasesResponse *)pg.v[p];
        for (size_t i = 0; i < r->n_leases; i++) {
            const Kvfence__V1__Lease *l = r->leases[i];
            cli_table_cell(&t, "%" PRIu64, l->lease_id);
            cli_table_cell(&t, "%" PRIu64, l->room ? l->room->room_id : 0);
            cli_table_cell(&t, "%" PRIu64, l->room ? l->room->generation : 0);
            cli_table_cell(&t, "%s", l->participant ? l->participant->node_id : "-");
            cli_table_cell(&t, "%u", l->participant ? l->participant->rank : 0);
            cli_table_cell(&t, "%s", ROLE_NAME(l->participant ? l->participant->role : 0, b));
            cli_table_cell(&t, "%u", l->pool_id);
            cli_table_cell(&t, "%s", LEASE_MODE_NAME(l->mode, b));
            if (wide) { /* the wait has its own column */
                cli_table_cell(&t, "%s",
                               cli_enum_name(&kvfence__v1__lease_state__descriptor, "LEASE_STATE_",
                                             l->state, b, sizeof b));
            } else {
                cli_table_cell(&t, "%s", cli_lease_state_cell(l, sb, sizeof sb));
            }
            cli_table_cell(&t, "%" PRIu64, cli_lease_pages(l));
            cli_fmt_ranges(l, rb, sizeof rb);
            cli_table_cell(&t, "%s", rb);
            if (wide) {
                cli_table_cell(&t, "%s", l->awaiting_host_proof ? "waiting" : "-");
            }
        }
    }
    rc = cli_finish_table(c, &t);
out:
    cli_pages_free(&pg);
    return rc;
}

/* ---- stats --------------------------------------------------------------- */

int cli_cmd_stats(struct cli *c)
{
    Kvfence__V1__GetStatsRequest rq = KVFENCE__V1__GET_STATS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    int rc = cli_call_view(c, "/kvfence.v1.Admin/GetStats", &rq.base,
                           &kvfence__v1__stats__descriptor, &m);
    if (rc != EXIT_OK || cli_doc(c)) {
        return rc;
    }
    const Kvfence__V1__Stats *s = (const Kvfence__V1__Stats *)m;
    static const Kvfence__V1__RoomCounts no_rooms = KVFENCE__V1__ROOM_COUNTS__INIT;
    static const Kvfence__V1__LeaseCounts no_leases = KVFENCE__V1__LEASE_COUNTS__INIT;
    static const Kvfence__V1__NodeCounts no_nodes = KVFENCE__V1__NODE_COUNTS__INIT;
    const Kvfence__V1__RoomCounts *r = s->rooms ? s->rooms : &no_rooms;
    const Kvfence__V1__LeaseCounts *l = s->leases ? s->leases : &no_leases;
    const Kvfence__V1__NodeCounts *n = s->nodes ? s->nodes : &no_nodes;
    const struct {
        const char *name;
        uint64_t v;
    } rows[] = {
        {"rooms.opening", r->opening},
        {"rooms.active", r->active},
        {"rooms.aborting", r->aborting},
        {"rooms.completed", r->completed},
        {"rooms.aborted", r->aborted},
        {"leases.active", l->active},
        {"leases.releasing", l->releasing},
        {"leases.released", l->released},
        {"leases_awaiting_host_proof", s->leases_awaiting_host_proof},
        {"nodes.attached", n->attached},
        {"nodes.suspect", n->suspect},
        {"nodes.lost", n->lost},
        {"notices_pending", s->notices_pending},
        {"notices_sent", s->notices_sent},
        {"notices_resent", s->notices_resent},
        {"reports_stale", s->reports_stale},
        {"reports_tokenless", s->reports_tokenless},
        {"reports_unknown", s->reports_unknown},
        {"rooms_past_deadline", s->rooms_past_deadline},
        {"fences_requested", s->fences_requested},
        {"generation", s->generation},
        {"uptime_ms", s->uptime_ms},
    };
    static const char *const h[] = {"STAT", "VALUE"};
    struct cli_table t;
    cli_table_init(&t, 2, h);
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        cli_table_cell(&t, "%s", rows[i].name);
        cli_table_cell(&t, "%" PRIu64, rows[i].v);
    }
    rc = cli_finish_table(c, &t);
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}
