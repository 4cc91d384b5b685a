/*
 * tcp.c: the TCP data transport: frames of page bytes between nodes, checked
 * against the sink lease before they land, fenced by closing sockets and
 * joining the threads that read them.
 *
 * The wire format and the rules a receiver applies are in tcp.h. This file
 * owns the listening socket, one outbound connection per peer (with its send
 * queue, and the connector's half of the handshake), the authenticated
 * inbound connections, the registered pools and the completion list; the
 * acceptor and the handshakes it runs are in tcp_accept.c, the shared
 * definitions in tcp_internal.h.
 *
 * DESIGN (threads and ordering):
 * - Acceptor thread (tcp_accept.c): accepts inbound connections (non-blocking) into a fixed
 *   table of max_pending handshakes and runs them all with one poll: read the
 *   hello, find the peer and its secret (waiting up to check_wait_ms for a
 *   peer not added yet), write the challenge, read and check the proof, each
 *   step as far as the socket allows, every connection with its deadline. A
 *   connection that fails, times out or is evicted for a newer one is closed
 *   abortively, counted and logged (at most TCP_LOG_PER_S lines a second).
 *   An authenticated one gets its receiver thread, named after its peer under
 *   the transport lock (a fenced peer is refused there, so a fence and an
 *   identification are ordered by that lock). So no thread exists for a
 *   connection that has not proven the pair's secret. The acceptor also joins
 *   receivers that ended on their own (EOF, malformed frame). It stops when
 *   destroy writes to its wake pipe.
 * - Receiver thread (one per authenticated inbound connection): owns its
 *   socket and is the only writer of pool memory for frames from its peer.
 *   It loops: header, bounds, check (admits the receive op), payload
 *   straight into the pool, retire, on_frame; on_idle when it would wait for
 *   the next header, or after a bounded batch (tcp.h).
 * - Sender thread (one per outbound connection): owns its socket and its
 *   frame sequence; first finishes the connect that kvf_transport_tcp_connect
 *   started non-blocking (deadline connect_timeout_ms: the caller, the node's
 *   owner thread, never waits for the network), sends the hello, reads the
 *   acceptor's challenge (deadline hello_timeout_ms) and answers with its
 *   proof; frames posted meanwhile wait in the queue, then pops xfers from the connection's queue
 * and writes each as one header + payload with sendmsg, so frames never interleave. A frame
 * completes OK when its last byte is in the socket, ERROR on a write failure (then every queued
 * xfer completes ERROR and later posts fail -EIO). A frame whose lifetime is no longer open when
 * the sender takes it off the queue is not written at all and completes FLUSHED: an abort drains
 * after at most the frame already on the wire, not the whole queue. A frame once started is always
 * written whole (or the connection dies), so the stream never carries half a frame and the sequence
 * numbers stay consecutive.
 * - Fence (control thread): marks the peer fenced under the transport lock,
 *   takes its receivers off the list, sets their stop flags and shuts their
 *   sockets down; sets the sender's stop flag and shuts its socket down; then
 *   joins all of them and completes the sender's queue FLUSHED. Only then does
 *   it close the descriptors (with SO_LINGER 0: an abortive close) and return.
 *   A receiver checks its stop flag before every recv, so the join is prompt,
 *   and after the join no byte from that peer can land.
 * - poll (any one thread): empties the completion list and retires each op
 *   there, outside the lock.
 * Lock order: transport lock, then a connection's queue lock; the completion
 * lock is taken alone.
 */
#include "tcp_internal.h"

#include "pool.h"
#include "kvf_log.h"
#include "kvf_clock.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static struct tcp *tcp_of(struct kvf_transport *base)
{
    return (struct tcp *)((char *)base - offsetof(struct tcp, base));
}

static const struct tcp *tcp_of_const(const struct kvf_transport *base)
{
    return (const struct tcp *)((const char *)base - offsetof(struct tcp, base));
}

static void hdr_encode(uint8_t out[KVF_TCP_HEADER_SIZE], const struct kvf_xfer *x, uint64_t seq)
{
    put_u32(out + 0, KVF_TCP_MAGIC_DATA);
    put_u16(out + 4, KVF_TCP_VERSION);
    put_u16(out + 6, 0);
    put_u64(out + 8, x->room.room_id);
    put_u64(out + 16, x->room.generation);
    put_u64(out + 24, seq);
    put_u32(out + 32, x->sink_pool);
    put_u32(out + 36, x->first_page);
    put_u32(out + 40, x->page_count);
    put_u32(out + 44, x->layout);
    put_u64(out + 48, x->offset);
    put_u64(out + 56, x->len);
}

static void hdr_decode(const uint8_t in[KVF_TCP_HEADER_SIZE], struct tcp_hdr *h)
{
    h->magic = get_u32(in + 0);
    h->version = get_u16(in + 4);
    h->flags = get_u16(in + 6);
    h->room.room_id = get_u64(in + 8);
    h->room.generation = get_u64(in + 16);
    h->seq = get_u64(in + 24);
    h->pool = get_u32(in + 32);
    h->first_page = get_u32(in + 36);
    h->page_count = get_u32(in + 40);
    h->layout = get_u32(in + 44);
    h->offset = get_u64(in + 48);
    h->length = get_u64(in + 56);
}

/*
 * True when the frame's bytes lie inside the pool and its page range names
 * exactly the pages they touch (tcp.h). All arithmetic is in 64 bits, where
 * page_count * page_size (both < 2^32) cannot overflow.
 */
static bool hdr_in_pool(const struct tcp_hdr *h, const struct tcp_pool *p)
{
    if (h->page_count == 0 || h->length == 0)
        return false;
    if ((uint64_t)h->first_page + h->page_count > p->page_count)
        return false;
    if (h->offset >= p->page_size)
        return false;
    uint64_t span = (uint64_t)h->page_count * p->page_size;
    if (h->length > span - h->offset)
        return false;
    uint64_t end = h->offset + h->length;
    return end > span - p->page_size;
}

/* ---- socket helpers --------------------------------------------------------- */

static int send_full(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/*
 * Reads exactly `len` bytes. 0 when done; 1 on a clean EOF before the first
 * byte (if `eof_ok`); -ECANCELED when `stop` was set; -ECONNRESET on EOF part
 * way; -errno on an error. The stop flag is checked before every recv, so a
 * fenced receiver gives up after at most one more recv call.
 */
static int recv_full(int fd, void *buf, uint64_t len, atomic_bool *stop, bool eof_ok)
{
    uint8_t *p = buf;
    uint64_t got = 0;
    while (got < len) {
        if (atomic_load_explicit(stop, memory_order_acquire))
            return -ECANCELED;
        size_t want = (len - got > (uint64_t)SSIZE_MAX) ? (size_t)SSIZE_MAX : (size_t)(len - got);
        ssize_t n = recv(fd, p + got, want, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            return (got == 0 && eof_ok) ? 1 : -ECONNRESET;
        got += (uint64_t)n;
    }
    return 0;
}

/* Reads and drops `len` bytes through `scratch`. */
static int recv_drop(int fd, uint8_t *scratch, uint64_t len, atomic_bool *stop)
{
    while (len > 0) {
        uint64_t n = len < TCP_SCRATCH_SIZE ? len : TCP_SCRATCH_SIZE;
        int rc = recv_full(fd, scratch, n, stop, false);
        if (rc != 0)
            return rc;
        len -= n;
    }
    return 0;
}

void tcp_set_nodelay(int fd)
{
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* Closes with an RST: nothing still queued on the socket is sent. */
void tcp_close_abortive(int fd)
{
    if (fd < 0)
        return;
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
}

uint64_t tcp_mono_ms(void)
{
    return (uint64_t)kvf_clock_mono_ms();
}

/* ---- handshake (tcp.h) ------------------------------------------------------------ */

/* HMAC(secret, label || hello || nonce_a). False when libcrypto failed. */
bool tcp_hs_mac(const uint8_t secret[KVF_TCP_SECRET_SIZE], const char *label,
                const uint8_t hello[KVF_TCP_HELLO_SIZE], const uint8_t nonce_a[TCP_NONCE_SIZE],
                uint8_t out[TCP_MAC_SIZE])
{
    uint8_t msg[sizeof(TCP_LABEL_CONNECTOR) + KVF_TCP_HELLO_SIZE + TCP_NONCE_SIZE];
    size_t n = strlen(label);
    memcpy(msg, label, n);
    memcpy(msg + n, hello, KVF_TCP_HELLO_SIZE);
    memcpy(msg + n + KVF_TCP_HELLO_SIZE, nonce_a, TCP_NONCE_SIZE);
    uint8_t mac[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    bool ok = HMAC(EVP_sha256(), secret, KVF_TCP_SECRET_SIZE, msg,
                   n + KVF_TCP_HELLO_SIZE + TCP_NONCE_SIZE, mac, &len) != NULL &&
              len == TCP_MAC_SIZE;
    if (ok)
        memcpy(out, mac, TCP_MAC_SIZE);
    OPENSSL_cleanse(mac, sizeof(mac));
    return ok;
}

/* ---- completions -------------------------------------------------------------- */

static void cq_push(struct tcp *t, struct kvf_xfer *x, enum kvf_lt_outcome outcome, int status)
{
    x->toutcome = (uint8_t)outcome;
    x->tstatus = status;
    x->tnext = NULL;
    pthread_mutex_lock(&t->cq_lock);
    bool was_empty = !t->cq_head;
    if (t->cq_tail)
        t->cq_tail->tnext = x;
    else
        t->cq_head = x;
    t->cq_tail = x;
    pthread_mutex_unlock(&t->cq_lock);
    if (was_empty)
        kvf_wake_signal(t->cq_wake); /* the poller may be asleep */
}

/* Completes a detached list of xfers with one outcome. */
static void cq_push_list(struct tcp *t, struct kvf_xfer *list, enum kvf_lt_outcome outcome,
                         int status)
{
    while (list) {
        struct kvf_xfer *next = list->tnext;
        cq_push(t, list, outcome, status);
        list = next;
    }
}

static int tcp_poll(struct kvf_transport *base, unsigned max, struct kvf_completion *out)
{
    struct tcp *t = tcp_of(base);
    if (max == 0)
        return 0;
    if (!out)
        return -EINVAL;
    pthread_mutex_lock(&t->cq_lock);
    struct kvf_xfer *list = t->cq_head;
    struct kvf_xfer *last = NULL;
    unsigned n = 0;
    for (struct kvf_xfer *x = list; x && n < max; x = x->tnext) {
        last = x;
        n++;
    }
    if (n > 0) {
        t->cq_head = last->tnext;
        if (!t->cq_head)
            t->cq_tail = NULL;
        last->tnext = NULL;
    }
    pthread_mutex_unlock(&t->cq_lock);

    unsigned i = 0;
    for (struct kvf_xfer *x = list; i < n; i++) {
        struct kvf_xfer *next = x->tnext;
        enum kvf_lt_outcome outcome = (enum kvf_lt_outcome)x->toutcome;
        out[i].xfer = x;
        out[i].outcome = outcome;
        out[i].status = x->tstatus;
        out[i].drained = kvf_lt_op_retire(&x->op, outcome);
        x = next;
    }
    return (int)n;
}

/* ---- sender -------------------------------------------------------------------- */

/* Writes one frame: header and payload in as few sendmsg calls as the socket
 * allows. 0 or -errno. */
static int tx_send_frame(struct tcp_tx *tx, const struct kvf_xfer *x)
{
    uint8_t hdr[KVF_TCP_HEADER_SIZE];
    hdr_encode(hdr, x, ++tx->seq);
    struct iovec iov[2] = {
        {.iov_base = hdr, .iov_len = sizeof(hdr)},
        {.iov_base = (void *)(uintptr_t)x->src, .iov_len = (size_t)x->len},
    };
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
    while (msg.msg_iovlen > 0) {
        ssize_t n = sendmsg(tx->fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        size_t left = (size_t)n;
        while (msg.msg_iovlen > 0 && left >= msg.msg_iov[0].iov_len) {
            left -= msg.msg_iov[0].iov_len;
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (msg.msg_iovlen > 0) {
            msg.msg_iov[0].iov_base = (uint8_t *)msg.msg_iov[0].iov_base + left;
            msg.msg_iov[0].iov_len -= left;
        }
    }
    return 0;
}

/*
 * The connector's half of the handshake, before the first frame: reads the
 * challenge (deadline hello_timeout_ms; a fence's shutdown ends the wait),
 * checks the acceptor's MAC and writes the proof. 0 or -errno: -ETIMEDOUT,
 * -EACCES (a wrong challenge: the other end does not hold the pair's secret),
 * -ECONNRESET (closed: refused), -EIO (libcrypto).
 */
static int tx_handshake(struct tcp_tx *tx)
{
    struct tcp *t = tx->t;
    uint8_t ch[KVF_TCP_CHALLENGE_SIZE];
    size_t got = 0;
    uint64_t deadline = tcp_mono_ms() + t->opts.hello_timeout_ms;
    while (got < sizeof(ch)) {
        uint64_t now = tcp_mono_ms();
        if (now >= deadline)
            return -ETIMEDOUT;
        struct pollfd pf = {.fd = tx->fd, .events = POLLIN};
        int pr = poll(&pf, 1, (int)(deadline - now));
        if (pr < 0 && errno != EINTR)
            return -errno;
        if (pr <= 0)
            continue;
        ssize_t n = recv(tx->fd, ch + got, sizeof(ch) - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            return -ECONNRESET;
        got += (size_t)n;
    }
    uint8_t mac[TCP_MAC_SIZE];
    if (get_u32(ch) != KVF_TCP_MAGIC_CHALLENGE)
        return -EACCES;
    if (!tcp_hs_mac(tx->secret, TCP_LABEL_ACCEPTOR, tx->hello, ch + 4, mac))
        return -EIO;
    if (CRYPTO_memcmp(mac, ch + 4 + TCP_NONCE_SIZE, TCP_MAC_SIZE) != 0)
        return -EACCES;
    uint8_t proof[KVF_TCP_PROOF_SIZE];
    put_u32(proof, KVF_TCP_MAGIC_PROOF);
    if (!tcp_hs_mac(tx->secret, TCP_LABEL_CONNECTOR, tx->hello, ch + 4, proof + 4))
        return -EIO;
    OPENSSL_cleanse(tx->secret, sizeof(tx->secret));
    return send_full(tx->fd, proof, sizeof(proof));
}

/* The connection is dead (`x`, the frame being written, may be NULL): unless
 * a fence stopped it, everything queued completes ERROR and later posts fail
 * -EIO; after a fence, `x` completes FLUSHED (the fencer takes the queue). */
static void tx_fail(struct tcp_tx *tx, struct kvf_xfer *x, int rc)
{
    struct tcp *t = tx->t;
    pthread_mutex_lock(&tx->lock);
    bool fenced = tx->stop;
    struct kvf_xfer *rest = NULL;
    if (!fenced) {
        tx->broken = rc;
        rest = tx->head;
        tx->head = tx->tail = NULL;
    }
    pthread_mutex_unlock(&tx->lock);
    if (fenced) {
        if (x)
            cq_push(t, x, KVF_LT_DONE_FLUSHED, -ECANCELED);
        return;
    }
    if (x) {
        kvf_log("error", "kvf_tcp: write to peer %u failed: %s", tx->peer, strerror(-rc));
        cq_push(t, x, KVF_LT_DONE_ERROR, rc);
    }
    cq_push_list(t, rest, KVF_LT_DONE_ERROR, rc);
}

/* True once a fence (or destroy) stopped the sender. */
static bool tx_stopped(struct tcp_tx *tx)
{
    pthread_mutex_lock(&tx->lock);
    bool stop = tx->stop;
    pthread_mutex_unlock(&tx->lock);
    return stop;
}

/*
 * Finishes the connect that kvf_transport_tcp_connect started on the
 * non-blocking socket: waits until it is writable (deadline
 * connect_timeout_ms; a fence's shutdown ends the wait), reads the result
 * and makes the socket blocking for the rest of its life. 0, -ETIMEDOUT (no
 * answer: a blackholed address, a full accept queue that drops SYNs),
 * -ECANCELED (fenced meanwhile) or the connect's -errno (-ECONNREFUSED...).
 */
static int tx_connect_finish(struct tcp_tx *tx)
{
    struct tcp *t = tx->t;
    uint64_t deadline = tcp_mono_ms() + t->opts.connect_timeout_ms;
    for (;;) {
        if (tx_stopped(tx))
            return -ECANCELED;
        uint64_t now = tcp_mono_ms();
        if (now >= deadline)
            return -ETIMEDOUT;
        struct pollfd pf = {.fd = tx->fd, .events = POLLOUT};
        int pr = poll(&pf, 1, (int)(deadline - now));
        if (pr < 0 && errno != EINTR)
            return -errno;
        if (pr > 0)
            break;
    }
    if (tx_stopped(tx))
        return -ECANCELED;
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(tx->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
        return -errno;
    if (err != 0)
        return -err;
    int fl = fcntl(tx->fd, F_GETFL);
    if (fl < 0 || fcntl(tx->fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        return -errno;
    return 0;
}

/* The connection was never made: every queued frame fails with `rc`. */
static void *tx_connect_failed(struct tcp_tx *tx, int rc)
{
    struct tcp *t = tx->t;
    /* The connection is marked failed before it is counted: whoever sees the
     * counter move sees the posts to this peer fail too. */
    (void)shutdown(tx->fd, SHUT_RDWR);
    tx_fail(tx, NULL, rc == -ECANCELED ? -ECANCELED : rc);
    if (rc != -ECANCELED) {
        CNT_ADD(t, connects_failed, 1);
        if (rc == -ETIMEDOUT)
            CNT_ADD(t, connects_timed_out, 1);
        char host[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &tx->addr.sin_addr, host, sizeof(host));
        kvf_log("error", "kvf_tcp: connect to peer %u at %s:%u: %s%s; its frames fail", tx->peer,
                host, ntohs(tx->addr.sin_port), strerror(-rc),
                rc == -ETIMEDOUT ? " (no answer within connect_timeout_ms)" : "");
    }
    return NULL;
}

static void *tx_main(void *arg)
{
    struct tcp_tx *tx = arg;
    struct tcp *t = tx->t;
    int crc = tx_connect_finish(tx);
    if (crc == 0) {
        tcp_set_nodelay(tx->fd);
        crc = send_full(tx->fd, tx->hello, KVF_TCP_HELLO_SIZE);
        if (crc != 0 && !tx_stopped(tx))
            kvf_log("error", "kvf_tcp: hello to peer %u: %s", tx->peer, strerror(-crc));
    }
    if (crc != 0)
        return tx_connect_failed(tx, crc);
    int hs = tx_handshake(tx);
    if (hs != 0) {
        pthread_mutex_lock(&tx->lock);
        bool fenced = tx->stop;
        pthread_mutex_unlock(&tx->lock);
        /* Tell the acceptor at once; the descriptor is closed after the join.
         * Failed before counted, as in tx_connect_failed. */
        (void)shutdown(tx->fd, SHUT_RDWR);
        tx_fail(tx, NULL, hs == -EACCES ? -EACCES : -EIO);
        if (!fenced) {
            CNT_ADD(t, handshakes_failed, 1);
            kvf_log(
                "error", "kvf_tcp: data port: handshake with peer %u failed: %s; its frames fail",
                tx->peer,
                hs == -EACCES ? "the challenge does not prove the pair's secret" : strerror(-hs));
        }
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&tx->lock);
        while (!tx->head && !tx->stop)
            pthread_cond_wait(&tx->cond, &tx->lock);
        if (tx->stop) {
            /* The fencer completes what is still queued, after the join. */
            pthread_mutex_unlock(&tx->lock);
            return NULL;
        }
        struct kvf_xfer *x = tx->head;
        tx->head = x->tnext;
        if (!tx->head)
            tx->tail = NULL;
        pthread_mutex_unlock(&tx->lock);

        if (!kvf_lt_is_open(x->op.lt)) {
            /* Its room is aborting (or the node stopping): nobody will use
             * these bytes and the sink would only read and drop them, so the
             * lifetime need not wait for the wire. Nothing of it was written. */
            CNT_ADD(t, frames_skipped, 1);
            cq_push(t, x, KVF_LT_DONE_FLUSHED, -ECANCELED);
            continue;
        }
        int rc = tx_send_frame(tx, x);
        if (rc == 0) {
            CNT_ADD(t, frames_sent, 1);
            CNT_ADD(t, bytes_sent, x->len);
            cq_push(t, x, KVF_LT_DONE_OK, 0);
            continue;
        }

        tx_fail(tx, x, rc); /* nothing more is written on this connection */
        return NULL;
    }
}

/* Stops the sender (once): wakes it, joins it, completes its queue FLUSHED
 * and closes the socket. Control thread. */
static void tx_fence(struct tcp *t, struct tcp_tx *tx)
{
    if (tx->joined)
        return;
    pthread_mutex_lock(&tx->lock);
    tx->stop = true;
    pthread_cond_signal(&tx->cond);
    pthread_mutex_unlock(&tx->lock);
    (void)shutdown(tx->fd, SHUT_RDWR);
    pthread_join(tx->thread, NULL);
    tx->joined = true;

    pthread_mutex_lock(&tx->lock);
    struct kvf_xfer *rest = tx->head;
    tx->head = tx->tail = NULL;
    pthread_mutex_unlock(&tx->lock);
    cq_push_list(t, rest, KVF_LT_DONE_FLUSHED, -ECANCELED);
    tcp_close_abortive(tx->fd);
    tx->fd = -1;
}

static void tx_free(struct tcp_tx *tx)
{
    if (!tx)
        return;
    OPENSSL_cleanse(tx->secret, sizeof(tx->secret));
    pthread_cond_destroy(&tx->cond);
    pthread_mutex_destroy(&tx->lock);
    free(tx);
}

static int tcp_post_write(struct kvf_transport *base, struct kvf_xfer *x)
{
    struct tcp *t = tcp_of(base);
    if (!x || !x->src || x->len == 0 || x->page_count == 0 || !x->op.lt || x->op.peer != x->peer ||
        x->op.kind != KVF_LT_OP_TCP_FRAME || x->len > (uint64_t)SIZE_MAX)
        return -EINVAL;
    if (x->peer >= t->opts.max_peers)
        return -ENOENT;

    pthread_mutex_lock(&t->lock);
    struct tcp_peer *p = &t->peers[x->peer];
    int rc = 0;
    struct tcp_tx *tx = p->tx;
    if (p->node_id == 0 || (!tx && !p->fenced))
        rc = -ENOENT;
    else if (p->fenced)
        rc = -ESTALE;
    pthread_mutex_unlock(&t->lock);
    if (rc != 0)
        return rc;

    x->tnext = NULL;
    pthread_mutex_lock(&tx->lock);
    if (tx->stop)
        rc = -ESTALE;
    else if (tx->broken)
        rc = -EIO;
    else {
        if (tx->tail)
            tx->tail->tnext = x;
        else
            tx->head = x;
        tx->tail = x;
        pthread_cond_signal(&tx->cond);
    }
    pthread_mutex_unlock(&tx->lock);
    return rc;
}

/* ---- receiver ------------------------------------------------------------------ */

/* `*removed_p`: pools_removed as of the lookup. */
static bool rx_find_pool(struct tcp *t, uint32_t id, struct tcp_pool *out, uint64_t *removed_p)
{
    bool found = false;
    pthread_mutex_lock(&t->lock);
    *removed_p = atomic_load_explicit(&t->pools_removed, memory_order_relaxed);
    for (uint32_t i = 0; i < t->pool_count; i++) {
        if (t->pools[i].id == id) {
            *out = t->pools[i];
            found = true;
            break;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

/* on_frame calls (and their payload bytes) not yet followed by on_idle. */
struct rx_idle {
    unsigned frames;
    uint64_t bytes;
};

static void rx_idle_flush(struct tcp *t, struct rx_idle *idle)
{
    if (idle->frames > 0 && t->opts.on_idle)
        t->opts.on_idle(t->opts.ctx);
    idle->frames = 0;
    idle->bytes = 0;
}

/* After an on_frame: on_idle once the batch reaches its bounds (tcp.h). */
static void rx_idle_count(struct tcp *t, struct rx_idle *idle, uint64_t bytes)
{
    if (!t->opts.on_idle)
        return; /* nobody to tell: never look ahead */
    idle->frames++;
    idle->bytes += bytes;
    if (idle->frames >= KVF_TCP_IDLE_FRAMES || idle->bytes >= KVF_TCP_IDLE_BYTES)
        rx_idle_flush(t, idle);
}

/*
 * Reads the next header, as recv_full(..., eof_ok) does. While frame events
 * wait for on_idle, it first takes what is already there without waiting;
 * only when the socket is empty (the receiver would sleep) does it call
 * on_idle, so a busy stream hands its events on in batches and the last
 * frame of a burst is handed on at once.
 */
static int rx_header(struct tcp_rx *rx, uint8_t buf[KVF_TCP_HEADER_SIZE], struct rx_idle *idle)
{
    size_t got = 0;
    if (idle->frames > 0 && !atomic_load_explicit(&rx->stop, memory_order_acquire)) {
        ssize_t n;
        do {
            n = recv(rx->fd, buf, KVF_TCP_HEADER_SIZE, MSG_DONTWAIT);
        } while (n < 0 && errno == EINTR);
        if (n == 0)
            return 1;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return -errno;
        if (n < 0)
            rx_idle_flush(rx->t, idle);
        else
            got = (size_t)n;
    }
    if (got == KVF_TCP_HEADER_SIZE)
        return 0;
    return recv_full(rx->fd, buf + got, KVF_TCP_HEADER_SIZE - got, &rx->stop, got == 0);
}

/*
 * A frame into a device pool: the payload goes through the receiver's bounce
 * buffer and kvf_pool_write, synchronously, so it has landed (or failed)
 * before the op is retired, as a direct read has. -EIO when the copy failed
 * (the rest of the payload is not read: the connection ends, as on a cut).
 */
static int rx_into_device(struct tcp_rx *rx, struct kvf_pool *dev, uint64_t at, uint64_t len)
{
    if (!rx->bounce) {
        rx->bounce = malloc(TCP_BOUNCE_SIZE);
        if (!rx->bounce)
            return -ENOMEM;
    }
    while (len > 0) {
        uint64_t n = len < TCP_BOUNCE_SIZE ? len : TCP_BOUNCE_SIZE;
        int rc = recv_full(rx->fd, rx->bounce, n, &rx->stop, false);
        if (rc != 0)
            return rc;
        rc = kvf_pool_write(dev, at, rx->bounce, (size_t)n);
        if (rc != 0) {
            kvf_log("error", "kvf_tcp: device pool write of %llu bytes failed: %s",
                    (unsigned long long)n, strerror(-rc));
            return -EIO;
        }
        at += n;
        len -= n;
    }
    return 0;
}

/* An admitted frame refused after all (its pool went away, or its layout
 * differs): its op retired as an error, on_frame told `err`, its payload read
 * past. 0 to read the next frame, else recv_drop's error (the connection
 * ends). */
static int rx_refuse_admitted(struct tcp_rx *rx, const struct tcp_hdr *h, struct kvf_lt_op *op,
                              int err, struct rx_idle *idle)
{
    struct tcp *t = rx->t;
    bool drained = kvf_lt_op_retire(op, KVF_LT_DONE_ERROR);
    CNT_ADD(t, frames_rejected, 1);
    if (t->opts.on_frame)
        t->opts.on_frame(t->opts.ctx, rx->peer, h->room, h->pool, h->first_page, h->page_count, 0,
                         err, drained);
    rx_idle_count(t, idle, 0);
    return recv_drop(rx->fd, rx->scratch, h->length, &rx->stop);
}

/* Reads frames until the connection ends, is fenced, or misbehaves. */
static void rx_frames(struct tcp_rx *rx, struct rx_idle *idle)
{
    struct tcp *t = rx->t;
    uint64_t expect_seq = 1;
    for (;;) {
        uint8_t buf[KVF_TCP_HEADER_SIZE];
        int rc = rx_header(rx, buf, idle);
        if (rc != 0)
            return; /* EOF between frames, fence, or error: nothing admitted */

        struct tcp_hdr h;
        struct tcp_pool pool;
        uint64_t removed;
        hdr_decode(buf, &h);
        if (h.magic != KVF_TCP_MAGIC_DATA || h.version != KVF_TCP_VERSION || h.flags != 0 ||
            h.seq != expect_seq || !rx_find_pool(t, h.pool, &pool, &removed) ||
            !hdr_in_pool(&h, &pool)) {
            CNT_ADD(t, frames_malformed, 1);
            kvf_log("error",
                    "kvf_tcp: malformed frame from peer %u (seq %llu, pool %u, pages %u+%u, "
                    "offset %llu, length %llu): closing",
                    rx->peer, (unsigned long long)h.seq, h.pool, h.first_page, h.page_count,
                    (unsigned long long)h.offset, (unsigned long long)h.length);
            return;
        }
        expect_seq++;

        struct kvf_lt_op op;
        memset(&op, 0, sizeof(op));
        rc = t->opts.check(t->opts.ctx, rx->peer, h.room, h.pool, h.first_page, h.page_count, &op);
        /* The source may know a room before this node does: wait a little. */
        if (rc == -EAGAIN)
            rx_idle_flush(t, idle); /* about to sleep */
        for (uint32_t waited = 0;
             rc == -EAGAIN && waited < t->opts.check_wait_ms && !atomic_load(&rx->stop); waited++) {
            struct timespec ms = {0, 1000000L};
            nanosleep(&ms, NULL);
            memset(&op, 0, sizeof(op));
            rc = t->opts.check(t->opts.ctx, rx->peer, h.room, h.pool, h.first_page, h.page_count,
                               &op);
        }
        if (rc != 0 || !op.lt) {
            CNT_ADD(t, frames_rejected, 1);
            if (recv_drop(rx->fd, rx->scratch, h.length, &rx->stop) != 0)
                return;
            continue;
        }

        /* The pool may have been removed between the lookup and the
         * admission (kvf_transport_tcp_remove_pool): now that the op holds the
         * lifetime open, look again if any pool was removed since, and never
         * write into a stale mapping. Usually none was: no second lookup. */
        struct tcp_pool again;
        if (atomic_load_explicit(&t->pools_removed, memory_order_acquire) != removed &&
            (!rx_find_pool(t, h.pool, &again, &removed) || again.base != pool.base ||
             again.dev != pool.dev)) {
            if (rx_refuse_admitted(rx, &h, &op, -ENOENT, idle) != 0)
                return;
            continue;
        }
        /* A page of another layout (other buffers, same page size) would
         * land scrambled: refused once admitted, so the room fails as for a
         * frame whose pool went away. One span a page takes any layout. */
        if (h.layout && pool.layout && h.layout != pool.layout) {
            if (rx_refuse_admitted(rx, &h, &op, -EPROTO, idle) != 0)
                return;
            continue;
        }
        uint64_t at = (uint64_t)h.first_page * pool.page_size + h.offset;
        if (pool.dev)
            rc = rx_into_device(rx, pool.dev, at, h.length);
        else
            rc = recv_full(rx->fd, pool.base + at, h.length, &rx->stop, false);
        /* The read has stopped either way: retire before telling anyone. */
        enum kvf_lt_outcome outcome = KVF_LT_DONE_OK;
        if (rc != 0)
            outcome = rc == -ECANCELED ? KVF_LT_DONE_FLUSHED : KVF_LT_DONE_ERROR;
        bool drained = kvf_lt_op_retire(&op, outcome);
        if (rc == 0) {
            CNT_ADD(t, frames_received, 1);
            CNT_ADD(t, bytes_received, h.length);
        } else {
            CNT_ADD(t, frames_cut, 1);
        }
        if (t->opts.on_frame)
            t->opts.on_frame(t->opts.ctx, rx->peer, h.room, h.pool, h.first_page, h.page_count,
                             h.length, rc, drained);
        rx_idle_count(t, idle, h.length);
        if (rc != 0)
            return;
    }
}

/* An authenticated connection (the acceptor named its peer). */
void *tcp_rx_main(void *arg)
{
    struct tcp_rx *rx = arg;
    struct tcp *t = rx->t;
    struct rx_idle idle = {0, 0};
    rx_frames(rx, &idle);
    rx_idle_flush(t, &idle); /* the events of the last batch */
    /* Close here, abortively, so that a peer still writing gets an error at
     * once instead of filling a window nobody reads. Under the lock: fencers
     * shut the descriptor down under it and must never see a reused number. */
    pthread_mutex_lock(&t->lock);
    tcp_close_abortive(rx->fd);
    rx->fd = -1;
    t->peers[rx->peer].nrx--;
    atomic_store_explicit(&rx->done, true, memory_order_release);
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

/* Joins a receiver already taken off the list and frees it (the thread
 * closed its socket). */
static void rx_join_free(struct tcp_rx *rx)
{
    pthread_join(rx->thread, NULL);
    free(rx->scratch);
    free(rx->bounce);
    free(rx);
}

/* Takes receivers off the list: those of `peer`, or `all`, or (done_only)
 * those whose thread ended. Stops the ones still running (flag, then
 * shutdown(2) to wake a blocked recv); the caller joins them after unlocking.
 * Under the transport lock. */
struct tcp_rx *tcp_rx_detach_locked(struct tcp *t, uint32_t peer, bool all, bool done_only)
{
    struct tcp_rx *taken = NULL;
    struct tcp_rx **pp = &t->rx_list;
    while (*pp) {
        struct tcp_rx *rx = *pp;
        bool pick = all || (done_only ? atomic_load(&rx->done) : rx->peer == peer);
        if (!pick) {
            pp = &rx->next;
            continue;
        }
        *pp = rx->next;
        if (!done_only) {
            atomic_store_explicit(&rx->stop, true, memory_order_release);
            if (rx->fd >= 0)
                (void)shutdown(rx->fd, SHUT_RDWR);
        }
        rx->next = taken;
        taken = rx;
    }
    return taken;
}

void tcp_rx_join_list(struct tcp_rx *list)
{
    while (list) {
        struct tcp_rx *next = list->next;
        rx_join_free(list);
        list = next;
    }
}

/* ---- fence and destroy ----------------------------------------------------------- */

static int tcp_fence_peer(struct kvf_transport *base, uint32_t peer)
{
    struct tcp *t = tcp_of(base);
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    pthread_mutex_lock(&t->lock);
    struct tcp_peer *p = &t->peers[peer];
    if (p->node_id == 0) {
        pthread_mutex_unlock(&t->lock);
        return -ENOENT;
    }
    p->fenced = true;
    struct tcp_tx *tx = p->tx;
    struct tcp_rx *rxs = tcp_rx_detach_locked(t, peer, false, false);
    pthread_mutex_unlock(&t->lock);

    if (tx)
        tx_fence(t, tx);
    tcp_rx_join_list(rxs);
    return 0;
}

static void tcp_destroy(struct kvf_transport *base)
{
    if (!base)
        return;
    struct tcp *t = tcp_of(base);

    if (t->acceptor_running) {
        ssize_t n;
        do {
            n = write(t->wake_fd[1], "x", 1);
        } while (n < 0 && errno == EINTR);
        pthread_join(t->acceptor, NULL);
    }
    pthread_mutex_lock(&t->lock);
    t->closing = true;
    pthread_mutex_unlock(&t->lock);
    /* Handshakes still running: the acceptor is gone, close them. */
    for (uint32_t i = 0; t->pending && i < t->opts.max_pending; i++) {
        if (t->pending[i].fd >= 0)
            tcp_close_abortive(t->pending[i].fd);
    }

    for (uint32_t i = 0; t->peers && i < t->opts.max_peers; i++) {
        if (t->peers[i].node_id != 0)
            (void)tcp_fence_peer(base, i);
    }
    /* Connections that never named a peer. */
    pthread_mutex_lock(&t->lock);
    struct tcp_rx *rest = tcp_rx_detach_locked(t, TCP_NO_PEER, true, false);
    pthread_mutex_unlock(&t->lock);
    tcp_rx_join_list(rest);

    /* Nobody will poll any more: retire what is left so no op stays counted. */
    for (struct kvf_xfer *x = t->cq_head; x;) {
        struct kvf_xfer *next = x->tnext;
        (void)kvf_lt_op_retire(&x->op, (enum kvf_lt_outcome)x->toutcome);
        x = next;
    }
    t->cq_head = t->cq_tail = NULL;

    for (uint32_t i = 0; t->peers && i < t->opts.max_peers; i++)
        tx_free(t->peers[i].tx);
    if (t->listen_fd >= 0)
        close(t->listen_fd);
    if (t->wake_fd[0] >= 0)
        close(t->wake_fd[0]);
    if (t->wake_fd[1] >= 0)
        close(t->wake_fd[1]);
    kvf_wake_close(t->cq_wake);
    pthread_mutex_destroy(&t->cq_lock);
    pthread_mutex_destroy(&t->lock);
    /* The pair secrets go back to malloc cleansed: the peers' and those of
     * handshakes still pending (closed above, their secrets still copied). */
    if (t->peers)
        OPENSSL_cleanse(t->peers, (size_t)t->opts.max_peers * sizeof(*t->peers));
    if (t->pending)
        OPENSSL_cleanse(t->pending, (size_t)t->opts.max_pending * sizeof(*t->pending));
    free(t->pools);
    free(t->peers);
    free(t->pending);
    free(t->pfds);
    free(t->pfd_slot);
    free(t);
}

static int tcp_wake_fd(struct kvf_transport *base)
{
    return tcp_of(base)->cq_wake;
}

static void tcp_wake_ack(struct kvf_transport *base)
{
    kvf_wake_clear(tcp_of(base)->cq_wake);
}

static int tcp_ops_add_pool(struct kvf_transport *base, const struct kvf_transport_pool *p,
                            uint64_t *key_p)
{
    int rc = p->dev ? kvf_transport_tcp_add_device_pool(base, p->id, p->dev)
                    : kvf_transport_tcp_add_pool(base, p->id, p->base, p->page_size, p->page_count);
    if (rc == 0 && key_p)
        *key_p = 0;
    return rc;
}

static const struct kvf_transport_ops tcp_ops = {
    .name = "tcp",
    .post_write = tcp_post_write,
    .poll = tcp_poll,
    .fence_peer = tcp_fence_peer,
    .destroy = tcp_destroy,
    .wake_fd = tcp_wake_fd,
    .wake_ack = tcp_wake_ack,
    .add_pool = tcp_ops_add_pool,
    .remove_pool = kvf_transport_tcp_remove_pool,
};

/* ---- public ------------------------------------------------------------------------ */

void kvf_transport_tcp_opts_init(struct kvf_transport_tcp_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->bind_host = "127.0.0.1";
    opts->max_peers = 64;
    opts->max_pools = 64;
    opts->check_wait_ms = 2000;
    opts->hello_timeout_ms = 5000;
    opts->max_pending = 64;
    opts->connect_timeout_ms = 10000;
}

static int tcp_listen(struct tcp *t)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(t->opts.port)};
    if (inet_pton(AF_INET, t->opts.bind_host, &sa.sin_addr) != 1) {
        kvf_log("error", "kvf_tcp: bad bind host '%s'", t->opts.bind_host);
        return -EINVAL;
    }
    /* Non-blocking: the acceptor takes connections until accept says EAGAIN. */
    t->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (t->listen_fd < 0)
        goto err;
    int one = 1;
    (void)setsockopt(t->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(t->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(t->listen_fd, 256) != 0)
        goto err;
    socklen_t len = sizeof(sa);
    if (getsockname(t->listen_fd, (struct sockaddr *)&sa, &len) != 0)
        goto err;
    t->port = ntohs(sa.sin_port);
    return 0;
err:
    kvf_log("error", "kvf_tcp: listen on %s:%u: %s", t->opts.bind_host, t->opts.port,
            strerror(errno));
    return -EIO;
}

struct kvf_transport *kvf_transport_tcp_create(const struct kvf_transport_tcp_opts *opts)
{
    if (!opts || !opts->check || opts->node_id == 0 || opts->max_peers == 0 ||
        opts->max_peers == TCP_NO_PEER || opts->max_pools == 0 || opts->hello_timeout_ms == 0 ||
        opts->hello_timeout_ms > INT_MAX || opts->max_pending == 0 || opts->max_pending > 65536 ||
        opts->connect_timeout_ms == 0 || opts->connect_timeout_ms > INT_MAX) {
        kvf_log("error", "kvf_tcp: bad options (check, node_id, max_peers, max_pools, "
                         "hello_timeout_ms, max_pending, connect_timeout_ms)");
        return NULL;
    }
    struct tcp *t = calloc(1, sizeof(*t));
    if (!t) {
        kvf_log("error", "kvf_tcp: out of memory");
        return NULL;
    }
    t->base.ops = &tcp_ops;
    t->opts = *opts;
    if (!t->opts.bind_host)
        t->opts.bind_host = "127.0.0.1";
    t->listen_fd = -1;
    atomic_init(&t->pools_removed, 0);
    t->wake_fd[0] = t->wake_fd[1] = -1;
    t->cq_wake = kvf_wake_open();
    pthread_mutex_init(&t->lock, NULL);
    pthread_mutex_init(&t->cq_lock, NULL);
    t->peers = calloc(opts->max_peers, sizeof(*t->peers));
    t->pools = calloc(opts->max_pools, sizeof(*t->pools));
    t->pending = calloc(opts->max_pending, sizeof(*t->pending));
    t->pfds = calloc((size_t)opts->max_pending + 2, sizeof(*t->pfds));
    t->pfd_slot = calloc((size_t)opts->max_pending + 2, sizeof(*t->pfd_slot));
    if (t->pending) {
        for (uint32_t i = 0; i < opts->max_pending; i++)
            t->pending[i].fd = -1;
    }
    if (!t->peers || !t->pools || !t->pending || !t->pfds || !t->pfd_slot) {
        kvf_log("error", "kvf_tcp: out of memory");
        goto err_destroy;
    }
    if (t->cq_wake < 0) {
        kvf_log("error", "kvf_tcp: eventfd: %s", strerror(-t->cq_wake));
        goto err_destroy;
    }
    if (pipe2(t->wake_fd, O_CLOEXEC) != 0) {
        kvf_log("error", "kvf_tcp: pipe: %s", strerror(errno));
        goto err_destroy;
    }
    if (tcp_listen(t) != 0)
        goto err_destroy;
    if (pthread_create(&t->acceptor, NULL, tcp_acceptor_main, t) != 0) {
        kvf_log("error", "kvf_tcp: cannot start the acceptor thread");
        goto err_destroy;
    }
    t->acceptor_running = true;
    return &t->base;

err_destroy:
    tcp_destroy(&t->base);
    return NULL;
}

uint16_t kvf_transport_tcp_port(const struct kvf_transport *base)
{
    return tcp_of_const(base)->port;
}

static int tcp_add_pool(struct kvf_transport *base, uint32_t pool_id, void *mem,
                        struct kvf_pool *dev, uint32_t page_size, uint32_t page_count)
{
    struct tcp *t = tcp_of(base);
    if (!mem || page_size == 0 || page_count == 0 ||
        (uint64_t)page_size * page_count > (uint64_t)SIZE_MAX)
        return -EINVAL;
    int rc = 0;
    pthread_mutex_lock(&t->lock);
    for (uint32_t i = 0; i < t->pool_count; i++) {
        if (t->pools[i].id == pool_id)
            rc = -EEXIST;
    }
    if (rc == 0 && t->pool_count == t->opts.max_pools)
        rc = -E2BIG;
    if (rc == 0) {
        t->pools[t->pool_count++] = (struct tcp_pool){.id = pool_id,
                                                      .dev = dev,
                                                      .base = mem,
                                                      .page_size = page_size,
                                                      .page_count = page_count,
                                                      .layout = dev ? kvf_pool_layout(dev) : 0};
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int kvf_transport_tcp_add_pool(struct kvf_transport *base, uint32_t pool_id, void *mem,
                               uint32_t page_size, uint32_t page_count)
{
    return tcp_add_pool(base, pool_id, mem, NULL, page_size, page_count);
}

int kvf_transport_tcp_add_device_pool(struct kvf_transport *base, uint32_t pool_id,
                                      struct kvf_pool *pool)
{
    if (!pool)
        return -EINVAL;
    return tcp_add_pool(base, pool_id, kvf_pool_page(pool, 0), pool, kvf_pool_page_size(pool),
                        kvf_pool_page_count(pool));
}

int kvf_transport_tcp_remove_pool(struct kvf_transport *base, uint32_t pool_id)
{
    struct tcp *t = tcp_of(base);
    int rc = -ENOENT;
    pthread_mutex_lock(&t->lock);
    for (uint32_t i = 0; i < t->pool_count; i++) {
        if (t->pools[i].id == pool_id) {
            t->pools[i] = t->pools[--t->pool_count];
            atomic_fetch_add_explicit(&t->pools_removed, 1, memory_order_release);
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int kvf_transport_tcp_add_peer(struct kvf_transport *base, uint32_t peer, uint64_t node_id)
{
    struct tcp *t = tcp_of(base);
    if (peer >= t->opts.max_peers || node_id == 0)
        return -EINVAL;
    int rc = 0;
    pthread_mutex_lock(&t->lock);
    for (uint32_t i = 0; i < t->opts.max_peers; i++) {
        if (t->peers[i].node_id == node_id)
            rc = -EEXIST;
    }
    if (t->peers[peer].node_id != 0)
        rc = -EEXIST;
    if (rc == 0)
        t->peers[peer].node_id = node_id;
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int kvf_transport_tcp_forget_peer(struct kvf_transport *base, uint32_t peer)
{
    struct tcp *t = tcp_of(base);
    if (peer >= t->opts.max_peers)
        return -EINVAL;
    pthread_mutex_lock(&t->lock);
    struct tcp_peer *p = &t->peers[peer];
    int rc = 0;
    if (p->node_id == 0)
        rc = -ENOENT;
    else if (!p->fenced || p->nrx != 0 || (p->tx && !p->tx->joined))
        rc = -EBUSY;
    struct tcp_tx *tx = rc == 0 ? p->tx : NULL;
    if (rc == 0)
        OPENSSL_cleanse(p, sizeof *p); /* node_id 0: a free index */
    pthread_mutex_unlock(&t->lock);
    tx_free(tx);
    return rc;
}

int kvf_transport_tcp_set_peer_key(struct kvf_transport *base, uint32_t peer,
                                   const uint8_t secret[KVF_TCP_SECRET_SIZE])
{
    struct tcp *t = tcp_of(base);
    if (peer >= t->opts.max_peers || !secret)
        return -EINVAL;
    int rc = 0;
    pthread_mutex_lock(&t->lock);
    struct tcp_peer *p = &t->peers[peer];
    if (p->node_id == 0) {
        rc = -ENOENT;
    } else if (p->have_secret) {
        rc = CRYPTO_memcmp(p->secret, secret, sizeof(p->secret)) == 0 ? 0 : -EEXIST;
    } else {
        memcpy(p->secret, secret, sizeof(p->secret));
        p->have_secret = true;
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int kvf_transport_tcp_connect(struct kvf_transport *base, uint32_t peer, const char *host,
                              uint16_t port)
{
    struct tcp *t = tcp_of(base);
    if (peer >= t->opts.max_peers || !host)
        return peer >= t->opts.max_peers ? -ENOENT : -EINVAL;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return -EINVAL;

    struct tcp_tx *tx = calloc(1, sizeof(*tx));
    if (!tx)
        return -ENOMEM;
    pthread_mutex_lock(&t->lock);
    struct tcp_peer *p = &t->peers[peer];
    /* A connection that died (a failed handshake, a failed write) is not
     * kept: this connect replaces it, so a peer that was away (paused, its
     * data port busy) is reached again instead of failing for good. */
    struct tcp_tx *dead = NULL;
    if (p->tx && !p->fenced) {
        pthread_mutex_lock(&p->tx->lock);
        bool broken = p->tx->broken != 0;
        pthread_mutex_unlock(&p->tx->lock);
        if (broken) {
            dead = p->tx;
            p->tx = NULL;
        }
    }
    int rc = p->node_id == 0   ? -ENOENT
             : p->fenced       ? -ESTALE
             : p->tx           ? -EEXIST
             : !p->have_secret ? -ENOKEY
                               : 0;
    uint64_t to_node = p->node_id;
    if (rc == 0)
        memcpy(tx->secret, p->secret, sizeof(tx->secret));
    pthread_mutex_unlock(&t->lock);
    if (dead) { /* its thread has ended; join it, close its socket */
        tx_fence(t, dead);
        tx_free(dead);
    }
    if (rc != 0) {
        free(tx);
        return rc;
    }
    uint8_t *hello = tx->hello;
    put_u32(hello, KVF_TCP_MAGIC_HELLO);
    put_u16(hello + 4, KVF_TCP_VERSION);
    put_u16(hello + 6, 0);
    put_u64(hello + 8, t->opts.node_id);
    put_u64(hello + 16, to_node);
    if (RAND_bytes(hello + 24, TCP_NONCE_SIZE) != 1) {
        kvf_log("error", "kvf_tcp: RAND_bytes failed");
        OPENSSL_cleanse(tx->secret, sizeof(tx->secret));
        free(tx);
        return -EIO;
    }

    /* Non-blocking: a peer that never answers (a blackholed address, an
     * accept queue that drops SYNs) is waited for by the sender thread, never
     * here. Loopback may connect at once; that is fine too. */
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0 || (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 && errno != EINPROGRESS)) {
        kvf_log("error", "kvf_tcp: connect to peer %u at %s:%u: %s", peer, host, port,
                strerror(errno));
        if (fd >= 0)
            close(fd);
        OPENSSL_cleanse(tx->secret, sizeof(tx->secret));
        free(tx);
        CNT_ADD(t, connects_failed, 1);
        return -EIO;
    }
    CNT_ADD(t, connects_started, 1);
    tx->addr = sa;

    tx->t = t;
    tx->peer = peer;
    tx->fd = fd;
    pthread_mutex_init(&tx->lock, NULL);
    pthread_cond_init(&tx->cond, NULL);
    if (pthread_create(&tx->thread, NULL, tx_main, tx) != 0) {
        tcp_close_abortive(fd);
        tx_free(tx);
        return -ENOMEM;
    }

    pthread_mutex_lock(&t->lock);
    rc = p->fenced ? -ESTALE : p->tx ? -EEXIST : 0;
    if (rc == 0)
        p->tx = tx;
    pthread_mutex_unlock(&t->lock);
    if (rc != 0) {
        tx_fence(t, tx);
        tx_free(tx);
    }
    return rc;
}

void kvf_transport_tcp_stats(const struct kvf_transport *base, struct kvf_transport_tcp_stats *out)
{
    struct tcp *t = (struct tcp *)tcp_of_const(base);
#define LOAD(f) out->f = atomic_load_explicit(&t->c.f, memory_order_relaxed)
    LOAD(frames_sent);
    LOAD(bytes_sent);
    LOAD(frames_received);
    LOAD(bytes_received);
    LOAD(frames_rejected);
    LOAD(frames_malformed);
    LOAD(frames_cut);
    LOAD(frames_skipped);
    LOAD(conns_accepted);
    LOAD(conns_refused);
    LOAD(conns_bad_hello);
    LOAD(conns_unknown);
    LOAD(conns_timed_out);
    LOAD(conns_over_cap);
    LOAD(conns_no_resource);
    LOAD(handshakes_failed);
    LOAD(connects_started);
    LOAD(connects_failed);
    LOAD(connects_timed_out);
#undef LOAD
}
