/*
 * main.c: entry point of kvfence-control, the kvfence control plane.
 *
 * Serves kvfence.v1.Control, kvfence.v1.Admin, grpc.health.v1.Health and
 * server reflection (controlplane/service/) on one gRPC port until SIGINT or
 * SIGTERM, then: health NOT_SERVING, server shutdown with a 2 s grace, state
 * thread stopped, everything freed, exit 0. Logs are JSON lines on stderr.
 * This version keeps its state in memory only and has no node sessions (see
 * controlplane/service/service.c).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvf_version.h"
#include "rpc_server.h"
#include "service.h"

#define DEFAULT_LISTEN    "127.0.0.1:7070"
#define SHUTDOWN_GRACE_MS 2000u

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvfence-control [options]\n"
            "  --listen ADDR         gRPC address (default " DEFAULT_LISTEN "; port 0 picks one)\n"
            "  --threads N           completion-queue threads (default: one per core)\n"
            "  --tls-cert PATH       server certificate (PEM); with --tls-key enables TLS\n"
            "  --tls-key PATH        server private key (PEM)\n"
            "  --tls-client-ca PATH  require client certificates signed by this CA\n"
            "  --port-file PATH      write the bound port there once serving\n"
            "  --version             print the version and exit\n"
            "  --help                print this help and exit\n");
}

static int write_port_file(const char *path, int port)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) {
        return -ENAMETOOLONG;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) {
        return -errno;
    }
    fprintf(f, "%d\n", port);
    if (fclose(f) != 0) {
        int e = errno;
        unlink(tmp);
        return -e;
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return -e;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *listen_addr = DEFAULT_LISTEN;
    const char *tls_cert = NULL, *tls_key = NULL, *tls_ca = NULL, *port_file = NULL;
    unsigned threads = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--version") == 0) {
            printf("kvfence-control %s (cuda %s)\n", KVF_VERSION_STRING,
                   KVF_HAVE_CUDA_BUILD ? "yes" : "no");
            return 0;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        const char **target = NULL;
        if (strcmp(a, "--listen") == 0) {
            target = &listen_addr;
        } else if (strcmp(a, "--tls-cert") == 0) {
            target = &tls_cert;
        } else if (strcmp(a, "--tls-key") == 0) {
            target = &tls_key;
        } else if (strcmp(a, "--tls-client-ca") == 0) {
            target = &tls_ca;
        } else if (strcmp(a, "--port-file") == 0) {
            target = &port_file;
        } else if (strcmp(a, "--threads") != 0) {
            fprintf(stderr, "kvfence-control: unknown argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvfence-control: %s needs a value\n", a);
            usage(stderr);
            return 2;
        }
        const char *val = argv[++i];
        if (target) {
            *target = val;
        } else {
            char *end = NULL;
            unsigned long n = strtoul(val, &end, 10);
            if (!val[0] || *end || n > 1024) {
                fprintf(stderr, "kvfence-control: --threads: '%s' is not a number 0..1024\n", val);
                return 2;
            }
            threads = (unsigned)n;
        }
    }
    if ((tls_cert == NULL) != (tls_key == NULL)) {
        fprintf(stderr, "kvfence-control: --tls-cert and --tls-key go together\n");
        return 2;
    }
    if (tls_ca && !tls_cert) {
        fprintf(stderr, "kvfence-control: --tls-client-ca needs --tls-cert and --tls-key\n");
        return 2;
    }

    /* Before grpc_init() starts threads (kvf_rpc_server_create): every thread
     * inherits the mask, so only sigwait() below sees these. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct kvf_svc *svc = kvf_svc_create();
    if (!svc) {
        return 1;
    }
    struct kvf_rpc_server_opts opts;
    kvf_rpc_server_opts_init(&opts);
    opts.listen_addr = listen_addr;
    opts.cq_threads = threads;
    opts.tls_cert_path = tls_cert;
    opts.tls_key_path = tls_key;
    opts.tls_client_ca_path = tls_ca;
    struct kvf_rpc_server *srv = kvf_rpc_server_create(&opts);
    if (!srv) {
        kvf_log("error", "cannot create the gRPC server");
        kvf_svc_destroy(svc);
        return 1;
    }
    if (kvf_svc_register(svc, srv) < 0) {
        kvf_rpc_server_destroy(srv);
        kvf_svc_destroy(svc);
        return 1;
    }
    int port = kvf_rpc_server_start(srv);
    if (port < 0) {
        kvf_log("error", "cannot serve on %s: %s", listen_addr, strerror(-port));
        kvf_rpc_server_destroy(srv);
        kvf_svc_destroy(svc);
        return 1;
    }
    kvf_log("info", "kvfence-control %s serving on %s (port %d, %s)", KVF_VERSION_STRING,
            listen_addr, port, tls_cert ? (tls_ca ? "mutual TLS" : "TLS") : "plaintext");
    int rc = 0;
    if (port_file) {
        int prc = write_port_file(port_file, port);
        if (prc < 0) {
            kvf_log("error", "cannot write port file %s: %s", port_file, strerror(-prc));
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
    if (sig) {
        kvf_log("info", "got %s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    }
    kvf_svc_not_serving(svc);
    kvf_rpc_server_shutdown(srv, SHUTDOWN_GRACE_MS);
    kvf_svc_stop(svc);
    kvf_rpc_server_destroy(srv);
    kvf_svc_destroy(svc);
    kvf_log("info", "stopped");
    return rc;
}
