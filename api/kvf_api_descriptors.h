/*
 * kvf_api_descriptors.h: the wire contract's descriptors, embedded.
 *
 * kvf_api_descriptor_set holds a serialized google.protobuf.FileDescriptorSet
 * made at build time by `protoc --include_imports` from the api/kvfence/v1 protos
 * and the gRPC health and reflection protos (those grpc-proto installed). Each
 * top-level entry (tag 0x0a, varint length, bytes) is one
 * FileDescriptorProto, ready to be served as is by server reflection.
 *
 * The bytes are constant and live for the whole program; any thread may read
 * them.
 */
#ifndef KVF_API_DESCRIPTORS_H
#define KVF_API_DESCRIPTORS_H

#include <stddef.h>

/* The serialized FileDescriptorSet. */
extern const unsigned char kvf_api_descriptor_set[];

/* Its length in bytes (> 0). */
extern const size_t kvf_api_descriptor_set_len;

#endif /* KVF_API_DESCRIPTORS_H */
