/*
 * cuda_export.c: the device memory export of a libkvfence built with CUDA
 * (KVF_HAVE_CUDA). cudaIpcGetMemHandle exports the allocation that holds the
 * pointer; the node's cudaIpcOpenMemHandle maps that whole allocation, so
 * the pointer's offset in it comes along, from the driver's
 * cuMemGetAddressRange (the runtime API does not say where an allocation
 * starts), reached through cudaGetDriverEntryPointByVersion: the library
 * links the runtime only, so it loads on a host without a CUDA driver (and
 * then refuses every real pointer). The device is the pointer's, from
 * cudaPointerGetAttributes.
 *
 * Plain C against the CUDA runtime API, with cuda.h for the driver's types
 * (no nvcc). Any thread.
 */
#include <string.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "client_internal.h"

int client_cuda_export(const void *dev_ptr, struct kvf_cuda_ipc *out, struct kvf_status *st)
{
    struct cudaPointerAttributes attr;
    cudaError_t ce = cudaPointerGetAttributes(&attr, dev_ptr);
    if (ce != cudaSuccess || attr.type != cudaMemoryTypeDevice)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_cuda_ipc_export: %p is not device memory (%s)", dev_ptr,
                             ce != cudaSuccess ? cudaGetErrorString(ce) : "host or managed");
    ce = cudaSetDevice(attr.device);
    cudaIpcMemHandle_t h;
    if (ce == cudaSuccess)
        ce = cudaIpcGetMemHandle(&h, (void *)dev_ptr);
    if (ce != cudaSuccess)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_cuda_ipc_export: cudaIpcGetMemHandle(%p) on device %d: %s",
                             dev_ptr, attr.device, cudaGetErrorString(ce));
    typedef CUresult (*range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    ce =
        cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q);
    if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
        return client_status(st, KVF_STATUS_INTERNAL,
                             "kvf_cuda_ipc_export: the driver has no cuMemGetAddressRange (%s)",
                             cudaGetErrorString(ce));
    CUdeviceptr base = 0;
    size_t len = 0;
    CUresult cr = ((range_fn)fn)(&base, &len, (CUdeviceptr)(uintptr_t)dev_ptr);
    if (cr != CUDA_SUCCESS)
        return client_status(st, KVF_STATUS_INTERNAL,
                             "kvf_cuda_ipc_export: cuMemGetAddressRange(%p): error %d", dev_ptr,
                             (int)cr);
    memset(out, 0, sizeof *out);
    memcpy(out->handle, &h, sizeof h < sizeof out->handle ? sizeof h : sizeof out->handle);
    out->device = (uint32_t)attr.device;
    out->offset = (uint64_t)((uintptr_t)dev_ptr - (uintptr_t)base);
    return 0;
}
