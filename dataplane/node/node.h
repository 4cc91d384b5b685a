/*
 * node.h: kvfence-node's data-plane worker (kvf_node_*): the owner thread that
 * holds the lifetime table, the room map, the registered pools, the TCP
 * transport and the state of the session with the control plane; the control
 * session (control_session.c: its thread and the protocol); and the NodeLocal service on a unix
 * socket (local_svc.c).
 *
 * The rules it follows are docs/design.md §3-4 and docs/state-cores.md ("Node
 * lifetime core"); what this version does and leaves out is at the top of
 * node.c.
 *
 * Errors: 0 or a negative errno (common/kvf_error.h); constructors return NULL
 * and log why.
 */
#ifndef KVF_NODE_H
#define KVF_NODE_H

#include <stdbool.h>
#include <stdint.h>

struct kvf_node;

struct kvf_node_opts {
    const char *control_addr; /* "host:port" of kvfence-control; required */
    /* TLS to kvfence-control (PEM paths): the CA that signed its certificate
     * (NULL: plaintext), this node's certificate and key for mutual TLS (the
     * control plane takes the node id from it), and the name to check
     * instead of the address's host. Read again at every reconnect, so a
     * rotated certificate is used from the next session on. */
    const char *control_tls_ca;
    const char *control_tls_cert;
    const char *control_tls_key;
    const char *control_tls_server_name;
    const char *node_id;      /* required, at most 128 bytes */
    const char *local_socket; /* NodeLocal unix socket path; required */
    /* The NodeLocal socket's (and its fd socket's) permission bits, 0: 0660,
     * and group, -1: the node's effective group (local_access.h). */
    uint32_t local_socket_mode;
    int64_t local_socket_gid;
    const char *data_host; /* numeric IPv4 the TCP transport binds; "127.0.0.1" */
    uint16_t data_port;    /* 0: any */
    /* How long an outbound TCP data connect may wait for the peer to answer
     * before the chunks queued for it fail -ETIMEDOUT; 0: 10000. */
    uint32_t data_connect_timeout_ms;
    uint64_t incarnation; /* 0: chosen from the realtime clock (ns) */
    /* Where the host lock lives (host_lock.h): <run_dir>/kvfence-node-<id>.lock;
     * NULL or "": next to the local socket, <local_socket>.lock. */
    const char *run_dir;
    uint64_t drain_timeout_ms; /* bound of the drain wait at shutdown */
    /* Rooms that ended and drained, kept known before the oldest is freed
     * (node_core.h, retention; a count, never a time). Default 1024. */
    uint64_t retain_rooms;

    /* Data path (xport.c). */
    const char *staging;      /* "none" (or NULL), "host" or "cuda" */
    uint32_t staging_buffers; /* staging ring buffers (0: 16) */
    /* Tests only: same-node copies wait while this file exists. */
    const char *test_local_hold_file;
    uint16_t peer_port; /* ZeroMQ peer channel port on data_host; 0: any */
    /* Tests only: peer channel fault injection, "drop_nth=N,duplicate_nth=N,
     * delay_nth=N,delay_after=M" (struct kvf_peer_fault); NULL or "": none. */
    const char *peer_fault;
    const char *fault_file; /* tests: fault injection (faults.h); NULL: off */
    /* Tests only: host_shm pools whose shm_name starts with this are fake
     * device pools (devpool.h); NULL or "": off. */
    const char *test_fake_device_pools;
    /* RDMA (rdma_link.c): "auto" (NULL), "off" or "fake" (tests: the fake
     * fabric named rdma_fabric, NULL: "kvf"); the GID index when
     * rdma_gid_set, else from the port's link layer. */
    const char *rdma;
    const char *rdma_fabric;
    bool rdma_gid_set;
    int rdma_gid_index;
};

/* Fills defaults: data_host "127.0.0.1", port 0, drain timeout 10 s, 1024
 * retained rooms. */
void kvf_node_opts_init(struct kvf_node_opts *opts);

/* Creates the node and starts its threads: owner, control session, NodeLocal
 * server, TCP transport, peer channel. NULL (logged) when something cannot start. Call from
 * main with SIGTERM/SIGINT blocked (gRPC threads inherit the mask). */
struct kvf_node *kvf_node_start(const struct kvf_node_opts *opts);

/* Waits up to `timeout_ms` for the first Welcome of the control plane.
 * Returns 0, -ETIMEDOUT, or the fatal error (see kvf_node_fatal). */
int kvf_node_wait_ready(struct kvf_node *n, int64_t timeout_ms);

/* 0 while the node runs; a negative errno once it hit an error it cannot
 * survive (the control plane refused it with FAILED_PRECONDITION). Any thread. */
int kvf_node_fatal(const struct kvf_node *n);

/* The bound TCP data port (owner thread's view; see kvf_node_welcomed). */
uint16_t kvf_node_data_port(const struct kvf_node *n);

/* How many Welcomes the node got so far (0: none yet), and in *data_port_p
 * the data port of the Hello the last one answered: a self-fence takes a new
 * incarnation on a new TCP transport, whose port differs with --data-port 0.
 * Any thread. */
uint64_t kvf_node_welcomed(struct kvf_node *n, uint16_t *data_port_p);

/*
 * Graceful stop (SIGTERM): closes admission on every lifetime, waits for them
 * to drain (at most drain_timeout_ms), sends the Drained reports due and a
 * last heartbeat, ends the session (the control plane sees the node go), then
 * stops the threads. Returns 0 when everything drained, -ETIMEDOUT when the
 * wait ran out (ops were still in flight: memory stays mapped until exit).
 * Call once, from the thread that started the node.
 */
int kvf_node_stop(struct kvf_node *n);

/* The node's metrics registry (docs/metrics.md, "Node metrics"), to serve
 * with kvf_metrics_http_start(); NULL when it could not be created. Valid
 * until kvf_node_destroy(): stop its HTTP server before that. */
struct kvf_metrics;
struct kvf_metrics *kvf_node_metrics(struct kvf_node *n);

/* Frees a stopped node (stops it first if needed). Accepts NULL. */
void kvf_node_destroy(struct kvf_node *n);

#endif /* KVF_NODE_H */
