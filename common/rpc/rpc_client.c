/*
 * rpc_client.c: the blocking gRPC client of kvfence on the gRPC core C API.
 *
 * It owns channels (a grpc_channel, its credentials' PEM text and the metadata
 * sent with every call), blocking unary calls and client streams. Messages are
 * opaque bytes.
 *
 * DESIGN (threads). Nothing here runs a thread of its own. Every unary call
 * and every stream gets its own completion queue made for pluck, and the
 * calling thread plucks the tag of the batch it waits for, so any number of
 * threads can share a channel without sharing a queue. A stream has one tag
 * per kind of batch (initial metadata, send, recv, status, half-close); at
 * most one of each is in flight (pitfall 3), and a recv that timed out stays
 * posted for the next recv to pluck. As the notes require, RECV_STATUS_ON_CLIENT
 * is posted alone when the stream opens and RECV_INITIAL_METADATA rides with
 * the first read. Every completion of a batch must be plucked, else gRPC keeps
 * the call referenced: close plucks whatever is still outstanding after
 * cancelling, then shuts the queue down and drains it. The caller owns every
 * message buffer returned (malloc'd).
 */
#include "rpc_client.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "rpc_internal.h"

struct kvf_rpc_channel {
    grpc_channel *gch;
    uint32_t md_flags; /* initial-metadata flags: wait-for-ready */
    grpc_metadata *md;
    size_t n_md;
    char *pem_root, *pem_cert, *pem_key;
};

struct kvf_rpc_client_stream {
    struct kvf_rpc_channel *ch;
    grpc_completion_queue *cq;
    grpc_call *call;
    /* Tags: the addresses of these bytes. */
    char tag_md, tag_send, tag_recv, tag_status, tag_close;
    bool md_pending, recv_pending, status_pending;
    bool first_recv_done;
    bool half_closed;
    bool ended;
    grpc_byte_buffer *recv_bb;
    grpc_metadata_array init_md;
    grpc_metadata_array trail_md;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;
    struct kvf_rpc_status final;
};

static void status_set(struct kvf_rpc_status *st, int code, const char *msg)
{
    if (!st)
        return;
    st->code = code;
    snprintf(st->message, sizeof(st->message), "%s", msg ? msg : "");
}

static void status_from_grpc(struct kvf_rpc_status *st, grpc_status_code code, grpc_slice details)
{
    if (!st)
        return;
    st->code = (int)code;
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof(st->message))
        n = sizeof(st->message) - 1;
    memcpy(st->message, GRPC_SLICE_START_PTR(details), n);
    st->message[n] = '\0';
}

/* Waits for `tag` on `cq`; returns the event (GRPC_QUEUE_TIMEOUT on timeout). */
static grpc_event cq_wait(grpc_completion_queue *cq, void *tag, gpr_timespec until)
{
    return grpc_completion_queue_pluck(cq, tag, until, NULL);
}

static void cq_destroy_drained(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
}

/* --- channels ----------------------------------------------------------- */

void kvf_rpc_channel_opts_init(struct kvf_rpc_channel_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
}

/* Keys: lower-case letters, digits, '-', '_', '.'; not reserved (pitfall 2). */
static bool metadata_ok(const struct kvf_rpc_metadata *m)
{
    if (!m->key || !m->key[0] || !m->value)
        return false;
    for (const char *p = m->key; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-' || *p == '_' ||
              *p == '.'))
            return false;
    if (strncmp(m->key, "grpc-", 5) == 0)
        return false;
    size_t klen = strlen(m->key);
    if (klen > 4 && strcmp(m->key + klen - 4, "-bin") == 0)
        return true;
    grpc_slice v = grpc_slice_from_static_string(m->value);
    return grpc_header_nonbin_value_is_legal(v) != 0;
}

static void channel_free(struct kvf_rpc_channel *ch)
{
    for (size_t i = 0; i < ch->n_md; i++) {
        grpc_slice_unref(ch->md[i].key);
        grpc_slice_unref(ch->md[i].value);
    }
    free(ch->md);
    free(ch->pem_root);
    free(ch->pem_cert);
    free(ch->pem_key);
    free(ch);
}

static grpc_channel_credentials *channel_credentials(struct kvf_rpc_channel *ch,
                                                     const struct kvf_rpc_channel_opts *opts)
{
    if (!opts->tls_root_ca_path)
        return grpc_insecure_credentials_create();
    int rc = rpc_read_file(opts->tls_root_ca_path, &ch->pem_root);
    const char *bad = opts->tls_root_ca_path;
    if (rc == 0 && opts->tls_cert_path) {
        rc = rpc_read_file(opts->tls_cert_path, &ch->pem_cert);
        bad = opts->tls_cert_path;
        if (rc == 0) {
            rc = rpc_read_file(opts->tls_key_path, &ch->pem_key);
            bad = opts->tls_key_path;
        }
    }
    if (rc != 0) {
        rpc_log("channel: cannot read %s: %s", bad, strerror(-rc));
        return NULL;
    }
    grpc_ssl_pem_key_cert_pair pair = {.private_key = ch->pem_key, .cert_chain = ch->pem_cert};
    return grpc_ssl_credentials_create(ch->pem_root, ch->pem_cert ? &pair : NULL, NULL, NULL);
}

struct kvf_rpc_channel *kvf_rpc_channel_create(const char *target,
                                               const struct kvf_rpc_channel_opts *opts)
{
    struct kvf_rpc_channel_opts defaults;
    if (!opts) {
        kvf_rpc_channel_opts_init(&defaults);
        opts = &defaults;
    }
    if (!target || !target[0]) {
        rpc_log("channel: no target");
        return NULL;
    }
    if (!opts->tls_cert_path != !opts->tls_key_path ||
        (opts->tls_cert_path && !opts->tls_root_ca_path)) {
        rpc_log("channel: a client certificate needs its key and a root CA");
        return NULL;
    }
    size_t max = opts->max_message_bytes ? opts->max_message_bytes : 16u * 1024u * 1024u;
    if (max > INT32_MAX) {
        rpc_log("channel: max_message_bytes %zu is over 2 GiB", max);
        return NULL;
    }
    for (size_t i = 0; i < opts->n_metadata; i++) {
        if (!metadata_ok(&opts->metadata[i])) {
            rpc_log("channel: metadata[%zu] key '%s' is not a lower-case legal key, or its "
                    "value is not printable",
                    i, opts->metadata[i].key ? opts->metadata[i].key : "(null)");
            return NULL;
        }
    }
    struct kvf_rpc_channel *ch = calloc(1, sizeof(*ch));
    if (!ch) {
        rpc_log("channel: out of memory");
        return NULL;
    }
    if (opts->n_metadata) {
        ch->md = calloc(opts->n_metadata, sizeof(*ch->md));
        if (!ch->md) {
            rpc_log("channel: out of memory");
            goto err_free_channel;
        }
        for (size_t i = 0; i < opts->n_metadata; i++) {
            ch->md[i].key = grpc_slice_from_copied_string(opts->metadata[i].key);
            ch->md[i].value = grpc_slice_from_copied_string(opts->metadata[i].value);
            ch->n_md++;
        }
    }
    if (opts->wait_for_ready)
        ch->md_flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY |
                       GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;

    grpc_init();
    grpc_channel_credentials *creds = channel_credentials(ch, opts);
    if (!creds)
        goto err_shutdown_grpc;
    grpc_arg args[3];
    size_t n = 0;
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[n++].value.integer = (int)max;
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[n++].value.integer = (int)max;
    if (opts->tls_target_name) {
        args[n].type = GRPC_ARG_STRING;
        args[n].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[n++].value.string = (char *)opts->tls_target_name;
    }
    grpc_channel_args chargs = {.num_args = n, .args = args};
    ch->gch = grpc_channel_create(target, creds, &chargs);
    grpc_channel_credentials_release(creds);
    if (!ch->gch) {
        rpc_log("channel: cannot create a channel to %s", target);
        goto err_shutdown_grpc;
    }
    return ch;

err_shutdown_grpc:
    grpc_shutdown();
err_free_channel:
    channel_free(ch);
    return NULL;
}

void kvf_rpc_channel_destroy(struct kvf_rpc_channel *ch)
{
    if (!ch)
        return;
    grpc_channel_destroy(ch->gch);
    channel_free(ch);
    grpc_shutdown();
}

/* --- unary -------------------------------------------------------------- */

int kvf_rpc_unary(struct kvf_rpc_channel *ch, const char *method, const uint8_t *req, size_t len,
                  int64_t timeout_ms, uint8_t **resp_p, size_t *resp_len_p,
                  struct kvf_rpc_status *st)
{
    if (!ch || !method || (!req && len) || !resp_p || !resp_len_p) {
        status_set(st, KVF_GRPC_INVALID_ARGUMENT, "bad arguments");
        return -EINVAL;
    }
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = grpc_channel_create_call(ch->gch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               grpc_slice_from_static_string(method), NULL,
                                               rpc_deadline_ms(timeout_ms), NULL);
    grpc_byte_buffer *send_bb = rpc_bb_from_bytes(req, len);
    grpc_byte_buffer *recv_bb = NULL;
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *error_string = NULL;

    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = ch->md_flags;
    ops[0].data.send_initial_metadata.count = ch->n_md;
    ops[0].data.send_initial_metadata.metadata = ch->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    ops[5].data.recv_status_on_client.error_string = &error_string;
    int tag;
    int rc;
    grpc_call_error ce = grpc_call_start_batch(call, ops, 6, &tag, NULL);
    if (ce != GRPC_CALL_OK) {
        /* No completion will come (pitfall 1). */
        rpc_log("unary %s: batch: %s", method, grpc_call_error_to_string(ce));
        status_set(st, KVF_GRPC_INTERNAL, grpc_call_error_to_string(ce));
        rc = -EIO;
        goto out;
    }
    cq_wait(cq, &tag, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    status_from_grpc(st, code, details);
    if (code != GRPC_STATUS_OK) {
        rc = -EREMOTEIO;
    } else if (!recv_bb) {
        status_set(st, KVF_GRPC_INTERNAL, "OK status without a reply message");
        rc = -EPROTO;
    } else {
        rc = rpc_bb_copy_out(recv_bb, resp_p, resp_len_p);
        if (rc != 0)
            status_set(st, KVF_GRPC_RESOURCE_EXHAUSTED, "cannot read the reply");
    }

out:
    if (recv_bb)
        grpc_byte_buffer_destroy(recv_bb);
    grpc_byte_buffer_destroy(send_bb); /* consumed, still ours (pitfall 4) */
    grpc_slice_unref(details);
    gpr_free((void *)error_string);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_call_unref(call);
    cq_destroy_drained(cq);
    return rc;
}

/* --- client streams ----------------------------------------------------- */

struct kvf_rpc_client_stream *kvf_rpc_client_stream_open(struct kvf_rpc_channel *ch,
                                                         const char *method, int64_t timeout_ms)
{
    if (!ch || !method) {
        rpc_log("stream: no channel or method");
        return NULL;
    }
    struct kvf_rpc_client_stream *cs = calloc(1, sizeof(*cs));
    if (!cs) {
        rpc_log("stream %s: out of memory", method);
        return NULL;
    }
    cs->ch = ch;
    cs->cq = grpc_completion_queue_create_for_pluck(NULL);
    cs->call = grpc_channel_create_call(ch->gch, NULL, GRPC_PROPAGATE_DEFAULTS, cs->cq,
                                        grpc_slice_from_static_string(method), NULL,
                                        rpc_deadline_ms(timeout_ms), NULL);
    grpc_metadata_array_init(&cs->init_md);
    grpc_metadata_array_init(&cs->trail_md);
    cs->details = grpc_empty_slice();

    /* The status first, in its own batch (see the notes). */
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &cs->trail_md;
    op.data.recv_status_on_client.status = &cs->status;
    op.data.recv_status_on_client.status_details = &cs->details;
    op.data.recv_status_on_client.error_string = &cs->error_string;
    grpc_call_error ce = grpc_call_start_batch(cs->call, &op, 1, &cs->tag_status, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("stream %s: status batch: %s", method, grpc_call_error_to_string(ce));
        goto err_close;
    }
    cs->status_pending = true;

    /* Headers now, so a stream that only listens still reaches the server;
     * the completion is plucked at close. */
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    op.flags = ch->md_flags;
    op.data.send_initial_metadata.count = ch->n_md;
    op.data.send_initial_metadata.metadata = ch->md;
    ce = grpc_call_start_batch(cs->call, &op, 1, &cs->tag_md, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("stream %s: metadata batch: %s", method, grpc_call_error_to_string(ce));
        goto err_close;
    }
    cs->md_pending = true;
    return cs;

err_close:
    kvf_rpc_client_stream_close(cs);
    return NULL;
}

int kvf_rpc_client_stream_send(struct kvf_rpc_client_stream *cs, const uint8_t *bytes, size_t len)
{
    if (!cs || (!bytes && len))
        return -EINVAL;
    if (cs->half_closed)
        return -EPIPE;
    if (cs->ended)
        return -ECANCELED;
    grpc_byte_buffer *bb = rpc_bb_from_bytes(bytes, len);
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    grpc_call_error ce = grpc_call_start_batch(cs->call, &op, 1, &cs->tag_send, NULL);
    int rc;
    if (ce != GRPC_CALL_OK) {
        rpc_log("stream: send batch: %s", grpc_call_error_to_string(ce));
        rc = -EIO;
    } else {
        grpc_event ev = cq_wait(cs->cq, &cs->tag_send, gpr_inf_future(GPR_CLOCK_MONOTONIC));
        rc = ev.success ? 0 : -ECANCELED;
    }
    grpc_byte_buffer_destroy(bb);
    return rc;
}

/* The stream is over: take its status (it follows the last message). */
static void stream_take_status(struct kvf_rpc_client_stream *cs)
{
    if (cs->status_pending) {
        cq_wait(cs->cq, &cs->tag_status, gpr_inf_future(GPR_CLOCK_MONOTONIC));
        cs->status_pending = false;
    }
    status_from_grpc(&cs->final, cs->status, cs->details);
    cs->ended = true;
}

int kvf_rpc_client_stream_recv(struct kvf_rpc_client_stream *cs, int64_t timeout_ms,
                               uint8_t **msg_p, size_t *len_p, struct kvf_rpc_status *st)
{
    if (!cs || !msg_p || !len_p)
        return -EINVAL;
    if (cs->ended)
        goto ended;
    if (!cs->recv_pending) {
        grpc_op ops[2];
        size_t n = 0;
        memset(ops, 0, sizeof(ops));
        if (!cs->first_recv_done) {
            ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
            ops[n++].data.recv_initial_metadata.recv_initial_metadata = &cs->init_md;
        }
        ops[n].op = GRPC_OP_RECV_MESSAGE;
        ops[n++].data.recv_message.recv_message = &cs->recv_bb;
        cs->recv_bb = NULL;
        grpc_call_error ce = grpc_call_start_batch(cs->call, ops, n, &cs->tag_recv, NULL);
        if (ce != GRPC_CALL_OK) {
            rpc_log("stream: recv batch: %s", grpc_call_error_to_string(ce));
            status_set(st, KVF_GRPC_INTERNAL, grpc_call_error_to_string(ce));
            return -EIO;
        }
        cs->first_recv_done = true;
        cs->recv_pending = true;
    }
    gpr_timespec until = rpc_deadline_ms(timeout_ms);
    grpc_event ev = cq_wait(cs->cq, &cs->tag_recv, until);
    if (ev.type == GRPC_QUEUE_TIMEOUT)
        return -ETIMEDOUT;
    cs->recv_pending = false;
    grpc_byte_buffer *bb = cs->recv_bb;
    cs->recv_bb = NULL;
    if (ev.success && bb) {
        int rc = rpc_bb_copy_out(bb, msg_p, len_p);
        grpc_byte_buffer_destroy(bb);
        return rc;
    }
    if (bb)
        grpc_byte_buffer_destroy(bb);
    stream_take_status(cs);
ended:
    if (st)
        *st = cs->final;
    return KVF_RPC_STREAM_END;
}

int kvf_rpc_client_stream_half_close(struct kvf_rpc_client_stream *cs)
{
    if (!cs)
        return -EINVAL;
    if (cs->half_closed)
        return -EALREADY;
    cs->half_closed = true;
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    grpc_call_error ce = grpc_call_start_batch(cs->call, &op, 1, &cs->tag_close, NULL);
    if (ce != GRPC_CALL_OK) {
        rpc_log("stream: half-close batch: %s", grpc_call_error_to_string(ce));
        return -EIO;
    }
    cq_wait(cs->cq, &cs->tag_close, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    return 0;
}

void kvf_rpc_client_stream_cancel(struct kvf_rpc_client_stream *cs)
{
    if (cs)
        grpc_call_cancel(cs->call, NULL);
}

void kvf_rpc_client_stream_close(struct kvf_rpc_client_stream *cs)
{
    if (!cs)
        return;
    gpr_timespec forever = gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (!cs->ended || cs->status_pending)
        grpc_call_cancel(cs->call, NULL);
    if (cs->md_pending)
        cq_wait(cs->cq, &cs->tag_md, forever);
    if (cs->recv_pending)
        cq_wait(cs->cq, &cs->tag_recv, forever);
    if (cs->status_pending)
        cq_wait(cs->cq, &cs->tag_status, forever);
    if (cs->recv_bb)
        grpc_byte_buffer_destroy(cs->recv_bb);
    grpc_slice_unref(cs->details);
    gpr_free((void *)cs->error_string);
    grpc_metadata_array_destroy(&cs->init_md);
    grpc_metadata_array_destroy(&cs->trail_md);
    grpc_call_unref(cs->call);
    cq_destroy_drained(cs->cq);
    free(cs);
}
