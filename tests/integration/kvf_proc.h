/*
 * kvf_proc.h: starts and stops a kvfence binary for integration tests.
 *
 * kvf_proc_start() runs the binary with "--listen 127.0.0.1:0 --port-file
 * <mkdtemp dir>/port" plus the caller's arguments, waits for the port file and
 * gives back the target "127.0.0.1:PORT". The child logs to the test's stderr
 * (ctest shows it on failure) and dies with the test process (PDEATHSIG).
 */
#ifndef KVF_TEST_PROC_H
#define KVF_TEST_PROC_H

#include <stdbool.h>
#include <sys/types.h>

struct kvf_proc {
    pid_t pid;    /* 0: not running (never started, or reaped) */
    int status;   /* the wait status once reaped */
    char dir[64]; /* the port file, and the data directory with KVF_TEST_DURABLE=1 */
    char port_file[128];
    char target[64]; /* "127.0.0.1:PORT" */
};

/* Starts `bin` with the listen/port-file arguments, then `extra_args` (NULL
 * terminated; NULL for none), and waits up to 10 s for the port. Returns 0, or
 * -1 after logging why (nothing is left running or on disk then). */
int kvf_proc_start(struct kvf_proc *p, const char *bin, const char *const *extra_args);

/* Waits up to `ms` for the child to exit. Returns 1 when it has (its wait
 * status in p->status and in *status_p when not NULL), 0 when still running. */
int kvf_proc_wait(struct kvf_proc *p, long ms, int *status_p);

/* Sends SIGTERM and waits up to `timeout_ms`; if the child is still running
 * then, kills it with SIGKILL. Returns the wait status (WIFEXITED...), or -1
 * when there was no child. Removes the port file and the directory. */
int kvf_proc_stop(struct kvf_proc *p, long timeout_ms);

/* SIGKILL, reap, remove the port file and the directory. Safe to call on a
 * stopped or never started process. */
void kvf_proc_kill(struct kvf_proc *p);

#endif /* KVF_TEST_PROC_H */
