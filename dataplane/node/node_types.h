/*
 * node_types.h: the data types the modules of kvfence-node share (the node,
 * its rooms, members, pairs, peers, pools and jobs) and their limits; no
 * function of any module is declared here: each module's header declares
 * its own (docs/node.md, "Module structure").
 *
 * DESIGN (threads): the owner thread (node.c, owner_main) alone touches the
 * lifetime table, the rooms' mutable fields, the pools list, the transport's
 * control calls (add_peer, connect, fence_peer, poll) and the session stream's
 * send side. Everyone else posts a struct node_job (a run function, its
 * argument and the argument's free function) to its queue (node_owner.h; the
 * session through the ops node.c gave it):
 *   - the control session thread: a stream opened (send Hello on it), one
 *     decoded ControlMessage, a stream closed (stop sending; the session
 *     thread waits for the owner's answer before it frees the stream);
 *   - NodeLocal handlers (gRPC CQ threads): RegisterPool, SubmitChunk,
 *     UnregisterPool; the owner completes the call;
 *   - TCP receiver threads: a frame event (an admitted frame landed or was cut);
 *   - the peer channel's thread (peer_link.c): a delivered AuxData,
 *     TransferStatus or ChunkNotice (copied), a gap (an OUT_OF_ORDER drop), an
 *     RDMA link message (packed: rdma_link.c);
 *   - NodeLocal.Watch streams (watch.c): a new watcher (send the snapshot);
 *   - NodeLocal.SubmitChunks streams (submit_stream.c): one request (the owner
 *     queues its result on the stream).
 * Watchers live in a list under `watch_lock` (CQ threads add and remove them;
 * the owner sends their events under it: sends only queue, never block).
 * SubmitChunks streams are listed under it the same way.
 * TCP receiver threads also read the room map in the transport's `check`
 * callback: rooms are published under `rooms_lock` (a rwlock; the owner takes
 * it for writing when it adds a room or replaces its members, receivers for
 * reading); a room is freed only when the rules core forgets it (terminal,
 * drained, beyond the retention count), after it was unlinked under the
 * lock for writing, so a reader holding it for reading never sees it go. The peer
 * channel's admission callback reads the room map the same way.
 */
#ifndef KVF_NODE_TYPES_H
#define KVF_NODE_TYPES_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"
#include "kvfence/v1/node.pb-c.h"
#include "lifetime.h"
#include "local_access.h"
#include "node.h"
#include "node_core.h"
#include "peer_channel.h"
#include "pool.h"
#include "rpc_client.h"
#include "rpc_server.h"
#include "transport.h"

#define NODE_ID_MAX     KVF_NODE_ID_MAX
#define NODE_MAX_POOLS  64
#define NODE_MAX_PEERS  64
#define NODE_FRAME_MAX  (256u * 1024u) /* largest TCP frame payload */
#define NODE_POLL_BATCH 64
#define NODE_RESYNC_MAX 4096 /* lifetimes in one Resync message (more: more messages) */

/* ---- pools ------------------------------------------------------------------- */

struct node_pool {
    uint32_t id;
    uint32_t page_size;
    uint32_t page_count;
    uint32_t rank;
    struct kvf_pool *pool; /* the mapping (dataplane/pool) */
    uint8_t *base;         /* its first page */
    char key[257];         /* the memory's identity on this host (Pool.pool_key); "" none */
};

/* ---- rooms ------------------------------------------------------------------- */

struct node_range {
    uint32_t first;
    uint32_t count;
};

struct node_member {
    char node_id[NODE_ID_MAX + 1];
    uint64_t incarnation;
    uint32_t rank;
    int role; /* Kvfence__V1__Role */
    uint32_t pool_id;
    uint32_t page_size; /* of its pool, from RoomUpdate; 0: not sent (older control plane) */
    struct node_range *ranges;
    size_t nranges;
    uint64_t pages; /* pages in the lease */
    bool local;     /* on this node */
    /* Owner thread: progress of a local participant. */
    uint64_t last_seq;     /* source: last admitted chunk_seq */
    uint32_t chunks_open;  /* source: chunks with frames in flight */
    bool last_submitted;   /* source: the last chunk was admitted */
    bool failed;           /* a chunk failed */
    uint64_t bytes_landed; /* sink: payload bytes of frames that landed */
    /* Sink: which lease pages whole-page frames covered, one bit per page of
     * [map_first, map_first + map_pages) (the span of the ranges), and how
     * many bits are set. Completion counts pages covered, not bytes, so that
     * pages written twice are not counted twice. */
    uint64_t *landed_map;
    uint32_t map_first, map_pages;
    uint64_t pages_landed;
    uint64_t status_bytes; /* sink: bytes named by ok TransferStatus messages */
    bool completed;        /* Completed was sent */
    /* Sink: receives into its pages are refused from now on (set under
     * rooms_lock, write, when it completes: read by the TCP check). */
    bool rx_closed;
};

struct node_intro {
    char node_id[NODE_ID_MAX + 1];
    uint64_t incarnation;
};

/* Owner thread: one source rank's transfer to one sink rank (peer_link.c). */
struct node_pair {
    uint32_t src_rank;
    uint32_t sink_rank;
    char sink_node[NODE_ID_MAX + 1];
    uint64_t sink_incarnation;
    uint64_t chunks;     /* admitted */
    uint64_t bytes;      /* payload bytes admitted */
    uint64_t last_seq;   /* last admitted chunk_seq */
    uint32_t open;       /* chunks with frames in flight */
    bool last_submitted; /* the last chunk was admitted */
    bool failed;
    bool status_sent;
    char error[128];
    uint8_t *aux; /* the last chunk's aux bytes, until sent */
    size_t aux_len;
    struct node_pair *next;
};

struct node_room {
    kvf_room_key key;
    uint64_t incarnation; /* the node incarnation the room was opened under */
    /* The rules' record (node_core.h): the lifetime (core.lt), whether the
     * room is aborting, its token and notice id, whether it drained and
     * Drained went out. Written by the core only; the owner reads it (and
     * receivers read core.lt under rooms_lock). */
    struct kvf_ncore_room core;
    /* Replaced by the owner under rooms_lock (write); read by receivers. */
    struct node_member *members;
    size_t nmembers;
    bool have_update; /* a RoomUpdate arrived (members known) */
    /* The peer incarnations the room's update introduced (with `members`):
     * the peer channel accepts their envelopes before their members are
     * published here (docs/node.md, "Ordered room updates"). */
    struct node_intro *intro;
    size_t nintro;
    /* Owner thread only. */
    int state;           /* Kvfence__V1__RoomState last learned */
    int abort_reason;    /* Kvfence__V1__AbortReason */
    uint32_t *peer_refs; /* peer slots this room's update named (kvf_ncore_peer_ref) */
    size_t npeer_refs;
    struct node_pair *pairs;
    struct node_peer_msg *done_pending; /* ok TransferStatus, until the sink completes */
    /* Written by the owner under rooms_lock (write): the peer channel must
     * answer LATE (aborting, admission closed, or drained). */
    bool peer_closed;
    struct node_room *next;  /* every room, newest first */
    struct node_room *hnext; /* the same index bucket */
};

/* ---- peers ------------------------------------------------------------------- */

struct node_peer {
    char node_id[NODE_ID_MAX + 1];
    uint64_t incarnation;
    uint64_t tcp_id; /* the id in TCP hellos */
    char host[64];
    uint16_t port;
    bool connected;
    bool fenced;
    bool rdma;        /* it advertises the RDMA feature (xport.c) */
    char peer_ep[96]; /* its PEER_ZMQ endpoint, "" if not announced */
    bool have_key;    /* introduced: its peer key (RoomUpdate), pair secret set */
    uint8_t key[KVF_PEER_KEY_SIZE];
};

/* A delivered peer envelope, copied for the owner (peer_link.c's job). */
struct node_peer_msg {
    struct node_peer_msg *next; /* done_pending */
    kvf_room_key room;
    char sender[NODE_ID_MAX + 1];
    uint64_t sender_incarnation;
    int body; /* Kvfence__V1__PeerEnvelope__BodyCase */
    uint32_t source_rank;
    uint32_t sink_rank;
    uint64_t chunk_seq; /* aux, chunk notice */
    uint32_t pool_id;   /* chunk notice: sink pool (ranges in data[], bytes: length) */
    int transport;      /* chunk notice: Kvfence__V1__TransportKind */
    bool ok;            /* status */
    uint64_t chunks, last_chunk_seq, bytes;
    char error[256];
    size_t len; /* aux bytes */
    uint8_t data[];
};

/* ---- jobs -------------------------------------------------------------------- */

/* A job: what another thread asks the owner thread to do (node_owner.h).
 * The poster builds its own argument; the owner calls run(n, arg) and then
 * free_arg(arg). A job dropped without running (the owner stopped, or the
 * post was refused) has free_arg called all the same, so the argument is
 * freed exactly once on every path; free_arg also answers what the
 * argument still owes (a unary call not yet completed fails UNAVAILABLE). */
struct node_job {
    struct node_job *next;
    void (*run)(struct kvf_node *n, void *arg); /* owner thread */
    void *arg;
    void (*free_arg)(void *arg); /* NULL: nothing to free */
    /* Test faults (faults.h): asked before run; true when the fault module
     * kept the job (it runs, reposts or frees it later). NULL: never held. */
    bool (*hold)(struct kvf_node *n, struct node_job *j);
    bool kept; /* hold kept it: not freed after */
    /* Synchronous jobs: the poster waits for `done`; the job and its
     * argument stay the poster's (on its stack). */
    bool sync;
    bool done;
};

/* ---- the node ---------------------------------------------------------------- */

struct node_metrics;

struct kvf_node {
    const struct node_owner_ops *owner_ops; /* node.c's actions (node_owner.h) */
    struct kvf_node_opts opts;
    char node_id[NODE_ID_MAX + 1];
    char local_socket[256];
    char data_host[64];
    uint64_t incarnation;

    /* Job queue. */
    pthread_mutex_t qlock;
    int qwake;            /* eventfd: a job was posted to an empty queue (the owner's poll) */
    pthread_cond_t qdone; /* a synchronous job is done; readiness changed */
    struct node_job *qhead, *qtail;
    pthread_t owner;
    bool owner_started;

    /* Readiness and fatal errors (under qlock). */
    bool welcomed;
    uint64_t welcomes;      /* Welcomes so far (main rewrites the port file) */
    uint16_t welcomed_port; /* the data port the last welcomed Hello announced */
    atomic_int fatal;
    atomic_bool stopping; /* the session thread must end */

    /* Owner thread state. The rules core (node_core.h) owns the lifetime
     * table; `lts` is its table, borrowed. */
    struct kvf_ncore *core;
    struct kvf_lt_table *lts;
    struct node_pool pools[NODE_MAX_POOLS];
    uint32_t npools;
    uint32_t next_pool_id;
    struct node_peer peers[NODE_MAX_PEERS];
    uint32_t npeers;
    struct kvf_transport *tcp;
    /* post / poll / fence go here: n->tcp, or the fault wrapper around it. */
    struct kvf_transport *tcp_io;
    struct node_faults *faults; /* NULL unless --fault-file (faults.h) */
    uint16_t data_port;
    struct kvf_rpc_client_stream *session; /* the stream Hello went out on */
    bool session_welcomed;
    uint64_t hb_seq;
    uint64_t hb_interval_ms;
    int64_t next_hb_ms;
    bool stop_requested;
    int64_t stop_deadline_ms;
    int stop_result;
    bool owner_exit;

    /* Session liveness (control_session.c; owner thread). */
    uint32_t node_ttl_ms;    /* from Welcome; 0 until welcomed */
    int64_t last_contact_ms; /* last sign of life of a welcomed session */
    bool cp_acks_heartbeats; /* the control plane answers heartbeats (HeartbeatAck) */
    bool welcomed_before;    /* this incarnation was welcomed once: Resync on re-attach */
    bool self_fenced;        /* this incarnation fenced itself; the next one is fresh */
    /* The stream the session thread must drop (a self-fence gave it up). */
    struct kvf_rpc_client_stream *_Atomic reset_stream;
    uint64_t self_fences; /* how many times (logs, tests) */

    /* The host lock (host_lock.h) and the witnesses it gives (owner thread). */
    int host_lock_fd;
    char host_lock_path[320];
    uint64_t witnessed_gone;      /* Hello.witnessed_gone: incarnations up to it are gone */
    uint64_t retired_incarnation; /* the last one this process gave up (self-fence), 0: none */
    bool retired_witness_sent;    /* its Witness went out on a welcomed session */

    /* Rooms: list published under rooms_lock, with a hash index by key (the
     * TCP check and SubmitChunk find a room per frame). A room that ended
     * and drained is kept for a bounded count (node_core.h, retention) and
     * then unlinked under the lock (write) and freed (node_room_free). */
    pthread_rwlock_t rooms_lock;
    struct node_room *rooms;
    struct node_room **room_index; /* room_index_cap buckets, a power of 2 */
    size_t room_index_cap;
    size_t room_count;

    /* Control session thread, and the owner as it sees it (control_session.h). */
    const struct node_session_ops *session_ops;
    void *session_ctx;
    struct kvf_rpc_channel *channel;
    pthread_t session_thread;
    bool session_started;

    /* NodeLocal server. */
    struct kvf_rpc_server *local_srv;
    /* Who may call it (set at start, then read-only), and the fd socket
     * beside it whose handle table is shared with the owner thread
     * (local_access.h). */
    struct node_access access;
    struct node_gate *gate;
    /* grpc.health.v1 on the same socket (node_health.c): the registry (its
     * own mutex), and what the owner last set in it (owner thread). */
    struct kvf_health *health;
    bool health_serving;

    /* Local transport, staging, transport choice (xport.c; owner thread). */
    struct node_xport *xp;
    struct node_rdma *rdma; /* rdma_link.c; NULL when RDMA is off */
    /* Peer channel (peer_link.c). */
    struct kvf_peer_channel *peerch;
    struct kvf_peer_keypair keys; /* this incarnation's peer keys (peer_keys.h); owner thread */
    char peer_ep[96];             /* ours, announced in Hello */
    atomic_bool peer_stopping;    /* admission stops waiting for room updates */
    /* Who takes a delivered ChunkNotice for a local sink (owner thread): the
     * RDMA link's node_rdma_notice_in, set by node.c, so that the peer link
     * does not call up into it. */
    void (*chunk_notice_in)(struct kvf_node *n, struct node_room *r, struct node_member *m,
                            const struct node_peer_msg *pm);
    /* Who takes a delivered link message (owner thread): the RDMA link's
     * node_rdma_link_msg, set by node.c, for the same reason. */
    void (*link_msg_in)(struct kvf_node *n, const struct node_peer_msg *pm);

    /* NodeLocal.Watch streams (watch.c). */
    pthread_mutex_t watch_lock;
    struct node_watcher *watchers;
    unsigned watchers_chunks;                       /* watchers with include_chunks (watch_lock) */
    uint64_t watch_chunk_calls, watch_chunk_packed; /* owner; logged at exit */
    struct node_substream *substreams;              /* SubmitChunks streams (submit_stream.c) */

    /* Metrics (node_metrics.h): lock-free hooks, any thread; NULL: none. */
    struct node_metrics *metrics;
};

#endif /* KVF_NODE_TYPES_H */
