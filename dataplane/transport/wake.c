/*
 * wake.c: the wake descriptors of the transports (transport.h, wake_fd and
 * wake_ack): an eventfd that a transport's worker threads signal when they
 * put a completion on an empty list and that the poller clears before it
 * polls, and the empty slots of a transport that has none.
 *
 * DESIGN: kvf_wake_signal is called from any thread, kvf_wake_clear from the
 * one poller; both are single non-blocking system calls on the eventfd, so
 * neither ever waits. A signal that finds the counter at its maximum (it
 * never gets there: the poller clears it) is dropped, which is harmless: the
 * descriptor is readable already.
 */
#include "transport.h"

#include <errno.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <unistd.h>

int kvf_transport_no_wake_fd(struct kvf_transport *t)
{
    (void)t;
    return -1;
}

void kvf_transport_no_wake_ack(struct kvf_transport *t)
{
    (void)t;
}

int kvf_wake_open(void)
{
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    return fd >= 0 ? fd : -errno;
}

void kvf_wake_signal(int fd)
{
    if (fd < 0)
        return;
    uint64_t one = 1;
    ssize_t n;
    do
        n = write(fd, &one, sizeof one);
    while (n < 0 && errno == EINTR);
}

void kvf_wake_clear(int fd)
{
    if (fd < 0)
        return;
    uint64_t v;
    ssize_t n;
    do
        n = read(fd, &v, sizeof v);
    while (n < 0 && errno == EINTR);
}

void kvf_wake_close(int fd)
{
    if (fd >= 0)
        close(fd);
}
