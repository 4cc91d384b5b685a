/*
 * kvf_types.c: names of the feature bits (the wire form of capabilities).
 */
#include "kvf_types.h"

#include <string.h>

static const char *const feature_names[KVF_FEATURE_COUNT] = {
    "QUIESCE_V1", "FENCE_V1", "RDMA", "TCP", "CUDA_STAGING", "LOCAL",
};

const char *kvf_feature_name(uint32_t bit)
{
    for (unsigned i = 0; i < KVF_FEATURE_COUNT; i++) {
        if (bit == (1u << i))
            return feature_names[i];
    }
    return NULL;
}

uint32_t kvf_feature_from_name(const char *name)
{
    for (unsigned i = 0; i < KVF_FEATURE_COUNT; i++) {
        if (strcmp(name, feature_names[i]) == 0)
            return 1u << i;
    }
    return 0;
}
