/*
 * http.c: the /metrics and /healthz endpoint of kvfence, on libmicrohttpd.
 *
 * It owns one MHD daemon bound to the one address it is given (never a
 * wildcard it was not asked for) and answers each request from the registry
 * it serves: /metrics is rendered afresh for every scrape.
 *
 * DESIGN (threads). The daemon runs in MHD_USE_INTERNAL_POLLING_THREAD mode:
 * one MHD thread accepts, reads and answers every connection, so scrapes are
 * handled one at a time and the registry's collectors run on that thread.
 * The request callback touches nothing but the registry (whose render is
 * thread-safe) and constant strings. Start and stop run on the owner's
 * thread; MHD_stop_daemon() closes the listening socket and the connections
 * and joins the MHD thread before the server is freed.
 */
#include "http.h"
#include "kvf_file.h"
#include "kvf_log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <microhttpd.h>

#define HTTP_DEFAULT_LISTEN      "127.0.0.1:0"
#define HTTP_DEFAULT_CONNECTIONS 64u
#define HTTP_DEFAULT_TIMEOUT_S   10u
#define METRICS_CONTENT_TYPE     "text/plain; version=0.0.4; charset=utf-8"

struct kvf_metrics_http {
    struct kvf_metrics *reg;
    struct MHD_Daemon *daemon;
    uint16_t port;
};

static void http_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void http_log(const char *fmt, ...)
{
    char msg[KVF_LOG_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvf_log("error", "kvf_metrics_http: %s", msg);
}

void kvf_metrics_http_opts_init(struct kvf_metrics_http_opts *opts)
{
    if (!opts)
        return;
    memset(opts, 0, sizeof(*opts));
    opts->listen_addr = HTTP_DEFAULT_LISTEN;
    opts->max_connections = HTTP_DEFAULT_CONNECTIONS;
    opts->timeout_s = HTTP_DEFAULT_TIMEOUT_S;
}

/* Parses "a.b.c.d:port", "[v6]:port" or "port" (127.0.0.1). */
static int parse_listen(const char *addr, struct sockaddr_storage *ss, bool *v6_p)
{
    char host[64];
    const char *port_s;
    if (addr[0] == '[') {
        const char *end = strchr(addr, ']');
        if (!end || end[1] != ':' || (size_t)(end - addr - 1) >= sizeof(host))
            return -EINVAL;
        memcpy(host, addr + 1, (size_t)(end - addr - 1));
        host[end - addr - 1] = '\0';
        port_s = end + 2;
    } else {
        const char *colon = strrchr(addr, ':');
        if (!colon) {
            snprintf(host, sizeof(host), "127.0.0.1");
            port_s = addr;
        } else {
            if (colon != strchr(addr, ':') || (size_t)(colon - addr) >= sizeof(host))
                return -EINVAL; /* a bare IPv6 address needs brackets */
            memcpy(host, addr, (size_t)(colon - addr));
            host[colon - addr] = '\0';
            port_s = colon + 1;
        }
    }
    unsigned long port = 0;
    if (!*port_s || strlen(port_s) > 5)
        return -EINVAL;
    for (const char *c = port_s; *c; c++) {
        if (*c < '0' || *c > '9')
            return -EINVAL;
        port = port * 10 + (unsigned long)(*c - '0');
    }
    if (port > 65535)
        return -EINVAL;

    memset(ss, 0, sizeof(*ss));
    struct sockaddr_in *sin = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, host, &sin->sin_addr) == 1) {
        sin->sin_family = AF_INET;
        sin->sin_port = htons((uint16_t)port);
        *v6_p = false;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &sin6->sin6_addr) == 1) {
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons((uint16_t)port);
        *v6_p = true;
        return 0;
    }
    return -EINVAL;
}

static enum MHD_Result reply_static(struct MHD_Connection *conn, unsigned status, const char *body,
                                    const char *allow)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_PERSISTENT);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
    if (allow)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result r = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return r;
}

static enum MHD_Result reply_metrics(struct kvf_metrics_http *srv, struct MHD_Connection *conn)
{
    char *text;
    size_t len;
    int rc = kvf_metrics_render(srv->reg, &text, &len);
    if (rc < 0) {
        http_log("render: %s", strerror(-rc));
        return reply_static(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "render failed\n", NULL);
    }
    /* MHD frees `text` with free() once the response is sent or dropped. */
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, METRICS_CONTENT_TYPE);
    enum MHD_Result r = MHD_queue_response(conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return r;
}

/* Runs on the MHD thread, once per request: it answers on the first call, so
 * a request body (which no endpoint takes) is never read. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_cls)
{
    struct kvf_metrics_http *srv = cls;
    (void)version;
    (void)upload_data;
    (void)upload_data_size;
    (void)req_cls;
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply_static(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n", "GET, HEAD");
    if (strcmp(url, "/metrics") == 0)
        return reply_metrics(srv, conn);
    if (strcmp(url, "/healthz") == 0)
        return reply_static(conn, MHD_HTTP_OK, "ok", NULL);
    return reply_static(conn, MHD_HTTP_NOT_FOUND, "not found\n", NULL);
}

int kvf_metrics_http_start(struct kvf_metrics *reg, const struct kvf_metrics_http_opts *opts,
                           struct kvf_metrics_http **srv_p, uint16_t *port_p)
{
    struct kvf_metrics_http_opts defaults;
    if (!opts) {
        kvf_metrics_http_opts_init(&defaults);
        opts = &defaults;
    }
    if (!reg || !srv_p)
        return -EINVAL;
    const char *addr = opts->listen_addr ? opts->listen_addr : HTTP_DEFAULT_LISTEN;
    struct sockaddr_storage ss;
    bool v6;
    int rc;
    if (parse_listen(addr, &ss, &v6) < 0) {
        http_log("listen address '%s' is not host:port with a numeric host", addr);
        return -EINVAL;
    }
    struct kvf_metrics_http *srv = calloc(1, sizeof(*srv));
    if (!srv) {
        http_log("out of memory");
        return -ENOMEM;
    }
    srv->reg = reg;

    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG;
    if (v6)
        flags |= MHD_USE_IPv6;
    errno = 0;
    srv->daemon = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, srv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
        MHD_OPTION_CONNECTION_LIMIT,
        opts->max_connections ? opts->max_connections : HTTP_DEFAULT_CONNECTIONS,
        MHD_OPTION_CONNECTION_TIMEOUT, opts->timeout_s ? opts->timeout_s : HTTP_DEFAULT_TIMEOUT_S,
        MHD_OPTION_END);
    if (!srv->daemon) {
        /* MHD does not return a reason; a failed bind or listen leaves errno. */
        int e = errno;
        rc = (e == EADDRINUSE || e == EACCES || e == EADDRNOTAVAIL) ? -e : -EIO;
        http_log("cannot listen on %s: %s", addr, strerror(-rc));
        goto err_free_srv;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(srv->daemon, MHD_DAEMON_INFO_BIND_PORT);
    if (!info || info->port == 0) {
        http_log("cannot read the port bound on %s", addr);
        rc = -EIO;
        goto err_stop_daemon;
    }
    srv->port = info->port;
    *srv_p = srv;
    if (port_p)
        *port_p = srv->port;
    return 0;

err_stop_daemon:
    MHD_stop_daemon(srv->daemon);
err_free_srv:
    free(srv);
    return rc;
}

int kvf_metrics_http_serve(struct kvf_metrics *reg, const char *listen_addr, const char *port_file,
                           struct kvf_metrics_http **srv_p)
{
    if (!srv_p) {
        return -EINVAL;
    }
    if (!listen_addr || !reg) {
        *srv_p = NULL;
        return 0;
    }
    struct kvf_metrics_http_opts opts;
    kvf_metrics_http_opts_init(&opts);
    opts.listen_addr = listen_addr;
    struct kvf_metrics_http *srv = NULL;
    uint16_t port = 0;
    int rc = kvf_metrics_http_start(reg, &opts, &srv, &port);
    if (rc < 0) {
        kvf_log("error", "cannot serve metrics on %s: %s (continuing without)", listen_addr,
                strerror(-rc));
        *srv_p = NULL;
        return 0;
    }
    kvf_log("info", "metrics on http://%s/metrics (port %u)", listen_addr, (unsigned)port);
    if (port_file) {
        rc = kvf_file_printf(port_file, 0, "%u\n", (unsigned)port);
        if (rc < 0) {
            kvf_log("error", "cannot write metrics port file %s: %s", port_file, strerror(-rc));
            kvf_metrics_http_stop(srv);
            return rc;
        }
    }
    *srv_p = srv;
    return 0;
}

uint16_t kvf_metrics_http_port(const struct kvf_metrics_http *srv)
{
    return srv ? srv->port : 0;
}

void kvf_metrics_http_stop(struct kvf_metrics_http *srv)
{
    if (!srv)
        return;
    MHD_stop_daemon(srv->daemon);
    free(srv);
}
