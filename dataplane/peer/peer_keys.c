/*
 * peer_keys.c: per-incarnation X25519 key pairs and pair secrets (see
 * peer_keys.h), on OpenSSL's libcrypto. Stateless: every function may run on
 * any thread.
 */
#include "peer_keys.h"
#include "kvf_log.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <zmq.h>

#define PAIR_LABEL "kvfence pair v1"

int kvf_peer_keypair_generate(struct kvf_peer_keypair *kp_p)
{
    EVP_PKEY *pk = NULL;
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, NULL);
    struct kvf_peer_keypair kp;
    size_t publen = sizeof kp.pub, seclen = sizeof kp.sec;
    int rc = -EIO;
    if (ctx != NULL && EVP_PKEY_keygen_init(ctx) == 1 && EVP_PKEY_keygen(ctx, &pk) == 1 &&
        EVP_PKEY_get_raw_public_key(pk, kp.pub, &publen) == 1 &&
        EVP_PKEY_get_raw_private_key(pk, kp.sec, &seclen) == 1 && publen == sizeof kp.pub &&
        seclen == sizeof kp.sec) {
        *kp_p = kp;
        rc = 0;
    } else {
        kvf_log("error", "kvf_peer: cannot generate an X25519 key pair (libcrypto)");
    }
    OPENSSL_cleanse(&kp, sizeof kp);
    EVP_PKEY_free(pk);
    EVP_PKEY_CTX_free(ctx);
    return rc;
}

void kvf_peer_keypair_wipe(struct kvf_peer_keypair *kp)
{
    if (kp != NULL)
        OPENSSL_cleanse(kp->sec, sizeof kp->sec);
}

int kvf_peer_pair_secret(const struct kvf_peer_keypair *self,
                         const uint8_t peer_pub[KVF_PEER_KEY_SIZE],
                         uint8_t secret_p[KVF_PEER_KEY_SIZE])
{
    if (CRYPTO_memcmp(self->pub, peer_pub, KVF_PEER_KEY_SIZE) == 0)
        return -EINVAL;
    EVP_PKEY *mine =
        EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, NULL, self->sec, KVF_PEER_KEY_SIZE);
    EVP_PKEY *theirs =
        EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, NULL, peer_pub, KVF_PEER_KEY_SIZE);
    EVP_PKEY_CTX *ctx = mine ? EVP_PKEY_CTX_new(mine, NULL) : NULL;
    uint8_t shared[KVF_PEER_KEY_SIZE];
    size_t len = sizeof shared;
    int rc = -EIO;
    /* OpenSSL refuses an all-zero result (a low-order peer point). */
    if (ctx == NULL || theirs == NULL || EVP_PKEY_derive_init(ctx) != 1 ||
        EVP_PKEY_derive_set_peer(ctx, theirs) != 1 || EVP_PKEY_derive(ctx, shared, &len) != 1 ||
        len != sizeof shared) {
        kvf_log("error", "kvf_peer: X25519 with a peer key failed (libcrypto)");
        rc = -EINVAL;
        goto out;
    }
    uint8_t msg[sizeof PAIR_LABEL - 1 + 2 * KVF_PEER_KEY_SIZE];
    const uint8_t *lo = self->pub, *hi = peer_pub;
    if (memcmp(lo, hi, KVF_PEER_KEY_SIZE) > 0) {
        lo = peer_pub;
        hi = self->pub;
    }
    memcpy(msg, PAIR_LABEL, sizeof PAIR_LABEL - 1);
    memcpy(msg + sizeof PAIR_LABEL - 1, lo, KVF_PEER_KEY_SIZE);
    memcpy(msg + sizeof PAIR_LABEL - 1 + KVF_PEER_KEY_SIZE, hi, KVF_PEER_KEY_SIZE);
    unsigned int maclen = 0;
    uint8_t mac[EVP_MAX_MD_SIZE];
    if (HMAC(EVP_sha256(), shared, (int)sizeof shared, msg, sizeof msg, mac, &maclen) == NULL ||
        maclen != KVF_PEER_KEY_SIZE) {
        kvf_log("error", "kvf_peer: HMAC-SHA256 failed (libcrypto)");
        goto out;
    }
    memcpy(secret_p, mac, KVF_PEER_KEY_SIZE);
    OPENSSL_cleanse(mac, sizeof mac);
    rc = 0;
out:
    OPENSSL_cleanse(shared, sizeof shared);
    EVP_PKEY_CTX_free(ctx);
    EVP_PKEY_free(theirs);
    EVP_PKEY_free(mine);
    return rc;
}

void kvf_peer_key_z85(const uint8_t key[KVF_PEER_KEY_SIZE], char out[KVF_PEER_Z85_SIZE])
{
    if (zmq_z85_encode(out, key, KVF_PEER_KEY_SIZE) == NULL)
        out[0] = '\0';
}
