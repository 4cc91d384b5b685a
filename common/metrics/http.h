/*
 * http.h: the HTTP endpoint that serves a metrics registry
 * (kvf_metrics_http_*), on libmicrohttpd.
 *
 *   GET /metrics   200, text/plain; version=0.0.4, kvf_metrics_render()
 *   GET /healthz   200, "ok"
 *   other paths    404
 *   other methods  405 with "Allow: GET, HEAD" (HEAD is answered as GET
 *                  without a body, as HTTP requires of GET resources)
 *
 * The server runs on one internal thread of libmicrohttpd, which renders the
 * registry and so runs its collectors. The thread that started a server stops
 * it; the registry must outlive the server.
 */
#ifndef KVF_METRICS_HTTP_H
#define KVF_METRICS_HTTP_H

#include <stdint.h>

#include "metrics.h"

struct kvf_metrics_http;

struct kvf_metrics_http_opts {
    /* Where to listen: "127.0.0.1:9100", "0.0.0.0:9100", "[::1]:9100", or a
     * bare port "9100" (which means 127.0.0.1). Numeric addresses only; port 0
     * picks a free port. Default "127.0.0.1:0". */
    const char *listen_addr;
    /* Most connections served at once; 0 = 64. */
    unsigned max_connections;
    /* Seconds an idle connection is kept; 0 = 10. */
    unsigned timeout_s;
};

/* Fills `opts` with defaults. */
void kvf_metrics_http_opts_init(struct kvf_metrics_http_opts *opts);

/* Starts serving `reg` on opts->listen_addr (`opts` may be NULL for
 * defaults). Returns 0 and writes `*srv_p` and, when `port_p` is not NULL, the
 * bound port; or -EINVAL (NULL reg or srv_p, an address that does not parse),
 * -ENOMEM, or the errno of the failed bind/listen when libmicrohttpd leaves
 * one (-EADDRINUSE, -EACCES, -EADDRNOTAVAIL), else -EIO; logs why. Outputs are
 * written only on success. */
int kvf_metrics_http_start(struct kvf_metrics *reg, const struct kvf_metrics_http_opts *opts,
                           struct kvf_metrics_http **srv_p, uint16_t *port_p);

/* A daemon's metrics endpoint, started the one way every daemon starts it:
 * serves `reg` on `listen_addr`, logs the URL and port, then writes the port
 * and a newline to `port_file` (when not NULL), the file a starter waits on.
 * An endpoint that cannot start is logged and is no error: the daemon runs on
 * without metrics. Returns 0 and writes `*srv_p` (the server, or NULL when
 * `listen_addr` or `reg` is NULL or the start failed); -EINVAL for a NULL
 * srv_p; or the -errno of a port file that cannot be written, logged, with the
 * server stopped again and `*srv_p` untouched. Stop it with
 * kvf_metrics_http_stop(). */
int kvf_metrics_http_serve(struct kvf_metrics *reg, const char *listen_addr, const char *port_file,
                           struct kvf_metrics_http **srv_p);

/* The port the server is bound to. */
uint16_t kvf_metrics_http_port(const struct kvf_metrics_http *srv);

/* Stops the server: closes the listening socket and every connection, joins
 * its thread and frees it. Accepts NULL. */
void kvf_metrics_http_stop(struct kvf_metrics_http *srv);

#endif /* KVF_METRICS_HTTP_H */
