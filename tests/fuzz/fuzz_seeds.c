/*
 * fuzz_seeds.c: writes the seed corpora of tests/fuzz into OUT/<target>/,
 * made by the real encoders rather than by hand, so that they follow the
 * formats as the code changes: WAL segments and snapshot files written by the
 * store itself, state-core snapshots of a core with attached nodes and a
 * room, packed requests for every Control and Admin method and a node Hello
 * (the script format of fuzz_services.c), TCP hello and frames (tcp.h), peer
 * frames, config files and command lines.
 *
 *   fuzz_seeds OUT
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cp_state.h"
#include "fuzz_util.h"
#include "kvfence/v1/node.pb-c.h"
#include "kvfence/v1/peer.pb-c.h"
#include "service_internal.h"
#include "tcp.h"
#include "wal.h"

static char out_dir[256];
static unsigned seeds;

static void seed(const char *target, const char *name, const uint8_t *p, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", out_dir, target);
    (void)mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
    fz_write_file(path, p, len);
    seeds++;
}

/* ---- byte buffer ---------------------------------------------------------------- */

struct buf {
    uint8_t b[1 << 16];
    size_t n;
};

static void b_put(struct buf *b, const void *p, size_t len)
{
    if (b->n + len > sizeof b->b)
        abort();
    memcpy(b->b + b->n, p, len);
    b->n += len;
}

static void b_u8(struct buf *b, uint8_t v)
{
    b_put(b, &v, 1);
}

static void b_le(struct buf *b, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        b_u8(b, (uint8_t)(v >> (8 * i)));
}

static void b_msg(struct buf *b, const ProtobufCMessage *m)
{
    size_t len = protobuf_c_message_get_packed_size(m);
    b_le(b, len, 2);
    if (b->n + len > sizeof b->b)
        abort();
    b->n += protobuf_c_message_pack(m, b->b + b->n);
}

static size_t read_file(const char *path, uint8_t *p, size_t cap)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    size_t n = fread(p, 1, cap, f);
    fclose(f);
    return n;
}

/* ---- config ------------------------------------------------------------------------ */

static void seeds_config(void)
{
    static const char a[] = "listen = 0.0.0.0:7070\n# comment\nnode-ttl-ms=1500\nverbose = yes\n"
                            "\xff--count\0"
                            "3\0--listen=127.0.0.1:1\0--verbose";
    static const char b[] = "data-dir = /var/lib/kvfence\n\xff--node-ttl-ms=99999999999\0--help";
    static const char c[] = "lisen = x\n\xff--verbose=maybe";
    seed("fuzz_config", "a", (const uint8_t *)a, sizeof a - 1);
    seed("fuzz_config", "b", (const uint8_t *)b, sizeof b - 1);
    seed("fuzz_config", "c", (const uint8_t *)c, sizeof c - 1);
}

/* ---- control plane: services and state snapshots ---------------------------------- */

static void fixed_random(void *ctx, void *p, size_t len)
{
    (void)ctx;
    memset(p, 0x33, len);
}

static void pack_hello(struct buf *b, const char *node, uint64_t inc)
{
    static char *features[] = {"QUIESCE_V1", "FENCE_V1", "TCP"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 3;
    caps.features = features;
    Kvfence__V1__Pool pool = KVFENCE__V1__POOL__INIT;
    pool.pool_id = 1;
    pool.kind = KVFENCE__V1__POOL_KIND__POOL_KIND_HOST_SHM;
    pool.page_size = 4096;
    pool.page_count = 64;
    Kvfence__V1__Pool *pools[1] = {&pool};
    Kvfence__V1__Endpoint ep = KVFENCE__V1__ENDPOINT__INIT;
    ep.kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_PEER_ZMQ;
    ep.address = "tcp://127.0.0.1:7081";
    Kvfence__V1__Endpoint *eps[1] = {&ep};
    Kvfence__V1__Hello h = KVFENCE__V1__HELLO__INIT;
    h.node_id = (char *)node;
    h.incarnation = inc;
    h.capabilities = &caps;
    h.n_endpoints = 1;
    h.endpoints = eps;
    h.n_pools = 1;
    h.pools = pools;
    h.software_version = "fuzz-seed";
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HELLO;
    m.hello = &h;
    b_msg(b, &m.base);
}

static void pack_join(struct buf *b, const char *node, int role)
{
    static char *features[] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = features;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)node;
    part.rank = 0;
    part.role = role;
    Kvfence__V1__PageRange r = KVFENCE__V1__PAGE_RANGE__INIT;
    r.first = 0;
    r.count = 8;
    Kvfence__V1__PageRange *rs[1] = {&r};
    Kvfence__V1__JoinRoomRequest j = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    j.room_id = 7;
    j.expected_sources = 1;
    j.expected_sinks = 1;
    j.participant = &part;
    j.engine_capabilities = &caps;
    j.pool_id = 1;
    j.n_ranges = 1;
    j.ranges = rs;
    b_msg(b, &j.base);
}

/* A join whose pages are a page set (types.proto PageSet), as engines with
 * scattered pages send it. */
static void pack_join_set(struct buf *b, const char *node, int role, Kvfence__V1__PageSet *ps)
{
    static char *features[] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = features;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)node;
    part.role = role;
    Kvfence__V1__JoinRoomRequest j = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    j.room_id = 8;
    j.expected_sources = 1;
    j.expected_sinks = 1;
    j.participant = &part;
    j.engine_capabilities = &caps;
    j.pool_id = 1;
    j.page_set = ps;
    b_msg(b, &j.base);
}

static size_t method_index(const char *name)
{
    for (size_t i = 0; i < kvf_svc_control_method_count; i++)
        if (strcmp(kvf_svc_control_methods[i].name, name) == 0)
            return i;
    for (size_t i = 0; i < kvf_svc_admin_method_count; i++)
        if (strcmp(kvf_svc_admin_methods[i].name, name) == 0)
            return kvf_svc_control_method_count + i;
    fprintf(stderr, "fuzz_seeds: no method %s\n", name);
    abort();
}

static int snap_write(void *ctx, const void *p, size_t len)
{
    b_put(ctx, p, len);
    return 0;
}

static void seeds_services(void)
{
    const size_t nm = kvf_svc_control_method_count + kvf_svc_admin_method_count;
    static struct buf b;
    char name[64];
    for (size_t i = 0; i < nm; i++) { /* each method once, with an empty request */
        b.n = 0;
        b_u8(&b, (uint8_t)i);
        b_le(&b, 0, 2);
        snprintf(name, sizeof name, "empty-%zu", i);
        seed("fuzz_services", name, b.b, b.n);
    }
    /* Two nodes attach, a room of one source and one sink fills, time passes. */
    b.n = 0;
    b_u8(&b, (uint8_t)nm);
    b_u8(&b, 4 * 0 + 1); /* "n1", incarnation 2: as the Hello says */
    pack_hello(&b, "n1", 2);
    b_u8(&b, (uint8_t)nm);
    b_u8(&b, 2);
    pack_hello(&b, "n2", 3);
    b_u8(&b, (uint8_t)method_index("/kvfence.v1.Control/JoinRoom"));
    pack_join(&b, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE);
    b_u8(&b, (uint8_t)method_index("/kvfence.v1.Control/JoinRoom"));
    pack_join(&b, "n2", KVFENCE__V1__ROLE__ROLE_SINK);
    b_u8(&b, (uint8_t)(nm + 2));
    b_le(&b, 200, 2);
    b_u8(&b, (uint8_t)(nm + 1));
    b_u8(&b, 1);
    b_u8(&b, (uint8_t)(nm + 2));
    b_le(&b, 2000, 2);
    seed("fuzz_services", "attach-join-tick", b.b, b.n);

    /* The same with page sets: the source's pages as deltas, the sink's as
     * a bitmap. */
    static uint8_t deltas[] = {3, 1, 0, 0, 5, 0x80, 0x01};
    static uint8_t bitmap[] = {0x55, 0xff, 0x01, 0x80};
    Kvfence__V1__PageSet pd = KVFENCE__V1__PAGE_SET__INIT, pb = KVFENCE__V1__PAGE_SET__INIT;
    pd.deltas.data = deltas;
    pd.deltas.len = sizeof deltas;
    pb.bitmap.data = bitmap;
    pb.bitmap.len = sizeof bitmap;
    pb.bitmap_first = 16;
    b.n = 0;
    b_u8(&b, (uint8_t)nm);
    b_u8(&b, 4 * 0 + 1);
    pack_hello(&b, "n1", 2);
    b_u8(&b, (uint8_t)nm);
    b_u8(&b, 2);
    pack_hello(&b, "n2", 3);
    b_u8(&b, (uint8_t)method_index("/kvfence.v1.Control/JoinRoom"));
    pack_join_set(&b, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, &pd);
    b_u8(&b, (uint8_t)method_index("/kvfence.v1.Control/JoinRoom"));
    pack_join_set(&b, "n2", KVFENCE__V1__ROLE__ROLE_SINK, &pb);
    b_u8(&b, (uint8_t)(nm + 2));
    b_le(&b, 200, 2);
    seed("fuzz_services", "attach-join-pagesets", b.b, b.n);

    /* State-core snapshots: empty, and after the two Hellos and the joins. */
    struct kvf_cps_opts opts;
    kvf_cps_opts_init(&opts);
    opts.random_fn = fixed_random;
    struct kvf_svc_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.cps = kvf_cps_create(&opts);
    ctx.sessions = kvf_svc_sessions_create();
    if (!ctx.cps || !ctx.sessions)
        abort();
    static struct buf img;
    img.n = 0;
    if (kvf_cps_snapshot(ctx.cps, 1000000000, snap_write, &img) != 0)
        abort();
    seed("fuzz_cp_snapshot", "empty", img.b, img.n);
    static struct buf m;
    m.n = 0;
    pack_hello(&m, "n1", 2);
    (void)kvf_svc_node_apply(&ctx, "", 0, m.b + 2, m.n - 2, 1000000000);
    m.n = 0;
    pack_hello(&m, "n2", 3);
    (void)kvf_svc_node_apply(&ctx, "", 0, m.b + 2, m.n - 2, 1000000000);
    img.n = 0;
    if (kvf_cps_snapshot(ctx.cps, 1100000000, snap_write, &img) != 0)
        abort();
    seed("fuzz_cp_snapshot", "two-nodes", img.b, img.n);
    kvf_svc_sessions_destroy(ctx.sessions);
    kvf_cps_destroy(ctx.cps);
}

/* ---- WAL -------------------------------------------------------------------------- */

static int produce(void *ctx, uint64_t seq, struct kvf_store_sink *sink)
{
    (void)ctx;
    (void)seq;
    static const char body[] = "a snapshot body";
    return kvf_store_sink_write(sink, body, sizeof body);
}

/* The newest file of `dir` whose name starts with `prefix`, into `p`. */
static size_t newest(const char *dir, const char *prefix, uint8_t *p, size_t cap, int nth)
{
    char names[16][64];
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL && n < 16)
        if (strncmp(e->d_name, prefix, strlen(prefix)) == 0 && !strstr(e->d_name, ".tmp"))
            snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    if (d)
        closedir(d);
    if (n == 0 || nth >= n)
        return 0;
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, names[n - 1 - nth]);
    return read_file(path, p, cap);
}

static void seeds_wal(void)
{
    char dir[300];
    snprintf(dir, sizeof dir, "%s/seed-wal", fz_scratch_dir());
    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    o.data_dir = dir;
    o.sync = KVF_STORE_WAL_UNSAFE_NO_SYNC;
    o.segment_bytes = 4096; /* the smallest: rolls after three big records */
    struct kvf_store *st = kvf_store_wal_create(&o);
    struct kvf_error err;
    kvf_error_clear(&err);
    if (!st || kvf_store_recover(st, NULL, NULL, NULL, NULL, &err) != 0)
        abort();
    for (int i = 0; i < 5; i++) {
        char rec[1500];
        memset(rec, 'a' + i, sizeof rec);
        size_t n = i < 3 ? sizeof rec : 16; /* the second segment: two small records */
        if (kvf_store_append(st, rec, n, NULL, NULL, NULL) != 0)
            abort();
    }
    kvf_store_destroy(st); /* durable: every segment on disk */

    static uint8_t seg1[16384], seg2[16384], snap[4096];
    static struct buf b;
    size_t n2 = newest(dir, "wal-", seg2, sizeof seg2, 0);
    size_t n1 = newest(dir, "wal-", seg1, sizeof seg1, 1);
    b.n = 0;
    b_u8(&b, 0);
    b_put(&b, seg2, n2);
    seed("fuzz_wal", "one-segment", b.b, b.n);
    b.n = 0;
    b_u8(&b, 1);
    b_le(&b, n1, 2);
    b_put(&b, seg1, n1);
    b_put(&b, seg2, n2);
    seed("fuzz_wal", "two-segments", b.b, b.n);

    st = kvf_store_wal_create(&o);
    if (!st || kvf_store_recover(st, NULL, NULL, NULL, NULL, &err) != 0)
        abort();
    if (kvf_store_write_snapshot(st, KVF_STORE_SEQ_LAST, produce, NULL, NULL, &err) != 0)
        abort();
    if (kvf_store_append(st, "after", 5, NULL, NULL, NULL) != 0)
        abort();
    kvf_store_destroy(st);
    size_t ns = newest(dir, "snapshot-", snap, sizeof snap, 0);
    n2 = newest(dir, "wal-", seg2, sizeof seg2, 0);
    b.n = 0;
    b_u8(&b, 2);
    b_le(&b, ns, 2);
    b_put(&b, snap, ns);
    b_put(&b, seg2, n2);
    seed("fuzz_wal", "snapshot-segment", b.b, b.n);
    fz_clear_dir(dir);
    (void)rmdir(dir);
}

/* ---- data plane: TCP frames, peer frames ----------------------------------------- */

static void tcp_frame(struct buf *b, uint64_t room, uint64_t seq, uint32_t first, uint32_t count,
                      uint64_t offset, uint64_t len)
{
    b_le(b, KVF_TCP_MAGIC_DATA, 4);
    b_le(b, KVF_TCP_VERSION, 2);
    b_le(b, 0, 2);
    b_le(b, room, 8);
    b_le(b, 1, 8);
    b_le(b, seq, 8);
    b_le(b, 1, 4); /* pool */
    b_le(b, first, 4);
    b_le(b, count, 4);
    b_le(b, 0, 4);
    b_le(b, offset, 8);
    b_le(b, len, 8);
    for (uint64_t i = 0; i < len; i++)
        b_u8(b, (uint8_t)i);
}

static void seeds_tcp(void)
{
    static struct buf b;
    b.n = 0;
    b_u8(&b, 0);
    tcp_frame(&b, 1, 1, 0, 1, 0, 512);
    tcp_frame(&b, 1, 2, 1, 2, 100, 700);
    seed("fuzz_tcp_frame", "two-frames", b.b, b.n);
    b.n = 0;
    b_u8(&b, 0);
    tcp_frame(&b, 2, 1, 0, 1, 0, 16); /* refused after a retry: drained to scratch */
    tcp_frame(&b, 3, 2, 0, 1, 0, 16);
    seed("fuzz_tcp_frame", "refused", b.b, b.n);
    b.n = 0;
    b_u8(&b, 1); /* its own hello */
    b_le(&b, KVF_TCP_MAGIC_HELLO, 4);
    b_le(&b, KVF_TCP_VERSION, 2);
    b_le(&b, 0, 2);
    b_le(&b, 0x1111, 8);
    b_le(&b, 0x5553, 8);
    for (int i = 0; i < 32; i++) /* nonce_c */
        b_u8(&b, (uint8_t)i);
    b_le(&b, KVF_TCP_MAGIC_PROOF, 4); /* a proof the acceptor refuses */
    for (int i = 0; i < 32; i++)
        b_u8(&b, 0);
    tcp_frame(&b, 1, 1, 5, 1, 0, 512);
    seed("fuzz_tcp_frame", "own-hello", b.b, b.n);
}

static void seeds_peer(void)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = 1;
    rk.generation = 1;
    Kvfence__V1__TransferStatus ts = KVFENCE__V1__TRANSFER_STATUS__INIT;
    ts.ok = true;
    ts.chunks = 3;
    Kvfence__V1__PeerEnvelope env = KVFENCE__V1__PEER_ENVELOPE__INIT;
    env.room = &rk;
    env.sender_node_id = "n2";
    env.sender_incarnation = 1;
    env.receiver_node_id = "fz";
    env.receiver_incarnation = 1;
    env.seq = 1;
    env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_TRANSFER_STATUS;
    env.transfer_status = &ts;
    Kvfence__V1__PeerFrame f = KVFENCE__V1__PEER_FRAME__INIT;
    f.frame_case = KVFENCE__V1__PEER_FRAME__FRAME_ENVELOPE;
    f.envelope = &env;
    static struct buf b;
    b.n = 0;
    b.n = protobuf_c_message_pack(&f.base, b.b);
    seed("fuzz_peer_envelope", "transfer-status", b.b, b.n);
    rk.room_id = 4; /* LATE */
    b.n = protobuf_c_message_pack(&f.base, b.b);
    seed("fuzz_peer_envelope", "late", b.b, b.n);
    Kvfence__V1__LinkMessage link = KVFENCE__V1__LINK_MESSAGE__INIT;
    link.receiver_node_id = "fz";
    link.receiver_incarnation = 1;
    f.frame_case = KVFENCE__V1__PEER_FRAME__FRAME_LINK;
    f.link = &link;
    b.n = protobuf_c_message_pack(&f.base, b.b);
    seed("fuzz_peer_envelope", "link", b.b, b.n);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_seeds OUT\n");
        return 2;
    }
    snprintf(out_dir, sizeof out_dir, "%s", argv[1]);
    (void)mkdir(out_dir, 0755);
    seeds_config();
    seeds_services();
    seeds_wal();
    seeds_tcp();
    seeds_peer();
    (void)rmdir(fz_scratch_dir());
    printf("fuzz_seeds: %u seeds in %s\n", seeds, out_dir);
    return 0;
}
