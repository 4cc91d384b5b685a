/*
 * kvfence.h: the C client library of kvfence (libkvfence), for engines
 * (prefill and decode schedulers) that hand KV-cache pages to kvfence.
 *
 * Two handles:
 *   kvf_client       the control plane (service Control over gRPC, TCP, with
 *                    optional TLS): join a room with a page lease, extend it,
 *                    complete, abort, and learn when leases are released.
 *   kvf_node_client  the local kvfence-node (service NodeLocal on its unix
 *                    socket): register page pools, submit chunks.
 *
 * Errors. Every call that can fail returns 0 or a negative status code:
 * -KVF_STATUS_NOT_FOUND, -KVF_STATUS_UNAVAILABLE, ... (the gRPC status codes,
 * negated). When `st` is not NULL it receives the same code (positive, as
 * the enum below) and a message: the server's (which names the field, page or
 * object at fault: "page 4100 is outside pool 7 (4096 pages)") or one that
 * describes the local failure. Nothing in the library aborts the process or
 * exits; bad arguments (NULL handles, missing fields) give
 * -KVF_STATUS_INVALID_ARGUMENT.
 *
 * Threads. Handles may be shared by any number of threads; every call blocks
 * the calling thread until the reply or the call's deadline
 * (kvf_client_opts.call_timeout_ms). Lease watches deliver their events on a
 * thread of the library (one per watch).
 *
 * ---- The lifecycle an engine must follow -----------------------------------
 *
 *  1. At start: kvf_client_create() to the control plane and
 *     kvf_node_client_create() to the node on this host; register each pool of
 *     KV pages once with kvf_register_pool_shm() (keep the pool id); open one
 *     kvf_watch_leases() for the node's leases (or use kvf_wait_released()).
 *  2. Per request (room): every participating rank calls kvf_join_room() with
 *     the pages it grants (a source grants pages to read, a sink pages to
 *     write). From this call on, THE PAGES ARE NOT THE ENGINE'S: it must not
 *     free, reuse or overwrite them. The room turns ACTIVE when the last
 *     expected participant joined. A join may fail with NOT_FOUND just after
 *     the pool was registered (the node's update races the join): retry.
 *     Scattered pages (one index per token): encode them once with
 *     kvf_page_set_encode() and join with kvf_join_room_pages().
 *  3. Chunked prefill: kvf_extend_lease() (or kvf_extend_lease_pages()) adds
 *     pages to the lease (same rule: once granted, hands off).
 *  4. A source submits its chunks to its own node with kvf_submit_chunk()
 *     (chunk_seq 1, 2, ...; last_chunk on the last). A SubmitChunk answered
 *     UNAVAILABLE means the node has not yet learned the room: retry.
 *  5. When its part is done, each rank calls kvf_complete_room(), or any
 *     party calls kvf_abort_room() to give up.
 *  6. The pages are the engine's again ONLY when the lease is RELEASED: a
 *     KVF_LEASE_EVENT_RELEASED event of kvf_watch_leases(), or
 *     kvf_wait_released() returning 0. Neither a CompleteRoom reply nor an
 *     AbortRoom reply means the pages are free: the nodes must first prove
 *     that no transfer can still touch them. If a release never comes, the
 *     pages stay fenced; do not reuse them on a timeout.
 *  7. At exit: kvf_watch_stop(), kvf_node_client_destroy(),
 *     kvf_client_destroy().
 *
 * ---- Example (a source rank; error handling shortened) ----------------------
 *
 *   struct kvf_status st;
 *   kvf_client *cp;
 *   kvf_node_client *node;
 *   struct kvf_client_opts o;
 *   kvf_client_opts_init(&o);
 *   if (kvf_client_create("10.0.0.1:7000", &o, &cp, &st) ||
 *       kvf_node_client_create("/run/kvfence/node.sock", NULL, &node, &st))
 *       die(st.message);
 *   struct kvf_shm_pool pool = {.shm_name = "/engine-kv-0", .size = 64 << 20,
 *                               .page_size = 4096, .page_count = 16384};
 *   uint32_t pool_id;
 *   kvf_register_pool_shm(node, &pool, &pool_id, &st);
 *
 *   struct kvf_page_range pages[] = {{.first = 0, .count = 8}};
 *   struct kvf_join join = {.room_id = 42, .expected_sources = 1,
 *                           .expected_sinks = 1, .node_id = "node-a",
 *                           .rank = 0, .role = KVF_ROLE_SOURCE,
 *                           .pool_id = pool_id, .ranges = pages,
 *                           .n_ranges = 1};
 *   struct kvf_join_result jr;
 *   if (kvf_join_room(cp, &join, &jr, &st) == 0) {
 *       struct kvf_chunk c = {.room = jr.room, .chunk_seq = 1,
 *                             .source_pool_id = pool_id,
 *                             .source_ranges = pages, .n_source_ranges = 1,
 *                             .sink_node_id = "node-b",
 *                             .sink_pool_id = sink_pool_id, // the sink's
 *                             .sink_ranges = sink_pages,    // from the router
 *                             .n_sink_ranges = 1,
 *                             .last_chunk = true};
 *       struct kvf_participant me = {.node_id = "node-a", .rank = 0,
 *                                    .role = KVF_ROLE_SOURCE};
 *       if (kvf_submit_chunk(node, &c, &st) == 0)
 *           kvf_complete_room(cp, jr.room, &me, NULL, &st);
 *       else
 *           kvf_abort_room(cp, jr.room, "submit failed", NULL, &st);
 *       if (kvf_wait_released(cp, jr.lease_id, 60000, &st) == 0)
 *           reuse_pages(pages); // only now
 *   }
 *   kvf_node_client_destroy(node);
 *   kvf_client_destroy(cp);
 */
#ifndef KVFENCE_KVFENCE_H
#define KVFENCE_KVFENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVF_CLIENT_BUILD)
#define KVF_PUBLIC __attribute__((visibility("default")))
#else
#define KVF_PUBLIC
#endif

#define KVF_CLIENT_VERSION_MAJOR 0
#define KVF_CLIENT_VERSION_MINOR 1
#define KVF_CLIENT_VERSION_PATCH 0

/* ---- status ------------------------------------------------------------------ */

/* Status codes: the gRPC codes. Calls return 0 or minus one of these. */
enum kvf_status_code {
    KVF_STATUS_OK = 0,
    KVF_STATUS_CANCELLED = 1,
    KVF_STATUS_UNKNOWN = 2,
    KVF_STATUS_INVALID_ARGUMENT = 3,
    KVF_STATUS_DEADLINE_EXCEEDED = 4,
    KVF_STATUS_NOT_FOUND = 5,
    KVF_STATUS_ALREADY_EXISTS = 6,
    KVF_STATUS_PERMISSION_DENIED = 7,
    KVF_STATUS_RESOURCE_EXHAUSTED = 8,
    KVF_STATUS_FAILED_PRECONDITION = 9,
    KVF_STATUS_ABORTED = 10,
    KVF_STATUS_OUT_OF_RANGE = 11,
    KVF_STATUS_UNIMPLEMENTED = 12,
    KVF_STATUS_INTERNAL = 13,
    KVF_STATUS_UNAVAILABLE = 14,
    KVF_STATUS_DATA_LOSS = 15,
    KVF_STATUS_UNAUTHENTICATED = 16,
};

#define KVF_STATUS_MSG_MAX 256

/* Why a call failed: `code` is an enum kvf_status_code (positive; 0 on
 * success, with an empty message). */
struct kvf_status {
    int code;
    char message[KVF_STATUS_MSG_MAX];
};

/* "NOT_FOUND" for KVF_STATUS_NOT_FOUND or -KVF_STATUS_NOT_FOUND; "?" if
 * unknown. */
KVF_PUBLIC const char *kvf_status_name(int code);

/* ---- wire types ---------------------------------------------------------------- */

struct kvf_room_key {
    uint64_t room_id;    /* 1 .. 2^63-1 */
    uint64_t generation; /* chosen by the control plane; 0 = current (abort only) */
};

/* Pages [first, first + count) of a pool. */
struct kvf_page_range {
    uint32_t first;
    uint32_t count;
};

enum kvf_role {
    KVF_ROLE_SOURCE = 1, /* grants a READ lease */
    KVF_ROLE_SINK = 2,   /* grants a WRITE lease */
};

enum kvf_room_state {
    KVF_ROOM_UNSPECIFIED = 0,
    KVF_ROOM_OPENING = 1,
    KVF_ROOM_ACTIVE = 2,
    KVF_ROOM_ABORTING = 3,
    KVF_ROOM_COMPLETED = 4,
    KVF_ROOM_ABORTED = 5,
};

/* Who takes part in a room. */
struct kvf_participant {
    const char *node_id; /* the kvfence-node the rank's pages live on */
    uint32_t rank;
    enum kvf_role role;
};

/* ---- control plane client ------------------------------------------------------- */

typedef struct kvf_client kvf_client;

struct kvf_client_opts {
    /* TLS: the CA (PEM file) that signed the control plane's certificate;
     * NULL = plaintext. */
    const char *tls_root_ca_path;
    /* Mutual TLS: this client's certificate and key (both or neither; needs
     * tls_root_ca_path). */
    const char *tls_cert_path;
    const char *tls_key_path;
    /* Name checked against the server certificate instead of the host. */
    const char *tls_target_name;
    /* Calls wait (up to their deadline) for an unreachable server instead of
     * failing fast with UNAVAILABLE. Default false. */
    bool wait_for_ready;
    /* Deadline of each unary call, ms; <= 0 means none. Default 5000. */
    int64_t call_timeout_ms;
};

/* Fills `opts` with the defaults: plaintext, fail fast, 5 s per call. */
KVF_PUBLIC void kvf_client_opts_init(struct kvf_client_opts *opts);

/* Creates a client of the control plane at `target` ("10.0.0.1:7000",
 * "dns:///cp.example:7000"); `opts` may be NULL for the defaults. Connects
 * lazily (the first call reports a server that is down). Returns 0 with
 * *out, or -KVF_STATUS_INVALID_ARGUMENT (bad options, unreadable TLS files),
 * -KVF_STATUS_RESOURCE_EXHAUSTED. */
KVF_PUBLIC int kvf_client_create(const char *target, const struct kvf_client_opts *opts,
                                 kvf_client **out, struct kvf_status *st);

/* Destroys the client. Every watch of it must be stopped and no call may be
 * in progress. Accepts NULL. */
KVF_PUBLIC void kvf_client_destroy(kvf_client *c);

/* A participant joins a room with its page lease (Control.JoinRoom). */
struct kvf_join {
    uint64_t room_id;          /* the router's id, 1 .. 2^63-1 */
    uint32_t expected_sources; /* same in every join of the room, >= 1 */
    uint32_t expected_sinks;   /* same in every join of the room, >= 1 */
    const char *node_id;
    uint32_t rank;
    enum kvf_role role;
    uint32_t pool_id; /* from kvf_register_pool_shm() on that node */
    const struct kvf_page_range *ranges;
    size_t n_ranges; /* may be 0: a rank that holds no data for the room */
};

struct kvf_join_result {
    struct kvf_room_key room; /* with the generation minted by the first join */
    uint64_t lease_id;
    enum kvf_room_state state; /* OPENING, or ACTIVE for the last joiner */
    uint32_t protocol_version;
};

/* Joins (idempotent for the same participant and lease). The engine's
 * capabilities (protocol 1, "QUIESCE_V1") are sent by the library. Errors:
 * INVALID_ARGUMENT (pages outside the pool: the message names the page),
 * NOT_FOUND (node or pool unknown), FAILED_PRECONDITION (pages in another
 * room's lease), UNAVAILABLE, ... (api/kvfence/v1/control.proto). `out` may
 * be NULL. */
KVF_PUBLIC int kvf_join_room(kvf_client *c, const struct kvf_join *join,
                             struct kvf_join_result *out, struct kvf_status *st);

/* Adds pages to lease `lease_id` of room `room` (exact generation). */
KVF_PUBLIC int kvf_extend_lease(kvf_client *c, struct kvf_room_key room, uint64_t lease_id,
                                const struct kvf_page_range *ranges, size_t n_ranges,
                                struct kvf_status *st);

/* ---- page sets: scattered pages in few bytes ------------------------------------ */

/*
 * A set of pages of one pool, encoded once for JoinRoom or ExtendLease in
 * the smallest of three forms (types.proto PageSet): ranges when pages come
 * in runs, a bitmap for a dense scatter (every other page: 2 bits a page), a
 * list of varint gaps for a sparse one (about 1 byte a page). Engines that
 * name every token's slot (SGLang with page size 1: its kv_indices) pass the
 * indices as they are: 32,768 scattered pages encode in well under a
 * millisecond (bench/pageset) into 4 to 40 KiB, instead of 32,768 ranges.
 *
 * A set is a set: the indices may come in any order but each at most once,
 * and the lease keeps them as ascending runs (the order is not kept; a
 * lease's ranges come back sorted). Immutable once encoded: a set may be
 * used by any number of threads and calls, and destroyed after the last.
 */
typedef struct kvf_page_set kvf_page_set;

enum kvf_page_set_form {
    KVF_PAGE_SET_EMPTY = 0,  /* no page */
    KVF_PAGE_SET_RANGES = 1, /* repeated PageRange */
    KVF_PAGE_SET_BITMAP = 2, /* one bit a page from the lowest page */
    KVF_PAGE_SET_DELTAS = 3, /* LEB128 varints: the first page, then gaps - 1 */
};

/* Encodes `n` page indices (any order; n may be 0: an empty set). Returns 0
 * with *out, -KVF_STATUS_INVALID_ARGUMENT (a page listed twice: the message
 * names it and both positions; pages NULL with n > 0) or
 * -KVF_STATUS_RESOURCE_EXHAUSTED (out of memory). */
KVF_PUBLIC int kvf_page_set_encode(const uint32_t *pages, size_t n, kvf_page_set **out,
                                   struct kvf_status *st);

/* Accepts NULL. */
KVF_PUBLIC void kvf_page_set_destroy(kvf_page_set *set);

/* The form the encoder chose, the bytes of the PageSet message on the wire,
 * the pages and the runs of consecutive pages in the set. */
KVF_PUBLIC enum kvf_page_set_form kvf_page_set_form(const kvf_page_set *set);
KVF_PUBLIC size_t kvf_page_set_wire_size(const kvf_page_set *set);
KVF_PUBLIC size_t kvf_page_set_page_count(const kvf_page_set *set);
KVF_PUBLIC size_t kvf_page_set_run_count(const kvf_page_set *set);

/* kvf_join_room() with the pages of `pages` instead of join->ranges (which
 * must be empty). An empty set joins with no pages (a dummy rank). The
 * control plane counts the set's runs against its range limit (65,536 by
 * default: RESOURCE_EXHAUSTED). */
KVF_PUBLIC int kvf_join_room_pages(kvf_client *c, const struct kvf_join *join,
                                   const kvf_page_set *pages, struct kvf_join_result *out,
                                   struct kvf_status *st);

/* kvf_extend_lease() with a page set (not empty). */
KVF_PUBLIC int kvf_extend_lease_pages(kvf_client *c, struct kvf_room_key room, uint64_t lease_id,
                                      const kvf_page_set *pages, struct kvf_status *st);

/* Declares that `who`'s part of the room finished well. Not a release: wait
 * for it. *state_out (may be NULL) gets the room's state after the call. */
KVF_PUBLIC int kvf_complete_room(kvf_client *c, struct kvf_room_key room,
                                 const struct kvf_participant *who, enum kvf_room_state *state_out,
                                 struct kvf_status *st);

struct kvf_abort_result {
    struct kvf_room_key room; /* generation filled in */
    uint64_t token_hi, token_lo;
    enum kvf_room_state state; /* ABORTING, or ABORTED */
    bool already_aborting;
    int reason; /* kvfence.v1.AbortReason of the first abort */
};

/* Aborts a room (generation 0: its current one). Idempotent. `detail` (may be
 * NULL) is free text, at most 256 bytes; `out` may be NULL. */
KVF_PUBLIC int kvf_abort_room(kvf_client *c, struct kvf_room_key room, const char *detail,
                              struct kvf_abort_result *out, struct kvf_status *st);

/* Blocks until lease `lease_id` is RELEASED (0), for at most `deadline_ms`
 * from now (<= 0: no limit). A lease already released (its room still kept
 * as a tombstone) returns 0 at once. Returns -KVF_STATUS_DEADLINE_EXCEEDED
 * when the deadline passed first (with the last connection error in the
 * message when the server was unreachable), or another error the server
 * answered (PERMISSION_DENIED, ...). Reconnects on UNAVAILABLE until the
 * deadline. */
KVF_PUBLIC int kvf_wait_released(kvf_client *c, uint64_t lease_id, int64_t deadline_ms,
                                 struct kvf_status *st);

/* ---- lease watch ----------------------------------------------------------------- */

typedef struct kvf_watch kvf_watch;

/* Which leases to hear about; the filters combine with AND, unset = any. */
struct kvf_watch_filter {
    const char *node_id;
    const uint32_t *ranks;
    size_t n_ranks;
    const uint64_t *lease_ids;
    size_t n_lease_ids;
    bool include_room_states; /* also KVF_LEASE_EVENT_ROOM_STATE events */
};

enum kvf_lease_event_kind {
    /* A lease is RELEASED: its pages are the engine's again. */
    KVF_LEASE_EVENT_RELEASED = 1,
    /* A room changed state (include_room_states only). */
    KVF_LEASE_EVENT_ROOM_STATE = 2,
    /* The replay of past releases is over (after every (re)subscription). */
    KVF_LEASE_EVENT_SYNCED = 3,
    /* The stream broke (`status` says why); the library resubscribes with
     * backoff, and the replay that follows may repeat releases: deduplicate
     * by lease_id. */
    KVF_LEASE_EVENT_DISCONNECTED = 4,
};

struct kvf_lease_event {
    enum kvf_lease_event_kind kind;
    /* RELEASED */
    uint64_t lease_id;
    struct kvf_room_key room; /* RELEASED and ROOM_STATE */
    const char *node_id;      /* RELEASED; valid during the callback only */
    uint32_t rank;
    uint32_t pool_id;
    const struct kvf_page_range *ranges; /* RELEASED; valid during the callback */
    size_t n_ranges;
    /* ROOM_STATE */
    enum kvf_room_state old_state, new_state;
    int abort_reason;
    /* SYNCED */
    uint64_t replayed;
    /* DISCONNECTED */
    struct kvf_status status;
};

/* Called on the watch's library thread, one event at a time. It may call
 * any kvf_* function except kvf_watch_stop() of its own watch. */
typedef void (*kvf_lease_cb)(const struct kvf_lease_event *ev, void *ctx);

/* Starts a watch (Control.WatchLeases) on a new library thread; `filter` may
 * be NULL (every lease: operators). Returns 0 with *out; the stream is
 * opened by the thread, so a server that is down shows as DISCONNECTED
 * events. */
KVF_PUBLIC int kvf_watch_leases(kvf_client *c, const struct kvf_watch_filter *filter,
                                kvf_lease_cb cb, void *ctx, kvf_watch **out, struct kvf_status *st);

/* Stops the watch and joins its thread: no callback runs after it returns.
 * Accepts NULL. */
KVF_PUBLIC void kvf_watch_stop(kvf_watch *w);

/* ---- node client ------------------------------------------------------------------ */

typedef struct kvf_node_client kvf_node_client;

/* Creates a client of the local node's NodeLocal socket (a path, or
 * "unix:/path"). `opts` may be NULL; its TLS fields are ignored (a unix
 * socket). */
KVF_PUBLIC int kvf_node_client_create(const char *socket_path, const struct kvf_client_opts *opts,
                                      kvf_node_client **out, struct kvf_status *st);

/* Accepts NULL; no call may be in progress. */
KVF_PUBLIC void kvf_node_client_destroy(kvf_node_client *n);

/* A pool of pages in POSIX shared memory that the node maps (for
 * kvf_register_pool_fd the memory is the descriptor's and shm_name is not
 * used). */
struct kvf_shm_pool {
    const char *shm_name; /* "/engine-kv-0" */
    uint64_t offset;      /* of the pool in the object, bytes */
    uint64_t size;        /* >= page_size * page_count */
    uint32_t page_size;
    uint32_t page_count;
    uint32_t rank; /* the registering engine rank */
};

/* Registers the pool with the node; *pool_id_out gets its id. The library
 * opens the object read-write itself and hands the descriptor to the node on
 * its fd socket ("<socket_path>.fds"), so the node maps only memory this
 * process may use (docs/security.md, "NodeLocal"); a node without the fd
 * socket, or an object this process cannot open, is asked by name (the node
 * answers NOT_FOUND, or PERMISSION_DENIED naming host_shm.shm_name). */
KVF_PUBLIC int kvf_register_pool_shm(kvf_node_client *n, const struct kvf_shm_pool *pool,
                                     uint32_t *pool_id_out, struct kvf_status *st);

/* Registers the memory of `fd` (a POSIX shm object or a memfd, open
 * read-write; the caller keeps it) with pool->offset, size, page_size,
 * page_count and rank: handed over on the fd socket. UNAVAILABLE when the
 * node has no fd socket. */
KVF_PUBLIC int kvf_register_pool_fd(kvf_node_client *n, int fd, const struct kvf_shm_pool *pool,
                                    uint32_t *pool_id_out, struct kvf_status *st);

/* Unregisters a pool (unmapped once no room can touch it any more). */
KVF_PUBLIC int kvf_unregister_pool(kvf_node_client *n, uint32_t pool_id, struct kvf_status *st);

/* One chunk: source pages of this node -> sink pages of the sink node. */
struct kvf_chunk {
    struct kvf_room_key room; /* exact generation */
    uint64_t chunk_seq;       /* >= 1, increasing per (room, source, sink) */
    uint32_t source_rank;
    uint32_t source_pool_id;
    const struct kvf_page_range *source_ranges;
    size_t n_source_ranges;
    const char *sink_node_id;
    uint32_t sink_rank;
    uint32_t sink_pool_id;
    const struct kvf_page_range *sink_ranges;
    size_t n_sink_ranges;
    bool last_chunk;
    const void *aux; /* last chunk only, at most 1 MiB */
    size_t aux_len;
    /* Optional lease versions (0: not given): the page count of the source
     * and sink leases as the caller knows them, e.g. after kvf_extend_lease.
     * A node learns an extension only once the lease's own node acknowledged
     * it; naming the version turns that wait into UNAVAILABLE (retry). */
    uint64_t source_lease_pages;
    uint64_t sink_lease_pages;
};

/* Submits a chunk; returns once the node admitted it. UNAVAILABLE: the node
 * does not know the room yet, or its copy of a lease is older than the
 * version named (retry); FAILED_PRECONDITION: pages outside the leases;
 * ABORTED: the room is aborting. */
KVF_PUBLIC int kvf_submit_chunk(kvf_node_client *n, const struct kvf_chunk *chunk,
                                struct kvf_status *st);

/* ---- pipelined submission (NodeLocal.SubmitChunks) ---------------------------------- */

/* Chunks on one stream without waiting for each: the node admits them in the
 * order sent (so chunk_seq order per source/sink pair holds on one stream)
 * and answers each with one result, in that order, with the checks and codes
 * of kvf_submit_chunk. A refused chunk does not end the stream. One thread
 * may send while another reads results. */
typedef struct kvf_chunk_stream kvf_chunk_stream;

/* Chunks a stream may have outstanding (sent, result not read yet). */
#define KVF_CHUNK_STREAM_WINDOW 64

/* One chunk's outcome. */
struct kvf_chunk_result {
    uint64_t chunk_seq;       /* 0 for a request the node could not decode */
    struct kvf_status status; /* OK: admitted; else what kvf_submit_chunk would return */
};

/* Opens a stream to the node (no deadline: it lives until destroyed). */
KVF_PUBLIC int kvf_chunk_stream_open(kvf_node_client *n, kvf_chunk_stream **out,
                                     struct kvf_status *st);

/* Sends a chunk and returns without its result. -RESOURCE_EXHAUSTED, nothing
 * sent, while KVF_CHUNK_STREAM_WINDOW chunks are outstanding (read a result
 * first); -UNAVAILABLE once the stream has ended (kvf_chunk_stream_result
 * says why); -FAILED_PRECONDITION after kvf_chunk_stream_close_send. */
KVF_PUBLIC int kvf_chunk_stream_send(kvf_chunk_stream *s, const struct kvf_chunk *chunk,
                                     struct kvf_status *st);

/* Waits up to `timeout_ms` (<= 0: no limit) for the next result. Returns 1
 * with *out; 0 when the stream ended cleanly (after close_send, every result
 * read); -DEADLINE_EXCEEDED when none came in time (call again); otherwise
 * -code of the stream's end (UNAVAILABLE: the node shut down; chunks still
 * outstanding then got no result and may or may not have been admitted). */
KVF_PUBLIC int kvf_chunk_stream_result(kvf_chunk_stream *s, int64_t timeout_ms,
                                       struct kvf_chunk_result *out, struct kvf_status *st);

/* No more chunks: the node ends the stream once every result is out. */
KVF_PUBLIC int kvf_chunk_stream_close_send(kvf_chunk_stream *s, struct kvf_status *st);

/* Chunks sent whose result was not read yet. */
KVF_PUBLIC size_t kvf_chunk_stream_outstanding(kvf_chunk_stream *s);

/* Cancels the stream if it has not ended and frees it. Accepts NULL; no call
 * on the stream may be in progress. */
KVF_PUBLIC void kvf_chunk_stream_destroy(kvf_chunk_stream *s);

#ifdef __cplusplus
}
#endif

#endif /* KVFENCE_KVFENCE_H */
