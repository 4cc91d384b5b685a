/*
 * cuda_export_none.c: the device memory export of a libkvfence built without
 * CUDA: every pointer that is not fake device memory (fake_device.c) is
 * refused UNIMPLEMENTED.
 */
#include "client_internal.h"

int client_cuda_export(const void *dev_ptr, struct kvf_cuda_ipc *out, struct kvf_status *st)
{
    (void)dev_ptr;
    (void)out;
    return client_status(st, KVF_STATUS_UNIMPLEMENTED,
                         "kvf_cuda_ipc_export: libkvfence was built without CUDA (and %p is no "
                         "kvf_fake_device_alloc memory)",
                         dev_ptr);
}
