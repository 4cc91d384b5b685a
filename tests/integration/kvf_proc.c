/*
 * kvf_proc.c: see kvf_proc.h.
 */
#include "kvf_proc.h"

#include <errno.h>
#include <ftw.h>
#include <sys/stat.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_ARGS 64

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void remove_files(struct kvf_proc *p)
{
    p->port_file[0] = '\0';
    if (p->dir[0]) {
        /* The port file, and the data directory when one was used. */
        nftw(p->dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
        p->dir[0] = '\0';
    }
}

int kvf_proc_wait(struct kvf_proc *p, long ms, int *status_p)
{
    if (p->pid <= 0) {
        if (status_p) {
            *status_p = p->status;
        }
        return 1;
    }
    for (long waited = 0;; waited += 10) {
        int status = 0;
        pid_t r = waitpid(p->pid, &status, WNOHANG);
        if (r == p->pid || (r < 0 && errno == ECHILD)) {
            p->pid = 0;
            p->status = status;
            if (status_p) {
                *status_p = status;
            }
            return 1;
        }
        if (waited >= ms) {
            return 0;
        }
        sleep_ms(10);
    }
}

void kvf_proc_kill(struct kvf_proc *p)
{
    if (p->pid > 0) {
        int status = 0;
        kill(p->pid, SIGKILL);
        if (waitpid(p->pid, &status, 0) == p->pid) {
            p->status = status;
        }
        p->pid = 0;
    }
    remove_files(p);
}

int kvf_proc_stop(struct kvf_proc *p, long timeout_ms)
{
    if (p->pid <= 0) {
        remove_files(p);
        return -1;
    }
    kill(p->pid, SIGTERM);
    int status = 0;
    if (!kvf_proc_wait(p, timeout_ms, &status)) {
        fprintf(stderr, "kvf_proc: pid %d still running %ld ms after SIGTERM: SIGKILL\n",
                (int)p->pid, timeout_ms);
        kvf_proc_kill(p);
        status = p->status;
    }
    remove_files(p);
    return status;
}

int kvf_proc_start(struct kvf_proc *p, const char *bin, const char *const *extra_args)
{
    memset(p, 0, sizeof *p);
    snprintf(p->dir, sizeof p->dir, "/tmp/kvf-test-proc-XXXXXX");
    if (!mkdtemp(p->dir)) {
        fprintf(stderr, "kvf_proc: mkdtemp: %s\n", strerror(errno));
        p->dir[0] = '\0';
        return -1;
    }
    snprintf(p->port_file, sizeof p->port_file, "%s/port", p->dir);

    const char *argv[MAX_ARGS];
    size_t n = 0;
    argv[n++] = bin;
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--port-file";
    argv[n++] = p->port_file;
    /* Tests run side by side: no fixed metrics port (a test may override). */
    argv[n++] = "--metrics-listen";
    argv[n++] = "127.0.0.1:0";
    /* KVF_TEST_DURABLE=1 runs the same tests against a durable control plane
     * (a write-ahead log in the test's own directory). */
    char data_dir[96];
    const char *durable = getenv("KVF_TEST_DURABLE");
    if (durable && strcmp(durable, "1") == 0) {
        snprintf(data_dir, sizeof data_dir, "%s/data", p->dir);
        argv[n++] = "--data-dir";
        argv[n++] = data_dir;
    }
    for (size_t i = 0; extra_args && extra_args[i]; i++) {
        if (n + 1 >= MAX_ARGS) {
            fprintf(stderr, "kvf_proc: more than %d arguments\n", MAX_ARGS - 6);
            remove_files(p);
            return -1;
        }
        argv[n++] = extra_args[i];
    }
    argv[n] = NULL;

    pid_t parent = getpid();
    p->pid = fork();
    if (p->pid < 0) {
        fprintf(stderr, "kvf_proc: fork: %s\n", strerror(errno));
        p->pid = 0;
        remove_files(p);
        return -1;
    }
    if (p->pid == 0) {
        /* Dies with the test, even if the test crashes. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) {
            _exit(127);
        }
        execv(bin, (char *const *)argv);
        _exit(127);
    }

    int port = 0;
    for (int i = 0; i < 1000 && port <= 0; i++) { /* 10 s */
        FILE *pf = fopen(p->port_file, "r");
        if (pf) {
            if (fscanf(pf, "%d", &port) != 1) {
                port = 0;
            }
            fclose(pf);
        }
        if (port > 0) {
            break;
        }
        int status;
        if (kvf_proc_wait(p, 0, &status)) {
            fprintf(stderr, "kvf_proc: %s exited early (status 0x%x)\n", bin, status);
            remove_files(p);
            return -1;
        }
        sleep_ms(10);
    }
    if (port <= 0) {
        fprintf(stderr, "kvf_proc: no port file from %s after 10 s\n", bin);
        kvf_proc_kill(p);
        return -1;
    }
    snprintf(p->target, sizeof p->target, "127.0.0.1:%d", port);
    return 0;
}
