/*
 * scrape.c: a test's client of the /metrics endpoints (scrape.h), one plain
 * socket a request, and a line scan of the Prometheus text it returns.
 */
#include "scrape.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

/* Reads `fd` to its end into a NUL-terminated buffer; NULL when out of
 * memory. */
static char *read_all(int fd)
{
    size_t cap = 65536, got = 0;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    for (;;) {
        if (got + 1 == cap) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger) {
                free(buf);
                return NULL;
            }
            buf = bigger;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + got, cap - got - 1);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    buf[got] = '\0';
    return buf;
}

int scrape_get(int port, const char *path, char **body_p)
{
    *body_p = NULL;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[256];
    int len = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    if (len < 0 || (size_t)len >= sizeof req ||
        connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || write(fd, req, (size_t)len) != len) {
        close(fd);
        return -1;
    }
    char *buf = read_all(fd);
    close(fd);
    if (!buf)
        return -1;
    int code = -1;
    if (sscanf(buf, "HTTP/1.%*d %d", &code) != 1)
        code = -1;
    const char *body = strstr(buf, "\r\n\r\n");
    *body_p = strdup(body ? body + 4 : "");
    free(buf);
    return *body_p ? code : -1;
}

int scrape_sample(const char *text, const char *series, double *v_p)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p;) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ') {
            *v_p = strtod(p + n + 1, NULL);
            return 0;
        }
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return -ENOENT;
}
