/*
 * peer_internal.h: the private pieces of the peer channel (defined in
 * peer_channel.c): the sequence maps and the frame sealing. They are declared
 * here so that the unit test can check them directly; nothing here is public.
 */
#ifndef KVF_PEER_INTERNAL_H
#define KVF_PEER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"

/*
 * Sequence state per (room-generation, node id, node incarnation). The send
 * side keeps the last seq assigned per receiver, under the channel's lock; the
 * receive side keeps the last seq delivered per sender, on the owner thread.
 * The hash covers only the room key, so every node of one room sits in one
 * chain and forgetting a room visits one bucket.
 */
struct peer_seq_entry {
    struct peer_seq_entry *next;
    kvf_room_key key;
    uint64_t incarnation;
    uint64_t seq; /* send: last assigned; receive: last delivered; 0 = none yet */
    char node[];  /* the other node's id, NUL-terminated */
};

struct peer_seq_map {
    struct peer_seq_entry **buckets;
    size_t nbuckets; /* a power of two */
    size_t count;
};

/* 0 or -ENOMEM. */
int peer_seq_map_init(struct peer_seq_map *m);
/* Frees every entry; accepts a map that failed to init (zeroed). */
void peer_seq_map_free(struct peer_seq_map *m);
/* The entry of (key, node, incarnation), created with seq 0 if missing; NULL on
 * out of memory. */
struct peer_seq_entry *peer_seq_map_get(struct peer_seq_map *m, kvf_room_key key, const char *node,
                                        uint64_t incarnation);
/* Removes every entry of `key`; returns how many. */
size_t peer_seq_map_forget(struct peer_seq_map *m, kvf_room_key key);

/* ---- frame encoding ---------------------------------------------------------- */

/* Room to reserve in front of a packed PeerEnvelope (PeerFrame tag + length
 * varint) and behind it (seq tag + varint). */
#define PEER_FRAME_HDR_MAX   11u
#define PEER_SEQ_TRAILER_MAX 11u

/*
 * Turns a PeerEnvelope packed without seq, lying at `body` (`body_len` bytes,
 * with PEER_FRAME_HDR_MAX writable bytes before it and PEER_SEQ_TRAILER_MAX
 * after it), into a whole PeerFrame{envelope} whose envelope carries `seq`:
 * appends field 6 (protobuf allows fields in any order; a later scalar wins)
 * and writes the frame header in front. Returns the frame's first byte and sets
 * `*len_p`. O(1), so it runs under the channel's lock.
 */
uint8_t *peer_frame_seal(uint8_t *body, size_t body_len, uint64_t seq, size_t *len_p);

/* The channel's ZeroMQ context: the unit test sends requests to its ZAP
 * handler (an inproc endpoint of this context) directly. */
struct kvf_peer_channel;
void *peer_channel_zmq_context(struct kvf_peer_channel *ch);

#endif /* KVF_PEER_INTERNAL_H */
