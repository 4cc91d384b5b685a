/*
 * scrape.h: what the tests of the metrics endpoints share (scrape_*): a GET
 * on a loopback HTTP port, and a sample's value in Prometheus text.
 * Single-threaded; no cmocka assertion, so callers choose how to fail.
 */
#ifndef KVF_TEST_SCRAPE_H
#define KVF_TEST_SCRAPE_H

/* GET `path` on 127.0.0.1:port (HTTP/1.0, 5 s receive timeout). Returns the
 * HTTP status, with the body (malloc'd, NUL-terminated, "" when there is
 * none) in *body_p; or -1 with *body_p NULL when the server cannot be
 * reached. */
int scrape_get(int port, const char *path, char **body_p);

/* The value of the sample whose line in `text` is `series` (the whole name
 * with its labels, as rendered) followed by a space: 0 and *v_p, or -ENOENT
 * when there is no such line. */
int scrape_sample(const char *text, const char *series, double *v_p);

#endif /* KVF_TEST_SCRAPE_H */
