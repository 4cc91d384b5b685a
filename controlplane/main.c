/*
 * main.c: entry point of kvfence-control, the kvfence control plane.
 *
 * Serves kvfence.v1.Control, kvfence.v1.Admin, grpc.health.v1.Health and
 * server reflection (controlplane/service/) on one gRPC port until SIGINT or
 * SIGTERM, then: health NOT_SERVING, server shutdown with a 2 s grace, state
 * thread stopped, everything freed, exit 0. If the write-ahead log cannot be
 * written (--data-dir on a full or failing disk), the service turns
 * NOT_SERVING and refuses every call at once, stays up so for a second
 * (STORE_FAILED_LINGER_MS) so that probes see it, then shuts down the same way
 * and exits with status 3 (KVF_SVC_EXIT_STORE_FAILED): fail-stop,
 * for a supervisor (Kubernetes) to restart it once the disk is fixed.
 * --repair-wal checks and repairs the log of --data-dir and exits. Logs are JSON lines on stderr.
 * Prometheus metrics (docs/metrics.md) are served over HTTP on
 * --metrics-listen (GET /metrics), 127.0.0.1:9464 by default.
 * Settings come from flags, KVF_CONTROL_* environment variables and an
 * optional config file (kvf_config.h; --help lists them).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "http.h"
#include "kvf_config.h"
#include "kvf_file.h"
#include "kvf_log.h"
#include "kvf_types.h"
#include "kvf_version.h"
#include "rpc_server.h"
#include "service.h"

#define DEFAULT_LISTEN    "127.0.0.1:7070"
#define DEFAULT_METRICS   "127.0.0.1:9464"
#define SHUTDOWN_GRACE_MS 2000u
/* After the log failed, the server stays up this long before it shuts down,
 * answering health NOT_SERVING and every call UNAVAILABLE ("free space ...
 * and restart"): a probe, and a caller that asks again, learn why instead of
 * finding the port closing. Nothing is acknowledged or released meanwhile
 * (the service refuses everything); SIGTERM or SIGINT ends the wait. */
#define STORE_FAILED_LINGER_MS 1000u

static int write_port_file(const char *path, int port)
{
    return kvf_file_printf(path, 0, "%d\n", port);
}

/* Every setting, with its default (kvf_config.h: flags > environment
 * KVF_CONTROL_* > config file > default). */
struct settings {
    const char *listen, *tls_cert, *tls_key, *tls_client_ca, *port_file, *data_dir;
    const char *metrics_listen, *metrics_port_file;
    const char *node_identity_prefix, *engine_identity_prefix, *admin_identities;
    const char *log_level;
    uint64_t threads, snapshot_every;
    uint64_t node_ttl_ms, heartbeat_timeout_ms, join_timeout_ms, drain_deadline_ms, resend_ms,
        tombstone_ttl_ms;
    bool version, repair_wal;
};

/* The service's fail-stop hook (any thread): wake sigwait() in main. */
static void store_failed(void *arg)
{
    (void)arg;
    kill(getpid(), SIGUSR1);
}

int main(int argc, char **argv)
{
    struct settings cfg = {
        .listen = DEFAULT_LISTEN,
        .metrics_listen = DEFAULT_METRICS,
        .node_ttl_ms = 10000,
        .heartbeat_timeout_ms = 15000,
        .join_timeout_ms = 30000,
        .drain_deadline_ms = 60000,
        .resend_ms = 200,
        .tombstone_ttl_ms = 600000,
        .snapshot_every = 4096,
        .log_level = "info",
    };
    const struct kvf_config_item items[] = {
        {"listen", KVF_CONFIG_STRING, &cfg.listen, 0,
         "gRPC address: host:port (port 0 picks one) or unix:/path"},
        {"threads", KVF_CONFIG_UINT, &cfg.threads, 1024,
         "completion-queue threads (0: one per core)"},
        {"tls-cert", KVF_CONFIG_STRING, &cfg.tls_cert, 0,
         "server certificate (PEM); with tls-key enables TLS"},
        {"tls-key", KVF_CONFIG_STRING, &cfg.tls_key, 0, "server private key (PEM)"},
        {"tls-client-ca", KVF_CONFIG_STRING, &cfg.tls_client_ca, 0,
         "require client certificates signed by this CA (mutual TLS)"},
        {"node-identity-prefix", KVF_CONFIG_STRING, &cfg.node_identity_prefix, 0,
         "with mutual TLS: a certificate name <prefix><node id> is that node (default "
         "spiffe://kvfence/node/)"},
        {"engine-identity-prefix", KVF_CONFIG_STRING, &cfg.engine_identity_prefix, 0,
         "with mutual TLS: a certificate name starting with this may call Control (default "
         "spiffe://kvfence/engine/)"},
        {"admin-identities", KVF_CONFIG_STRING, &cfg.admin_identities, 0,
         "with mutual TLS: comma-separated certificate names that may call Admin (default "
         "spiffe://kvfence/admin)"},
        {"data-dir", KVF_CONFIG_STRING, &cfg.data_dir, 0,
         "write-ahead log and snapshots; empty or absent: a new cluster; unset: memory only"},
        {"snapshot-every", KVF_CONFIG_UINT, &cfg.snapshot_every, 100000000,
         "write a snapshot (and truncate the log) every this many logged changes"},
        {"port-file", KVF_CONFIG_STRING, &cfg.port_file, 0,
         "write the bound port to this file once serving"},
        {"metrics-listen", KVF_CONFIG_STRING, &cfg.metrics_listen, 0,
         "Prometheus /metrics HTTP address: host:port, [v6]:port or a port (port 0 picks "
         "one); empty disables"},
        {"metrics-port-file", KVF_CONFIG_STRING, &cfg.metrics_port_file, 0,
         "write the bound metrics port to this file once serving (before port-file)"},
        {"node-ttl-ms", KVF_CONFIG_UINT, &cfg.node_ttl_ms, 86400000,
         "a node whose session is gone this long is LOST (its peers fence it)"},
        {"heartbeat-timeout-ms", KVF_CONFIG_UINT, &cfg.heartbeat_timeout_ms, 86400000,
         "end the session of a node that sent nothing for this long (nodes heartbeat every "
         "second); 0: never"},
        {"join-timeout-ms", KVF_CONFIG_UINT, &cfg.join_timeout_ms, 86400000,
         "a room still OPENING after this long is aborted"},
        {"drain-deadline-ms", KVF_CONFIG_UINT, &cfg.drain_deadline_ms, 86400000,
         "an ABORTING room not drained by then is escalated and its laggards fenced (never "
         "released)"},
        {"resend-ms", KVF_CONFIG_UINT, &cfg.resend_ms, 5000,
         "first re-send of an unacknowledged notice, at most 5000 (then doubling to 5 s, with "
         "jitter)"},
        {"tombstone-ttl-ms", KVF_CONFIG_UINT, &cfg.tombstone_ttl_ms, 86400000,
         "terminal rooms are kept this long to recognise late messages"},
        {"log-level", KVF_CONFIG_STRING, &cfg.log_level, 0,
         "least severe log lines written to stderr: debug, info, warn or error"},
        {"version", KVF_CONFIG_BOOL, &cfg.version, 0, "print the version and exit"},
        {"repair-wal", KVF_CONFIG_BOOL, &cfg.repair_wal, 0,
         "check the log in data-dir; cut it at a damaged or missing record after a backup "
         "(repair-<time>/ in data-dir), say how many records were dropped, and exit"},
    };
    struct kvf_error err;
    kvf_error_clear(&err);
    int prc = kvf_config_parse(items, sizeof(items) / sizeof(items[0]), "KVF_CONTROL_", argc, argv,
                               stdout, &err);
    if (prc == 1)
        return 0;
    if (prc < 0) {
        fprintf(stderr, "kvfence-control: %s\n", err.msg);
        return 2;
    }
    enum kvf_log_level log_level;
    if (kvf_log_level_parse(cfg.log_level, &log_level) != 0) {
        fprintf(stderr, "kvfence-control: --log-level: '%s' is not debug, info, warn or error\n",
                cfg.log_level ? cfg.log_level : "");
        kvf_config_free();
        return 2;
    }
    kvf_log_set_level(log_level);
    kvf_log_set_proc("kvfence-control");
    if (cfg.version) {
        printf("kvfence-control %s (cuda %s)\n", KVF_VERSION_STRING,
               KVF_HAVE_CUDA_BUILD ? "yes" : "no");
        return 0;
    }
    if (cfg.repair_wal) {
        if (!cfg.data_dir || !cfg.data_dir[0]) {
            fprintf(stderr, "kvfence-control: --repair-wal needs --data-dir\n");
            return 2;
        }
        int rrc = kvf_svc_repair_wal(cfg.data_dir);
        kvf_config_free();
        return rrc == 0 ? 0 : 1;
    }
    const char *tls_cert = cfg.tls_cert && cfg.tls_cert[0] ? cfg.tls_cert : NULL;
    const char *tls_key = cfg.tls_key && cfg.tls_key[0] ? cfg.tls_key : NULL;
    const char *tls_ca = cfg.tls_client_ca && cfg.tls_client_ca[0] ? cfg.tls_client_ca : NULL;
    const char *port_file = cfg.port_file && cfg.port_file[0] ? cfg.port_file : NULL;
    const char *listen_addr = cfg.listen;
    const char *metrics_listen =
        cfg.metrics_listen && cfg.metrics_listen[0] ? cfg.metrics_listen : NULL;
    const char *metrics_port_file =
        cfg.metrics_port_file && cfg.metrics_port_file[0] ? cfg.metrics_port_file : NULL;
    if ((tls_cert == NULL) != (tls_key == NULL)) {
        fprintf(stderr, "kvfence-control: --tls-cert and --tls-key go together\n");
        return 2;
    }
    if (tls_ca && !tls_cert) {
        fprintf(stderr, "kvfence-control: --tls-client-ca needs --tls-cert and --tls-key\n");
        return 2;
    }
    struct kvf_svc_opts sopts = {
        .node_ttl = cfg.node_ttl_ms * KVF_NS_PER_MS,
        .heartbeat_timeout = cfg.heartbeat_timeout_ms * KVF_NS_PER_MS,
        .join_timeout = cfg.join_timeout_ms * KVF_NS_PER_MS,
        .drain_deadline = cfg.drain_deadline_ms * KVF_NS_PER_MS,
        .resend_initial = cfg.resend_ms * KVF_NS_PER_MS,
        .tombstone_ttl = cfg.tombstone_ttl_ms * KVF_NS_PER_MS,
        .data_dir = cfg.data_dir,
        .snapshot_every = cfg.snapshot_every,
        .authz = {.enforce = tls_ca != NULL,
                  .node_prefix = cfg.node_identity_prefix,
                  .engine_prefix = cfg.engine_identity_prefix,
                  .admin_names = cfg.admin_identities},
        .on_store_failed = store_failed,
    };

    /* Before grpc_init() starts threads (kvf_rpc_server_create): every thread
     * inherits the mask, so only sigwait() below sees these. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGUSR1); /* store_failed() */
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct kvf_svc *svc = kvf_svc_create(&sopts);
    if (!svc) {
        return 1;
    }
    struct kvf_rpc_server_opts opts;
    kvf_rpc_server_opts_init(&opts);
    opts.listen_addr = listen_addr;
    opts.cq_threads = (unsigned)cfg.threads;
    opts.tls_cert_path = tls_cert;
    opts.tls_key_path = tls_key;
    opts.tls_client_ca_path = tls_ca;
    opts.max_receive_bytes = KVF_SVC_REQUEST_MAX; /* refused before any decode */
    kvf_svc_rpc_observer(svc, &opts);
    struct kvf_rpc_server *srv = kvf_rpc_server_create(&opts);
    if (!srv) {
        kvf_log("error", "cannot create the gRPC server");
        kvf_svc_destroy(svc);
        return 1;
    }
    if (kvf_svc_register(svc, srv) < 0) {
        kvf_svc_destroy(svc);
        kvf_rpc_server_destroy(srv);
        return 1;
    }
    int port = kvf_rpc_server_start(srv);
    if (port < 0) {
        kvf_log("error", "cannot serve on %s: %s", listen_addr, strerror(-port));
        kvf_svc_destroy(svc);
        kvf_rpc_server_destroy(srv);
        return 1;
    }
    kvf_log("info", "kvfence-control %s serving on %s (port %d, %s)", KVF_VERSION_STRING,
            listen_addr, port, tls_cert ? (tls_ca ? "mutual TLS" : "TLS") : "plaintext");
    if (!tls_ca)
        kvf_log("warn",
                "INSECURE: no --tls-client-ca, so callers are not authenticated: anyone who "
                "reaches %s can attach as any node, report its drains and call Admin. Use mutual "
                "TLS outside a test bed (docs/security.md)",
                listen_addr);
    int rc = 0;
    /* Metrics next, so that port-file (the readiness signal) comes last. A
     * metrics endpoint that cannot start is logged, not fatal: the control
     * plane keeps serving. */
    struct kvf_metrics_http *mhttp = NULL;
    if (kvf_metrics_http_serve(kvf_svc_metrics(svc), metrics_listen, metrics_port_file, &mhttp) <
        0) {
        rc = 1;
    }
    if (!metrics_listen) {
        kvf_log("info", "metrics disabled (empty metrics-listen)");
    }
    if (rc == 0 && port_file) {
        int wrc = write_port_file(port_file, port);
        if (wrc < 0) {
            kvf_log("error", "cannot write port file %s: %s", port_file, strerror(-wrc));
            rc = 1;
        }
    }

    int sig = 0;
    while (rc == 0) {
        int e = sigwait(&sigs, &sig);
        if (e == 0) {
            break;
        }
        if (e != EINTR) {
            kvf_log("error", "sigwait: %s", strerror(e));
            rc = 1;
        }
    }
    if (sig == SIGUSR1) {
        kvf_log("error",
                "the write-ahead log failed: NOT_SERVING, shutting down in %u ms, exit status %d",
                STORE_FAILED_LINGER_MS, KVF_SVC_EXIT_STORE_FAILED);
        rc = KVF_SVC_EXIT_STORE_FAILED;
        struct timespec linger = {.tv_sec = STORE_FAILED_LINGER_MS / 1000,
                                  .tv_nsec = (STORE_FAILED_LINGER_MS % 1000) * 1000000L};
        sigset_t stop;
        sigemptyset(&stop);
        sigaddset(&stop, SIGINT);
        sigaddset(&stop, SIGTERM);
        (void)sigtimedwait(&stop, NULL, &linger); /* a signal or the timeout */
    } else if (sig) {
        kvf_log("info", "got %s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    }
    kvf_svc_not_serving(svc);
    kvf_rpc_server_shutdown(srv, SHUTDOWN_GRACE_MS);
    kvf_metrics_http_stop(mhttp); /* before the registry goes with the service */
    kvf_svc_stop(svc);
    /* The service before the server: destroying it flushes the store, whose
     * thread sends held replies (gRPC byte buffers), and frees the streams the
     * sessions still hold. The server's destroy calls grpc_shutdown(), after
     * which no thread may call into gRPC any more. */
    kvf_svc_destroy(svc);
    kvf_rpc_server_destroy(srv);
    kvf_log("info", "stopped");
    kvf_config_free();
    return rc;
}
