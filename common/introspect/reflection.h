/*
 * reflection.h: gRPC server reflection (grpc.reflection.v1alpha and
 * grpc.reflection.v1 ServerReflection/ServerReflectionInfo) as pure bytes in,
 * bytes out, with no gRPC in it.
 *
 * A struct kvf_reflection is built once from a serialized FileDescriptorSet
 * (normally kvf_api_descriptor_set from kvf_api_descriptors.h) and the names of
 * the services the server exposes. The RPC glue then passes every message it
 * reads from a ServerReflectionInfo stream to kvf_reflection_handle() and
 * writes the bytes it gets back, one response per request, in order.
 *
 * v1 and v1alpha: the two protos declare the same messages with the same field
 * numbers and types, only the package differs, and a package name never goes
 * on the wire. So the same handler serves both services: the glue registers
 * "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo" (grpcurl
 * 1.8 and older) and "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
 * (newer tools) and routes both to kvf_reflection_handle().
 *
 * Errors about the request's content (unknown file or symbol) are not errors
 * of the call: they come back as an ErrorResponse inside a normal response
 * (error_code 5 NOT_FOUND and a message naming what was asked), as the gRPC
 * reflection protocol wants, and the stream goes on. Only bytes that do not
 * decode make kvf_reflection_handle() fail; the glue should then end the
 * stream with INVALID_ARGUMENT.
 *
 * Threads: a struct kvf_reflection is immutable after create, so any number
 * of threads may call kvf_reflection_handle() on it at once. Destroy it only
 * after every call has returned.
 */
#ifndef KVF_REFLECTION_H
#define KVF_REFLECTION_H

#include <stddef.h>
#include <stdint.h>

struct kvf_reflection;

/* The two reflection service names; list_services always reports both, and
 * the health service (KVF_HEALTH_SERVICE, health.h), besides the ones given
 * to kvf_reflection_create(). */
#define KVF_REFLECTION_SERVICE_V1ALPHA "grpc.reflection.v1alpha.ServerReflection"
#define KVF_REFLECTION_SERVICE_V1      "grpc.reflection.v1.ServerReflection"

/*
 * Builds the reflection index.
 *
 * `descriptor_set`/`len`: a serialized google.protobuf.FileDescriptorSet,
 * made with `protoc --include_imports` so that every import is in it. The
 * bytes are copied; the caller may free them after the call. Each file is
 * served exactly as it appears in the set.
 *
 * `service_names`/`n`: the fully qualified names of the services the server
 * exposes ("kvfence.v1.Control"); copied. list_services reports them in this
 * order, then the two reflection services and the health service (each name
 * once). A name need not be in the set, but then clients cannot describe it.
 *
 * The index maps every symbol a client may ask for to the file that defines
 * it: messages (nested ones too, "pkg.Outer.Inner"), enums, enum values (in
 * the scope that encloses the enum, as protobuf scopes them), fields, services,
 * methods (both "pkg.Svc.Method" and "pkg.Svc/Method") and extensions. A
 * leading '.' in a query is ignored.
 *
 * Returns NULL (and says why on stderr) when the set does not parse, when two
 * files in it have the same name, or when memory runs out.
 */
struct kvf_reflection *kvf_reflection_create(const uint8_t *descriptor_set, size_t len,
                                             const char *const *service_names, size_t n);

/* Frees everything. Accepts NULL. */
void kvf_reflection_destroy(struct kvf_reflection *refl);

/*
 * Answers one ServerReflectionRequest (`req`/`len`, the message bytes without
 * gRPC framing) with one ServerReflectionResponse, which echoes the request in
 * original_request and its host in valid_host:
 *   list_services                  -> list_services_response
 *   file_by_filename               -> file_descriptor_response: that file, then
 *                                     its transitive imports, each once
 *   file_containing_symbol         -> file_descriptor_response: the defining file,
 *                                     then its transitive imports
 *   file_containing_extension      -> file_descriptor_response of the file that
 *                                     declares the extension, or NOT_FOUND
 *   all_extension_numbers_of_type  -> all_extension_numbers_response (often
 *                                     empty), or NOT_FOUND for an unknown type
 *   unknown file, symbol or type   -> error_response, error_code 5 (NOT_FOUND)
 *   no request set                 -> error_response, error_code 12 (UNIMPLEMENTED)
 *
 * On success returns 0 and writes a malloc'd buffer to *resp_p (free() it) and
 * its length to *resp_len_p. Returns -EINVAL if `req` does not decode as a
 * ServerReflectionRequest (or an argument is NULL), -ENOMEM if memory runs out;
 * the outputs are then untouched. Any thread.
 */
int kvf_reflection_handle(const struct kvf_reflection *refl, const uint8_t *req, size_t len,
                          uint8_t **resp_p, size_t *resp_len_p);

#endif /* KVF_REFLECTION_H */
