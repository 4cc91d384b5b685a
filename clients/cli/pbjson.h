/*
 * pbjson.h: prints any protobuf-c message as proto3's canonical JSON
 * mapping, or as the same data in YAML, walking its descriptors
 * (ProtobufCMessageDescriptor, ProtobufCFieldDescriptor): one printer for
 * every message, not one per command.
 *
 * The JSON is the dialect grpcurl and protobuf's own printers write:
 * lowerCamelCase member names (the proto field name with each "_x" turned
 * into "X"), 64-bit integers as decimal strings (a double-based parser such
 * as jq keeps them exact), 32-bit integers as numbers, enum values by their
 * proto names (an unknown number as a number), bytes as base64 (RFC 4648,
 * padded), float and double as numbers or "NaN" / "Infinity" / "-Infinity",
 * and default values omitted: 0, false, "", empty bytes and lists, enum 0
 * and absent messages (a field of a oneof is printed when it is the one
 * set). Members come in field number order. One document on one line.
 *
 * The YAML is block style, two spaces per level, list items as "- " at the
 * level of their key; strings are plain where YAML reads them back as the
 * same string, else double-quoted like JSON; 64-bit integers are quoted
 * strings as in the JSON, so a YAML-to-JSON conversion gives the JSON
 * document. An empty message is "{}".
 *
 * Not handled: map fields (printed as lists of {key, value} entries, since
 * protobuf-c keeps no map-entry flag) and the well-known types' special
 * forms (Timestamp, Duration, wrappers, Any); kvfence's API uses neither.
 */
#ifndef KVF_CLI_PBJSON_H
#define KVF_CLI_PBJSON_H

#include <protobuf-c/protobuf-c.h>
#include <stdio.h>

enum cli_pb_form {
    CLI_PB_JSON,
    CLI_PB_YAML,
};

/* A member printed before the message's own, e.g. the time an event was
 * received; `value` is printed as a JSON string. */
struct cli_pb_extra {
    const char *key; /* lowerCamelCase already */
    const char *value;
};

/*
 * Prints `m` to `f` as one JSON document on one line ending in a newline, or
 * as a YAML document. `extra` (NULL: none) comes first. Returns 0, or -EIO
 * when `f` reports an error.
 */
int cli_pb_print(FILE *f, const ProtobufCMessage *m, enum cli_pb_form form,
                 const struct cli_pb_extra *extra);

#endif /* KVF_CLI_PBJSON_H */
