"""Device memory for kvfence pools: exporting CUDA memory by IPC handle, and
fake device memory for tests and machines without a GPU.

The node opens an engine's GPU memory with cudaIpcOpenMemHandle. An engine
exports the allocation that holds its pages with cudaIpcGetMemHandle and names
the pool's first byte by its offset in that allocation (the node maps the
whole allocation). `export(ptr)` does that for a raw device pointer (ctypes on
libcudart and libcuda, loaded on first use); `export_tensor(t)` for a torch
CUDA tensor (torch's own export, `storage._share_cuda_()`, which knows the
caching allocator's block).

FakeDeviceBuffer is "device memory" that is host shared memory: its pointer
exports as a fake handle (b"KVFFAKE1" + the object's name, 64 bytes: the
layout of common/kvf_fake_ipc.h) that the same calls and the same
RegisterPool field (cuda_ipc) carry, and that a node started with
--test-fake-device-pools PREFIX opens as a fake device pool when the name
starts with PREFIX. Any other node takes it for a CUDA handle and refuses it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

__all__ = ["CudaIpc", "FakeDeviceBuffer", "export", "export_tensor", "IPC_HANDLE_SIZE"]

#: Bytes of a cudaIpcMemHandle_t.
IPC_HANDLE_SIZE = 64
_FAKE_MAGIC = b"KVFFAKE1"
_FAKE_NAME_MAX = IPC_HANDLE_SIZE - len(_FAKE_MAGIC) - 1


@dataclass(frozen=True)
class CudaIpc:
    """An exported device allocation: its cudaIpcMemHandle_t, the CUDA device
    it lives on, and the offset of the exported pointer in it."""
    handle: bytes
    device: int = 0
    offset: int = 0


_fake_lock = threading.Lock()
_fakes: List["FakeDeviceBuffer"] = []


class FakeDeviceBuffer:
    """Tests only: `size` bytes of fake device memory, the POSIX shm object
    `name` (created here, mode 0660 so that the node may open it by name;
    unlinked by close). `ptr` is its address, `mem` a writable memoryview."""

    def __init__(self, name: str, size: int) -> None:
        if not name.startswith("/"):
            name = "/" + name
        if len(name.encode()) > _FAKE_NAME_MAX:
            raise ValueError("FakeDeviceBuffer: name longer than %d bytes" % _FAKE_NAME_MAX)
        self.name = name
        self.size = size
        fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o660)
        try:
            os.fchmod(fd, 0o660)
            os.ftruncate(fd, size)
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink("/dev/shm" + name)
            raise
        os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.ptr: int = ctypes.addressof(self._anchor)
        self.mem = memoryview(self._map)
        with _fake_lock:
            _fakes.append(self)

    def data_ptr(self) -> int:
        return self.ptr

    def close(self) -> None:
        with _fake_lock:
            if self in _fakes:
                _fakes.remove(self)
        if self._map is not None:
            self.mem.release()
            del self._anchor
            self._map.close()
            self._map = None
            try:
                os.unlink("/dev/shm" + self.name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "FakeDeviceBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fake_export(ptr: int) -> Optional[CudaIpc]:
    with _fake_lock:
        for f in _fakes:
            if f.ptr <= ptr < f.ptr + f.size:
                h = _FAKE_MAGIC + f.name.encode().ljust(IPC_HANDLE_SIZE - len(_FAKE_MAGIC), b"\0")
                return CudaIpc(h, 0, ptr - f.ptr)
    return None


class _PtrAttr(ctypes.Structure):  # struct cudaPointerAttributes (CUDA >= 11)
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


_cuda_lock = threading.Lock()
_cuda_libs: Optional[tuple] = None


def _load(names: tuple) -> Optional[ctypes.CDLL]:
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    return None


def _cuda() -> tuple:
    global _cuda_libs
    with _cuda_lock:
        if _cuda_libs is None:
            rt = _load(("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"))
            drv = _load(("libcuda.so.1", "libcuda.so"))
            _cuda_libs = (rt, drv)
        return _cuda_libs


def export(ptr: int) -> CudaIpc:
    """Exports the device allocation holding `ptr` (an int, e.g. a tensor's
    data_ptr() or SGLang's kv_data_ptrs[i]): FakeDeviceBuffer memory gets its
    fake handle; otherwise cudaIpcGetMemHandle, with the allocation's start
    from cuMemGetAddressRange and the device from cudaPointerGetAttributes.
    ValueError when the CUDA runtime says it is not device memory;
    RuntimeError when there is no CUDA runtime or driver."""
    fake = _fake_export(ptr)
    if fake is not None:
        return fake
    rt, drv = _cuda()
    if rt is None or drv is None:
        raise RuntimeError("kvfence.device.export: no CUDA runtime/driver (libcudart, libcuda) "
                           "and %#x is no FakeDeviceBuffer memory" % ptr)
    attr = _PtrAttr()
    rc = rt.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(ptr))
    if rc != 0 or attr.type != 2:  # cudaMemoryTypeDevice
        raise ValueError("kvfence.device.export: %#x is not device memory (cuda error %d)" %
                         (ptr, rc))
    # The handle is taken on the allocation's device; the calling thread's
    # current device (the engine's) is set back at once.
    prev = ctypes.c_int(0)
    rc = rt.cudaGetDevice(ctypes.byref(prev))
    if rc == 0:
        rc = rt.cudaSetDevice(attr.device)
    h = ctypes.create_string_buffer(IPC_HANDLE_SIZE)
    if rc == 0:
        try:
            rc = rt.cudaIpcGetMemHandle(h, ctypes.c_void_p(ptr))
        finally:
            rt.cudaSetDevice(prev.value)
    if rc != 0:
        raise ValueError("kvfence.device.export: cudaIpcGetMemHandle(%#x): cuda error %d" %
                         (ptr, rc))
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError("kvfence.device.export: cuMemGetAddressRange(%#x): error %d" %
                           (ptr, rc))
    return CudaIpc(h.raw, attr.device, ptr - base.value)


def export_tensor(t: Any) -> CudaIpc:
    """Exports a tensor's memory at its first element: a torch CUDA tensor by
    torch's own IPC export (its storage's handle, the storage's offset in the
    caching allocator's block plus the tensor's offset in the storage);
    anything else with data_ptr() (e.g. FakeDeviceBuffer) by export()."""
    if getattr(t, "is_cuda", False) and hasattr(t, "untyped_storage"):
        st = t.untyped_storage()
        dev, handle, _size, storage_off = st._share_cuda_()[:4]
        return CudaIpc(bytes(handle), int(dev),
                       int(storage_off) + t.storage_offset() * t.element_size())
    return export(int(t.data_ptr()))
