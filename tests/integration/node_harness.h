/*
 * node_harness.h: the shared harness of the real-process kvfence-node tests
 * (test_node_e2e, _races, _peer, _paths, _session_e2e, _stream).
 *
 * The test plays the engine: it starts kvfence-node children (nh_node_start:
 * the node's flags, a port file, a NodeLocal channel on its unix socket), a
 * control plane (nh_control_start, on kvf_proc.c), creates POSIX shm pools
 * filled with canary patterns (nh_pool_create), registers them over NodeLocal,
 * joins rooms over Control.JoinRoom (retrying while the pool is not yet known
 * to the control plane), follows rooms with Admin.GetRoom, and submits chunks
 * over NodeLocal.SubmitChunk.
 *
 * What differs between the tests is a parameter: extra node flags as a NULL
 * terminated argv list, a log file and a fault file per node (flags), page
 * size and count per pool, timeouts, expected sources and sinks, ranks.
 *
 * nh_call() and nh_submit() make no cmocka assertion (safe from threads); the
 * other helpers fail the test (cmocka) on a wrong answer or a timeout. Waits
 * are on observed state with timeouts.
 */
#ifndef KVF_TEST_NODE_HARNESS_H
#define KVF_TEST_NODE_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvf_proc.h"
#include "kvf_types.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_client.h"

#define NH_CALL_TIMEOUT_MS 5000

int64_t nh_now_ms(void);
void nh_sleep_ms(long ms);

/* cmocka setup: a zeroed fixture of `size` bytes in *state. */
int nh_fx_alloc(void **state, size_t size);

/* mkdtemp of "/tmp/kvf-<prefix>-XXXXXX" into dir (64 bytes); fails the test. */
void nh_tmpdir(char *dir, size_t size, const char *prefix);

/* ---- a kvfence-node child -------------------------------------------------------- */

struct nh_node {
    pid_t pid;
    char id[16]; /* the tag naming its files in the test directory */
    char sock[160];
    char port_file[160];
    char fault_file[160];          /* with NH_FAULT_FILE, else "" */
    char log[160];                 /* with NH_LOG_FILE, else "" (stderr of the test) */
    bool any_exit;                 /* the test cut it off: its exit status is not checked */
    struct kvf_rpc_channel *local; /* NodeLocal */
};

enum {
    NH_LOG_FILE = 1u,   /* the node's stderr goes to dir/<tag>.log */
    NH_FAULT_FILE = 2u, /* --fault-file dir/<tag>.faults */
};

/* Starts kvfence-node `node_id` against `control` with --local-socket,
 * --port-file (files in `dir` named after `tag`), --data-host 127.0.0.1
 * --data-port 0 --drain-timeout-ms 3000, then `extra` (NULL terminated; NULL
 * for none). Waits up to 10 s for its port file (written once the control
 * plane welcomed it) and opens the NodeLocal channel. 0 or -1. */
int nh_node_start(struct nh_node *np, const char *dir, const char *tag, const char *node_id,
                  const char *control, const char *const *extra, unsigned flags);

/* SIGCONT (a test may have stopped it), SIGTERM, wait up to `ms`, then
 * SIGKILL. The wait status, -1 if none ran, -2 if it had to be killed.
 * Closes the NodeLocal channel. */
int nh_node_stop(struct nh_node *np, long ms);

/* SIGKILL and reap; marks it any_exit; its NodeLocal channel is closed. */
void nh_node_kill9(struct nh_node *np);

/* Stops every node (nh_node_stop, `ms`): each not any_exit must exit 0 on
 * SIGTERM. 0, or -1 after logging which did not. */
int nh_nodes_stop(struct nh_node *const *nodes, size_t n, long ms);

/* Copies the node's log file to stderr (with NH_LOG_FILE). */
void nh_node_dump_log(const struct nh_node *np);

/* Removes the node's files (port, socket, fault file and its .tmp, log). */
void nh_node_remove_files(const struct nh_node *np);

/* ---- the node's log and fault file ------------------------------------------------ */

/* Lines of the node's log file (NH_LOG_FILE) holding `needle` and, when `k`
 * is not NULL, the room's tag "room":"ID:GEN". 0 while there is no log. */
unsigned nh_log_count(const struct nh_node *np, const char *needle, const kvf_room_key *k);

/* Waits up to `timeout_ms` until nh_log_count(np, needle, k) >= `min`; fails
 * the test on the timeout. */
void nh_wait_log(const struct nh_node *np, const char *needle, const kvf_room_key *k, unsigned min,
                 int64_t timeout_ms);

/* Writes `text` to the node's fault file (NH_FAULT_FILE) atomically
 * (kvf_file_write: a .tmp beside it, then rename), so the node never reads
 * half a file. Does not wait for the node to load it. Fails the test. */
void nh_fault_file_write(const struct nh_node *np, const char *text);

/* nh_fault_file_write, then waits up to `timeout_ms` until the node logged
 * one more "fault: config loaded" than before (it needs NH_LOG_FILE too).
 * Fails the test. */
void nh_set_faults(const struct nh_node *np, const char *text, int64_t timeout_ms);

/* ---- the control plane ------------------------------------------------------------- */

/* kvf_proc_start of kvfence-control with `args`, and a wait-for-ready channel
 * to it in *ch. Fails the test. */
void nh_control_start(struct kvf_proc *cp, struct kvf_rpc_channel **ch, const char *const *args);

/* SIGTERM the control plane when running: it must exit 0 (10 s). Then
 * kvf_proc_kill. 0, or -1 after logging. */
int nh_control_stop(struct kvf_proc *cp);

/* ---- shm pools ------------------------------------------------------------------- */

struct nh_pool {
    char name[64];
    uint8_t *mem;
    uint32_t pool_id;
    uint32_t page_size;
    uint32_t page_count;
    bool by_name; /* RegisterPool names it (host_shm) instead of handing its fd over */
};

typedef uint8_t (*nh_canary_fn)(uint32_t page, uint32_t i);

/* Two canary patterns (a source's and a sink's). */
uint8_t nh_canary1(uint32_t page, uint32_t i);
uint8_t nh_canary2(uint32_t page, uint32_t i);

/* Creates and maps "/kvf-<prefix>-<pid>-<tag>", page_size * page_count bytes,
 * each byte fill(page, i) (NULL: zeros). 0 or -1. */
int nh_pool_create(struct nh_pool *p, const char *prefix, const char *tag, uint32_t page_size,
                   uint32_t page_count, nh_canary_fn fill);

/* Unmaps and unlinks; safe on a pool never created. */
void nh_pool_destroy(struct nh_pool *p);

/* Checks every byte of `sink`: pages [dfirst, +count) hold src_canary's
 * pages [sfirst, +count) (a copy landed there), every other page still holds
 * sink_canary. Fails the test naming `label`, the page and the byte. */
void nh_check_pool(const struct nh_pool *sink, nh_canary_fn sink_canary, uint32_t dfirst,
                   uint32_t count, nh_canary_fn src_canary, uint32_t sfirst, const char *label);

/* Seeded page patterns, for tests that give each room or pool its own bytes:
 * byte `i` of page `page` under `seed` (157 is odd: two seeds under 256 apart
 * differ at every byte). */
uint8_t nh_seed_byte(uint32_t seed, uint32_t page, uint32_t i);
/* Fills pages [first, +count) of `p` with `seed`'s pattern. */
void nh_seed_fill(struct nh_pool *p, uint32_t first, uint32_t count, uint32_t seed);
/* True when pages [first, +count) of `p` hold `seed`'s pattern as if written
 * at pages starting `as_first` (a copy from elsewhere), byte for byte; else
 * false with the first difference in `why`. */
bool nh_seed_holds(const struct nh_pool *p, uint32_t first, uint32_t count, uint32_t seed,
                   uint32_t as_first, char *why, size_t whylen);
/* nh_seed_holds, failing the test ("canary: ...") when it does not. */
void nh_seed_check(const struct nh_pool *p, uint32_t first, uint32_t count, uint32_t seed,
                   uint32_t as_first);

/* ---- RPCs ------------------------------------------------------------------------- */

/* One unary call; returns the status code (st filled), *resp_p (free it) on
 * OK. No cmocka assertion. */
int nh_call(struct kvf_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
            uint8_t **resp_p, size_t *len_p, struct kvf_rpc_status *st);

/* NodeLocal.RegisterPool of `p` (host shm) with `page_size` (page count:
 * the pool's bytes / page_size), as engines do it: the object's descriptor
 * handed over on the node's fd socket, then host_fd naming its handle
 * (host_shm naming the object when p->by_name). The status code; the pool id
 * in *id_p. */
int nh_register_pool_sized(struct nh_node *np, const struct nh_pool *p, uint32_t page_size,
                           uint32_t *id_p, struct kvf_rpc_status *st);

/* The same with the pool's page size; fails the test unless OK. */
uint32_t nh_register_pool(struct nh_node *np, const struct nh_pool *p);

/* NodeLocal.UnregisterPool of `pool_id` on `np`, retried every 20 ms while
 * the node still holds a room's lifetime on it (FAILED_PRECONDITION until
 * it drained), up to `timeout_ms`; fails the test on another answer or the
 * timeout. */
void nh_unregister_pool(struct nh_node *np, uint32_t pool_id, int64_t timeout_ms);

/* Control.JoinRoom of one participant of room `room_id` (`nsrc` sources,
 * `nsink` sinks; QUIESCE_V1): `node` rank `rank`, pages [first, +count) of
 * `pool_id`. Retries for up to `timeout_ms` while the node's pool is not yet
 * known to the control plane (the PoolUpdate races the engine's JoinRoom).
 * *lease_p gets the lease id when not NULL. */
kvf_room_key nh_join(struct kvf_rpc_channel *ch, uint64_t room_id, uint32_t nsrc, uint32_t nsink,
                     const char *node, uint32_t rank, int role, uint32_t pool_id, uint32_t first,
                     uint32_t count, int64_t timeout_ms, uint64_t *lease_p);

/* A room of one source and one sink, rank 0 each: `src_node` pages [sfirst,
 * +count) of `src_pool`, `sink_node` pages [dfirst, +count) of `sink_pool`
 * (nh_join). Both joins must give the same room; waits for it ACTIVE. */
kvf_room_key nh_join_pair(struct kvf_rpc_channel *ch, uint64_t room_id, const char *src_node,
                          uint32_t src_pool, uint32_t sfirst, const char *sink_node,
                          uint32_t sink_pool, uint32_t dfirst, uint32_t count, int64_t timeout_ms);

/* Admin.GetRoom (free it); fails the test unless OK. */
Kvfence__V1__RoomInfo *nh_get_room(struct kvf_rpc_channel *ch, kvf_room_key k);

/* The room's state; *released_p: how many of its leases are RELEASED,
 * *leases_p: its participants (each may be NULL). */
int nh_room_state(struct kvf_rpc_channel *ch, kvf_room_key k, unsigned *released_p,
                  unsigned *leases_p);

/* Waits up to `timeout_ms` for `want` (terminal states: with every
 * participant's lease RELEASED); returns the room's abort reason. */
int nh_wait_room_state(struct kvf_rpc_channel *ch, kvf_room_key k, Kvfence__V1__RoomState want,
                       int64_t timeout_ms);

/* Control.AbortRoom with `detail`; fails the test unless OK. */
void nh_abort_room(struct kvf_rpc_channel *ch, kvf_room_key k, const char *detail);

/* Control.ExtendLease of `lease_id` in `k` by pages [first, first + count);
 * fails the test unless OK. */
void nh_extend_lease(struct kvf_rpc_channel *ch, kvf_room_key k, uint64_t lease_id, uint32_t first,
                     uint32_t count);

/* One NodeLocal.SubmitChunk: `n` (1..4) ranges, source pages [sfirst[i],
 * +count[i]) -> sink pages [dfirst[i], +count[i]). */
struct nh_chunk {
    uint32_t source_rank;
    uint64_t seq;
    uint32_t source_pool;
    const char *sink_node;
    uint32_t sink_rank;
    uint32_t sink_pool;
    unsigned n;
    uint32_t sfirst[4], dfirst[4], count[4];
    bool last;
    const uint8_t *aux;
    size_t aux_len;
    uint64_t source_lease_pages;
};

/* The status code (st filled). No cmocka assertion. */
int nh_submit(struct kvf_rpc_channel *local, kvf_room_key k, const struct nh_chunk *c,
              struct kvf_rpc_status *st);

/* A last chunk of one range, seq 1, on `np`: source pages [sfirst, +count)
 * of `source_pool` -> [dfirst, +count) of `sink_pool` on `sink_node` (ranks
 * 0). Fails the test unless OK. */
void nh_submit_one_ok(struct nh_node *np, kvf_room_key k, uint32_t source_pool,
                      const char *sink_node, uint32_t sink_pool, uint32_t sfirst, uint32_t dfirst,
                      uint32_t count);

/* Waits up to `timeout_ms` until `np` has the room's update: a probe
 * SubmitChunk naming source rank 99 (in no lease), seq 1, source page 0 of
 * `source_pool` -> page `dfirst` of `sink_pool` on `sink_node`, answers
 * UNAVAILABLE before, FAILED_PRECONDITION after; any other answer fails the
 * test. */
void nh_wait_node_knows(struct nh_node *np, kvf_room_key k, uint32_t source_pool,
                        const char *sink_node, uint32_t sink_pool, uint32_t dfirst,
                        int64_t timeout_ms);

/* ---- the lease watch (Control.WatchLeases) ------------------------------------------ */

/* A WatchLeases stream that counts the RELEASED events of each lease (the
 * first NH_WATCH_MAX lease ids seen). */
#define NH_WATCH_MAX 64

struct nh_watch {
    struct kvf_rpc_client_stream *cs;
    uint64_t ids[NH_WATCH_MAX];
    unsigned counts[NH_WATCH_MAX];
    unsigned n;
};

/* Opens the stream on `ch` and reads up to its `synced` event (up to
 * `timeout_ms`): releases from then on are live. Fails the test. */
void nh_watch_open(struct nh_watch *w, struct kvf_rpc_channel *ch, int64_t timeout_ms);

/* Cancels and closes the stream when open. */
void nh_watch_close(struct nh_watch *w);

/* Reads the events that arrive for `ms`; fails the test if the stream ends. */
void nh_watch_pump(struct nh_watch *w, int64_t ms);

/* How many RELEASED events lease `id` had so far. */
unsigned nh_watch_count(const struct nh_watch *w, uint64_t id);

/* The lease ids of room `k` (at most 2, from Admin.GetRoom): how many. */
unsigned nh_room_leases(struct kvf_rpc_channel *ch, kvf_room_key k, uint64_t ids[2]);

/* Both leases of `k` were RELEASED exactly once on the watch: waits up to
 * `timeout_ms` for the events, then reads 100 ms more for a duplicate. */
void nh_watch_released_once(struct nh_watch *w, struct kvf_rpc_channel *ch, kvf_room_key k,
                            int64_t timeout_ms);

/* No lease of `k` was released, on the watch (50 ms read) nor in GetRoom:
 * `what` (the work still in flight) names it in the failure. */
void nh_watch_none_released(struct nh_watch *w, struct kvf_rpc_channel *ch, kvf_room_key k,
                            const char *what);

/* ---- teardown --------------------------------------------------------------------- */

/* The fixture's end: SIGCONT the control plane (a test may have stopped it),
 * stop the nodes (`node_ms` each; nh_nodes_stop), close `ch`, stop the control
 * plane (nh_control_stop), destroy the pools; with `dir`, dump each node's
 * log file to stderr, remove the nodes' files and the directory. 0, or -1
 * when a process did not exit 0. */
int nh_teardown(struct kvf_proc *cp, struct kvf_rpc_channel *ch, struct nh_node *const *nodes,
                size_t nnodes, long node_ms, struct nh_pool *const *pools, size_t npools,
                const char *dir);

#endif /* KVF_TEST_NODE_HARNESS_H */
