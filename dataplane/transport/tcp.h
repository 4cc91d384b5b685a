/*
 * tcp.h: the TCP data transport (struct kvf_transport_ops "tcp").
 *
 * A node listens on one TCP port and opens one outbound connection to each
 * peer it writes to; a peer's writes arrive on the connection it opened. Pages
 * are written straight from the socket into the registered pool (a device
 * pool: through a host bounce buffer and kvf_pool_write), but only
 * after the receiver checked the frame's header against the pool and asked
 * the node (the `check` callback) whether the room-generation's sink lease
 * covers the pages and its admission is open (docs/design.md §2.3).
 *
 * Wire format (all integers little-endian; version 2). This is a fixed binary
 * header, not protobuf (peer.proto points here): a fixed size is read with one
 * recv, needs no allocation and no length prefix, and every field has a fixed
 * range to check before anything variable is read.
 *
 * Handshake: a mutual HMAC-SHA256 challenge-response with the secret of the
 * pair (kvf_transport_tcp_set_peer_key: the node derives it from the two
 * incarnations' peer keys, peer_keys.h), before any frame is read:
 *   hello, connector -> acceptor (56 bytes):
 *     u32 magic 'KVFH' (0x4846564b)   u16 version (2)   u16 flags (0)
 *     u64 from_node   u64 to_node     u8 nonce_c[32]
 *   challenge, acceptor -> connector (68 bytes):
 *     u32 magic 'KVFC' (0x4346564b)   u8 nonce_a[32]
 *     u8 mac_a[32] = HMAC(K, "kvfence tcp v2 acceptor" || hello || nonce_a)
 *   proof, connector -> acceptor (36 bytes):
 *     u32 magic 'KVFP' (0x5046564b)
 *     u8 mac_c[32] = HMAC(K, "kvfence tcp v2 connector" || hello || nonce_a)
 * Each side checks the other's MAC (CRYPTO_memcmp) with the secret of the peer
 * the hello names; the ids are only a lookup key. Fresh nonces on both sides
 * make a recorded handshake useless; the two labels keep one side's MAC from
 * serving as the other's. The acceptor runs every handshake itself, without a
 * thread per connection: at most opts.max_pending connections are in it at
 * once (a new one beyond that evicts the oldest), each is dropped at
 * opts.hello_timeout_ms, and only an authenticated connection gets its
 * receiver thread (at most KVF_TCP_MAX_RX_PER_PEER per peer). Every refusal is
 * counted (conns_refused and its reason's counter) and logged (rate-limited).
 * The connector's sender thread checks the challenge before its first frame:
 * a connector never sends page bytes to a port that cannot prove the secret.
 * What the handshake does not give: frames are not encrypted nor MACed, so an
 * attacker on the path (who can inject into an established TCP stream) is
 * out of scope here (docs/security.md, "Data channels").
 *
 *   data frame header (64 bytes), then `length` payload bytes:
 *     u32 magic 'KVFD' (0x4446564b)   u16 version (2)   u16 flags (0)
 *     u64 room_id   u64 generation     u64 seq (1, 2, ... per connection)
 *     u32 sink_pool u32 first_page     u32 page_count   u32 layout
 *     u64 offset    u64 length
 *
 * `layout` is the source pool's page layout (kvf_pool_layout: 0 for one span
 * a page, a fingerprint of the buffers' slot sizes for a multi-buffer pool;
 * this field was "reserved (0)" before, so a node older than multi-buffer
 * pools closes the connection on a nonzero one). A well-formed frame whose
 * layout and the sink pool's are both nonzero and differ is admitted, then
 * refused without a byte written: on_frame with -EPROTO (frames_rejected).
 *
 * A frame is well formed when magic, version and flags are as
 * above, seq is the previous one + 1, the pool is registered, 1 <= page_count,
 * first_page + page_count <= the pool's pages, offset < page_size, length >= 1
 * and offset + length lies in ((page_count - 1) * page_size, page_count *
 * page_size]: the named pages are exactly the pages written. A malformed frame
 * closes the connection (counted in frames_malformed) before any byte of it is
 * written. A well-formed frame that `check` refuses is read into a scratch
 * buffer and dropped (frames_rejected); the connection goes on.
 *
 * Receive-side ops: `check` admits the frame as an op of the room's lifetime
 * (kvf_lt_admit into the `op` it is given, kind KVF_LT_OP_TCP_FRAME); the
 * receiver retires it when the payload has landed (OK) or the read stopped
 * (ERROR, or FLUSHED when a fence stopped it), then calls `on_frame`. So an
 * aborted room cannot drain while bytes of one of its frames are still being
 * written into its pages, and fence_peer returns only after that retirement.
 *
 * DESIGN (threads): one acceptor thread, which also runs the handshakes of
 * the connections it accepted (poll, non-blocking sockets, deadlines); one
 * receiver thread per authenticated inbound connection, which alone reads its
 * socket and writes into the pools; one
 * sender thread per outbound connection, which alone writes its socket and
 * takes xfers from that connection's queue (a mutex and condition variable;
 * post_write from any thread appends). A frame is written by one thread with
 * one header, so frames never interleave. Completions go on one
 * mutex-protected list that poll() empties; poll never waits for I/O. Other
 * threads touch a socket only with shutdown(2) (fence, destroy), which wakes
 * its owner; the descriptor is closed after its owner thread is joined.
 * Peers, pools and counters are shared: peers and pools under the transport's
 * lock, counters atomic.
 *
 * Send side, closed lifetimes: when the sender takes a frame off the queue
 * whose op's lifetime is no longer open (kvf_lt_is_open: an abort notice or
 * node shutdown closed admission, or a quarantine shut it), it does not write
 * it: the frame completes FLUSHED with status -ECANCELED and nothing of it
 * reaches the socket (frames_skipped). The other frames keep their order. A
 * frame the sender already started is written whole even if its lifetime
 * closes meanwhile (or fails with the connection), so a receiver never sees
 * half a frame. An aborted room thus drains after at most the frame on the
 * wire (plus what already sits in the socket buffers), however many were
 * queued.
 */
#ifndef KVF_TRANSPORT_TCP_H
#define KVF_TRANSPORT_TCP_H

#include <stdbool.h>
#include <stdint.h>

#include "transport.h"

struct kvf_pool;

#define KVF_TCP_HELLO_SIZE      56u
#define KVF_TCP_CHALLENGE_SIZE  68u
#define KVF_TCP_PROOF_SIZE      36u
#define KVF_TCP_HEADER_SIZE     64u
#define KVF_TCP_MAGIC_HELLO     0x4846564bu
#define KVF_TCP_MAGIC_CHALLENGE 0x4346564bu
#define KVF_TCP_MAGIC_PROOF     0x5046564bu
#define KVF_TCP_MAGIC_DATA      0x4446564bu
#define KVF_TCP_VERSION         2u
#define KVF_TCP_SECRET_SIZE     32u
#define KVF_TCP_MAX_RX_PER_PEER 4u /* authenticated inbound connections per peer at once */

/*
 * Sink-lease check, on a receiver thread, once per well-formed frame and
 * before any byte of it is written. Returns 0 after admitting `op` (zeroed on
 * entry) into the room's lifetime with kvf_lt_admit(lt, op,
 * KVF_LT_OP_TCP_FRAME, peer), or a negative errno to refuse the frame (room
 * unknown, aborting, or pages outside its ACTIVE sink lease). A 0 without an
 * admitted op counts as a refusal. -EAGAIN means "not known here yet" (the
 * sink node has not processed the room's update, while the source already
 * has): the receiver asks again, every millisecond, for up to
 * opts.check_wait_ms before it refuses the frame. Must not block for long:
 * the connection waits, and a fence of `peer` waits for it.
 */
typedef int (*kvf_tcp_check_fn)(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                                uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op);

/*
 * After an admitted frame's op is retired, on the receiver thread. `room`,
 * `pool_id`, `first_page` and `page_count` are the frame's own, as its header
 * named them and `check` admitted them, so the caller needs no state carried
 * from check to here (one peer may have several inbound connections at once,
 * e.g. across a reconnect). `status` is 0 when all `bytes` landed, else -errno
 * (the read stopped part way, so the pages hold a partial write; or -ENOENT
 * with `bytes` 0: the pool was removed after the check, nothing landed).
 * `drained` says the retirement drained the lifetime: tell its owner thread
 * (kvf_lt_take_drained there).
 */
typedef void (*kvf_tcp_frame_fn)(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                                 uint32_t first_page, uint32_t page_count, uint64_t bytes,
                                 int status, bool drained);

/*
 * The receiver is about to wait: it called `on_frame` since the last
 * `on_idle` and finds no next header in its socket, or it delivered
 * KVF_TCP_IDLE_FRAMES frames or KVF_TCP_IDLE_BYTES payload bytes since the
 * last call, or it is about to end. On the receiver thread. Lets the caller
 * hand a batch of frame events on with one wake-up instead of one per frame;
 * every on_frame is followed by an on_idle within those bounds. A wait in the
 * middle of a payload does not count (a sender writes each frame whole, so
 * only a stalled sender leaves one half sent): the events before it wait for
 * that frame, or for the connection to end.
 */
typedef void (*kvf_tcp_idle_fn)(void *ctx);

#define KVF_TCP_IDLE_FRAMES 16u
#define KVF_TCP_IDLE_BYTES  (1024u * 1024u)

struct kvf_transport_tcp_opts {
    uint64_t node_id;            /* this node (incarnation), carried in hellos; != 0 */
    const char *bind_host;       /* numeric IPv4; default "127.0.0.1" */
    uint16_t port;               /* 0: any free port (kvf_transport_tcp_port) */
    uint32_t max_peers;          /* peer indices are < max_peers; default 64 */
    uint32_t max_pools;          /* default 64 */
    kvf_tcp_check_fn check;      /* required */
    uint32_t check_wait_ms;      /* how long an -EAGAIN from check, or a hello from a peer not
                                    added yet, is waited for; default 2000 */
    uint32_t hello_timeout_ms;   /* a connection must finish its handshake within this, both
                                    sides; default 5000 (> check_wait_ms: the acceptor may wait
                                    that long for the peer to be added) */
    uint32_t max_pending;        /* connections in the handshake at once; default 64 */
    uint32_t connect_timeout_ms; /* an outbound connect must be accepted by the peer's kernel
                                    within this (a blackholed address never answers); its
                                    queued frames then fail -ETIMEDOUT; default 10000 */
    kvf_tcp_frame_fn on_frame;   /* may be NULL */
    kvf_tcp_idle_fn on_idle;     /* may be NULL */
    void *ctx;
};

struct kvf_transport_tcp_stats {
    uint64_t frames_sent;        /* written whole to a socket (completed OK) */
    uint64_t bytes_sent;         /* payload bytes of those */
    uint64_t frames_received;    /* landed whole in a pool */
    uint64_t bytes_received;     /* payload bytes of those */
    uint64_t frames_rejected;    /* refused by `check`, drained to scratch */
    uint64_t frames_malformed;   /* bad header: connection closed */
    uint64_t frames_cut;         /* admitted, then the connection ended mid-payload */
    uint64_t frames_skipped;     /* queued, their lifetime closed before they started on the
                                    wire: completed FLUSHED, not written */
    uint64_t conns_accepted;     /* inbound connections that passed the handshake */
    uint64_t conns_refused;      /* inbound connections refused, all reasons: */
    uint64_t conns_bad_hello;    /*   not a version-2 hello to this node, or no valid proof */
    uint64_t conns_unknown;      /*   a peer still unknown (or without a secret) after
                                      check_wait_ms, or fenced */
    uint64_t conns_timed_out;    /*   no complete handshake within hello_timeout_ms */
    uint64_t conns_over_cap;     /*   evicted for a newer one (max_pending), or the peer had
                                      KVF_TCP_MAX_RX_PER_PEER receivers already */
    uint64_t conns_no_resource;  /*   proven, but no memory or receiver thread for it */
    uint64_t handshakes_failed;  /* outbound: the acceptor's challenge missing or wrong */
    uint64_t connects_started;   /* outbound connects begun (kvf_transport_tcp_connect) */
    uint64_t connects_failed;    /* outbound connects that never reached the peer, all reasons: */
    uint64_t connects_timed_out; /*   no answer within connect_timeout_ms */
};

void kvf_transport_tcp_opts_init(struct kvf_transport_tcp_opts *opts);

/* Creates the transport and starts listening. NULL (logged on stderr) on a bad
 * option, a socket error or out of memory. Destroy with kvf_transport_destroy. */
struct kvf_transport *kvf_transport_tcp_create(const struct kvf_transport_tcp_opts *opts);

/* The port the transport listens on. */
uint16_t kvf_transport_tcp_port(const struct kvf_transport *t);

/*
 * Registers a pool frames may write into. `base` stays valid until the pool
 * is removed (kvf_transport_tcp_remove_pool) or the transport destroyed. -EEXIST, -E2BIG
 * (max_pools), -EINVAL (sizes 0 or the pool larger than the address space). Any thread.
 */
int kvf_transport_tcp_add_pool(struct kvf_transport *t, uint32_t pool_id, void *base,
                               uint32_t page_size, uint32_t page_count);

/*
 * Registers a device pool (kvf_pool_is_device): its pages are never
 * dereferenced here. A frame for it is read into the receiver's host bounce
 * buffer and copied in with kvf_pool_write, synchronously, before its op is
 * retired: the lease check still comes before any byte moves, and a fence
 * (which joins the receiver) still means no byte lands after it returns.
 * The pool must stay open until removed. Same errors. Any thread.
 */
int kvf_transport_tcp_add_device_pool(struct kvf_transport *t, uint32_t pool_id,
                                      struct kvf_pool *pool);

/*
 * Unregisters a pool: frames for it are malformed from now on. A receiver
 * that looked the pool up before a removal (of any pool) looks again after
 * its `check` admitted the frame, and refuses it then if the pool is gone or
 * its id now names other memory (on_frame gets -ENOENT), so no byte
 * lands in the old mapping once this returns, provided `check` admits nothing
 * into the pool from now on (the node removes a pool only when every lifetime
 * that could use it is drained). -ENOENT (unknown pool). Any thread.
 */
int kvf_transport_tcp_remove_pool(struct kvf_transport *t, uint32_t pool_id);

/*
 * Names peer index `peer` as node `node_id` (non-zero): inbound connections
 * whose hello says they come from that node are accepted as that peer.
 * -EINVAL (index out of range, node 0), -EEXIST (index or node taken).
 * Control thread.
 */
int kvf_transport_tcp_add_peer(struct kvf_transport *t, uint32_t peer, uint64_t node_id);

/*
 * Frees peer index `peer` for another node: the peer must be fenced
 * (kvf_transport_fence_peer: its sender joined, its receivers joined), and
 * then its connection state and secret are dropped and the index is free
 * for kvf_transport_tcp_add_peer. -ENOENT (index not added), -EBUSY (not
 * fenced, or a receiver still runs), -EINVAL. Control thread.
 */
int kvf_transport_tcp_forget_peer(struct kvf_transport *t, uint32_t peer);

/*
 * Sets the secret of the pair with peer `peer` (KVF_TCP_SECRET_SIZE bytes,
 * peer_keys.h): connections in either direction must prove it. Without one,
 * connect refuses and inbound hellos naming the peer are refused (after
 * check_wait_ms). Set once: -EEXIST when a different secret is already set
 * (the same one again: 0). -ENOENT (index not added), -EINVAL. Control thread.
 */
int kvf_transport_tcp_set_peer_key(struct kvf_transport *t, uint32_t peer,
                                   const uint8_t secret[KVF_TCP_SECRET_SIZE]);

/*
 * Starts the outbound connection to a registered peer at `host:port` (numeric
 * IPv4) and its sender thread; never blocks on the network. The socket's
 * connect is started non-blocking here; the sender thread waits for it (at
 * most opts.connect_timeout_ms), sends the hello and runs the rest of the
 * handshake before its first frame. Frames posted meanwhile wait in the
 * connection's queue; a connect or handshake that fails completes every
 * queued frame ERROR (-ETIMEDOUT when the peer never answered,
 * -ECONNREFUSED, -EHOSTUNREACH..., -EIO for a failed handshake), like a
 * write error. A connection that died (failed connect, handshake or write)
 * is replaced: its thread is joined and a new connection started, so
 * calling this before each use reaches a peer again after it was away.
 * -ENOENT (unknown peer), -EEXIST (connecting or connected, and alive),
 * -ESTALE (fenced), -ENOKEY (no secret set for the peer), -EIO (the socket
 * could not be made, or the connect failed at once; errno logged), -ENOMEM.
 * Control thread.
 */
int kvf_transport_tcp_connect(struct kvf_transport *t, uint32_t peer, const char *host,
                              uint16_t port);

/* A snapshot of the counters. Any thread. */
void kvf_transport_tcp_stats(const struct kvf_transport *t, struct kvf_transport_tcp_stats *out);

#endif /* KVF_TRANSPORT_TCP_H */
