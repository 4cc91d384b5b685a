/*
 * tcp_accept.c: the TCP data transport's acceptor thread and the handshakes
 * it runs (the acceptor's half of the challenge-response in tcp.h).
 *
 * DESIGN: one thread, started by create and joined by destroy, owns the
 * listening socket's accept(2) and a fixed table of max_pending handshakes
 * (non-blocking sockets). One poll covers the listener, the wake pipe and
 * every handshake socket, with the nearest deadline (or a millisecond while a
 * hello waits for its peer to be added) as its timeout. A handshake moves as
 * far as its socket allows on each turn: hello, the peer's secret (looked up
 * under the transport lock), challenge, proof. A refusal closes the socket
 * abortively, counts it by reason and logs it, at most TCP_LOG_PER_S lines a
 * second. Only a connection whose proof is right gets a receiver thread, and
 * its peer is named under the transport lock, where a fence cannot pass it.
 * The acceptor also joins receivers that ended on their own.
 */
#include "tcp_internal.h"
#include "kvf_log.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- acceptor: handshakes ------------------------------------------------------- */

/* A refusal line, at most TCP_LOG_PER_S a second; the rest are counted and
 * summed up in the next second's first line. Acceptor thread. */
static void refuse_log(struct tcp *t, int fd, const char *why, uint32_t peer)
{
    uint64_t now = tcp_mono_ms();
    if (now - t->log_second_ms >= 1000) {
        if (t->log_dropped > 0)
            kvf_log("warn", "kvf_tcp: data port: %llu more refusals not logged",
                    (unsigned long long)t->log_dropped);
        t->log_second_ms = now;
        t->log_lines = 0;
        t->log_dropped = 0;
    }
    if (t->log_lines >= TCP_LOG_PER_S) {
        t->log_dropped++;
        return;
    }
    t->log_lines++;
    struct sockaddr_in sa;
    socklen_t len = sizeof(sa);
    char addr[INET_ADDRSTRLEN] = "?";
    if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0 && sa.sin_family == AF_INET)
        (void)inet_ntop(AF_INET, &sa.sin_addr, addr, sizeof(addr));
    unsigned port = len == sizeof(sa) ? ntohs(sa.sin_port) : 0;
    if (peer != TCP_NO_PEER)
        kvf_log("warn", "kvf_tcp: data port: refused %s:%u (peer %u): %s", addr, port, peer, why);
    else
        kvf_log("warn", "kvf_tcp: data port: refused %s:%u: %s", addr, port, why);
}

/* Closes a connection in its handshake: counted, logged, its slot freed. */
static void pend_refuse(struct tcp *t, struct tcp_pending *pd, enum tcp_refusal why,
                        const char *text)
{
    CNT_ADD(t, conns_refused, 1);
    switch (why) {
    case REFUSE_BAD_HELLO:
        CNT_ADD(t, conns_bad_hello, 1);
        break;
    case REFUSE_UNKNOWN:
        CNT_ADD(t, conns_unknown, 1);
        break;
    case REFUSE_TIMED_OUT:
        CNT_ADD(t, conns_timed_out, 1);
        break;
    case REFUSE_OVER_CAP:
        CNT_ADD(t, conns_over_cap, 1);
        break;
    case REFUSE_NO_RESOURCE:
        CNT_ADD(t, conns_no_resource, 1);
        break;
    }
    refuse_log(t, pd->fd, text, pd->state >= PEND_CHALLENGE ? pd->peer : TCP_NO_PEER);
    tcp_close_abortive(pd->fd);
    OPENSSL_cleanse(pd->secret, sizeof(pd->secret));
    pd->fd = -1;
}

/* PEND_HELLO done or PEND_PEER: finds the hello's peer and its secret and
 * writes the challenge; keeps waiting (PEND_PEER) for a peer not added yet
 * until peer_wait_ms. */
static void pend_find_peer(struct tcp *t, struct tcp_pending *pd, uint64_t now)
{
    uint64_t from = get_u64(pd->hello + 8);
    int found = 0; /* 1: named, -1: fenced */
    pthread_mutex_lock(&t->lock);
    for (uint32_t i = 0; i < t->opts.max_peers; i++) {
        struct tcp_peer *p = &t->peers[i];
        if (p->node_id != from)
            continue;
        if (p->fenced) {
            found = -1;
        } else if (p->have_secret) {
            memcpy(pd->secret, p->secret, sizeof(pd->secret));
            pd->peer = i;
            found = 1;
        }
        break;
    }
    pthread_mutex_unlock(&t->lock);
    if (found < 0) {
        pend_refuse(t, pd, REFUSE_UNKNOWN, "the hello names a fenced peer");
        return;
    }
    if (found == 0) {
        if (now >= pd->peer_wait_ms)
            pend_refuse(t, pd, REFUSE_UNKNOWN,
                        "the hello names no introduced peer (or one without a secret)");
        else
            pd->state = PEND_PEER;
        return;
    }
    uint8_t *c = pd->challenge;
    put_u32(c, KVF_TCP_MAGIC_CHALLENGE);
    if (RAND_bytes(c + 4, TCP_NONCE_SIZE) != 1 ||
        !tcp_hs_mac(pd->secret, TCP_LABEL_ACCEPTOR, pd->hello, c + 4, c + 4 + TCP_NONCE_SIZE)) {
        pend_refuse(t, pd, REFUSE_BAD_HELLO, "libcrypto failed (RAND_bytes or HMAC)");
        return;
    }
    pd->state = PEND_CHALLENGE;
    pd->done = 0;
}

/* The proof is right: the connection gets its receiver thread, unless the
 * peer was fenced meanwhile or has KVF_TCP_MAX_RX_PER_PEER already. */
static void pend_admit(struct tcp *t, struct tcp_pending *pd)
{
    struct tcp_rx *rx = calloc(1, sizeof(*rx));
    uint8_t *scratch = malloc(TCP_SCRATCH_SIZE);
    int fl = fcntl(pd->fd, F_GETFL);
    if (!rx || !scratch || fl < 0 || fcntl(pd->fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        free(rx);
        free(scratch);
        pend_refuse(t, pd, REFUSE_NO_RESOURCE, "out of memory (or fcntl failed)");
        return;
    }
    tcp_set_nodelay(pd->fd);
    rx->t = t;
    rx->fd = pd->fd;
    rx->peer = pd->peer;
    rx->scratch = scratch;
    atomic_init(&rx->stop, false);
    atomic_init(&rx->done, false);

    const char *why = NULL;
    enum tcp_refusal kind = REFUSE_UNKNOWN;
    pthread_mutex_lock(&t->lock);
    struct tcp_peer *p = &t->peers[pd->peer];
    /* Ordered with fence_peer by the lock: a fenced peer is never named. */
    if (t->closing || p->fenced) {
        why = "the peer was fenced during the handshake";
    } else if (p->nrx >= KVF_TCP_MAX_RX_PER_PEER) {
        why = "the peer has its most connections already";
        kind = REFUSE_OVER_CAP;
    } else if (pthread_create(&rx->thread, NULL, tcp_rx_main, rx) != 0) {
        why = "cannot start a receiver thread";
        kind = REFUSE_NO_RESOURCE;
    } else {
        p->nrx++;
        rx->next = t->rx_list;
        t->rx_list = rx;
    }
    pthread_mutex_unlock(&t->lock);
    if (why) {
        free(scratch);
        free(rx);
        pend_refuse(t, pd, kind, why);
        return;
    }
    CNT_ADD(t, conns_accepted, 1);
    OPENSSL_cleanse(pd->secret, sizeof(pd->secret));
    pd->fd = -1; /* the receiver's now */
}

/* Moves one handshake on as far as its socket allows. */
static void pend_step(struct tcp *t, struct tcp_pending *pd, uint64_t now)
{
    for (;;) {
        if (pd->state == PEND_CHALLENGE) {
            ssize_t n = send(pd->fd, pd->challenge + pd->done, sizeof(pd->challenge) - pd->done,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0 && (errno == EINTR))
                continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
                return;
            if (n <= 0) {
                pend_refuse(t, pd, REFUSE_BAD_HELLO, "closed during the challenge");
                return;
            }
            pd->done += (size_t)n;
            if (pd->done == sizeof(pd->challenge)) {
                pd->state = PEND_PROOF;
                pd->done = 0;
            }
            continue;
        }
        if (pd->state != PEND_HELLO && pd->state != PEND_PROOF)
            return;
        /* Exactly the message's bytes: what follows it stays for the receiver. */
        uint8_t *buf = pd->state == PEND_HELLO ? pd->hello : pd->proof;
        size_t want = pd->state == PEND_HELLO ? sizeof(pd->hello) : sizeof(pd->proof);
        ssize_t n = recv(pd->fd, buf + pd->done, want - pd->done, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n <= 0) {
            pend_refuse(t, pd, REFUSE_BAD_HELLO,
                        pd->state == PEND_HELLO ? "closed before a whole hello"
                                                : "closed before a whole proof");
            return;
        }
        pd->done += (size_t)n;
        if (pd->done < want)
            continue;
        if (pd->state == PEND_HELLO) {
            if (get_u32(buf) != KVF_TCP_MAGIC_HELLO || get_u16(buf + 4) != KVF_TCP_VERSION ||
                get_u16(buf + 6) != 0 || get_u64(buf + 16) != t->opts.node_id ||
                get_u64(buf + 8) == 0) {
                pend_refuse(t, pd, REFUSE_BAD_HELLO,
                            "not a version-2 hello addressed to this node");
                return;
            }
            pd->peer_wait_ms = now + t->opts.check_wait_ms;
            pend_find_peer(t, pd, now);
            if (pd->fd < 0 || pd->state != PEND_CHALLENGE)
                return;
            continue;
        }
        uint8_t mac[TCP_MAC_SIZE];
        if (get_u32(buf) != KVF_TCP_MAGIC_PROOF ||
            !tcp_hs_mac(pd->secret, TCP_LABEL_CONNECTOR, pd->hello, pd->challenge + 4, mac) ||
            CRYPTO_memcmp(mac, buf + 4, TCP_MAC_SIZE) != 0) {
            pend_refuse(t, pd, REFUSE_BAD_HELLO, "the proof does not prove the pair's secret");
            return;
        }
        pend_admit(t, pd);
        return;
    }
}

/* Accepts what the listener has, into free handshake slots; when none is
 * free the oldest handshake is refused to make room (a flood of idle
 * connections cannot keep a real peer out for longer than its own turnover). */
static void accept_batch(struct tcp *t, uint64_t now)
{
    for (int k = 0; k < TCP_ACCEPT_BATCH; k++) {
        int fd = accept4(t->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            /* Out of descriptors or memory: back off instead of spinning on a
             * listener that stays readable. EINTR, ECONNABORTED: retry. */
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                struct pollfd w = {.fd = t->wake_fd[0], .events = POLLIN};
                (void)poll(&w, 1, 10);
            }
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return;
        }
        struct tcp_pending *slot = NULL, *oldest = NULL;
        for (uint32_t i = 0; i < t->opts.max_pending && !slot; i++) {
            struct tcp_pending *pd = &t->pending[i];
            if (pd->fd < 0)
                slot = pd;
            else if (!oldest || pd->deadline_ms < oldest->deadline_ms)
                oldest = pd;
        }
        if (!slot) {
            pend_refuse(t, oldest, REFUSE_OVER_CAP,
                        "evicted: max_pending connections in their handshake");
            slot = oldest;
        }
        memset(slot, 0, sizeof(*slot));
        slot->fd = fd;
        slot->state = PEND_HELLO;
        slot->peer = TCP_NO_PEER;
        slot->deadline_ms = now + t->opts.hello_timeout_ms;
    }
}

/* ---- acceptor ------------------------------------------------------------------ */

void *tcp_acceptor_main(void *arg)
{
    struct tcp *t = arg;
    for (;;) {
        /* Receivers that ended on their own. */
        pthread_mutex_lock(&t->lock);
        struct tcp_rx *ended = tcp_rx_detach_locked(t, TCP_NO_PEER, false, true);
        pthread_mutex_unlock(&t->lock);
        tcp_rx_join_list(ended);

        uint64_t now = tcp_mono_ms();
        nfds_t n = 0;
        t->pfds[n++] = (struct pollfd){.fd = t->listen_fd, .events = POLLIN};
        t->pfds[n++] = (struct pollfd){.fd = t->wake_fd[0], .events = POLLIN};
        int timeout = -1;
        for (uint32_t i = 0; i < t->opts.max_pending; i++) {
            struct tcp_pending *pd = &t->pending[i];
            if (pd->fd < 0)
                continue;
            uint64_t until = pd->deadline_ms;
            if (pd->state == PEND_PEER)
                until = now + 1; /* look for the peer again in a millisecond */
            int left = until > now ? (int)(until - now) : 0;
            if (timeout < 0 || left < timeout)
                timeout = left;
            t->pfd_slot[n] = i;
            t->pfds[n++] = (struct pollfd){.fd = pd->fd,
                                           .events = pd->state == PEND_CHALLENGE ? POLLOUT
                                                     : pd->state == PEND_PEER    ? 0
                                                                                 : POLLIN};
        }
        int pr = poll(t->pfds, n, timeout);
        if (pr < 0 && errno != EINTR) {
            kvf_log("error", "kvf_tcp: poll: %s", strerror(errno));
            return NULL;
        }
        if (pr > 0 && t->pfds[1].revents)
            return NULL;
        now = tcp_mono_ms();
        for (nfds_t k = 2; pr > 0 && k < n; k++) {
            struct tcp_pending *pd = &t->pending[t->pfd_slot[k]];
            if (t->pfds[k].revents && pd->fd >= 0)
                pend_step(t, pd, now);
        }
        for (uint32_t i = 0; i < t->opts.max_pending; i++) {
            struct tcp_pending *pd = &t->pending[i];
            if (pd->fd >= 0 && pd->state == PEND_PEER)
                pend_find_peer(t, pd, now);
            if (pd->fd >= 0 && pd->state == PEND_CHALLENGE)
                pend_step(t, pd, now);
            if (pd->fd >= 0 && now >= pd->deadline_ms)
                pend_refuse(t, pd, REFUSE_TIMED_OUT, "no complete handshake by the deadline");
        }
        if (pr > 0 && t->pfds[0].revents)
            accept_batch(t, now);
    }
}
