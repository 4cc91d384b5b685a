"""An engine's KV buffers as one kvfence pool.

Both engines keep the KV cache in buffers that live as long as the engine:
one per layer (SGLang: one for K and one for V per layer, KVArgs.kv_data_ptrs;
vLLM: one tensor per layer, K and V halves in it). A page index names the same
page in every buffer at once. kvfence leases pages of one pool per
participant, so the buffers have to be one pool.

register_kv_memory() is the only place that knows how. Today a kvfence-node
registers host shared memory only (NodeClient.register_pool_shm /
register_pool_fd), one pool per call, with one page geometry; so today the
buffers must lie in ONE POSIX shm object (the engine lays the per-layer
buffers out in it, each at a multiple of the page size), and the pool spans
them all: page p of buffer b is pool page bases[b] + p. When the node gets
multi-buffer pools (several buffers, one page geometry) and CUDA
registration, this function registers the buffers as they are (GPU memory
included) and KvMemory.ranges() maps a page index to one pool page again;
nothing else in kvfence.sglang or kvfence.vllm changes.

Which shm object holds an address is read from /proc/self/maps (the mapping's
file and offset), so the engine hands over plain addresses, as it does to
Mooncake or NIXL.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from ..client import NodeClient, PageRange, Pool, ranges_from_pages

__all__ = ["KvMemory", "register_kv_memory", "shm_region", "buffer_address", "ranges_for"]


def buffer_address(buf) -> int:
    """The address of a writable buffer (a memoryview, mmap, bytearray)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def shm_region(addr: int, length: int) -> Tuple[str, int]:
    """(shm_open name, offset in the object) of [addr, addr+length), which
    must lie in one shared mapping of a /dev/shm object of this process.
    ValueError names the address otherwise (e.g. GPU memory: not yet)."""
    with open("/proc/self/maps", "r", encoding="utf-8") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not lo <= addr < hi:
                continue
            path = parts[5].strip()
            if not path.startswith("/dev/shm/") or "s" not in parts[1]:
                raise ValueError("address 0x%x is not in a shared /dev/shm mapping (%r): "
                                 "kvfence-node pools are host shm today" % (addr, path))
            if addr + length > hi:
                raise ValueError("[0x%x, +%d) runs past its mapping of %s" % (addr, length, path))
            return path[len("/dev/shm"):], int(parts[2], 16) + (addr - lo)
    raise ValueError("address 0x%x is not mapped in this process" % addr)


def ranges_for(bases: Sequence[int], indices: Iterable[int]) -> List[PageRange]:
    """Pool page ranges of engine page `indices` in every buffer, buffer by
    buffer (the order both sides of a chunk use, so page i of the source
    list lands in page i of the sink list)."""
    idx = [int(i) for i in indices]
    out: List[PageRange] = []
    for b in bases:
        out.extend(ranges_from_pages(b + i for i in idx))
    return out


@dataclass(frozen=True)
class KvMemory:
    """The engine's KV buffers as registered: the pool, the page size (bytes
    of one page of one buffer), the first pool page of each buffer, and how
    many pages each buffer has."""
    pool: Pool
    item_len: int
    bases: Tuple[int, ...]
    pages_per_buffer: int

    @property
    def pool_id(self) -> int:
        return self.pool.pool_id

    def ranges(self, indices: Iterable[int]) -> List[PageRange]:
        """The pool ranges of engine pages `indices`, in order (a chunk's
        source or sink pages: page i goes to page i)."""
        return ranges_for(self.bases, indices)

    def pool_pages(self, indices: Iterable[int]) -> List[int]:
        """The pool pages of engine pages `indices` in every buffer, for a
        lease (join_room / extend_lease pages=: sent as a page set, a few
        bytes a page however scattered)."""
        idx = [int(i) for i in indices]
        return [b + i for b in self.bases for i in idx]

    def page_count(self, n_indices: int) -> int:
        """Pool pages that n_indices engine pages are (in every buffer)."""
        return n_indices * len(self.bases)

    def describe(self) -> dict:
        """What the peer needs to address these pages (JSON-able)."""
        return {"pool_id": self.pool.pool_id, "item_len": self.item_len,
                "bases": list(self.bases), "pages_per_buffer": self.pages_per_buffer}


def register_kv_memory(node: NodeClient, ptrs: Sequence[int], lens: Sequence[int],
                       item_lens: Sequence[int], *, rank: int = 0,
                       timeout: Optional[float] = None) -> KvMemory:
    """Registers the KV buffers [ptrs[b], +lens[b]) (pages of item_lens[b]
    bytes) with this host's kvfence-node as one pool; see the module text
    for what today's node needs (one shm object, one page size)."""
    if not ptrs or len(ptrs) != len(lens) or len(ptrs) != len(item_lens):
        raise ValueError("kv buffers: %d ptrs, %d lens, %d item_lens (must be equal, > 0)" %
                         (len(ptrs), len(lens), len(item_lens)))
    item = int(item_lens[0])
    if item <= 0 or any(int(i) != item for i in item_lens):
        raise ValueError("kv_item_lens: every buffer needs the same page size today, got %s" %
                         sorted(set(int(i) for i in item_lens)))
    pages = int(lens[0]) // item
    regions = []
    for b, (p, n) in enumerate(zip(ptrs, lens)):
        if int(n) != pages * item:
            raise ValueError("kv_data_lens[%d]: %d bytes, not %d pages of %d" % (b, n, pages, item))
        regions.append(shm_region(int(p), int(n)))
    names = sorted(set(r[0] for r in regions))
    if len(names) != 1:
        raise ValueError("kv buffers lie in %d shm objects (%s): today they must share one "
                         "(one pool per participant until multi-buffer pools)" %
                         (len(names), ", ".join(names)))
    base = min(off for _, off in regions)
    end = max(off + int(n) for (_, off), n in zip(regions, lens))
    if base % item:
        base -= base % item
    for b, (_, off) in enumerate(regions):
        if (off - base) % item:
            raise ValueError("kv_data_ptrs[%d]: at byte %d of %s, not on a page boundary" %
                             (b, off, names[0]))
    count = (end - base + item - 1) // item
    pool = node.register_pool_shm(names[0], item, count, rank=rank, offset=base,
                                  size=count * item, timeout=timeout)
    bases = tuple((off - base) // item for _, off in regions)
    return KvMemory(pool, item, bases, pages)
