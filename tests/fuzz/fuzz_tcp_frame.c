/*
 * fuzz_tcp_frame.c: the TCP data transport's receive side
 * (dataplane/transport/tcp.c) on hostile bytes, through its public API only:
 * one transport listens on 127.0.0.1 with one pool (8 pages of 512 bytes) and
 * one known peer with its secret; each input is sent on a new connection,
 * which is then half-closed, and the target waits for the receiver to close
 * it. The handshake and frame headers (tcp.h's wire format), the pool and seq
 * checks, the payload reads, the sink-lease check and the retirement all run
 * as they do between nodes.
 *
 * Input: byte 0, bit 0 clear: the target runs the connector's half of the
 * handshake as the known peer (hello, the acceptor's challenge checked, the
 * proof), so the fuzzer starts at the frames; set: the input brings its own
 * hello and proof (the acceptor's hello and proof checks are fuzzed).
 * The lease check admits frames of room (1, 1) on pages 0..5 and refuses the
 * rest (room 2 answers "not known yet" once: the wait-and-retry path).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "lifetime.h"
#include "tcp.h"

#define NODE_US    0x5553u
#define NODE_PEER  0x1111u
#define POOL_ID    1u
#define PAGE_SIZE  512u
#define PAGE_COUNT 8u

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct kvf_transport *tp;
static struct kvf_lt_table *tab;
static struct kvf_lt *lt;
static pthread_mutex_t lt_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t pool[PAGE_SIZE * PAGE_COUNT];
static uint16_t port;
static const uint8_t secret[KVF_TCP_SECRET_SIZE] = "fuzz_tcp_frame: pair secret";

static int check_cb(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                    uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op)
{
    (void)ctx;
    static _Thread_local unsigned eagain;
    if (room.room_id == 2 && eagain++ % 2 == 0)
        return -EAGAIN;
    if (room.room_id != 1 || room.generation != 1 || pool_id != POOL_ID ||
        (uint64_t)first_page + page_count > 6)
        return -EPERM;
    pthread_mutex_lock(&lt_lock);
    int rc = kvf_lt_admit(lt, op, KVF_LT_OP_TCP_FRAME, peer);
    pthread_mutex_unlock(&lt_lock);
    return rc;
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void start(void)
{
    tab = kvf_lt_table_create();
    if (!tab || kvf_lt_table_open(tab, (kvf_room_key){.room_id = 1, .generation = 1}, &lt) != 0)
        abort();
    struct kvf_transport_tcp_opts o;
    kvf_transport_tcp_opts_init(&o);
    o.node_id = NODE_US;
    o.check = check_cb;
    o.check_wait_ms = 2;
    tp = kvf_transport_tcp_create(&o);
    if (!tp || kvf_transport_tcp_add_pool(tp, POOL_ID, pool, PAGE_SIZE, PAGE_COUNT) != 0 ||
        kvf_transport_tcp_add_peer(tp, 0, NODE_PEER) != 0 ||
        kvf_transport_tcp_set_peer_key(tp, 0, secret) != 0)
        abort();
    port = kvf_transport_tcp_port(tp);
}

static void send_all(int fd, const uint8_t *p, size_t len)
{
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue; /* libFuzzer's SIGALRM (its -timeout watchdog) */
        if (n <= 0)
            return; /* the receiver closed: a malformed frame */
        p += n;
        len -= (size_t)n;
    }
}

static bool recv_all(int fd, uint8_t *p, size_t len)
{
    while (len) {
        ssize_t n = recv(fd, p, len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        p += n;
        len -= (size_t)n;
    }
    return true;
}

/* HMAC(secret, label || hello || nonce_a) into mac (tcp.h). */
static void handshake_mac(const char *label, const uint8_t *hello, const uint8_t *nonce_a,
                          uint8_t mac[32])
{
    uint8_t msg[64 + KVF_TCP_HELLO_SIZE + 32];
    size_t n = strlen(label);
    memcpy(msg, label, n);
    memcpy(msg + n, hello, KVF_TCP_HELLO_SIZE);
    memcpy(msg + n + KVF_TCP_HELLO_SIZE, nonce_a, 32);
    unsigned len = 0;
    if (!HMAC(EVP_sha256(), secret, sizeof secret, msg, n + KVF_TCP_HELLO_SIZE + 32, mac, &len) ||
        len != 32)
        abort();
}

/* The connector's half of the handshake, as the known peer. False when the
 * acceptor hung up instead of answering (it must not: the hello is valid). */
static bool handshake(int fd)
{
    uint8_t hello[KVF_TCP_HELLO_SIZE];
    put_le(hello, KVF_TCP_MAGIC_HELLO, 4);
    put_le(hello + 4, KVF_TCP_VERSION, 2);
    put_le(hello + 6, 0, 2);
    put_le(hello + 8, NODE_PEER, 8);
    put_le(hello + 16, NODE_US, 8);
    memset(hello + 24, 0xa5, 32); /* nonce_c: fixed, the run stays reproducible */
    send_all(fd, hello, sizeof hello);
    uint8_t ch[KVF_TCP_CHALLENGE_SIZE];
    if (!recv_all(fd, ch, sizeof ch)) {
        perror("fuzz_tcp_frame: no challenge");
        return false;
    }
    uint8_t mac[32];
    handshake_mac("kvfence tcp v2 acceptor", hello, ch + 4, mac);
    if (ch[0] != (uint8_t)KVF_TCP_MAGIC_CHALLENGE || CRYPTO_memcmp(mac, ch + 36, 32) != 0)
        abort(); /* the acceptor proved the wrong secret */
    uint8_t proof[KVF_TCP_PROOF_SIZE];
    put_le(proof, KVF_TCP_MAGIC_PROOF, 4);
    handshake_mac("kvfence tcp v2 connector", hello, ch + 4, proof + 4);
    send_all(fd, proof, sizeof proof);
    return true;
}

/* A connection to the transport; with `shake`, one that finished the
 * handshake (a valid hello from the known peer must get its challenge).
 * Every call here may see EINTR: libFuzzer's -timeout watchdog is a
 * SIGALRM every few seconds. */
static int connect_to_transport(bool shake)
{
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0)
            abort();
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
            if (errno == EINTR) { /* the connect goes on in the background: start over */
                close(fd);
                continue;
            }
            perror("fuzz_tcp_frame: connect");
            abort();
        }
        struct timeval tv = {.tv_sec = 5};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (shake && !handshake(fd))
            abort(); /* a valid hello from the known peer was refused */
        return fd;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!tp)
        start();
    if (size == 0)
        return 0;
    int fd = connect_to_transport(!(data[0] & 1));
    send_all(fd, data + 1, size - 1);
    shutdown(fd, SHUT_WR);
    /* The receiver closes its end when it is done with the connection. */
    uint8_t buf[64];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n == 0 || (n < 0 && errno != EINTR))
            break;
    }
    /* Both sides are done: close with a reset, so that this end leaves no
     * TIME_WAIT behind. A thousand connections a second would otherwise use
     * up the ephemeral ports within a minute (connect: EADDRNOTAVAIL), for
     * this run and for everything else on the machine. */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
    return 0;
}
