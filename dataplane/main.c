/*
 * main.c: entry point of kvfence-node, the kvfence per-host data-plane worker.
 *
 * Parses the settings (flags > KVF_NODE_* environment > config file >
 * default, common/kvf_config.h), starts the node (dataplane/node/node.h),
 * writes the port file once the control plane welcomed the node (again when
 * a Welcome follows a Hello with another data port: a self-fence), and waits
 * for SIGTERM or SIGINT. On a signal it closes admission on every lifetime,
 * waits for them to drain (bounded by --drain-timeout-ms), reports, ends its
 * session and exits 0. It exits 1 when the control plane refuses the node
 * (FAILED_PRECONDITION) or the node cannot start, 2 on a bad setting.
 *
 * With --metrics-listen it serves Prometheus metrics (docs/metrics.md, "Node
 * metrics") over HTTP, GET /metrics, from a thread of its own that reads only
 * the node's atomic counters; off by default (several nodes may share a
 * host), and a metrics endpoint that cannot start is logged, not fatal.
 *
 * With --probe it starts nothing: it asks the node already serving
 * --local-socket for its health (probe.c) and exits 0 when SERVING, else 1.
 */
#include <errno.h>
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvf_config.h"
#include "kvf_log.h"
#include "kvf_file.h"
#include "kvf_version.h"
#include "http.h"
#include "node.h"
#include "probe.h"

/* An unset or empty string setting: NULL. */
static const char *nonempty(const char *s)
{
    return s != NULL && s[0] != '\0' ? s : NULL;
}

struct settings {
    const char *config, *control, *node_id, *local_socket, *data_host, *port_file, *peer_fault,
        *fault_file, *test_fake_device_pools, *local_socket_mode, *local_socket_group;
    const char *staging, *test_local_hold_file, *rdma, *rdma_fabric, *rdma_gid_index;
    const char *control_tls_ca, *control_tls_cert, *control_tls_key, *control_tls_server_name;
    const char *run_dir, *log_level, *metrics_listen, *metrics_port_file;
    uint64_t data_port, peer_port, drain_timeout_ms, staging_buffers, probe_timeout_ms;
    uint64_t retain_rooms;
    uint64_t data_connect_timeout_ms;
    bool version, probe;
};

/* --local-socket-mode (octal, at most 0777) and --local-socket-group (a name
 * or a number) into `opts`: 0, or -1 after saying why. */
static int parse_socket_access(const struct settings *cfg, struct kvf_node_opts *opts)
{
    const char *m = nonempty(cfg->local_socket_mode);
    if (m) {
        char *end;
        errno = 0;
        unsigned long v = strtoul(m, &end, 8);
        if (errno || *end || end == m || v > 0777) {
            fprintf(stderr, "kvfence-node: --local-socket-mode %s: not octal permission bits\n", m);
            return -1;
        }
        if ((v & 0600) != 0600) {
            fprintf(stderr, "kvfence-node: --local-socket-mode %s: the owner needs rw\n", m);
            return -1;
        }
        opts->local_socket_mode = (uint32_t)v;
    }
    const char *g = nonempty(cfg->local_socket_group);
    if (g) {
        char *end;
        errno = 0;
        unsigned long v = strtoul(g, &end, 10);
        if (!errno && !*end && end != g && v < (unsigned long)UINT32_MAX) {
            opts->local_socket_gid = (int64_t)v;
        } else {
            struct group *gr = getgrnam(g);
            if (!gr) {
                fprintf(stderr, "kvfence-node: --local-socket-group %s: no such group\n", g);
                return -1;
            }
            opts->local_socket_gid = (int64_t)gr->gr_gid;
        }
    }
    return 0;
}

/* Writes "DATA_PORT\nLOCAL_SOCKET\n" atomically (rename). */
static int write_port_file(const char *path, unsigned port, const char *sock)
{
    return kvf_file_printf(path, 0, "%u\n%s\n", port, sock);
}

int main(int argc, char **argv)
{
    char host[256] = "localhost";
    (void)gethostname(host, sizeof host - 1);
    struct settings cfg = {
        .node_id = host,
        .local_socket = "/run/kvfence/node.sock",
        .data_host = "127.0.0.1",
        .drain_timeout_ms = 10000,
        .retain_rooms = 1024,
        .staging = "none",
        .staging_buffers = 16,
        .rdma = "auto",
        .rdma_fabric = "kvf",
        .probe_timeout_ms = 1000,
        .log_level = "info",
    };
    const struct kvf_config_item items[] = {
        {"control", KVF_CONFIG_STRING, &cfg.control, 0,
         "kvfence-control address (host:port); required"},
        {"control-tls-ca", KVF_CONFIG_STRING, &cfg.control_tls_ca, 0,
         "TLS to kvfence-control: the CA of its certificate (PEM); unset: plaintext"},
        {"control-tls-cert", KVF_CONFIG_STRING, &cfg.control_tls_cert, 0,
         "mutual TLS: this node's certificate (PEM; names spiffe://kvfence/node/<node id>)"},
        {"control-tls-key", KVF_CONFIG_STRING, &cfg.control_tls_key, 0,
         "mutual TLS: this node's private key (PEM)"},
        {"control-tls-server-name", KVF_CONFIG_STRING, &cfg.control_tls_server_name, 0,
         "TLS: the name checked in kvfence-control's certificate (default: the address's host)"},
        {"node-id", KVF_CONFIG_STRING, &cfg.node_id, 0, "this node's id (default: hostname)"},
        {"local-socket", KVF_CONFIG_STRING, &cfg.local_socket, 0,
         "unix socket of the NodeLocal service (engines); its fd socket is PATH.fds"},
        {"local-socket-mode", KVF_CONFIG_STRING, &cfg.local_socket_mode, 0,
         "permission bits (octal) of the NodeLocal socket and its fd socket (default 0660): who "
         "may connect (docs/security.md, NodeLocal)"},
        {"local-socket-group", KVF_CONFIG_STRING, &cfg.local_socket_group, 0,
         "group (name or number) of the NodeLocal socket and its fd socket (default: the node's "
         "group)"},
        {"run-dir", KVF_CONFIG_STRING, &cfg.run_dir, 0,
         "directory of the host lock kvfence-node-<id>.lock, held for the process's life: a "
         "restarted node that takes it witnesses its predecessor's death (default: the lock is "
         "<local socket>.lock)"},
        {"data-host", KVF_CONFIG_STRING, &cfg.data_host, 0,
         "numeric IPv4 the TCP data transport binds and announces"},
        {"data-port", KVF_CONFIG_UINT, &cfg.data_port, 65535, "TCP data port (0: any)"},
        {"data-connect-timeout-ms", KVF_CONFIG_UINT, &cfg.data_connect_timeout_ms, 3600000,
         "how long a TCP data connection to a peer may wait for it to answer; the chunks "
         "queued for it then fail (0: 10000)"},
        {"peer-port", KVF_CONFIG_UINT, &cfg.peer_port, 65535,
         "ZeroMQ peer channel port on the data host (0: any)"},
        {"peer-fault", KVF_CONFIG_STRING, &cfg.peer_fault, 0,
         "tests only: peer channel faults, e.g. delay_nth=1,delay_after=1"},
        {"port-file", KVF_CONFIG_STRING, &cfg.port_file, 0,
         "once attached, write the data port and the local socket path here (tests)"},
        {"drain-timeout-ms", KVF_CONFIG_UINT, &cfg.drain_timeout_ms, 86400000,
         "at SIGTERM, how long to wait for lifetimes to drain"},
        {"retain-rooms", KVF_CONFIG_UINT, &cfg.retain_rooms, 1000000,
         "rooms that ended and drained kept known (watch, Resync) before the oldest is freed"},
        {"staging", KVF_CONFIG_STRING, &cfg.staging, 0,
         "none, host or cuda (cuda only in a build with CUDA): copy each frame into a staging "
         "buffer before the transport sends it"},
        {"staging-buffers", KVF_CONFIG_UINT, &cfg.staging_buffers, 4096,
         "staging ring buffers (256 KiB each)"},
        {"test-local-hold-file", KVF_CONFIG_STRING, &cfg.test_local_hold_file, 0,
         "tests only: same-node copies wait while this file exists"},
        {"fault-file", KVF_CONFIG_STRING, &cfg.fault_file, 0,
         "tests only: inject the faults this key=value file names, re-read when it changes "
         "(docs/node.md)"},
        {"test-fake-device-pools", KVF_CONFIG_STRING, &cfg.test_fake_device_pools, 0,
         "tests only: host_shm pools whose shm_name starts with this prefix are treated as "
         "device memory (copied through the device path; docs/node.md)"},
        {"rdma", KVF_CONFIG_STRING, &cfg.rdma, 0,
         "auto (an RDMA device when one is found, else TCP), off, or fake (tests only: the "
         "fake verbs fabric between processes of this host)"},
        {"rdma-fabric", KVF_CONFIG_STRING, &cfg.rdma_fabric, 0,
         "tests only: the fake fabric's name with --rdma fake (nodes meet on the same name)"},
        {"rdma-gid-index", KVF_CONFIG_STRING, &cfg.rdma_gid_index, 0,
         "RDMA GID index, or -1 for LID routing (default: 0 on Ethernet/RoCE and the fake "
         "fabric, -1 on InfiniBand)"},
        {"metrics-listen", KVF_CONFIG_STRING, &cfg.metrics_listen, 0,
         "Prometheus /metrics HTTP address: host:port, [v6]:port or a port (= 127.0.0.1; port 0 "
         "picks one); unset or empty: no metrics endpoint (docs/metrics.md)"},
        {"metrics-port-file", KVF_CONFIG_STRING, &cfg.metrics_port_file, 0,
         "write the bound metrics port to this file once serving (before port-file)"},
        {"log-level", KVF_CONFIG_STRING, &cfg.log_level, 0,
         "least severe log lines written to stderr: debug, info, warn or error"},
        {"version", KVF_CONFIG_BOOL, &cfg.version, 0, "print the version and exit"},
        {"probe", KVF_CONFIG_BOOL, &cfg.probe, 0,
         "do not start: ask the node serving --local-socket for its grpc.health.v1 status, "
         "exit 0 when SERVING, 1 otherwise (an exec probe)"},
        {"probe-timeout-ms", KVF_CONFIG_UINT, &cfg.probe_timeout_ms, 60000,
         "with --probe: how long to wait for the answer"},
    };
    size_t nitems = sizeof items / sizeof items[0];
    struct kvf_error err;
    kvf_error_clear(&err);
    int prc = kvf_config_parse(items, nitems, "KVF_NODE_", argc, argv, stdout, &err);
    if (prc == 1) {
        kvf_config_free();
        return 0;
    }
    if (prc < 0) {
        fprintf(stderr, "kvfence-node: %s\n", err.msg);
        kvf_config_usage(items, nitems, "KVF_NODE_", stderr);
        kvf_config_free();
        return 2;
    }
    enum kvf_log_level log_level;
    if (kvf_log_level_parse(cfg.log_level, &log_level) != 0) {
        fprintf(stderr, "kvfence-node: --log-level: '%s' is not debug, info, warn or error\n",
                cfg.log_level ? cfg.log_level : "");
        kvf_config_free();
        return 2;
    }
    kvf_log_set_level(log_level);
    kvf_log_set_proc("kvfence-node");
    if (cfg.version) {
        printf("kvfence-node %s (cuda %s)\n", KVF_VERSION_STRING,
               KVF_HAVE_CUDA_BUILD ? "yes" : "no");
        kvf_config_free();
        return 0;
    }
    if (cfg.probe) {
        int probe_rc = kvf_node_probe(cfg.local_socket, (int64_t)cfg.probe_timeout_ms);
        kvf_config_free();
        return probe_rc;
    }
    if (!cfg.control || !cfg.control[0]) {
        fprintf(stderr, "kvfence-node: --control is required\n");
        kvf_config_usage(items, nitems, "KVF_NODE_", stderr);
        kvf_config_free();
        return 2;
    }

    bool staging_ok = strcmp(cfg.staging, "none") == 0 || strcmp(cfg.staging, "host") == 0 ||
                      (strcmp(cfg.staging, "cuda") == 0 && KVF_HAVE_CUDA_BUILD);
    if (!staging_ok || cfg.staging_buffers == 0) {
        fprintf(stderr, "kvfence-node: --staging: %s\n",
                cfg.staging_buffers == 0      ? "--staging-buffers must be >= 1"
                : strcmp(cfg.staging, "cuda") ? "must be none, host or cuda"
                                              : "cuda needs a build with CUDA");
        kvf_config_usage(items, nitems, "KVF_NODE_", stderr);
        kvf_config_free();
        return 2;
    }

    bool gid_set = cfg.rdma_gid_index && cfg.rdma_gid_index[0];
    long gid = 0;
    if (gid_set) {
        char *end = NULL;
        errno = 0;
        gid = strtol(cfg.rdma_gid_index, &end, 10);
        if (errno || *end || gid < -1 || gid > 255) {
            fprintf(stderr, "kvfence-node: --rdma-gid-index: \"%s\" is not -1 .. 255\n",
                    cfg.rdma_gid_index);
            kvf_config_usage(items, nitems, "KVF_NODE_", stderr);
            kvf_config_free();
            return 2;
        }
    }
    if (strcmp(cfg.rdma, "auto") != 0 && strcmp(cfg.rdma, "off") != 0 &&
        strcmp(cfg.rdma, "fake") != 0) {
        fprintf(stderr, "kvfence-node: --rdma: must be auto, off or fake\n");
        kvf_config_usage(items, nitems, "KVF_NODE_", stderr);
        kvf_config_free();
        return 2;
    }
    if (strcmp(cfg.rdma, "fake") == 0 && strcmp(cfg.staging, "none") != 0) {
        /* auto just leaves RDMA off with staging (docs/node.md); fake asks for it. */
        fprintf(stderr, "kvfence-node: --rdma fake: RDMA is not used with --staging %s\n",
                cfg.staging);
        kvf_config_free();
        return 2;
    }

    /* Before any thread starts: they all inherit the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct kvf_node_opts opts;
    kvf_node_opts_init(&opts);
    opts.control_addr = cfg.control;
    opts.control_tls_ca = nonempty(cfg.control_tls_ca);
    opts.control_tls_cert = nonempty(cfg.control_tls_cert);
    opts.control_tls_key = nonempty(cfg.control_tls_key);
    opts.control_tls_server_name = nonempty(cfg.control_tls_server_name);
    opts.node_id = cfg.node_id;
    opts.local_socket = cfg.local_socket;
    opts.run_dir = cfg.run_dir;
    if (parse_socket_access(&cfg, &opts) != 0) {
        kvf_config_free();
        return 2;
    }
    opts.data_host = cfg.data_host;
    opts.data_port = (uint16_t)cfg.data_port;
    opts.peer_port = (uint16_t)cfg.peer_port;
    opts.peer_fault = cfg.peer_fault;
    opts.drain_timeout_ms = cfg.drain_timeout_ms;
    opts.retain_rooms = cfg.retain_rooms;
    opts.data_connect_timeout_ms = (uint32_t)cfg.data_connect_timeout_ms;
    opts.staging = cfg.staging;
    opts.staging_buffers = (uint32_t)cfg.staging_buffers;
    opts.test_local_hold_file = cfg.test_local_hold_file;
    opts.fault_file = cfg.fault_file;
    opts.test_fake_device_pools = cfg.test_fake_device_pools;
    opts.rdma = cfg.rdma;
    opts.rdma_fabric = cfg.rdma_fabric;
    opts.rdma_gid_set = gid_set;
    opts.rdma_gid_index = (int)gid;
    struct kvf_node *n = kvf_node_start(&opts);
    if (!n) {
        kvf_config_free();
        return 1;
    }

    int rc = 0;
    struct kvf_metrics_http *mhttp = NULL;
    if (kvf_metrics_http_serve(kvf_node_metrics(n), nonempty(cfg.metrics_listen),
                               nonempty(cfg.metrics_port_file), &mhttp) < 0) {
        rc = 1;
    }
    uint64_t seen = 0;    /* Welcomes handled */
    uint16_t written = 0; /* the port in the port file (0: none yet) */
    for (; rc == 0;) {
        if (kvf_node_fatal(n)) {
            rc = 1;
            break;
        }
        uint16_t port;
        uint64_t welcomes = kvf_node_welcomed(n, &port);
        if (welcomes != seen) {
            seen = welcomes;
            /* After a self-fence the new incarnation may listen elsewhere. */
            if (port != written && cfg.port_file && cfg.port_file[0]) {
                written = port;
                int wrc = write_port_file(cfg.port_file, port, cfg.local_socket);
                if (wrc < 0) {
                    kvf_log("error", "cannot write %s: %s", cfg.port_file, strerror(-wrc));
                    rc = 1;
                    break;
                }
            }
        }
        struct timespec ts = {0, 100 * 1000000L};
        int sig = sigtimedwait(&sigs, NULL, &ts);
        if (sig == SIGTERM || sig == SIGINT) {
            kvf_log("info", "got %s: draining", sig == SIGINT ? "SIGINT" : "SIGTERM");
            break;
        }
    }
    int src = kvf_node_stop(n);
    if (src != 0 && rc == 0)
        kvf_log("error", "stopped with lifetimes undrained (%s)", strerror(-src));
    kvf_metrics_http_stop(mhttp); /* before the registry goes with the node */
    kvf_node_destroy(n);
    kvf_config_free();
    return rc;
}
