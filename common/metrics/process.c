/*
 * process.c: kvfence_build_info and the process_* metrics (process.h).
 *
 * Everything is read at scrape time on the thread that renders (the HTTP
 * server's): /proc/self/stat (CPU time, start time in clock ticks since
 * boot), /proc/self/statm (memory in pages), /proc/self/fd (one entry per
 * open descriptor, minus the one the listing itself holds) and the btime line
 * of /proc/stat (the boot time), so no state is kept and nothing touches the
 * daemon's own threads.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "process.h"

/* Reads a small /proc file into buf (NUL-terminated). 0 or -errno. */
static int read_small(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -errno;
    size_t n = fread(buf, 1, size - 1, f);
    int err = ferror(f) ? -EIO : 0;
    fclose(f);
    if (err)
        return err;
    buf[n] = '\0';
    return 0;
}

/* utime, stime (fields 14, 15) and starttime (field 22) of /proc/self/stat:
 * the fields after the command name in parentheses, which may hold spaces. */
static int read_stat(unsigned long long *utime, unsigned long long *stime,
                     unsigned long long *start)
{
    char buf[1024];
    int rc = read_small("/proc/self/stat", buf, sizeof buf);
    if (rc < 0)
        return rc;
    char *p = strrchr(buf, ')');
    if (!p)
        return -EPROTO;
    p++;
    /* p is at field 3 (state). */
    unsigned long long v[20];
    char state;
    int k = sscanf(p,
                   " %c %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu "
                   "%llu %llu %llu %llu %llu",
                   &state, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9],
                   &v[10], &v[11], &v[12], &v[13], &v[14], &v[15], &v[16], &v[17], &v[18]);
    /* v[0] is field 4 (ppid): utime is field 14 = v[10], stime v[11],
     * starttime field 22 = v[18]. */
    if (k < 20)
        return -EPROTO;
    *utime = v[10];
    *stime = v[11];
    *start = v[18];
    return 0;
}

static int read_btime(unsigned long long *btime)
{
    FILE *f = fopen("/proc/stat", "re");
    if (!f)
        return -errno;
    char line[256];
    int rc = -EPROTO;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "btime %llu", btime) == 1) {
            rc = 0;
            break;
        }
    fclose(f);
    return rc;
}

static int count_fds(double *n_p)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -errno;
    double n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    *n_p = n > 0 ? n - 1 : 0; /* the listing's own descriptor */
    return 0;
}

int kvf_metrics_process_read(struct kvf_metrics_process_stats *st)
{
    long tck = sysconf(_SC_CLK_TCK);
    long page = sysconf(_SC_PAGESIZE);
    if (tck <= 0 || page <= 0)
        return -EINVAL;
    unsigned long long ut, stt, start, btime;
    int rc = read_stat(&ut, &stt, &start);
    if (rc < 0)
        return rc;
    rc = read_btime(&btime);
    if (rc < 0)
        return rc;
    char buf[256];
    rc = read_small("/proc/self/statm", buf, sizeof buf);
    if (rc < 0)
        return rc;
    unsigned long long vsz, rss;
    if (sscanf(buf, "%llu %llu", &vsz, &rss) != 2)
        return -EPROTO;
    double fds = 0;
    rc = count_fds(&fds);
    if (rc < 0)
        return rc;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return -errno;
    st->cpu_seconds = (double)(ut + stt) / (double)tck;
    st->resident_bytes = (double)rss * (double)page;
    st->virtual_bytes = (double)vsz * (double)page;
    st->open_fds = fds;
    st->max_fds = rl.rlim_cur == RLIM_INFINITY ? -1.0 : (double)rl.rlim_cur;
    st->start_time_seconds = (double)btime + (double)start / (double)tck;
    return 0;
}

static void collect_process(void *ctx, struct kvf_metrics_writer *w)
{
    (void)ctx;
    struct kvf_metrics_process_stats st;
    if (kvf_metrics_process_read(&st) != 0)
        return;
    kvf_metrics_write_counter(w, "process_cpu_seconds_total",
                              "Total user and system CPU time spent in seconds.", NULL,
                              st.cpu_seconds);
    kvf_metrics_write_gauge(w, "process_resident_memory_bytes", "Resident memory size in bytes.",
                            NULL, st.resident_bytes);
    kvf_metrics_write_gauge(w, "process_virtual_memory_bytes", "Virtual memory size in bytes.",
                            NULL, st.virtual_bytes);
    kvf_metrics_write_gauge(w, "process_open_fds", "Number of open file descriptors.", NULL,
                            st.open_fds);
    if (st.max_fds >= 0)
        kvf_metrics_write_gauge(w, "process_max_fds",
                                "Maximum number of open file descriptors (soft limit).", NULL,
                                st.max_fds);
    kvf_metrics_write_gauge(w, "process_start_time_seconds",
                            "Start time of the process since unix epoch in seconds.", NULL,
                            st.start_time_seconds);
}

int kvf_metrics_process_add(struct kvf_metrics *reg, const char *version)
{
    if (!reg || !version)
        return -EINVAL;
    static const char *const labels[] = {"version", NULL};
    struct kvf_metric_vec *vec;
    int rc =
        kvf_metrics_gauge_vec(reg, "kvfence_build_info",
                              "Always 1; the version label names the running build.", labels, &vec);
    if (rc < 0)
        return rc;
    const char *values[] = {version};
    struct kvf_metric *m;
    rc = kvf_metric_child(vec, values, &m);
    if (rc < 0)
        return rc;
    kvf_gauge_set(m, 1.0);
    return kvf_metrics_add_collector(reg, collect_process, NULL);
}
