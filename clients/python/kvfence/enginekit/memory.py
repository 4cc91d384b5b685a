"""An engine's KV buffers as one kvfence pool of several buffers.

Both engines keep the KV cache in buffers that live as long as the engine:
one per layer (SGLang: one for K and one for V per layer, KVArgs.kv_data_ptrs;
vLLM: one tensor per layer, K and V halves in it). A page index names the same
page in every buffer at once, and a kvfence-node pool of several buffers
(NodeClient.register_pool_buffers; docs/node.md "Pools") says exactly that:
page i is slot i of every buffer. So register_kv_memory() registers the
engine's buffers as they are, as ONE pool, and a lease or a chunk names the
engine's page indices as they are: one page set however many layers (before,
the buffers had to lie in one shm object and a lease named every layer's slot
separately, so 8,000 scattered pages over 8 buffers were 64,000 runs).

Each buffer is its own memory, found from its address:
  - FakeDeviceBuffer memory (tests) and any address that is not host shm:
    device memory, exported by CUDA IPC (kvfence.device.export: the node opens
    the handle; cuda_ipc);
  - an address in a shared mapping of a /dev/shm object of this process: that
    object at that offset (the mapping's file and offset from /proc/self/maps),
    handed to the node as a descriptor (host_fd).
Buffers may differ in bytes per page (kv_item_lens) and in kind; every buffer
must hold the same number of pages. The pool's page is the buffers' slots in
buffer order, so a source and a sink must list the same slot sizes in the same
order (the backends compare them at rendezvous; the node refuses a chunk
between different layouts).

SGLang's aux buffers are indexed by request, not by page; they are no pool:
the aux bytes of a request travel with its last chunk (SubmitChunk's aux) and
the decode backend writes them into the request's slot (kvfence.sglang).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from .. import device as _device
from ..client import NodeClient, PageRange, Pool, PoolBuffer, ranges_from_pages

__all__ = ["KvMemory", "register_kv_memory", "shm_region", "buffer_address", "kv_buffer"]


def buffer_address(buf) -> int:
    """The address of a writable buffer (a memoryview, mmap, bytearray)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _shm_mapping(addr: int) -> Optional[Tuple[str, int, int, str]]:
    """(path, offset in the file, end address, perms) of the mapping holding
    addr, or None when nothing of this process maps it."""
    with open("/proc/self/maps", "r", encoding="utf-8") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip(), int(parts[2], 16) + (addr - lo), hi, parts[1]
    return None


def shm_region(addr: int, length: int) -> Tuple[str, int]:
    """(shm_open name, offset in the object) of [addr, addr+length), which
    must lie in one shared mapping of a /dev/shm object of this process.
    ValueError names the address otherwise."""
    m = _shm_mapping(addr)
    if m is None:
        raise ValueError("address 0x%x is not mapped in this process" % addr)
    path, off, hi, perms = m
    if not path.startswith("/dev/shm/") or "s" not in perms:
        raise ValueError("address 0x%x is not in a shared /dev/shm mapping (%r)" % (addr, path))
    if addr + length > hi:
        raise ValueError("[0x%x, +%d) runs past its mapping of %s" % (addr, length, path))
    return path[len("/dev/shm"):], off


def kv_buffer(ptr: int, length: int, item_len: int, *, what: str = "kv buffer") -> PoolBuffer:
    """The PoolBuffer of [ptr, +length) with item_len bytes a page: device
    memory by CUDA IPC (a FakeDeviceBuffer's fake handle in tests), host shm
    as its object and offset. ValueError naming `what` when it is neither
    (e.g. private heap memory, or a GPU address on a machine without CUDA)."""
    if _device._fake_export(ptr) is not None:
        return PoolBuffer(item_len, ipc=_device.export(ptr), size=length)
    m = _shm_mapping(ptr)
    if m is not None and m[0].startswith("/dev/shm/") and "s" in m[3]:
        name, off = shm_region(ptr, length)
        return PoolBuffer(item_len, shm_name=name, offset=off, size=length)
    try:
        ipc = _device.export(ptr)
    except (ValueError, RuntimeError) as e:
        where = "in %r" % m[0] if m is not None else "not mapped in this process"
        raise ValueError("%s: 0x%x (%s) is neither host shm (a shared /dev/shm mapping) nor "
                         "device memory: %s" % (what, ptr, where, e)) from None
    return PoolBuffer(item_len, ipc=ipc, size=length)


@dataclass(frozen=True)
class KvMemory:
    """The engine's KV buffers as registered: the pool (page i = slot i of
    every buffer), each buffer's bytes per page, and the pages a buffer has."""
    pool: Pool
    item_lens: Tuple[int, ...]
    pages_per_buffer: int

    @property
    def pool_id(self) -> int:
        return self.pool.pool_id

    @property
    def buffers(self) -> int:
        return len(self.item_lens)

    @property
    def page_size(self) -> int:
        """Bytes of one engine page over every buffer (the pool's page)."""
        return sum(self.item_lens)

    def ranges(self, indices: Iterable[int]) -> List[PageRange]:
        """The pool ranges of engine pages `indices`, in order (a chunk's
        source or sink pages: page i goes to page i)."""
        return ranges_from_pages(int(i) for i in indices)

    def pool_pages(self, indices: Iterable[int]) -> List[int]:
        """The pool pages of engine pages `indices`, for a lease (join_room /
        extend_lease pages=): the indices themselves, one page set for every
        layer."""
        return [int(i) for i in indices]

    def describe(self) -> dict:
        """What the peer needs to address these pages (JSON-able)."""
        return {"pool_id": self.pool.pool_id, "item_lens": list(self.item_lens),
                "pages_per_buffer": self.pages_per_buffer}

    def same_layout(self, info: dict) -> bool:
        """Whether a peer's describe() (or bootstrap registration) lists the
        same slot sizes in the same order (chunks between them are refused
        otherwise)."""
        return [int(i) for i in info.get("item_lens") or []] == list(self.item_lens)


def register_kv_memory(node: NodeClient, ptrs: Sequence[int], lens: Sequence[int],
                       item_lens: Sequence[int], *, rank: int = 0, pool_key: str = "",
                       buffers: Optional[Sequence[PoolBuffer]] = None,
                       timeout: Optional[float] = None) -> KvMemory:
    """Registers the KV buffers [ptrs[b], +lens[b]) (pages of item_lens[b]
    bytes, every buffer the same number of pages) with this host's
    kvfence-node as ONE pool of len(ptrs) buffers (module text). buffers:
    the PoolBuffers when the caller knows them better (vLLM: torch's own
    IPC export of a tensor); ptrs are then only checked for their count.
    ValueError naming the buffer for bad geometry or memory, before the node
    is asked; the node's refusals (InvalidArgument naming buffers[b], ...)
    register nothing."""
    if not ptrs or len(ptrs) != len(lens) or len(ptrs) != len(item_lens):
        raise ValueError("kv buffers: %d ptrs, %d lens, %d item_lens (must be equal, > 0)" %
                         (len(ptrs), len(lens), len(item_lens)))
    items = tuple(int(i) for i in item_lens)
    for b, i in enumerate(items):
        if i <= 0:
            raise ValueError("kv_item_lens[%d]: %d bytes a page (must be > 0)" % (b, i))
    pages = int(lens[0]) // items[0]
    if pages <= 0:
        raise ValueError("kv_data_lens[0]: %d bytes, not one page of %d" % (lens[0], items[0]))
    for b, (n, i) in enumerate(zip(lens, items)):
        if int(n) != pages * i:
            raise ValueError("kv_data_lens[%d]: %d bytes, not %d pages of %d" % (b, n, pages, i))
    if buffers is None:
        bufs = [kv_buffer(int(p), int(n), i, what="kv_data_ptrs[%d]" % b)
                for b, (p, n, i) in enumerate(zip(ptrs, lens, items))]
    else:
        if len(buffers) != len(ptrs):
            raise ValueError("kv buffers: %d PoolBuffers for %d ptrs" % (len(buffers), len(ptrs)))
        bufs = list(buffers)
    pool = node.register_pool_buffers(bufs, pages, rank=rank, pool_key=pool_key,
                                      timeout=timeout)
    return KvMemory(pool, items, pages)
