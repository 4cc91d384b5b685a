/*
 * rpc_server.h: kvfence's gRPC server glue (kvf_rpc_server_*).
 *
 * Messages are opaque bytes here: callers pack and unpack protobuf-c
 * themselves. A server is created, gets its methods registered, is started,
 * serves on its own completion-queue (CQ) threads, and is shut down and
 * destroyed by the thread that created it.
 *
 * Unary handlers are asynchronous: the handler gets a struct kvf_rpc_call and
 * completes it exactly once, then or later and from any thread, with
 * kvf_rpc_call_reply() or kvf_rpc_call_fail(). Handlers and stream callbacks
 * run on CQ threads and must not block: post the work to the thread that owns
 * the state and complete the call when the answer comes back.
 *
 * Signals: gRPC starts internal threads in grpc_init() (called by
 * kvf_rpc_server_create): a daemon blocks SIGINT/SIGTERM before creating the
 * server and waits for them with sigwait() or a signalfd. CQ threads run with
 * all signals blocked.
 */
#ifndef KVF_RPC_SERVER_H
#define KVF_RPC_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

/* Default maximum message size, both directions. */
#define KVF_RPC_DEFAULT_MAX_MESSAGE (16u * 1024u * 1024u)

struct kvf_rpc_server;
struct kvf_rpc_call;
struct kvf_rpc_stream;

struct kvf_rpc_server_opts {
    /* "127.0.0.1:0" (port 0 picks one), "[::]:7000", "unix:/run/kvf.sock". */
    const char *listen_addr;
    /* CQ threads; 0 = number of online cores. */
    unsigned cq_threads;
    /* Largest message accepted or sent; 0 = KVF_RPC_DEFAULT_MAX_MESSAGE. */
    size_t max_message_bytes;
    /* Largest message received, when smaller than max_message_bytes (0: the
     * same). gRPC itself refuses a bigger one with RESOURCE_EXHAUSTED before
     * any handler sees a byte of it, so set it to the largest request the
     * service takes: an oversized request then costs no decode at all. */
    size_t max_receive_bytes;
    /* TLS: both set = TLS, both NULL = plaintext. PEM file paths. */
    const char *tls_cert_path;
    const char *tls_key_path;
    /* With TLS: when set, clients must present a certificate signed by this CA
     * (mutual TLS); when NULL, client certificates are not requested. */
    const char *tls_client_ca_path;
    /* Optional observer (metrics): when not NULL, called once for every call
     * that ends, with `observer_ctx`, the method name ("unknown" for methods
     * that are not registered), the final status code (enum kvf_grpc_code) and
     * the time from the call's arrival to its end in nanoseconds. A unary call
     * ends when gRPC lets it go: after its reply or failure was sent (the code
     * sent), or when the client cancelled, missed its deadline or the server
     * shut down before the owner completed it (CANCELLED or
     * DEADLINE_EXCEEDED). A stream ends likewise after on_closed (its finish
     * code, or CANCELLED / DEADLINE_EXCEEDED). Unknown methods report
     * UNIMPLEMENTED. Runs on a CQ thread (whichever finished the call), with
     * no lock of the server held; it must not block and must not call into the
     * server. `method` is valid during the call only. `observer_ctx` must stay
     * valid until kvf_rpc_server_shutdown() returns (every call has ended by
     * then). NULL: no observer, no cost. */
    void (*on_call_done)(void *ctx, const char *method, int grpc_code, uint64_t latency_ns);
    void *observer_ctx;
};

/* Fills `opts` with defaults: "127.0.0.1:0", one thread per core, 16 MiB,
 * plaintext. */
void kvf_rpc_server_opts_init(struct kvf_rpc_server_opts *opts);

/* Creates a server (not yet listening); calls grpc_init(). Reads the TLS files
 * now. Returns NULL and logs why on bad options or unreadable files. */
struct kvf_rpc_server *kvf_rpc_server_create(const struct kvf_rpc_server_opts *opts);

/* A unary handler: runs on a CQ thread, must not block. `req`/`len` is the
 * request message, valid only until the handler returns. The handler, or any
 * thread later, completes `call` exactly once with kvf_rpc_call_reply() or
 * kvf_rpc_call_fail(); until then `call` stays valid even if the client goes
 * away. */
typedef void (*kvf_rpc_unary_fn)(void *ctx, struct kvf_rpc_call *call, const uint8_t *req,
                                 size_t len);

/* Registers a unary method ("/kvfence.v1.Control/JoinRoom") before start.
 * `ctx` is passed to every call of `handler`. Returns 0, -EINVAL (bad name or
 * NULL handler), -EEXIST (method already registered), -EPERM (server already
 * started) or -ENOMEM. */
int kvf_rpc_server_add_unary(struct kvf_rpc_server *srv, const char *method,
                             kvf_rpc_unary_fn handler, void *ctx);

enum kvf_rpc_stream_kind {
    KVF_RPC_SERVER_STREAMING = 1, /* one request message, a stream of replies */
    KVF_RPC_BIDI = 2,             /* streams both ways */
};

/* Why a server stream ended, as seen by on_closed. gRPC core does not tell a
 * client's cancel from a lost connection: both report CANCELLED. */
enum kvf_rpc_close_reason {
    KVF_RPC_CLOSED_FINISHED = 0, /* our kvf_rpc_stream_finish() status was sent */
    KVF_RPC_CLOSED_CANCELLED,    /* client cancelled, or the connection was lost */
    KVF_RPC_CLOSED_DEADLINE,     /* the call's deadline passed */
    KVF_RPC_CLOSED_SHUTDOWN,     /* the server's shutdown cancelled it */
};

/* Stream callbacks, all run on CQ threads and never concurrently for one
 * stream, in this order: on_open, then on_message* (bidi), then on_half_close
 * (bidi, if the client half-closes), then on_closed exactly once (only for
 * streams that were opened). The stream pointer is valid until on_closed
 * returns; take a kvf_rpc_stream_ref() to keep it longer. Any callback but
 * on_open may be NULL. */
struct kvf_rpc_stream_callbacks {
    /* A new stream. Server-streaming: `req`/`len` is the single request
     * message; bidi: NULL/0. Valid only during the callback. */
    void (*on_open)(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len);
    /* Bidi: one client message, valid only during the callback. */
    void (*on_message)(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *msg, size_t len);
    /* Bidi: the client will send no more messages. */
    void (*on_half_close)(void *ctx, struct kvf_rpc_stream *stream);
    /* The stream is over; sends and finish now return -ECANCELED. */
    void (*on_closed)(void *ctx, struct kvf_rpc_stream *stream, enum kvf_rpc_close_reason reason);
};

/* Registers a streaming method before start. `cbs` is copied. Same returns as
 * kvf_rpc_server_add_unary(). */
int kvf_rpc_server_add_stream(struct kvf_rpc_server *srv, const char *method,
                              enum kvf_rpc_stream_kind kind,
                              const struct kvf_rpc_stream_callbacks *cbs, void *ctx);

/* Binds, starts the CQ threads and begins serving; unknown methods get
 * UNIMPLEMENTED. Returns the bound TCP port (> 0; 0 for a unix: address), or
 * -EADDRINUSE when the address cannot be bound (in use: SO_REUSEPORT is off; or
 * gRPC rejected the TLS certificate or key, which it reports the same way),
 * -EPERM if already started, -ENOMEM, -EAGAIN (no thread could start) or -EIO. */
int kvf_rpc_server_start(struct kvf_rpc_server *srv);

/* Stops the server; from the creating thread, never from a handler or
 * callback. Stops accepting calls, waits up to `grace_ms` for running calls to
 * finish, cancels the rest (clients see CANCELLED or UNAVAILABLE, stream
 * owners get on_closed(SHUTDOWN)), waits until gRPC has let go of every call,
 * and joins the CQ threads. Unary calls not yet completed by their owner stay
 * valid: completing them later returns -ECANCELED and frees them. Idempotent. */
void kvf_rpc_server_shutdown(struct kvf_rpc_server *srv, unsigned grace_ms);

/* Shuts down (grace 0) if needed and frees the server; calls grpc_shutdown().
 * Accepts NULL. */
void kvf_rpc_server_destroy(struct kvf_rpc_server *srv);

/* Calls and streams gRPC currently holds (for tests and metrics). Any thread. */
size_t kvf_rpc_server_calls_in_flight(struct kvf_rpc_server *srv);

/* --- unary calls -------------------------------------------------------- */

/* Completes `call` with OK and a copy of `bytes`. Any thread, exactly once per
 * call (reply or fail); `call` is freed by it and must not be used after.
 * Returns 0 when the reply was handed to gRPC, -ECANCELED when the call had
 * already ended (client cancelled, deadline, shutdown: the reply is dropped),
 * -EIO if gRPC refused the batch. The call is freed in every case. */
int kvf_rpc_call_reply(struct kvf_rpc_call *call, const uint8_t *bytes, size_t len);

/* Completes `call` with a non-OK status `code` (enum kvf_grpc_code; OK is
 * sent as UNKNOWN) and an optional message (NULL = none). Same rules and
 * returns as kvf_rpc_call_reply(). Use kvf_errno_to_grpc_code() to map a
 * -errno. */
int kvf_rpc_call_fail(struct kvf_rpc_call *call, int code, const char *message);

/* The call's deadline as CLOCK_MONOTONIC nanoseconds, INT64_MAX if none.
 * Any thread while the caller still owns `call`. */
int64_t kvf_rpc_call_deadline_ns(const struct kvf_rpc_call *call);

/* Copies the client's address ("ipv4:127.0.0.1:5555") into `buf` (truncated,
 * NUL-terminated). Returns 0, -ECANCELED if the call has ended, -EINVAL. */
int kvf_rpc_call_peer(struct kvf_rpc_call *call, char *buf, size_t cap);

/* The peer's identity, as the client certificate it presented over mutual TLS
 * names it: every subject alternative name (URI, DNS, e-mail, IP; in the
 * certificate's order) and then the subject's common name, each truncated to
 * KVF_RPC_NAME_MAX - 1 bytes, at most KVF_RPC_NAMES of them. `verified` is
 * true only when gRPC verified that certificate against the server's client
 * CA; on a plaintext port, or TLS without client certificates, it is false
 * and there are no names: nobody is who they say. */
#define KVF_RPC_NAMES    8
#define KVF_RPC_NAME_MAX 256
struct kvf_rpc_identity {
    bool verified;
    unsigned n_names;
    char names[KVF_RPC_NAMES][KVF_RPC_NAME_MAX];
};

/* Fills *id_p with the identity of the call's (or stream's) peer. Returns 0,
 * or -ECANCELED if the call has ended (then *id_p is not written). Any thread
 * while the caller owns the call or holds a stream reference. */
int kvf_rpc_call_identity(struct kvf_rpc_call *call, struct kvf_rpc_identity *id_p);
int kvf_rpc_stream_identity(struct kvf_rpc_stream *stream, struct kvf_rpc_identity *id_p);

/* Copies the value of request metadata `key` (lower-case) into `buf`
 * (truncated, NUL-terminated) and its full length into *len_p. Returns 0,
 * -ENOENT if absent, -ECANCELED if the call has ended, -EINVAL. */
int kvf_rpc_call_metadata(struct kvf_rpc_call *call, const char *key, char *buf, size_t cap,
                          size_t *len_p);

/* --- server streams ----------------------------------------------------- */

/* Queues a copy of `bytes` to send; sends go out one at a time, in the order
 * queued (the queue is unbounded: callers keep their own window); messages
 * queued behind a send are written together. Any thread.
 * Returns 0, -ECANCELED once the stream has closed (or a send failed), -EPIPE
 * after kvf_rpc_stream_finish(), -EIO if gRPC refused the batch. */
int kvf_rpc_stream_send(struct kvf_rpc_stream *stream, const uint8_t *bytes, size_t len);

/* Ends the stream with status `code` (enum kvf_grpc_code) and an optional
 * message, after every queued send has been written. Any thread, once.
 * Returns 0, -ECANCELED if the stream already closed, -EALREADY if finish was
 * already called, -EIO if gRPC refused the batch. on_closed follows. */
int kvf_rpc_stream_finish(struct kvf_rpc_stream *stream, int code, const char *message);

/* Takes / drops a reference: the stream is freed when gRPC is done with it and
 * every reference is dropped. Any thread. */
void kvf_rpc_stream_ref(struct kvf_rpc_stream *stream);
void kvf_rpc_stream_unref(struct kvf_rpc_stream *stream);

/* A pointer the owner attaches to the stream (NULL at first). Any thread; the
 * stream does not synchronise it beyond a plain store/load under its lock. */
void kvf_rpc_stream_set_user(struct kvf_rpc_stream *stream, void *user);
void *kvf_rpc_stream_user(struct kvf_rpc_stream *stream);

/* The stream's deadline (CLOCK_MONOTONIC ns, INT64_MAX if none). */
int64_t kvf_rpc_stream_deadline_ns(const struct kvf_rpc_stream *stream);

/* Messages queued and not yet written (including the one being written). */
size_t kvf_rpc_stream_queued(struct kvf_rpc_stream *stream);

#endif /* KVF_RPC_SERVER_H */
