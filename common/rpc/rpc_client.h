/*
 * rpc_client.h: kvfence's gRPC client glue (kvf_rpc_channel_*, kvf_rpc_unary,
 * kvf_rpc_client_stream_*), for tests, benchmarks, the C client library and
 * the node's session with the control plane.
 *
 * Messages are opaque bytes: callers pack and unpack protobuf-c themselves.
 * Everything here blocks the calling thread; a channel may be shared by any
 * number of threads.
 */
#ifndef KVF_RPC_CLIENT_H
#define KVF_RPC_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

/* No deadline, for the timeout_ms arguments below. */
#define KVF_RPC_NO_TIMEOUT (-1)

/* kvf_rpc_client_stream_recv() returns this when the stream has ended. */
#define KVF_RPC_STREAM_END 1

#define KVF_RPC_STATUS_MSG_MAX 256

/* The status a call ended with. */
struct kvf_rpc_status {
    int code; /* enum kvf_grpc_code */
    char message[KVF_RPC_STATUS_MSG_MAX];
};

/* One metadata entry sent with every call of a channel. Keys are lower-case
 * ([a-z0-9_.-]); values of keys ending in "-bin" may be binary, others are
 * printable ASCII. */
struct kvf_rpc_metadata {
    const char *key;
    const char *value;
};

struct kvf_rpc_channel_opts {
    /* TLS: PEM path of the CA that signed the server's certificate; NULL =
     * plaintext. */
    const char *tls_root_ca_path;
    /* Mutual TLS: the client's certificate and key (both or neither). */
    const char *tls_cert_path;
    const char *tls_key_path;
    /* TLS: the name checked against the server certificate instead of the
     * target's host (GRPC_SSL_TARGET_NAME_OVERRIDE_ARG); NULL = the host. */
    const char *tls_target_name;
    /* Calls wait for the connection instead of failing fast with UNAVAILABLE
     * while the server is unreachable (pitfall 9). */
    bool wait_for_ready;
    /* Largest message sent or received; 0 = 16 MiB. */
    size_t max_message_bytes;
    /* Metadata sent with every call (copied); validated at create. */
    const struct kvf_rpc_metadata *metadata;
    size_t n_metadata;
};

struct kvf_rpc_channel;
struct kvf_rpc_client_stream;

/* Fills `opts` with defaults: plaintext, fail fast, 16 MiB, no metadata. */
void kvf_rpc_channel_opts_init(struct kvf_rpc_channel_opts *opts);

/* Creates a channel to `target` ("127.0.0.1:7000", "unix:/run/kvf.sock");
 * calls grpc_init(). Connects lazily, on the first call. Returns NULL and logs
 * why on bad options (metadata keys, unreadable TLS files). */
struct kvf_rpc_channel *kvf_rpc_channel_create(const char *target,
                                               const struct kvf_rpc_channel_opts *opts);

/* Destroys the channel; every call and stream on it must be over (streams
 * closed). Calls grpc_shutdown(). Accepts NULL. */
void kvf_rpc_channel_destroy(struct kvf_rpc_channel *ch);

/* Blocking unary call of `method` ("/kvfence.v1.Control/JoinRoom") with
 * request `req`/`len`, `timeout_ms` from now (KVF_RPC_NO_TIMEOUT: none). Any
 * thread; each call has its own completion queue.
 * Returns 0 when the status is OK: *resp_p (malloc'd, the caller frees it,
 * non-NULL even when empty) and *resp_len_p are written. Returns -EREMOTEIO
 * when the call ended with another status, -EPROTO if an OK reply carried no
 * message, -EINVAL on bad arguments, -EIO if gRPC refused the batch. `st`
 * (may be NULL) always receives the status: the server's, or the one that
 * describes the local failure (INTERNAL, INVALID_ARGUMENT). */
int kvf_rpc_unary(struct kvf_rpc_channel *ch, const char *method, const uint8_t *req, size_t len,
                  int64_t timeout_ms, uint8_t **resp_p, size_t *resp_len_p,
                  struct kvf_rpc_status *st);

/* Opens a client stream (bidi or server-streaming) on `method`, with a
 * deadline `timeout_ms` from now for the whole stream (KVF_RPC_NO_TIMEOUT:
 * none). Does not wait for the server. Returns NULL and logs why on failure.
 * Threads: one thread may send/half-close while another receives; cancel from
 * any thread; close when neither is inside a call. */
struct kvf_rpc_client_stream *kvf_rpc_client_stream_open(struct kvf_rpc_channel *ch,
                                                         const char *method, int64_t timeout_ms);

/* Sends one message and waits until gRPC has taken it (flow control may hold
 * it). Returns 0, -EPIPE after half-close, -ECANCELED if the stream has ended
 * (recv gives the status), -EIO if gRPC refused the batch. */
int kvf_rpc_client_stream_send(struct kvf_rpc_client_stream *cs, const uint8_t *bytes, size_t len);

/* Waits up to `timeout_ms` (KVF_RPC_NO_TIMEOUT: no limit) for the next
 * message. Returns 0 with *msg_p (malloc'd, the caller frees it) and
 * *len_p; KVF_RPC_STREAM_END once the stream is over, with its status in `st`
 * (any code: OK when the server finished cleanly), again on every later call;
 * -ETIMEDOUT when nothing came in time (the stream is unaffected: call again);
 * -EIO if gRPC refused the batch; -ENOMEM. */
int kvf_rpc_client_stream_recv(struct kvf_rpc_client_stream *cs, int64_t timeout_ms,
                               uint8_t **msg_p, size_t *len_p, struct kvf_rpc_status *st);

/* Tells the server no more messages will come. Returns 0, -EALREADY, -EIO. */
int kvf_rpc_client_stream_half_close(struct kvf_rpc_client_stream *cs);

/* Cancels the stream (the server sees CANCELLED; recv then returns
 * KVF_RPC_STREAM_END with CANCELLED). Any thread, any number of times. */
void kvf_rpc_client_stream_cancel(struct kvf_rpc_client_stream *cs);

/* Cancels the stream if it has not ended, waits for gRPC to finish with it and
 * frees it. Accepts NULL. */
void kvf_rpc_client_stream_close(struct kvf_rpc_client_stream *cs);

#endif /* KVF_RPC_CLIENT_H */
