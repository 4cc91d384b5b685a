/*
 * peer_keys.h: a node incarnation's peer key pair, and the secret two
 * introduced incarnations share.
 *
 * Every incarnation of kvfence-node generates one X25519 (Curve25519) key pair
 * at its start and never writes the secret half anywhere. The public half goes
 * in its Hello; the control plane hands it to the peers it introduces
 * (PeerNode.peer_key). It serves both data channels:
 * - the peer channel (ZeroMQ CURVE): the node's CURVE server key, and the
 *   client key its ZAP handler admits as that incarnation;
 * - the TCP data port: kvf_peer_pair_secret() turns this node's secret key and
 *   the peer's public key into the 32-byte secret of the pair (X25519, then
 *   HMAC-SHA256 over both public keys), which the port's challenge-response
 *   proves (dataplane/transport/tcp.h). Both ends get the same secret; nobody
 *   else can, the control plane included.
 * So a new incarnation means new keys and new pair secrets, and nothing
 * secret lives in the control plane (docs/security.md, "Data channels").
 */
#ifndef KVF_PEER_KEYS_H
#define KVF_PEER_KEYS_H

#include <stdint.h>

#define KVF_PEER_KEY_SIZE 32u
#define KVF_PEER_Z85_SIZE 41u /* 40 characters and a NUL */

struct kvf_peer_keypair {
    uint8_t pub[KVF_PEER_KEY_SIZE];
    uint8_t sec[KVF_PEER_KEY_SIZE];
};

/* Generates a fresh key pair (OpenSSL's X25519 from its CSPRNG). 0 or -EIO
 * (logged). Any thread. */
int kvf_peer_keypair_generate(struct kvf_peer_keypair *kp_p);

/* Overwrites the secret half (before the pair is dropped). */
void kvf_peer_keypair_wipe(struct kvf_peer_keypair *kp);

/*
 * The secret of the pair (`self`, the peer whose public key is `peer_pub`):
 * HMAC-SHA256(X25519(self.sec, peer_pub), "kvfence pair v1" || lower public
 * key || higher public key). Symmetric: the peer computes the same from its
 * key pair and self.pub. 0, -EINVAL (peer_pub is our own key, or a low-order
 * point: X25519 gives all zeros) or -EIO (logged). Any thread.
 */
int kvf_peer_pair_secret(const struct kvf_peer_keypair *self,
                         const uint8_t peer_pub[KVF_PEER_KEY_SIZE],
                         uint8_t secret_p[KVF_PEER_KEY_SIZE]);

/* `key` in Z85 (ZeroMQ's text form of a CURVE key), NUL-terminated. */
void kvf_peer_key_z85(const uint8_t key[KVF_PEER_KEY_SIZE], char out[KVF_PEER_Z85_SIZE]);

#endif /* KVF_PEER_KEYS_H */
