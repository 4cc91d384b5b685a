/*
 * fuzz_peer_envelope.c: the peer channel's receive side
 * (dataplane/peer/peer_channel.c) on hostile messages, through its public API
 * only: one channel is bound on an ipc endpoint, the target pushes each input
 * as one ZeroMQ message from a PUSH socket, and waits until the channel has
 * accounted for it (delivered, dropped for a reason, or a link message).
 * PeerFrame decoding, the envelope checks, addressing, the admission verdict
 * and the per-sender sequence all run as between nodes.
 *
 * The channel is node "fz" incarnation 1. The PUSH socket is a CURVE client
 * with a key the channel was introduced to as node "n2" incarnation 1 (the
 * seeds' sender), so inputs get past the channel's authentication and reach
 * the envelope checks, as an introduced but hostile peer's would. Admission:
 * odd room ids ACCEPT, ids divisible by 4 LATE, the rest UNKNOWN.
 */
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "fuzz_util.h"
#include "peer_channel.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct kvf_peer_channel *ch;
static void *zctx, *push;

static void on_message(void *ctx, const Kvfence__V1__PeerEnvelope *env)
{
    (void)ctx;
    if (!env->sender_node_id)
        abort(); /* the channel promised a checked envelope */
}

static enum kvf_peer_verdict accept_cb(void *ctx, kvf_room_key key, const char *sender,
                                       uint64_t inc)
{
    (void)ctx;
    (void)sender;
    (void)inc;
    if (key.room_id & 1)
        return KVF_PEER_ACCEPT;
    return key.room_id % 4 == 0 ? KVF_PEER_LATE : KVF_PEER_UNKNOWN;
}

static void on_link(void *ctx, const Kvfence__V1__LinkMessage *msg)
{
    (void)ctx;
    (void)msg;
}

static uint64_t accounted(void)
{
    struct kvf_peer_stats s;
    kvf_peer_channel_stats(ch, &s);
    return s.delivered + s.links + s.wrong_receiver + s.malformed + s.late + s.unknown +
           s.duplicate + s.out_of_order + s.unauthenticated;
}

static void start(void)
{
    static char ep[300];
    snprintf(ep, sizeof ep, "ipc://%s/peer.sock", fz_scratch_dir());
    static struct kvf_peer_keypair own, peer;
    if (kvf_peer_keypair_generate(&own) != 0 || kvf_peer_keypair_generate(&peer) != 0)
        abort();
    struct kvf_peer_channel_opts o;
    kvf_peer_channel_opts_init(&o);
    o.public_key = own.pub;
    o.secret_key = own.sec;
    o.node_id = "fz";
    o.incarnation = 1;
    o.bind_endpoint = ep;
    o.on_message = on_message;
    o.accept = accept_cb;
    o.on_link = on_link;
    o.max_message_bytes = 1u << 16;
    ch = kvf_peer_channel_create(&o);
    if (!ch || kvf_peer_channel_introduce(ch, "n2", 1, peer.pub) != 0)
        abort();
    zctx = zmq_ctx_new();
    push = zctx ? zmq_socket(zctx, ZMQ_PUSH) : NULL;
    if (!push || zmq_setsockopt(push, ZMQ_CURVE_SERVERKEY, own.pub, KVF_PEER_KEY_SIZE) != 0 ||
        zmq_setsockopt(push, ZMQ_CURVE_PUBLICKEY, peer.pub, KVF_PEER_KEY_SIZE) != 0 ||
        zmq_setsockopt(push, ZMQ_CURVE_SECRETKEY, peer.sec, KVF_PEER_KEY_SIZE) != 0 ||
        zmq_connect(push, kvf_peer_channel_endpoint(ch)) != 0)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!ch)
        start();
    if (size > (1u << 16))
        return 0; /* over max_message_bytes: ZeroMQ drops it before the channel sees it */
    uint64_t before = accounted();
    if (zmq_send(push, data, size, 0) < 0)
        abort();
    while (accounted() == before)
        sched_yield();
    return 0;
}
