/*
 * cuda_export.c: the device memory export of a libkvfence built with CUDA
 * (KVF_HAVE_CUDA). cudaIpcGetMemHandle exports the allocation that holds the
 * pointer; the node's cudaIpcOpenMemHandle maps that whole allocation, so
 * the pointer's offset in it comes along, from the driver's
 * cuMemGetAddressRange (the runtime API does not say where an allocation
 * starts), reached through cudaGetDriverEntryPointByVersion. The device is
 * the pointer's, from cudaPointerGetAttributes.
 *
 * The CUDA runtime is loaded when the first real pointer is exported
 * (dlopen of libcudart), not linked: libkvfence then loads on a host without
 * CUDA, where only fake device memory exports and a real pointer is refused
 * UNIMPLEMENTED. Plain C with the CUDA headers for the types (no nvcc).
 *
 * DESIGN: the runtime's entry points are resolved once (pthread_once); any
 * thread may export.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "client_internal.h"

/* The runtime's calls used here, resolved from libcudart. */
struct cudart {
    cudaError_t (*pointer_attrs)(struct cudaPointerAttributes *, const void *);
    cudaError_t (*get_device)(int *);
    cudaError_t (*set_device)(int);
    cudaError_t (*ipc_get)(cudaIpcMemHandle_t *, void *);
    cudaError_t (*entry_point)(const char *, void **, unsigned int, unsigned long long,
                               enum cudaDriverEntryPointQueryResult *);
    const char *(*error_string)(cudaError_t);
    char why[160]; /* why not, when a call is missing */
};

static struct cudart rt;
static pthread_once_t rt_once = PTHREAD_ONCE_INIT;

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p && !rt.why[0])
        snprintf(rt.why, sizeof rt.why, "libcudart has no %s", name);
    return p;
}

static void rt_load(void)
{
    static const char *const names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12"};
    void *lib = NULL;
    for (size_t i = 0; !lib && i < sizeof names / sizeof names[0]; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(rt.why, sizeof rt.why, "no CUDA runtime on this host (dlopen libcudart: %s)",
                 dlerror());
        return;
    }
    /* POSIX: a data pointer from dlsym converts to a function pointer. */
    *(void **)&rt.pointer_attrs = sym(lib, "cudaPointerGetAttributes");
    *(void **)&rt.get_device = sym(lib, "cudaGetDevice");
    *(void **)&rt.set_device = sym(lib, "cudaSetDevice");
    *(void **)&rt.ipc_get = sym(lib, "cudaIpcGetMemHandle");
    *(void **)&rt.entry_point = sym(lib, "cudaGetDriverEntryPointByVersion");
    *(void **)&rt.error_string = sym(lib, "cudaGetErrorString");
}

int client_cuda_export(const void *dev_ptr, struct kvf_cuda_ipc *out, struct kvf_status *st)
{
    pthread_once(&rt_once, rt_load);
    if (rt.why[0])
        return client_status(st, KVF_STATUS_UNIMPLEMENTED, "kvf_cuda_ipc_export: %s", rt.why);
    struct cudaPointerAttributes attr;
    cudaError_t ce = rt.pointer_attrs(&attr, dev_ptr);
    if (ce != cudaSuccess || attr.type != cudaMemoryTypeDevice)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_cuda_ipc_export: %p is not device memory (%s)", dev_ptr,
                             ce != cudaSuccess ? rt.error_string(ce) : "host or managed");
    /* The handle is taken on the allocation's device; the calling thread's
     * current device is the engine's and is set back at once. */
    int prev = -1;
    ce = rt.get_device(&prev);
    if (ce == cudaSuccess)
        ce = rt.set_device(attr.device);
    cudaIpcMemHandle_t h;
    if (ce == cudaSuccess) {
        ce = rt.ipc_get(&h, (void *)dev_ptr);
        (void)rt.set_device(prev);
    }
    if (ce != cudaSuccess)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_cuda_ipc_export: cudaIpcGetMemHandle(%p) on device %d: %s",
                             dev_ptr, attr.device, rt.error_string(ce));
    typedef CUresult (*range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    ce = rt.entry_point("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q);
    if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
        return client_status(st, KVF_STATUS_INTERNAL,
                             "kvf_cuda_ipc_export: the driver has no cuMemGetAddressRange (%s)",
                             rt.error_string(ce));
    range_fn range;
    *(void **)&range = fn;
    CUdeviceptr base = 0;
    size_t len = 0;
    CUresult cr = range(&base, &len, (CUdeviceptr)(uintptr_t)dev_ptr);
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
