/*
 * test_node_local_perm.c: NodeLocal is not a confused deputy (issue 13, item
 * 5; docs/security.md, "NodeLocal"). One kvfence-control, one kvfence-node
 * run by this test's user (root in CI); an unprivileged engine is this same
 * executable re-run with --child, which drops to uid/gid 65534 before it
 * touches gRPC:
 *
 *  - under umask 000 the NodeLocal socket is created 0660 (the default), and
 *    --local-socket-mode / --local-socket-group set the mode and the group of
 *    both the socket and its fd socket (SOCKET.fds);
 *  - uid 65534 naming root's 0600 shm object in RegisterPool is refused and
 *    the node maps nothing (its /proc/PID/maps does not name the object):
 *    with the default socket it cannot connect at all; with a socket opened
 *    to everyone (0666) it gets PERMISSION_DENIED naming host_shm.shm_name;
 *  - the same uid registers memory it owns (a memfd) through the fd socket;
 *  - an old-style RegisterPool naming the caller's own object still works
 *    where it is safe: on a 0600 socket (every caller is the node's user),
 *    and on the default 0660 socket for an object the socket's group may
 *    read and write; a 0600 object on the 0660 socket is refused.
 *
 * On the code before the fix every test here failed: the socket followed the
 * umask (0777), uid 65534 connected and the node mapped root's object for it,
 * and the new flags were unknown.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "kvf_fdpass.h"
#include "node_harness.h"

#define NOBODY      65534u
#define PAGE        4096u
#define PAGES       4u
#define CHILD_SETUP 100 /* the child's exit status when it could not even try */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1;
    struct nh_pool p1;
    mode_t old_umask;
};

static int setup(void **state)
{
    int rc = nh_fx_alloc(state, sizeof(struct fx));
    if (rc == 0) {
        struct fx *f = *state;
        f->old_umask = umask(0); /* the nodes start under umask 000 */
    }
    return rc;
}

static int teardown(void **state)
{
    struct fx *f = *state;
    umask(f->old_umask);
    struct nh_node *nodes[] = {&f->n1};
    struct nh_pool *pools[] = {&f->p1};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 1, 8000, pools, 1, f->dir);
    free(f);
    return rc;
}

static void fx_start(struct fx *f, const char *const *extra)
{
    const char *args[] = {"--threads", "2", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "perm");
    /* Others must reach the socket through its directory. */
    assert_int_equal(chmod(f->dir, 0755), 0);
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, extra, 0), 0);
}

/* Root's pool, `mode` (0600: no one else may open it). */
static void pool_create(struct fx *f, mode_t mode)
{
    assert_int_equal(nh_pool_create(&f->p1, "perm", "p1", PAGE, PAGES, nh_canary1), 0);
    char path[96];
    snprintf(path, sizeof path, "/dev/shm%s", f->p1.name);
    assert_int_equal(chmod(path, mode), 0);
}

/* True when the node's address space maps `shm_name`. */
static bool node_maps(const struct nh_node *np, const char *shm_name)
{
    char path[64], line[512], needle[96];
    snprintf(path, sizeof path, "/proc/%d/maps", (int)np->pid);
    snprintf(needle, sizeof needle, "/dev/shm%s", shm_name);
    FILE *fp = fopen(path, "r");
    assert_non_null(fp);
    bool found = false;
    while (!found && fgets(line, sizeof line, fp))
        found = strstr(line, needle) != NULL;
    fclose(fp);
    return found;
}

static void expect_mode(const char *path, mode_t mode, gid_t gid)
{
    struct stat st;
    assert_int_equal(lstat(path, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    if ((st.st_mode & 07777) != mode || st.st_gid != gid)
        fail_msg("%s: mode %04o gid %u, want %04o gid %u", path, (unsigned)(st.st_mode & 07777),
                 (unsigned)st.st_gid, (unsigned)mode, (unsigned)gid);
}

/* Runs this executable as uid/gid 65534: `--child what sock arg`. Its exit
 * status (the gRPC code of its RegisterPool, CHILD_SETUP when it could not
 * try); its stdout (the status message) in `out`. */
static int run_child(const char *what, const char *sock, const char *arg, char *out, size_t cap)
{
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        execl("/proc/self/exe", "test_node_local_perm", "--child", what, sock, arg, (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < cap && (r = read(pfd[0], out + n, cap - 1 - n)) > 0)
        n += (size_t)r;
    out[n] = '\0';
    close(pfd[0]);
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    fprintf(stderr, "  child %s: %s", what, out);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

/* Old-style RegisterPool naming `p` by its shm name, as this process. */
static int register_by_name(struct nh_node *np, const struct nh_pool *p, struct kvf_rpc_status *st)
{
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = (char *)p->name;
    shm.size = (uint64_t)PAGE * PAGES;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = PAGE;
    req.page_count = PAGES;
    return nh_call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, NULL, NULL, st);
}

static void test_socket_mode_default_under_umask_000(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    expect_mode(f->n1.sock, 0660, getegid());
    char fds[200];
    snprintf(fds, sizeof fds, "%s.fds", f->n1.sock);
    expect_mode(fds, 0660, getegid());
}

static void test_socket_mode_and_group_configured(void **state)
{
    struct fx *f = *state;
    const char *extra[] = {"--local-socket-mode", "0640", "--local-socket-group", "65534", NULL};
    fx_start(f, extra);
    expect_mode(f->n1.sock, 0640, NOBODY);
    char fds[200];
    snprintf(fds, sizeof fds, "%s.fds", f->n1.sock);
    expect_mode(fds, 0640, NOBODY);
}

static void test_other_uid_cannot_reach_default_socket(void **state)
{
    struct fx *f = *state;
    pool_create(f, 0600);
    fx_start(f, NULL);
    char out[512];
    int code = run_child("name", f->n1.sock, f->p1.name, out, sizeof out);
    assert_int_not_equal(code, KVF_GRPC_OK);
    assert_int_not_equal(code, CHILD_SETUP);
    assert_false(node_maps(&f->n1, f->p1.name));
}

static void test_other_uid_refused_on_open_socket(void **state)
{
    struct fx *f = *state;
    pool_create(f, 0600);
    const char *extra[] = {"--local-socket-mode", "0666", NULL};
    fx_start(f, extra);
    char out[512];
    int code = run_child("name", f->n1.sock, f->p1.name, out, sizeof out);
    assert_int_equal(code, KVF_GRPC_PERMISSION_DENIED);
    assert_non_null(strstr(out, "host_shm.shm_name"));
    assert_false(node_maps(&f->n1, f->p1.name));
    /* Memory it owns, handed over as a descriptor, is its to register. */
    code = run_child("memfd", f->n1.sock, "-", out, sizeof out);
    assert_int_equal(code, KVF_GRPC_OK);
}

static void test_old_style_by_name_where_safe(void **state)
{
    struct fx *f = *state;
    pool_create(f, 0600);
    const char *extra[] = {"--local-socket-mode", "0600", NULL};
    fx_start(f, extra);
    struct kvf_rpc_status st;
    assert_int_equal(register_by_name(&f->n1, &f->p1, &st), KVF_GRPC_OK);
    assert_true(node_maps(&f->n1, f->p1.name));
}

static void test_old_style_by_name_on_group_socket(void **state)
{
    struct fx *f = *state;
    pool_create(f, 0600);
    fx_start(f, NULL);
    struct kvf_rpc_status st;
    int code = register_by_name(&f->n1, &f->p1, &st);
    if (code != KVF_GRPC_PERMISSION_DENIED || !strstr(st.message, "host_shm.shm_name"))
        fail_msg("0600 object on a 0660 socket: %d %s", code, st.message);
    assert_false(node_maps(&f->n1, f->p1.name));
    char path[96];
    snprintf(path, sizeof path, "/dev/shm%s", f->p1.name);
    assert_int_equal(chmod(path, 0660), 0); /* the socket's group may use it */
    assert_int_equal(register_by_name(&f->n1, &f->p1, &st), KVF_GRPC_OK);
}

/* ---- the unprivileged engine ------------------------------------------------------- */

static int child_main(const char *what, const char *sock, const char *arg)
{
    if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0) {
        printf("cannot drop to %u: %s\n", NOBODY, strerror(errno));
        return CHILD_SETUP;
    }
    char target[300];
    snprintf(target, sizeof target, "unix:%s", sock);
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, NULL);
    if (!ch)
        return CHILD_SETUP;
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    Kvfence__V1__HostFdMemory hfd = KVFENCE__V1__HOST_FD_MEMORY__INIT;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    uint8_t handle[KVF_FDPASS_HANDLE_SIZE];
    req.page_size = PAGE;
    req.page_count = PAGES;
    if (strcmp(what, "name") == 0) {
        shm.shm_name = (char *)arg;
        shm.size = (uint64_t)PAGE * PAGES;
        req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
        req.host_shm = &shm;
    } else {
        int fd = memfd_create("kvf-perm-child", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)PAGE * PAGES) != 0)
            return CHILD_SETUP;
        char fds[300];
        snprintf(fds, sizeof fds, "%s.fds", sock);
        struct kvf_error err;
        kvf_error_clear(&err);
        int rc = kvf_fdpass_send(fds, fd, handle, &err);
        close(fd);
        if (rc != 0) {
            printf("fd socket: %s\n", err.msg);
            return CHILD_SETUP;
        }
        hfd.handle.data = handle;
        hfd.handle.len = sizeof handle;
        hfd.size = (uint64_t)PAGE * PAGES;
        req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD;
        req.host_fd = &hfd;
    }
    struct kvf_rpc_status st;
    int code = nh_call(ch, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, NULL, NULL, &st);
    printf("%s: %s\n", kvf_grpc_code_name((enum kvf_grpc_code)code),
           code ? st.message : "registered");
    kvf_rpc_channel_destroy(ch);
    return code;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--child") == 0)
        return child_main(argv[2], argv[3], argv[4]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_socket_mode_default_under_umask_000, setup, teardown),
        cmocka_unit_test_setup_teardown(test_socket_mode_and_group_configured, setup, teardown),
        cmocka_unit_test_setup_teardown(test_other_uid_cannot_reach_default_socket, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_other_uid_refused_on_open_socket, setup, teardown),
        cmocka_unit_test_setup_teardown(test_old_style_by_name_where_safe, setup, teardown),
        cmocka_unit_test_setup_teardown(test_old_style_by_name_on_group_socket, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
