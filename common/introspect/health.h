/*
 * health.h: the gRPC health service (grpc.health.v1.Health, Check and Watch)
 * as a registry of serving states plus pure bytes in, bytes out handlers,
 * with no gRPC in it.
 *
 * The server registers what it serves with kvf_health_set(): the empty name
 * "" is the server as a whole (what Kubernetes gRPC probes ask by default),
 * any other name is one service ("kvfence.v1.Control"). A new registry already
 * has "" = SERVING. On shutdown the server calls kvf_health_shutdown() (or
 * sets NOT_SERVING itself) so that probes and load balancers stop sending
 * before the listener closes.
 *
 * Check: the glue passes the HealthCheckRequest bytes to kvf_health_check()
 * and finishes the call with the gRPC code it gets; with OK it sends the
 * response bytes, with NOT_FOUND (a service never registered, as the health
 * spec wants) it sends no message.
 *
 * Watch: the glue decodes nothing itself. It calls kvf_health_watch_add()
 * with the request bytes and a callback that writes the bytes it is given on
 * the stream; the callback gets the current status at once (SERVICE_UNKNOWN
 * for a service never registered: not an error, the status may come later)
 * and then every change. When the stream ends the glue calls
 * kvf_health_watch_remove().
 *
 * Threads: every function may be called from any thread; one mutex inside
 * orders them. Watch callbacks run on the thread that calls kvf_health_set(),
 * kvf_health_shutdown() or kvf_health_watch_add(), WITH that mutex held: that
 * is what makes "current status first, then each change, in order" hold for
 * every watcher. So a callback must be short (copy or queue the bytes) and
 * must not call any kvf_health_* function on the same registry (it would
 * deadlock).
 */
#ifndef KVF_HEALTH_H
#define KVF_HEALTH_H

#include <stddef.h>
#include <stdint.h>

struct kvf_health;

/* The health service's name, as list_services reports it. */
#define KVF_HEALTH_SERVICE "grpc.health.v1.Health"

/* grpc.health.v1.HealthCheckResponse.ServingStatus; the values are the wire's. */
enum kvf_health_status {
    KVF_HEALTH_UNKNOWN = 0,
    KVF_HEALTH_SERVING = 1,
    KVF_HEALTH_NOT_SERVING = 2,
    KVF_HEALTH_SERVICE_UNKNOWN = 3, /* Watch only */
};

/*
 * A Watch callback: `resp`/`len` is one serialized HealthCheckResponse to
 * send on the stream, valid during the call only (it may be 0 bytes long:
 * the encoding of status UNKNOWN, which kvfence never sets). Runs with the
 * registry's mutex held; see the Threads paragraph above.
 */
typedef void (*kvf_health_watch_fn)(void *ctx, const uint8_t *resp, size_t len);

/* A registry with "" = SERVING. Returns NULL (and says why on stderr) when
 * out of memory. */
struct kvf_health *kvf_health_create(void);

/* Frees the registry and every watch still registered, without calling
 * them. No other call may run or start on `h`. Accepts NULL. */
void kvf_health_destroy(struct kvf_health *h);

/*
 * Sets the status of `service` ("" = the whole server), registering it if it
 * is new. `status` is KVF_HEALTH_SERVING or KVF_HEALTH_NOT_SERVING. When the
 * status changes (or the service is new), every watch on `service` is called
 * with the new status before this returns.
 *
 * Returns 0; -EINVAL for a NULL name or another status; -ENOMEM; -EPERM after
 * kvf_health_shutdown() (the states stay NOT_SERVING).
 */
int kvf_health_set(struct kvf_health *h, const char *service, enum kvf_health_status status);

/* Sets every registered service, "" included, to NOT_SERVING (calling their
 * watches) and makes later kvf_health_set() calls fail with -EPERM, so that a
 * late "SERVING" from some module cannot undo the shutdown. Idempotent. */
void kvf_health_shutdown(struct kvf_health *h);

/*
 * Answers one Check: `req`/`len` is a HealthCheckRequest. On success returns
 * 0 and writes the gRPC status code to finish the call with to *grpc_code_p:
 *   - KVF_GRPC_OK: *resp_p is a malloc'd HealthCheckResponse (free() it) of
 *     *resp_len_p bytes;
 *   - KVF_GRPC_NOT_FOUND: the service was never registered; *resp_p is NULL
 *     and *resp_len_p 0.
 * Returns -EINVAL when the bytes do not decode (or an argument is NULL),
 * -ENOMEM when out of memory; the outputs are then untouched.
 */
int kvf_health_check(struct kvf_health *h, const uint8_t *req, size_t len, uint8_t **resp_p,
                     size_t *resp_len_p, int *grpc_code_p);

/*
 * Starts a Watch on `service` ("" = the whole server): calls `cb(ctx, ...)`
 * with the current status before returning, then on every change until
 * kvf_health_watch_remove(). Use kvf_health_watch_add_request() to pass the
 * Watch request's bytes instead of a name.
 *
 * Returns 0, -EINVAL (NULL name or callback), -ENOMEM.
 */
int kvf_health_watch_add(struct kvf_health *h, const char *service, kvf_health_watch_fn cb,
                         void *ctx);

/* kvf_health_watch_add() for the service named in a HealthCheckRequest
 * (`req`/`len`); -EINVAL if the bytes do not decode. */
int kvf_health_watch_add_request(struct kvf_health *h, const uint8_t *req, size_t len,
                                 kvf_health_watch_fn cb, void *ctx);

/*
 * Ends every watch registered with this (cb, ctx) pair. When it returns, the
 * callback is not running for that pair and will not run again, so the
 * caller may free `ctx`. Returns 0, or -ENOENT if there was no such watch.
 */
int kvf_health_watch_remove(struct kvf_health *h, kvf_health_watch_fn cb, void *ctx);

#endif /* KVF_HEALTH_H */
