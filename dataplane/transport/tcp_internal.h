/*
 * tcp_internal.h: the TCP data transport's private pieces, shared by tcp.c
 * (senders, receivers, fence, the public calls) and tcp_accept.c (the
 * acceptor and the handshakes it runs). Nothing here is public; the wire
 * format and the threads are described in tcp.h and at the top of tcp.c.
 */
#ifndef KVF_TRANSPORT_TCP_INTERNAL_H
#define KVF_TRANSPORT_TCP_INTERNAL_H

#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tcp.h"

#define TCP_SCRATCH_SIZE (64u * 1024u)
/* Device pools: the payload lands here first, then kvf_pool_write copies it
 * in. One frame of the node (256 KiB) is one copy; longer ones take several. */
#define TCP_BOUNCE_SIZE     (256u * 1024u)
#define TCP_NO_PEER         UINT32_MAX
#define TCP_NONCE_SIZE      32u
#define TCP_MAC_SIZE        32u
#define TCP_ACCEPT_BATCH    64  /* accept(2) calls per acceptor turn */
#define TCP_LOG_PER_S       10u /* refusal lines a second; the rest are counted */
#define TCP_LABEL_ACCEPTOR  "kvfence tcp v2 acceptor"
#define TCP_LABEL_CONNECTOR "kvfence tcp v2 connector"

struct tcp;

struct tcp_pool {
    uint32_t id;
    struct kvf_pool *dev; /* a device pool: written through kvf_pool_write only */
    uint8_t *base;
    uint64_t page_size;
    uint64_t page_count;
    uint32_t layout; /* kvf_pool_layout of dev; 0 for host pages */
};

/* One outbound connection. `fd` and `seq` belong to the sender thread; the
 * queue, `stop` and `broken` are under `lock`. */
struct tcp_tx {
    struct tcp *t;
    uint32_t peer;
    int fd;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct kvf_xfer *head;
    struct kvf_xfer *tail;
    bool stop;
    int broken; /* -errno once a write failed */
    bool joined;
    uint64_t seq;
    /* The connect (started non-blocking by kvf_transport_tcp_connect, finished
     * by the sender thread) and the handshake: sender thread only. */
    struct sockaddr_in addr;
    uint8_t secret[KVF_TCP_SECRET_SIZE];
    uint8_t hello[KVF_TCP_HELLO_SIZE];
};

/* One inbound connection. `fd` belongs to the receiver thread; `peer` and
 * `next` are under the transport lock. */
struct tcp_rx {
    struct tcp *t;
    int fd;
    pthread_t thread;
    uint32_t peer;
    atomic_bool stop;
    atomic_bool done;
    struct tcp_rx *next;
    uint8_t *scratch;
    uint8_t *bounce; /* TCP_BOUNCE_SIZE, allocated at the first device-pool frame */
};

struct tcp_peer {
    uint64_t node_id; /* 0: unused slot */
    bool fenced;
    bool have_secret;
    uint8_t secret[KVF_TCP_SECRET_SIZE]; /* the pair's (kvf_transport_tcp_set_peer_key) */
    uint32_t nrx;                        /* its receivers still running */
    struct tcp_tx *tx;                   /* kept until destroy */
};

/* One inbound connection in its handshake. Acceptor thread only. */
enum tcp_pend_state {
    PEND_HELLO = 1,     /* reading the hello */
    PEND_PEER = 2,      /* the hello names a peer not added (or without a secret) yet */
    PEND_CHALLENGE = 3, /* writing the challenge */
    PEND_PROOF = 4,     /* reading the proof */
};

struct tcp_pending {
    int fd; /* -1: a free slot */
    uint8_t state;
    uint32_t peer;
    uint64_t deadline_ms;  /* hello_timeout_ms after the accept */
    uint64_t peer_wait_ms; /* PEND_PEER: until then */
    size_t done;           /* bytes of the current message read or written */
    uint8_t secret[KVF_TCP_SECRET_SIZE];
    uint8_t hello[KVF_TCP_HELLO_SIZE];
    uint8_t challenge[KVF_TCP_CHALLENGE_SIZE];
    uint8_t proof[KVF_TCP_PROOF_SIZE];
};

enum tcp_refusal {
    REFUSE_BAD_HELLO,
    REFUSE_UNKNOWN,
    REFUSE_TIMED_OUT,
    REFUSE_OVER_CAP,
    REFUSE_NO_RESOURCE,
};

struct tcp_counters {
    atomic_uint_fast64_t frames_sent;
    atomic_uint_fast64_t bytes_sent;
    atomic_uint_fast64_t frames_received;
    atomic_uint_fast64_t bytes_received;
    atomic_uint_fast64_t frames_rejected;
    atomic_uint_fast64_t frames_malformed;
    atomic_uint_fast64_t frames_cut;
    atomic_uint_fast64_t frames_skipped;
    atomic_uint_fast64_t conns_accepted;
    atomic_uint_fast64_t conns_refused;
    atomic_uint_fast64_t conns_bad_hello;
    atomic_uint_fast64_t conns_unknown;
    atomic_uint_fast64_t conns_timed_out;
    atomic_uint_fast64_t conns_over_cap;
    atomic_uint_fast64_t conns_no_resource;
    atomic_uint_fast64_t handshakes_failed;
    atomic_uint_fast64_t connects_started;
    atomic_uint_fast64_t connects_failed;
    atomic_uint_fast64_t connects_timed_out;
};

struct tcp {
    struct kvf_transport base;
    struct kvf_transport_tcp_opts opts;
    int listen_fd;
    uint16_t port;
    int wake_fd[2];
    pthread_t acceptor;
    bool acceptor_running;
    /* Acceptor thread only: the handshakes, and the refusal log's budget. */
    struct tcp_pending *pending;
    struct pollfd *pfds;
    uint32_t *pfd_slot;
    uint64_t log_second_ms;
    uint32_t log_lines;
    uint64_t log_dropped;

    pthread_mutex_t lock; /* peers, pools, rx list, closing */
    struct tcp_peer *peers;
    struct tcp_pool *pools;
    uint32_t pool_count;
    /* Bumped (under lock) by every pool removal: a receiver whose lookup saw
     * the same value after its admission knows its copy is still current. */
    atomic_uint_fast64_t pools_removed;
    struct tcp_rx *rx_list;
    bool closing;

    int cq_wake; /* eventfd: the completion list became non-empty (wake_fd) */
    pthread_mutex_t cq_lock;
    struct kvf_xfer *cq_head;
    struct kvf_xfer *cq_tail;

    struct tcp_counters c;
};

/* The header of one data frame, decoded. */
struct tcp_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t flags;
    kvf_room_key room;
    uint64_t seq;
    uint32_t pool;
    uint32_t first_page;
    uint32_t page_count;
    uint32_t layout; /* the source pool's kvf_pool_layout; 0: one span a page */
    uint64_t offset;
    uint64_t length;
};

#define CNT_ADD(t, field, v) atomic_fetch_add_explicit(&(t)->c.field, (v), memory_order_relaxed)

/* ---- encoding ------------------------------------------------------------ */

static inline void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* ---- shared between tcp.c and tcp_accept.c ------------------------------------------- */

/* Closes with an RST: nothing still queued on the socket is sent. */
void tcp_close_abortive(int fd);
void tcp_set_nodelay(int fd);
/* CLOCK_MONOTONIC in ms. */
uint64_t tcp_mono_ms(void);
/* HMAC(secret, label || hello || nonce_a) (tcp.h). False when libcrypto failed. */
bool tcp_hs_mac(const uint8_t secret[KVF_TCP_SECRET_SIZE], const char *label,
                const uint8_t hello[KVF_TCP_HELLO_SIZE], const uint8_t nonce_a[TCP_NONCE_SIZE],
                uint8_t out[TCP_MAC_SIZE]);
/* The receiver thread of an authenticated connection (its peer named). */
void *tcp_rx_main(void *arg);
/* Takes receivers off the list (tcp.c); under the transport lock. */
struct tcp_rx *tcp_rx_detach_locked(struct tcp *t, uint32_t peer, bool all, bool done_only);
/* Joins and frees a detached list of receivers. */
void tcp_rx_join_list(struct tcp_rx *list);
/* The acceptor thread (tcp_accept.c): accepts, runs the handshakes, starts
 * receivers; returns when destroy writes to wake_fd. */
void *tcp_acceptor_main(void *arg);

#endif /* KVF_TRANSPORT_TCP_INTERNAL_H */
