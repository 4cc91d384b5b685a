/*
 * process.h: the metrics every kvfence daemon exports about itself
 * (kvf_metrics_process_*): kvfence_build_info{version} and the standard
 * process_* families Prometheus client libraries export, read from /proc at
 * scrape time.
 *
 *   kvfence_build_info{version}       gauge, always 1
 *   process_cpu_seconds_total         counter, user + system CPU time
 *   process_resident_memory_bytes     gauge, resident set size
 *   process_virtual_memory_bytes      gauge, virtual memory size
 *   process_open_fds                  gauge, open file descriptors
 *   process_max_fds                   gauge, RLIMIT_NOFILE (soft)
 *   process_start_time_seconds        gauge, start time since the Unix epoch
 *
 * A /proc file that cannot be read leaves its family out of that scrape.
 */
#ifndef KVF_METRICS_PROCESS_H
#define KVF_METRICS_PROCESS_H

#include "metrics.h"

/* Registers kvfence_build_info{version=`version`} 1 and a collector of the
 * process_* families on `reg`. Returns 0, -EINVAL (NULL reg or version) or
 * the registration's error (-EEXIST when called twice). Any thread. */
int kvf_metrics_process_add(struct kvf_metrics *reg, const char *version);

/* The process's numbers as the collector reads them (tests). */
struct kvf_metrics_process_stats {
    double cpu_seconds;
    double resident_bytes;
    double virtual_bytes;
    double open_fds;
    double max_fds;
    double start_time_seconds;
};

/* Reads /proc/self (and /proc/stat for the boot time) into `st`. Returns 0,
 * or -errno of the first file that could not be read or parsed (`st` is then
 * left as is). Any thread. */
int kvf_metrics_process_read(struct kvf_metrics_process_stats *st);

#endif /* KVF_METRICS_PROCESS_H */
