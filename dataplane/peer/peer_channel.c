/*
 * peer_channel.c: the node-to-node peer channel over ZeroMQ.
 *
 * The channel owns one ZeroMQ context, one bound PULL socket that receives from
 * every peer, one PUSH socket per peer endpoint it sends to, the handoff queue
 * from other threads, and two sequence maps: the send side (last seq assigned
 * per room-generation and receiver) and the receive side (last seq delivered per
 * room-generation and sender). Every ZeroMQ message is one frame holding one
 * PeerFrame (api/kvfence/v1/peer.proto).
 *
 * DESIGN (threads and order). A ZeroMQ socket is not thread-safe, so one owner
 * thread per channel touches the sockets (R11). A sending thread packs its
 * envelope outside any lock, then under the channel's mutex takes the next seq
 * of (room, receiver), seals it into the frame (an O(1) append, see
 * peer_frame_seal) and appends the whole message to the handoff queue. Seq
 * order is therefore queue order. The owner takes the whole queue at once,
 * appends each message to its peer's FIFO and writes the FIFOs with
 * ZMQ_DONTWAIT; a FIFO that hits the high-water mark waits for ZMQ_POLLOUT, so
 * the owner never blocks on a slow peer and keeps receiving. One PUSH socket
 * keeps its messages in order over one TCP connection, so the wire order per
 * (sender, receiver) is the seq order. The owner polls the PULL socket, the
 * eventfd that senders write when they make the queue non-empty, and the PUSH
 * sockets with a backlog. Received frames are checked in this order: decodes
 * as exactly one PeerFrame; addressed to our id and incarnation; the node's
 * admission callback accepts the room-generation and sender (R10, R13); seq is
 * exactly last+1 for (room, sender, sender incarnation) — then delivered, else
 * dropped and counted (invariant 8: in order, or rejected). The counters live on
 * the owner thread and are published under the mutex once per loop turn.
 *
 * Authentication (peer_channel.h): the PULL socket is a CURVE server and the
 * PUSH sockets CURVE clients, all with this incarnation's key pair. The ZAP
 * handler is a REP socket of the channel's own context
 * (inproc://zeromq.zap.01), bound before the PULL socket and closed after it,
 * and polled by the owner thread like the other sockets: libzmq's I/O thread
 * asks it about every CURVE client and waits for the answer, which the owner
 * gives from the introductions (under the mutex: any thread introduces and
 * forgets). A PUSH socket is made for an (endpoint, server key) pair: when the
 * incarnation behind an endpoint changes, the old socket and its backlog go.
 *
 * Shutdown: destroy sets `stopping` and wakes the owner, which discards what is
 * still queued or held, closes its sockets (linger 0) and exits; destroy joins
 * it and terminates the context, which cannot block because no socket is left.
 */
#include "peer_channel.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <openssl/crypto.h>
#include <zmq.h>

#include "peer_internal.h"
#include "kvf_log.h"

#define PEER_QUEUE_MAX_DEFAULT   65536u
#define PEER_MAX_MESSAGE_DEFAULT (4u << 20)
#define PEER_ENDPOINT_MAX        256u
#define PEER_RECV_BATCH          256 /* frames received per loop turn before sends get a turn */
#define PEER_INTRO_MAX           4096u
#define PEER_NODE_ID_MAX         255u
#define PEER_USER_ID_MAX         (PEER_NODE_ID_MAX + 24u) /* "<incarnation>:<node id>" */
#define PEER_ZAP_ENDPOINT        "inproc://zeromq.zap.01"
#define PEER_ZAP_DOMAIN          "kvfence-peer"

enum peer_msg_kind {
    PEER_MSG_FRAME = 0,  /* a sealed frame for a peer */
    PEER_MSG_FORGET = 1, /* forget the receive-side seq state of `key` */
};

enum peer_msg_fault {
    PEER_FAULT_NONE = 0,
    PEER_FAULT_DROP = 1,
    PEER_FAULT_DUPLICATE = 2,
    PEER_FAULT_DELAY = 3,
};

/* One message in the handoff queue, then in a peer's FIFO. One allocation:
 * the endpoint and the frame bytes live in `buf`. */
struct peer_msg {
    struct peer_msg *next;
    uint8_t kind;   /* enum peer_msg_kind */
    uint8_t fault;  /* enum peer_msg_fault */
    uint8_t copies; /* sends still to make (2 for an injected duplicate) */
    kvf_room_key key;
    uint8_t server_key[KVF_PEER_KEY_SIZE]; /* the receiver incarnation's introduced key */
    const char *endpoint;                  /* into buf */
    const uint8_t *data;                   /* into buf */
    size_t len;
    uint8_t buf[];
};

/* One peer endpoint we send to. Owner thread only. */
struct peer_out {
    struct peer_out *next;
    void *sock; /* ZMQ_PUSH, CURVE client of `server_key`, connected to `endpoint` */
    uint8_t server_key[KVF_PEER_KEY_SIZE];
    struct peer_msg *head, *tail;
    struct peer_msg *held;   /* a message held back by the delay fault */
    uint32_t held_countdown; /* frames still to route past it */
    char endpoint[];
};

/* An introduced peer incarnation (kvf_peer_channel_introduce). */
struct peer_intro {
    uint64_t incarnation;
    uint8_t key[KVF_PEER_KEY_SIZE];
    char node[PEER_NODE_ID_MAX + 1];
};

struct kvf_peer_channel {
    /* Set by create, read-only afterwards. */
    char *node_id;
    uint64_t incarnation;
    uint8_t public_key[KVF_PEER_KEY_SIZE];
    uint8_t secret_key[KVF_PEER_KEY_SIZE];
    char endpoint[PEER_ENDPOINT_MAX];
    kvf_peer_message_fn on_message;
    kvf_peer_accept_fn accept;
    kvf_peer_link_fn on_link;
    kvf_peer_drop_fn on_drop;
    void *ctx;
    size_t queue_max;
    void *zctx;
    int efd;
    pthread_t thread;

    /* Guarded by mu. */
    pthread_mutex_t mu;
    struct peer_msg *q_head, *q_tail;
    size_t q_count;      /* frames queued and not yet released by the owner */
    uint64_t n_accepted; /* frames accepted since create (fault counting) */
    bool stopping;
    struct kvf_peer_fault fault;
    struct peer_seq_map send_seq;
    struct kvf_peer_stats published;
    struct peer_intro *intros;
    size_t n_intros, intros_cap;

    /* Owner thread only (and create/destroy before/after it runs). */
    void *pull; /* ZMQ_PULL, CURVE server, bound to `endpoint` */
    void *zap;  /* ZMQ_REP, the ZAP handler of zctx */
    uint64_t zap_logged;
    uint64_t zap_resets; /* zap_reset: owner thread */
    struct peer_seq_map recv_seq;
    struct peer_out *peers;
    size_t n_peers;
    zmq_pollitem_t *items;
    struct peer_out **item_peer;
    size_t items_cap;
    struct kvf_peer_stats st;
    size_t released; /* frames that left the channel since the last publish */
};

static void peer_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void peer_log(const char *fmt, ...)
{
    char msg[KVF_LOG_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvf_log("error", "kvf_peer: %s", msg);
}

/* ---- sequence maps (peer_internal.h) ------------------------------------------ */

#define SEQ_MAP_INITIAL_BUCKETS 64u

static uint64_t seq_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static size_t seq_bucket(const struct peer_seq_map *m, kvf_room_key key)
{
    uint64_t h = seq_mix64(key.room_id ^ seq_mix64(key.generation + 0x9e3779b97f4a7c15ull));
    return (size_t)(h & (m->nbuckets - 1));
}

int peer_seq_map_init(struct peer_seq_map *m)
{
    m->buckets = calloc(SEQ_MAP_INITIAL_BUCKETS, sizeof(*m->buckets));
    if (m->buckets == NULL)
        return -ENOMEM;
    m->nbuckets = SEQ_MAP_INITIAL_BUCKETS;
    m->count = 0;
    return 0;
}

void peer_seq_map_free(struct peer_seq_map *m)
{
    if (m->buckets == NULL)
        return;
    for (size_t i = 0; i < m->nbuckets; i++) {
        struct peer_seq_entry *e = m->buckets[i];
        while (e != NULL) {
            struct peer_seq_entry *next = e->next;
            free(e);
            e = next;
        }
    }
    free(m->buckets);
    m->buckets = NULL;
    m->nbuckets = 0;
    m->count = 0;
}

/* Doubles the table; on out of memory keeps the old one (longer chains, still
 * correct). */
static void seq_map_grow(struct peer_seq_map *m)
{
    size_t old_n = m->nbuckets;
    struct peer_seq_entry **old = m->buckets;
    struct peer_seq_entry **nb = calloc(old_n * 2, sizeof(*nb));
    if (nb == NULL)
        return;
    m->buckets = nb;
    m->nbuckets = old_n * 2;
    for (size_t i = 0; i < old_n; i++) {
        struct peer_seq_entry *e = old[i];
        while (e != NULL) {
            struct peer_seq_entry *next = e->next;
            size_t b = seq_bucket(m, e->key);
            e->next = nb[b];
            nb[b] = e;
            e = next;
        }
    }
    free(old);
}

struct peer_seq_entry *peer_seq_map_get(struct peer_seq_map *m, kvf_room_key key, const char *node,
                                        uint64_t incarnation)
{
    size_t b = seq_bucket(m, key);
    for (struct peer_seq_entry *e = m->buckets[b]; e != NULL; e = e->next) {
        if (kvf_room_key_eq(e->key, key) && e->incarnation == incarnation &&
            strcmp(e->node, node) == 0)
            return e;
    }
    size_t node_len = strlen(node);
    struct peer_seq_entry *e = malloc(sizeof(*e) + node_len + 1);
    if (e == NULL)
        return NULL;
    e->key = key;
    e->incarnation = incarnation;
    e->seq = 0;
    memcpy(e->node, node, node_len + 1);
    if (m->count + 1 > m->nbuckets * 2) {
        seq_map_grow(m);
        b = seq_bucket(m, key);
    }
    e->next = m->buckets[b];
    m->buckets[b] = e;
    m->count++;
    return e;
}

size_t peer_seq_map_forget(struct peer_seq_map *m, kvf_room_key key)
{
    size_t removed = 0;
    struct peer_seq_entry **pp = &m->buckets[seq_bucket(m, key)];
    while (*pp != NULL) {
        struct peer_seq_entry *e = *pp;
        if (kvf_room_key_eq(e->key, key)) {
            *pp = e->next;
            free(e);
            removed++;
        } else {
            pp = &e->next;
        }
    }
    m->count -= removed;
    return removed;
}

/* ---- frame encoding ---------------------------------------------------------- */

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static size_t varint_put(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* PeerEnvelope.seq is field 6, varint; PeerFrame.envelope is field 1,
 * length-delimited (api/kvfence/v1/peer.proto). */
#define PEER_TAG_ENVELOPE_SEQ   ((6u << 3) | 0u)
#define PEER_TAG_FRAME_ENVELOPE ((1u << 3) | 2u)

uint8_t *peer_frame_seal(uint8_t *body, size_t body_len, uint64_t seq, size_t *len_p)
{
    uint8_t *t = body + body_len;
    t[0] = PEER_TAG_ENVELOPE_SEQ;
    size_t env_len = body_len + 1 + varint_put(t + 1, seq);
    size_t hdr_len = 1 + varint_len(env_len);
    uint8_t *frame = body - hdr_len;
    frame[0] = PEER_TAG_FRAME_ENVELOPE;
    varint_put(frame + 1, env_len);
    *len_p = hdr_len + env_len;
    return frame;
}

/* ---- options ------------------------------------------------------------------ */

void kvf_peer_channel_opts_init(struct kvf_peer_channel_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->queue_max = PEER_QUEUE_MAX_DEFAULT;
    o->max_message_bytes = PEER_MAX_MESSAGE_DEFAULT;
}

const char *kvf_peer_drop_reason_name(enum kvf_peer_drop_reason r)
{
    switch (r) {
    case KVF_PEER_DROP_MALFORMED:
        return "malformed";
    case KVF_PEER_DROP_WRONG_RECEIVER:
        return "wrong_receiver";
    case KVF_PEER_DROP_LATE:
        return "late";
    case KVF_PEER_DROP_UNKNOWN:
        return "unknown";
    case KVF_PEER_DROP_DUPLICATE:
        return "duplicate";
    case KVF_PEER_DROP_OUT_OF_ORDER:
        return "out_of_order";
    case KVF_PEER_DROP_UNAUTHENTICATED:
        return "unauthenticated";
    }
    return "?";
}

/* ---- introductions (any thread, under mu) ------------------------------------------ */

static struct peer_intro *intro_find_locked(struct kvf_peer_channel *ch, const char *node,
                                            uint64_t incarnation)
{
    for (size_t i = 0; i < ch->n_intros; i++) {
        if (ch->intros[i].incarnation == incarnation && strcmp(ch->intros[i].node, node) == 0)
            return &ch->intros[i];
    }
    return NULL;
}

int kvf_peer_channel_introduce(struct kvf_peer_channel *ch, const char *node_id,
                               uint64_t incarnation, const uint8_t *public_key)
{
    if (ch == NULL || node_id == NULL || node_id[0] == '\0' || strlen(node_id) > PEER_NODE_ID_MAX ||
        incarnation == 0 || public_key == NULL)
        return -EINVAL;
    int rc = 0;
    pthread_mutex_lock(&ch->mu);
    struct peer_intro *in = intro_find_locked(ch, node_id, incarnation);
    if (in != NULL) {
        rc = memcmp(in->key, public_key, KVF_PEER_KEY_SIZE) == 0 ? 0 : -EEXIST;
    } else if (ch->n_intros >= PEER_INTRO_MAX) {
        rc = -E2BIG;
    } else {
        if (ch->n_intros == ch->intros_cap) {
            size_t cap = ch->intros_cap ? ch->intros_cap * 2 : 16;
            struct peer_intro *v = realloc(ch->intros, cap * sizeof(*v));
            if (v == NULL)
                rc = -ENOMEM;
            else {
                ch->intros = v;
                ch->intros_cap = cap;
            }
        }
        if (rc == 0) {
            in = &ch->intros[ch->n_intros++];
            memset(in, 0, sizeof(*in));
            in->incarnation = incarnation;
            memcpy(in->key, public_key, KVF_PEER_KEY_SIZE);
            memcpy(in->node, node_id, strlen(node_id) + 1);
        }
    }
    pthread_mutex_unlock(&ch->mu);
    return rc;
}

int kvf_peer_channel_forget_peer(struct kvf_peer_channel *ch, const char *node_id,
                                 uint64_t incarnation)
{
    if (ch == NULL || node_id == NULL)
        return -EINVAL;
    int rc = -ENOENT;
    pthread_mutex_lock(&ch->mu);
    struct peer_intro *in = intro_find_locked(ch, node_id, incarnation);
    if (in != NULL) {
        *in = ch->intros[--ch->n_intros];
        rc = 0;
    }
    pthread_mutex_unlock(&ch->mu);
    return rc;
}

/* Copies the key introduced for the receiver into `m`. -ENOKEY when none. */
static int intro_key_locked(struct kvf_peer_channel *ch, const char *node, uint64_t incarnation,
                            struct peer_msg *m)
{
    const struct peer_intro *in = intro_find_locked(ch, node, incarnation);
    if (in == NULL)
        return -ENOKEY;
    memcpy(m->server_key, in->key, KVF_PEER_KEY_SIZE);
    return 0;
}

/* ---- the handoff queue (any thread) ---------------------------------------------- */

static void msg_free_list(struct peer_msg *m)
{
    while (m != NULL) {
        struct peer_msg *next = m->next;
        free(m);
        m = next;
    }
}

/* Fault of the frame numbered `n`. Caller holds mu. */
static enum peer_msg_fault fault_for(const struct kvf_peer_channel *ch, uint64_t n)
{
    if (ch->fault.drop_nth == n)
        return PEER_FAULT_DROP;
    if (ch->fault.duplicate_nth == n)
        return PEER_FAULT_DUPLICATE;
    if (ch->fault.delay_nth == n)
        return PEER_FAULT_DELAY;
    return PEER_FAULT_NONE;
}

/* Appends `m` and wakes the owner if the queue was empty (it takes the whole
 * queue each turn, so one wake-up per non-empty transition is enough). Caller
 * holds mu. */
static void queue_push_locked(struct kvf_peer_channel *ch, struct peer_msg *m)
{
    bool was_empty = ch->q_head == NULL;
    m->next = NULL;
    if (ch->q_tail != NULL)
        ch->q_tail->next = m;
    else
        ch->q_head = m;
    ch->q_tail = m;
    if (was_empty) {
        uint64_t one = 1;
        if (write(ch->efd, &one, sizeof(one)) != (ssize_t)sizeof(one))
            peer_log("eventfd write: %s", strerror(errno));
    }
}

/* Admits one frame into the queue: capacity, fault number. Caller holds mu. */
static int queue_admit_locked(struct kvf_peer_channel *ch)
{
    if (ch->stopping || ch->q_count >= ch->queue_max)
        return -EAGAIN;
    return 0;
}

static void queue_account_locked(struct kvf_peer_channel *ch, struct peer_msg *m)
{
    ch->q_count++;
    ch->n_accepted++;
    ch->published.queued++;
    m->fault = (uint8_t)fault_for(ch, ch->n_accepted);
    m->copies = m->fault == PEER_FAULT_DUPLICATE ? 2 : 1;
}

static bool endpoint_ok(const char *ep)
{
    return ep != NULL && ep[0] != '\0' && strlen(ep) < PEER_ENDPOINT_MAX;
}

/* Allocates a frame message with room for the endpoint, `hdr` bytes of header
 * space, `body` bytes and `trailer` bytes; returns it with *body_p pointing at
 * the body. */
static struct peer_msg *msg_alloc(const char *ep, size_t hdr, size_t body, size_t trailer,
                                  uint8_t **body_p)
{
    size_t ep_len = strlen(ep);
    struct peer_msg *m = malloc(sizeof(*m) + ep_len + 1 + hdr + body + trailer);
    if (m == NULL)
        return NULL;
    memset(m, 0, sizeof(*m));
    m->kind = PEER_MSG_FRAME;
    memcpy(m->buf, ep, ep_len + 1);
    m->endpoint = (const char *)m->buf;
    *body_p = m->buf + ep_len + 1 + hdr;
    return m;
}

static bool room_key_valid(const Kvfence__V1__RoomKey *rk)
{
    return rk != NULL && rk->room_id != 0 && rk->room_id <= KVF_ROOM_ID_MAX && rk->generation != 0;
}

int kvf_peer_send(struct kvf_peer_channel *ch, const char *peer_endpoint,
                  const Kvfence__V1__PeerEnvelope *env)
{
    if (ch == NULL || env == NULL || !endpoint_ok(peer_endpoint) || !room_key_valid(env->room) ||
        env->receiver_node_id == NULL || env->receiver_node_id[0] == '\0' ||
        env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY__NOT_SET)
        return -EINVAL;

    /* Pack without seq, outside the lock; the seq is sealed in under it. */
    Kvfence__V1__PeerEnvelope copy = *env;
    copy.sender_node_id = ch->node_id;
    copy.sender_incarnation = ch->incarnation;
    copy.seq = 0;
    size_t body_len = kvfence__v1__peer_envelope__get_packed_size(&copy);
    uint8_t *body;
    struct peer_msg *m =
        msg_alloc(peer_endpoint, PEER_FRAME_HDR_MAX, body_len, PEER_SEQ_TRAILER_MAX, &body);
    if (m == NULL)
        return -ENOMEM;
    kvfence__v1__peer_envelope__pack(&copy, body);
    kvf_room_key key = {env->room->room_id, env->room->generation};

    pthread_mutex_lock(&ch->mu);
    int rc = queue_admit_locked(ch);
    struct peer_seq_entry *e = NULL;
    if (rc == 0)
        rc = intro_key_locked(ch, env->receiver_node_id, env->receiver_incarnation, m);
    if (rc == 0) {
        e = peer_seq_map_get(&ch->send_seq, key, env->receiver_node_id, env->receiver_incarnation);
        if (e == NULL)
            rc = -ENOMEM;
    }
    if (rc == 0) {
        e->seq++;
        m->data = peer_frame_seal(body, body_len, e->seq, &m->len);
        m->key = key;
        queue_account_locked(ch, m);
        queue_push_locked(ch, m);
    }
    pthread_mutex_unlock(&ch->mu);
    if (rc != 0)
        free(m);
    return rc;
}

int kvf_peer_send_link(struct kvf_peer_channel *ch, const char *peer_endpoint,
                       const Kvfence__V1__LinkMessage *msg)
{
    if (ch == NULL || msg == NULL || !endpoint_ok(peer_endpoint) || msg->receiver_node_id == NULL ||
        msg->receiver_node_id[0] == '\0' ||
        msg->body_case == KVFENCE__V1__LINK_MESSAGE__BODY__NOT_SET)
        return -EINVAL;

    Kvfence__V1__LinkMessage copy = *msg;
    copy.sender_node_id = ch->node_id;
    copy.sender_incarnation = ch->incarnation;
    Kvfence__V1__PeerFrame frame = KVFENCE__V1__PEER_FRAME__INIT;
    frame.frame_case = KVFENCE__V1__PEER_FRAME__FRAME_LINK;
    frame.link = &copy;
    size_t len = kvfence__v1__peer_frame__get_packed_size(&frame);
    uint8_t *body;
    struct peer_msg *m = msg_alloc(peer_endpoint, 0, len, 0, &body);
    if (m == NULL)
        return -ENOMEM;
    kvfence__v1__peer_frame__pack(&frame, body);
    m->data = body;
    m->len = len;

    pthread_mutex_lock(&ch->mu);
    int rc = queue_admit_locked(ch);
    if (rc == 0)
        rc = intro_key_locked(ch, msg->receiver_node_id, msg->receiver_incarnation, m);
    if (rc == 0) {
        queue_account_locked(ch, m);
        queue_push_locked(ch, m);
    }
    pthread_mutex_unlock(&ch->mu);
    if (rc != 0)
        free(m);
    return rc;
}

int kvf_peer_forget_room(struct kvf_peer_channel *ch, kvf_room_key key)
{
    if (ch == NULL)
        return -EINVAL;
    struct peer_msg *m = malloc(sizeof(*m));
    if (m == NULL)
        return -ENOMEM;
    memset(m, 0, sizeof(*m));
    m->kind = PEER_MSG_FORGET;
    m->key = key;

    pthread_mutex_lock(&ch->mu);
    int rc = ch->stopping ? -EAGAIN : 0;
    if (rc == 0) {
        peer_seq_map_forget(&ch->send_seq, key);
        queue_push_locked(ch, m); /* not counted against queue_max */
    }
    pthread_mutex_unlock(&ch->mu);
    if (rc != 0)
        free(m);
    return rc;
}

void kvf_peer_channel_set_fault(struct kvf_peer_channel *ch, const struct kvf_peer_fault *f)
{
    pthread_mutex_lock(&ch->mu);
    ch->fault = *f;
    if (ch->fault.delay_after == 0)
        ch->fault.delay_after = 1;
    pthread_mutex_unlock(&ch->mu);
}

void kvf_peer_channel_stats(struct kvf_peer_channel *ch, struct kvf_peer_stats *stats_p)
{
    pthread_mutex_lock(&ch->mu);
    *stats_p = ch->published;
    pthread_mutex_unlock(&ch->mu);
}

const char *kvf_peer_channel_endpoint(const struct kvf_peer_channel *ch)
{
    return ch->endpoint;
}

/* ---- owner thread: sending --------------------------------------------------------- */

static void frame_release(struct kvf_peer_channel *ch, struct peer_msg *m);
static struct peer_msg *peer_fifo_pop(struct peer_out *p);

/* Closes a peer's socket and discards what it still held. */
static void peer_out_free(struct kvf_peer_channel *ch, struct peer_out *p)
{
    while (p->head != NULL) {
        ch->st.discarded++;
        frame_release(ch, peer_fifo_pop(p));
    }
    if (p->held != NULL) {
        ch->st.discarded++;
        frame_release(ch, p->held);
    }
    zmq_close(p->sock);
    free(p);
}

/* The peer of (`ep`, `key`), with its PUSH socket (a CURVE client that
 * requires `key` of the server) connected on first use. A socket to the same
 * endpoint with another server key (another incarnation answers there now)
 * is closed first, with its backlog. NULL (logged) when ZeroMQ refuses the
 * endpoint or is out of resources. */
static struct peer_out *peer_get(struct kvf_peer_channel *ch, const char *ep,
                                 const uint8_t key[KVF_PEER_KEY_SIZE])
{
    for (struct peer_out **pp = &ch->peers; *pp != NULL; pp = &(*pp)->next) {
        struct peer_out *p = *pp;
        if (strcmp(p->endpoint, ep) != 0)
            continue;
        if (memcmp(p->server_key, key, KVF_PEER_KEY_SIZE) == 0)
            return p;
        *pp = p->next;
        ch->n_peers--;
        peer_out_free(ch, p);
        break;
    }
    size_t ep_len = strlen(ep);
    struct peer_out *p = calloc(1, sizeof(*p) + ep_len + 1);
    if (p == NULL) {
        peer_log("%s: out of memory", ep);
        return NULL;
    }
    memcpy(p->endpoint, ep, ep_len + 1);
    memcpy(p->server_key, key, KVF_PEER_KEY_SIZE);
    p->sock = zmq_socket(ch->zctx, ZMQ_PUSH);
    if (p->sock == NULL) {
        peer_log("%s: zmq_socket: %s", ep, zmq_strerror(zmq_errno()));
        goto err_free_peer;
    }
    int linger = 0;
    zmq_setsockopt(p->sock, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_setsockopt(p->sock, ZMQ_CURVE_SERVERKEY, key, KVF_PEER_KEY_SIZE) != 0 ||
        zmq_setsockopt(p->sock, ZMQ_CURVE_PUBLICKEY, ch->public_key, KVF_PEER_KEY_SIZE) != 0 ||
        zmq_setsockopt(p->sock, ZMQ_CURVE_SECRETKEY, ch->secret_key, KVF_PEER_KEY_SIZE) != 0) {
        peer_log("%s: CURVE client options: %s", ep, zmq_strerror(zmq_errno()));
        goto err_close_sock;
    }
    if (zmq_connect(p->sock, ep) != 0) {
        peer_log("%s: zmq_connect: %s", ep, zmq_strerror(zmq_errno()));
        goto err_close_sock;
    }
    p->next = ch->peers;
    ch->peers = p;
    ch->n_peers++;
    return p;

err_close_sock:
    zmq_close(p->sock);
err_free_peer:
    free(p);
    return NULL;
}

static void peer_fifo_push(struct peer_out *p, struct peer_msg *m)
{
    m->next = NULL;
    if (p->tail != NULL)
        p->tail->next = m;
    else
        p->head = m;
    p->tail = m;
}

static struct peer_msg *peer_fifo_pop(struct peer_out *p)
{
    struct peer_msg *m = p->head;
    p->head = m->next;
    if (p->head == NULL)
        p->tail = NULL;
    m->next = NULL;
    return m;
}

/* Frees a frame that leaves the channel (sent, dropped, refused). */
static void frame_release(struct kvf_peer_channel *ch, struct peer_msg *m)
{
    free(m);
    ch->released++;
}

/* Takes one queued message: a forget request is done here; a frame goes to
 * its peer's FIFO, or is dropped by an injected fault, or held back (delay
 * fault) until `delay_after` later frames for the same peer entered the FIFO,
 * and then queued behind them. */
static void route_msg(struct kvf_peer_channel *ch, struct peer_msg *m)
{
    if (m->kind == PEER_MSG_FORGET) {
        peer_seq_map_forget(&ch->recv_seq, m->key);
        ch->st.forgotten++;
        free(m);
        return;
    }
    if (m->fault == PEER_FAULT_DROP) {
        ch->st.fault_dropped++;
        frame_release(ch, m);
        return;
    }
    struct peer_out *p = peer_get(ch, m->endpoint, m->server_key);
    if (p == NULL) {
        ch->st.send_failed++;
        frame_release(ch, m);
        return;
    }
    if (m->fault == PEER_FAULT_DUPLICATE)
        ch->st.fault_duplicated++;
    if (m->fault == PEER_FAULT_DELAY && p->held == NULL) {
        ch->st.fault_delayed++;
        m->fault = PEER_FAULT_NONE;
        p->held = m;
        pthread_mutex_lock(&ch->mu);
        p->held_countdown = ch->fault.delay_after ? ch->fault.delay_after : 1;
        pthread_mutex_unlock(&ch->mu);
        return;
    }
    peer_fifo_push(p, m);
    if (p->held != NULL && --p->held_countdown == 0) {
        peer_fifo_push(p, p->held);
        p->held = NULL;
    }
}

/* Writes the peer's FIFO until it is empty or ZeroMQ says EAGAIN (high-water
 * mark: the poll waits for ZMQ_POLLOUT). Never blocks. */
static void peer_flush(struct kvf_peer_channel *ch, struct peer_out *p)
{
    while (p->head != NULL) {
        struct peer_msg *m = p->head;
        if (zmq_send(p->sock, m->data, m->len, ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            if (err == EAGAIN)
                return;
            if (err == EINTR)
                continue;
            peer_log("%s: zmq_send: %s", p->endpoint, zmq_strerror(err));
            ch->st.send_failed++;
            frame_release(ch, peer_fifo_pop(p));
            continue;
        }
        ch->st.sent++;
        if (--m->copies > 0)
            continue;
        frame_release(ch, peer_fifo_pop(p));
    }
}

/* ---- owner thread: receiving ------------------------------------------------------- */

static void drop(struct kvf_peer_channel *ch, enum kvf_peer_drop_reason reason,
                 const Kvfence__V1__PeerEnvelope *env)
{
    switch (reason) {
    case KVF_PEER_DROP_MALFORMED:
        ch->st.malformed++;
        break;
    case KVF_PEER_DROP_WRONG_RECEIVER:
        ch->st.wrong_receiver++;
        break;
    case KVF_PEER_DROP_LATE:
        ch->st.late++;
        break;
    case KVF_PEER_DROP_UNKNOWN:
        ch->st.unknown++;
        break;
    case KVF_PEER_DROP_DUPLICATE:
        ch->st.duplicate++;
        break;
    case KVF_PEER_DROP_OUT_OF_ORDER:
        ch->st.out_of_order++;
        break;
    case KVF_PEER_DROP_UNAUTHENTICATED:
        ch->st.unauthenticated++;
        break;
    }
    if (ch->on_drop != NULL)
        ch->on_drop(ch->ctx, reason, env);
}

static bool addressed_to_us(const struct kvf_peer_channel *ch, const char *node, uint64_t inc)
{
    return node != NULL && strcmp(node, ch->node_id) == 0 && inc == ch->incarnation;
}

/*
 * Whether a message that says it comes from (`node`, `incarnation`) came on a
 * connection that authenticated as that incarnation (`user_id`, from the ZAP
 * handler) and the incarnation is still introduced (not fenced since).
 */
static bool sender_authenticated(struct kvf_peer_channel *ch, const char *user_id, const char *node,
                                 uint64_t incarnation)
{
    if (user_id == NULL || node == NULL)
        return false;
    char want[PEER_USER_ID_MAX + 1];
    int n = snprintf(want, sizeof(want), "%" PRIu64 ":%s", incarnation, node);
    if (n < 0 || (size_t)n >= sizeof(want) || strcmp(want, user_id) != 0)
        return false;
    pthread_mutex_lock(&ch->mu);
    bool known = intro_find_locked(ch, node, incarnation) != NULL;
    pthread_mutex_unlock(&ch->mu);
    return known;
}

static void handle_envelope(struct kvf_peer_channel *ch, const Kvfence__V1__PeerEnvelope *env,
                            const char *user_id)
{
    if (!room_key_valid(env->room) || env->sender_node_id == NULL ||
        env->sender_node_id[0] == '\0' ||
        env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY__NOT_SET) {
        drop(ch, KVF_PEER_DROP_MALFORMED, NULL);
        return;
    }
    if (!sender_authenticated(ch, user_id, env->sender_node_id, env->sender_incarnation)) {
        drop(ch, KVF_PEER_DROP_UNAUTHENTICATED, env);
        return;
    }
    if (!addressed_to_us(ch, env->receiver_node_id, env->receiver_incarnation)) {
        drop(ch, KVF_PEER_DROP_WRONG_RECEIVER, env);
        return;
    }
    kvf_room_key key = {env->room->room_id, env->room->generation};
    enum kvf_peer_verdict v =
        ch->accept(ch->ctx, key, env->sender_node_id, env->sender_incarnation);
    if (v != KVF_PEER_ACCEPT) {
        drop(ch, v == KVF_PEER_LATE ? KVF_PEER_DROP_LATE : KVF_PEER_DROP_UNKNOWN, env);
        return;
    }
    struct peer_seq_entry *e =
        peer_seq_map_get(&ch->recv_seq, key, env->sender_node_id, env->sender_incarnation);
    if (e == NULL) {
        /* Cannot track the order: never deliver unchecked. */
        drop(ch, KVF_PEER_DROP_OUT_OF_ORDER, env);
        return;
    }
    if (env->seq <= e->seq) {
        drop(ch, KVF_PEER_DROP_DUPLICATE, env);
        return;
    }
    if (env->seq != e->seq + 1) {
        drop(ch, KVF_PEER_DROP_OUT_OF_ORDER, env);
        return;
    }
    e->seq = env->seq;
    ch->st.delivered++;
    ch->on_message(ch->ctx, env);
}

static void handle_frame(struct kvf_peer_channel *ch, const uint8_t *data, size_t len,
                         const char *user_id)
{
    Kvfence__V1__PeerFrame *f = kvfence__v1__peer_frame__unpack(NULL, len, data);
    if (f == NULL) {
        drop(ch, KVF_PEER_DROP_MALFORMED, NULL);
        return;
    }
    switch (f->frame_case) {
    case KVFENCE__V1__PEER_FRAME__FRAME_ENVELOPE:
        handle_envelope(ch, f->envelope, user_id);
        break;
    case KVFENCE__V1__PEER_FRAME__FRAME_LINK:
        /* Link messages carry RDMA addresses and rkeys: only from the
         * incarnation the connection authenticated as. */
        if (!sender_authenticated(ch, user_id, f->link->sender_node_id,
                                  f->link->sender_incarnation)) {
            ch->st.unauthenticated++;
        } else if (!addressed_to_us(ch, f->link->receiver_node_id, f->link->receiver_incarnation)) {
            ch->st.wrong_receiver++;
        } else {
            ch->st.links++;
            if (ch->on_link != NULL)
                ch->on_link(ch->ctx, f->link);
        }
        break;
    default:
        drop(ch, KVF_PEER_DROP_MALFORMED, NULL);
        break;
    }
    kvfence__v1__peer_frame__free_unpacked(f, NULL);
}

/* Receives up to PEER_RECV_BATCH messages without blocking. A message of more
 * than one frame is not ours (peer.proto: exactly one frame): it is drained
 * whole and counted malformed. */
static void recv_batch(struct kvf_peer_channel *ch)
{
    for (int i = 0; i < PEER_RECV_BATCH; i++) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, ch->pull, ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            zmq_msg_close(&msg);
            if (err == EINTR)
                continue;
            if (err != EAGAIN)
                peer_log("zmq_msg_recv: %s", zmq_strerror(err));
            return;
        }
        if (zmq_msg_more(&msg)) {
            do {
                zmq_msg_close(&msg);
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, ch->pull, 0) < 0 && zmq_errno() != EINTR)
                    break;
            } while (zmq_msg_more(&msg));
            zmq_msg_close(&msg);
            drop(ch, KVF_PEER_DROP_MALFORMED, NULL);
            continue;
        }
        /* The incarnation the ZAP handler authenticated the connection as. */
        handle_frame(ch, zmq_msg_data(&msg), zmq_msg_size(&msg), zmq_msg_gets(&msg, "User-Id"));
        zmq_msg_close(&msg);
    }
}

/* ---- owner thread: the ZAP handler -------------------------------------------------- */

#define ZAP_FRAMES_MAX   8
#define ZAP_REBIND_TRIES 100 /* 1 ms apart: libzmq frees a closed socket's inproc name later */

/* Sends one ZAP reply (RFC 27): version, request id (`id`, or empty), status,
 * status text, User-Id, metadata (empty). 0, or the first failure's -errno. */
static int zap_reply(struct kvf_peer_channel *ch, const zmq_msg_t *id, const char *status,
                     const char *text, const char *user)
{
    zmq_msg_t *idm = (zmq_msg_t *)id; /* zmq_msg_data takes no const */
    if (zmq_send(ch->zap, "1.0", 3, ZMQ_SNDMORE) < 0 ||
        zmq_send(ch->zap, idm ? zmq_msg_data(idm) : "", idm ? zmq_msg_size(idm) : 0, ZMQ_SNDMORE) <
            0 ||
        zmq_send(ch->zap, status, 3, ZMQ_SNDMORE) < 0 ||
        zmq_send(ch->zap, text, strlen(text), ZMQ_SNDMORE) < 0 ||
        zmq_send(ch->zap, user, strlen(user), ZMQ_SNDMORE) < 0 || zmq_send(ch->zap, "", 0, 0) < 0)
        return -zmq_errno();
    return 0;
}

/* The ZAP socket's request/reply state is lost (a request that could not be
 * read whole nor answered): a new REP socket replaces it on the same
 * endpoint, so that later handshakes are answered again. The request that
 * was lost gets no answer; libzmq's handshake timeout ends that connection
 * and the client connects again. Without a socket (the bind kept failing:
 * logged) libzmq asks no handler, and a connection's messages carry no
 * User-Id, so every one is dropped as unauthenticated (handle_frame). */
static void zap_reset(struct kvf_peer_channel *ch)
{
    zmq_close(ch->zap);
    ch->zap = zmq_socket(ch->zctx, ZMQ_REP);
    if (ch->zap != NULL) {
        int linger = 0;
        zmq_setsockopt(ch->zap, ZMQ_LINGER, &linger, sizeof(linger));
        int tries = 0;
        while (zmq_bind(ch->zap, PEER_ZAP_ENDPOINT) != 0) {
            if (zmq_errno() != EADDRINUSE || ++tries >= ZAP_REBIND_TRIES) {
                zmq_close(ch->zap);
                ch->zap = NULL;
                break;
            }
            usleep(1000);
        }
    }
    ch->zap_resets++;
    if (ch->zap == NULL)
        peer_log("zap: the handler could not be bound again (%s): connections are not "
                 "authenticated, their messages are dropped",
                 zmq_strerror(zmq_errno()));
    else
        peer_log("zap: the handler socket was reset (%" PRIu64 " resets)", ch->zap_resets);
}

/* A request whose frame `got` (0-based) could not be read (`err`): the rest
 * of it is read, while ZMQ_RCVMORE says more (libzmq delivers a multipart
 * message whole, so they are there), and it is answered "500"; if that
 * fails too, the socket is reset. A REP socket that took a request must
 * answer it, or it takes no other. */
static void zap_fail_request(struct kvf_peer_channel *ch, const zmq_msg_t *id, int got, int err)
{
    peer_log("zap: zmq_msg_recv of frame %d of a request: %s; answered 500", got,
             zmq_strerror(err));
    ch->st.zap_refused++;
    int more = 1;
    size_t len = sizeof(more);
    int rc = 0;
    while (rc == 0 && zmq_getsockopt(ch->zap, ZMQ_RCVMORE, &more, &len) == 0 && more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, ch->zap, ZMQ_DONTWAIT) < 0 && zmq_errno() != EINTR)
            rc = -zmq_errno();
        zmq_msg_close(&m);
        len = sizeof(more);
    }
    if (rc == 0)
        rc = zap_reply(ch, id, "500", "the request could not be read", "");
    if (rc != 0)
        zap_reset(ch);
}

/* Answers one ZAP request (RFC 27): "200" with the incarnation's name as
 * User-Id when the CURVE client key is an introduced one, else "400"; "500"
 * when the request could not be read whole (zap_fail_request). Every request
 * taken is answered, or the socket is reset (zap_reset). */
static void zap_answer(struct kvf_peer_channel *ch)
{
    if (ch->zap == NULL)
        return;
    zmq_msg_t f[ZAP_FRAMES_MAX];
    int n = 0;     /* frames kept */
    int extra = 0; /* frames beyond ZAP_FRAMES_MAX, read and dropped */
    for (bool more = true; more;) {
        zmq_msg_t scratch;
        zmq_msg_t *m = n < ZAP_FRAMES_MAX ? &f[n] : &scratch;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, ch->zap, n + extra == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            int err = zmq_errno();
            zmq_msg_close(m);
            if (err == EINTR)
                continue;
            if (n + extra > 0 && err != ETERM) /* mid-request: it is answered */
                zap_fail_request(ch, n > 1 ? &f[1] : NULL, n + extra, err);
            else if (err != EAGAIN && err != ETERM)
                peer_log("zap: zmq_msg_recv: %s", zmq_strerror(err));
            for (int i = 0; i < n; i++)
                zmq_msg_close(&f[i]);
            return;
        }
        more = zmq_msg_more(m);
        if (m == &scratch) {
            zmq_msg_close(m);
            extra++;
        } else {
            n++;
        }
    }
    int nf = n;
    /* version, request id, domain, address, routing id, mechanism, client key */
    char user[PEER_USER_ID_MAX + 1] = "";
    bool ok = n == 7 && extra == 0 && zmq_msg_size(&f[5]) == 5 &&
              memcmp(zmq_msg_data(&f[5]), "CURVE", 5) == 0 &&
              zmq_msg_size(&f[6]) == KVF_PEER_KEY_SIZE;
    if (ok) {
        ok = false;
        pthread_mutex_lock(&ch->mu);
        for (size_t i = 0; i < ch->n_intros && !ok; i++) {
            if (memcmp(ch->intros[i].key, zmq_msg_data(&f[6]), KVF_PEER_KEY_SIZE) == 0) {
                snprintf(user, sizeof(user), "%" PRIu64 ":%s", ch->intros[i].incarnation,
                         ch->intros[i].node);
                ok = true;
            }
        }
        pthread_mutex_unlock(&ch->mu);
    }
    if (!ok) {
        ch->st.zap_refused++;
        /* Logged: the first ten, then every 1000th. */
        if (ch->st.zap_refused <= 10 || ch->st.zap_refused % 1000 == 0) {
            char addr[64] = "?";
            if (nf > 3 && zmq_msg_size(&f[3]) < sizeof(addr)) {
                memcpy(addr, zmq_msg_data(&f[3]), zmq_msg_size(&f[3]));
                addr[zmq_msg_size(&f[3])] = '\0';
            }
            peer_log("peer channel: refused a connection from %s: %s (%" PRIu64 " refused so far)",
                     addr,
                     n == 7 && zmq_msg_size(&f[6]) == KVF_PEER_KEY_SIZE
                         ? "its CURVE key belongs to no introduced peer incarnation"
                         : "not a CURVE client",
                     ch->st.zap_refused);
        }
    }
    int rc = zap_reply(ch, nf > 1 ? &f[1] : NULL, ok ? "200" : "400",
                       ok ? "OK" : "not an introduced peer", user);
    for (int i = 0; i < nf; i++)
        zmq_msg_close(&f[i]);
    if (rc != 0 && rc != -ETERM) {
        peer_log("zap: the reply could not be sent: %s", zmq_strerror(-rc));
        zap_reset(ch); /* a REP socket left half-way through its reply takes no request */
    }
}

void *peer_channel_zmq_context(struct kvf_peer_channel *ch)
{
    return ch->zctx;
}

/* ---- owner thread: the loop -------------------------------------------------------- */

/* Fills the poll set: [0] the PULL socket, [1] the eventfd, [2] the ZAP
 * handler, then every peer with a backlog, for ZMQ_POLLOUT. Returns the
 * count, or -ENOMEM. */
static int poll_build(struct kvf_peer_channel *ch)
{
    size_t need = ch->n_peers + 3;
    if (need > ch->items_cap) {
        size_t cap = need * 2;
        zmq_pollitem_t *items = realloc(ch->items, cap * sizeof(*items));
        if (items == NULL)
            return -ENOMEM;
        ch->items = items;
        struct peer_out **ip = realloc(ch->item_peer, cap * sizeof(*ip));
        if (ip == NULL)
            return -ENOMEM;
        ch->item_peer = ip;
        ch->items_cap = cap;
    }
    size_t n = 0;
    ch->items[n++] = (zmq_pollitem_t){.socket = ch->pull, .events = ZMQ_POLLIN};
    ch->items[n++] = (zmq_pollitem_t){.socket = NULL, .fd = ch->efd, .events = ZMQ_POLLIN};
    /* fd -1 when the ZAP socket is gone (zap_reset): poll ignores it. */
    ch->items[n++] = ch->zap ? (zmq_pollitem_t){.socket = ch->zap, .events = ZMQ_POLLIN}
                             : (zmq_pollitem_t){.socket = NULL, .fd = -1};
    for (struct peer_out *p = ch->peers; p != NULL; p = p->next) {
        if (p->head == NULL)
            continue;
        ch->item_peer[n] = p;
        ch->items[n++] = (zmq_pollitem_t){.socket = p->sock, .events = ZMQ_POLLOUT};
    }
    return (int)n;
}

/* Publishes the owner's counters and hands back the queue slots of the frames
 * that left. Returns whether the channel is stopping. */
static bool publish(struct kvf_peer_channel *ch)
{
    pthread_mutex_lock(&ch->mu);
    uint64_t queued = ch->published.queued;
    ch->published = ch->st;
    ch->published.queued = queued;
    ch->q_count -= ch->released;
    ch->released = 0;
    bool stopping = ch->stopping;
    pthread_mutex_unlock(&ch->mu);
    return stopping;
}

/* Discards what is still queued or held, closes the sockets. Owner thread, on
 * its way out. */
static void owner_teardown(struct kvf_peer_channel *ch)
{
    pthread_mutex_lock(&ch->mu);
    ch->stopping = true;
    struct peer_msg *q = ch->q_head;
    ch->q_head = ch->q_tail = NULL;
    pthread_mutex_unlock(&ch->mu);
    for (struct peer_msg *m = q; m != NULL; m = m->next) {
        if (m->kind == PEER_MSG_FRAME) {
            ch->st.discarded++;
            ch->released++;
        }
    }
    msg_free_list(q);

    struct peer_out *p = ch->peers;
    while (p != NULL) {
        struct peer_out *next = p->next;
        peer_out_free(ch, p);
        p = next;
    }
    ch->peers = NULL;
    ch->n_peers = 0;
    zmq_close(ch->pull);
    ch->pull = NULL;
    zmq_close(ch->zap); /* after the PULL socket: no CURVE handshake asks any more */
    ch->zap = NULL;
    publish(ch);
}

static void *owner_main(void *arg)
{
    struct kvf_peer_channel *ch = arg;
    for (;;) {
        int n = poll_build(ch);
        if (n < 0) {
            peer_log("poll set: out of memory; the channel stops");
            break;
        }
        if (zmq_poll(ch->items, n, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            peer_log("zmq_poll: %s; the channel stops", zmq_strerror(zmq_errno()));
            break;
        }
        if (ch->items[2].revents & ZMQ_POLLIN) {
            /* Every request waiting: libzmq's I/O thread waits for each. */
            int zev = 0;
            size_t zlen = sizeof(zev);
            do {
                zap_answer(ch);
                zev = 0;
                zlen = sizeof(zev);
            } while (zmq_getsockopt(ch->zap, ZMQ_EVENTS, &zev, &zlen) == 0 && (zev & ZMQ_POLLIN));
        }
        if (ch->items[1].revents & ZMQ_POLLIN) {
            uint64_t v;
            if (read(ch->efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
                peer_log("eventfd read: %s", strerror(errno));
        }

        pthread_mutex_lock(&ch->mu);
        struct peer_msg *q = ch->q_head;
        ch->q_head = ch->q_tail = NULL;
        bool stopping = ch->stopping;
        pthread_mutex_unlock(&ch->mu);
        if (stopping) {
            /* Put them back for owner_teardown to count and free. */
            pthread_mutex_lock(&ch->mu);
            if (q != NULL) {
                struct peer_msg *last = q;
                while (last->next != NULL)
                    last = last->next;
                last->next = ch->q_head;
                if (ch->q_head == NULL)
                    ch->q_tail = last;
                ch->q_head = q;
            }
            pthread_mutex_unlock(&ch->mu);
            break;
        }
        while (q != NULL) {
            struct peer_msg *next = q->next;
            route_msg(ch, q);
            q = next;
        }
        for (struct peer_out *p = ch->peers; p != NULL; p = p->next)
            peer_flush(ch, p);
        if (ch->items[0].revents & ZMQ_POLLIN)
            recv_batch(ch);
        if (publish(ch))
            break;
    }
    owner_teardown(ch);
    return NULL;
}

/* ---- create / destroy ---------------------------------------------------------------- */

struct kvf_peer_channel *kvf_peer_channel_create(const struct kvf_peer_channel_opts *o)
{
    if (o == NULL || o->node_id == NULL || o->node_id[0] == '\0' || o->incarnation == 0 ||
        !endpoint_ok(o->bind_endpoint) || o->on_message == NULL || o->accept == NULL ||
        o->queue_max == 0 || o->public_key == NULL || o->secret_key == NULL) {
        peer_log("create: bad options (node id, incarnation, key pair, bind endpoint, "
                 "on_message, accept and queue_max are required)");
        return NULL;
    }
    if (!zmq_has("curve")) {
        /* Without CURVE there is no authenticated channel: refuse to run one. */
        peer_log("create: this libzmq has no CURVE security (zmq_has(\"curve\") is false)");
        return NULL;
    }
    struct kvf_peer_channel *ch = calloc(1, sizeof(*ch));
    if (ch == NULL)
        goto err_log_oom;
    ch->node_id = strdup(o->node_id);
    if (ch->node_id == NULL)
        goto err_free_ch;
    ch->incarnation = o->incarnation;
    memcpy(ch->public_key, o->public_key, KVF_PEER_KEY_SIZE);
    memcpy(ch->secret_key, o->secret_key, KVF_PEER_KEY_SIZE);
    ch->on_message = o->on_message;
    ch->accept = o->accept;
    ch->on_link = o->on_link;
    ch->on_drop = o->on_drop;
    ch->ctx = o->ctx;
    ch->queue_max = o->queue_max;
    ch->fault = o->fault;
    if (ch->fault.delay_after == 0)
        ch->fault.delay_after = 1;
    if (peer_seq_map_init(&ch->send_seq) != 0)
        goto err_free_node_id;
    if (peer_seq_map_init(&ch->recv_seq) != 0)
        goto err_free_send_seq;
    if (pthread_mutex_init(&ch->mu, NULL) != 0)
        goto err_free_recv_seq;
    ch->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ch->efd < 0) {
        peer_log("create: eventfd: %s", strerror(errno));
        goto err_destroy_mu;
    }
    ch->zctx = zmq_ctx_new();
    if (ch->zctx == NULL) {
        peer_log("create: zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        goto err_close_efd;
    }
    int linger = 0;
    /* The ZAP handler first: a CURVE server asks it about every client. */
    ch->zap = zmq_socket(ch->zctx, ZMQ_REP);
    if (ch->zap == NULL) {
        peer_log("create: zmq_socket (zap): %s", zmq_strerror(zmq_errno()));
        goto err_term_ctx;
    }
    zmq_setsockopt(ch->zap, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(ch->zap, PEER_ZAP_ENDPOINT) != 0) {
        peer_log("create: bind %s: %s", PEER_ZAP_ENDPOINT, zmq_strerror(zmq_errno()));
        goto err_close_zap;
    }
    ch->pull = zmq_socket(ch->zctx, ZMQ_PULL);
    if (ch->pull == NULL) {
        peer_log("create: zmq_socket: %s", zmq_strerror(zmq_errno()));
        goto err_close_zap;
    }
    int64_t max_msg =
        o->max_message_bytes ? (int64_t)o->max_message_bytes : (int64_t)PEER_MAX_MESSAGE_DEFAULT;
    int one = 1;
    zmq_setsockopt(ch->pull, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(ch->pull, ZMQ_MAXMSGSIZE, &max_msg, sizeof(max_msg));
    if (zmq_setsockopt(ch->pull, ZMQ_CURVE_SERVER, &one, sizeof(one)) != 0 ||
        zmq_setsockopt(ch->pull, ZMQ_CURVE_SECRETKEY, ch->secret_key, KVF_PEER_KEY_SIZE) != 0 ||
        zmq_setsockopt(ch->pull, ZMQ_ZAP_DOMAIN, PEER_ZAP_DOMAIN, strlen(PEER_ZAP_DOMAIN)) != 0) {
        peer_log("create: CURVE server options: %s", zmq_strerror(zmq_errno()));
        goto err_close_pull;
    }
    if (zmq_bind(ch->pull, o->bind_endpoint) != 0) {
        peer_log("create: bind %s: %s", o->bind_endpoint, zmq_strerror(zmq_errno()));
        goto err_close_pull;
    }
    size_t ep_len = sizeof(ch->endpoint);
    if (zmq_getsockopt(ch->pull, ZMQ_LAST_ENDPOINT, ch->endpoint, &ep_len) != 0) {
        peer_log("create: ZMQ_LAST_ENDPOINT: %s", zmq_strerror(zmq_errno()));
        goto err_close_pull;
    }
    /* From here the owner thread owns the sockets (thread creation is the
     * full barrier ZeroMQ asks for when a socket changes threads). */
    int rc = pthread_create(&ch->thread, NULL, owner_main, ch);
    if (rc != 0) {
        peer_log("create: pthread_create: %s", strerror(rc));
        goto err_close_pull;
    }
    return ch;

err_close_pull:
    zmq_close(ch->pull);
err_close_zap:
    zmq_close(ch->zap);
err_term_ctx:
    while (zmq_ctx_term(ch->zctx) != 0 && zmq_errno() == EINTR) {
    }
err_close_efd:
    close(ch->efd);
err_destroy_mu:
    pthread_mutex_destroy(&ch->mu);
err_free_recv_seq:
    peer_seq_map_free(&ch->recv_seq);
err_free_send_seq:
    peer_seq_map_free(&ch->send_seq);
err_free_node_id:
    OPENSSL_cleanse(ch->secret_key, sizeof(ch->secret_key));
    free(ch->node_id);
err_free_ch:
    free(ch);
err_log_oom:
    peer_log("create: failed (out of memory, or see above)");
    return NULL;
}

void kvf_peer_channel_destroy(struct kvf_peer_channel *ch)
{
    if (ch == NULL)
        return;
    pthread_mutex_lock(&ch->mu);
    ch->stopping = true;
    pthread_mutex_unlock(&ch->mu);
    uint64_t one = 1;
    if (write(ch->efd, &one, sizeof(one)) != (ssize_t)sizeof(one))
        peer_log("destroy: eventfd write: %s", strerror(errno));
    int rc = pthread_join(ch->thread, NULL);
    if (rc != 0)
        peer_log("destroy: pthread_join: %s", strerror(rc));
    /* The owner closed every socket on its way out, so this cannot block. */
    while (zmq_ctx_term(ch->zctx) != 0) {
        if (zmq_errno() != EINTR) {
            peer_log("destroy: zmq_ctx_term: %s", zmq_strerror(zmq_errno()));
            break;
        }
    }
    msg_free_list(ch->q_head); /* sends that raced with the owner's exit */
    close(ch->efd);
    pthread_mutex_destroy(&ch->mu);
    peer_seq_map_free(&ch->recv_seq);
    peer_seq_map_free(&ch->send_seq);
    free(ch->items);
    free(ch->item_peer);
    free(ch->intros);
    OPENSSL_cleanse(ch->secret_key, sizeof(ch->secret_key));
    free(ch->node_id);
    free(ch);
}
