"""kvfence demo: the single-buffer shm pool and problem counters of the
one-process demo, kept as they were for the chaos tests
(tests/chaos/test_node_kill.py imports them from demo.py, which re-exports
them). The main job itself uses demo_rank.py's pools of several buffers.

Pool: one engine rank's KV buffer, a POSIX shm object registered with its
node, a page allocator and the canary bookkeeping; Stats: the counters its
checks report to (thread-safe).
"""
from __future__ import annotations

import os
import random
import struct
import threading
from multiprocessing import shared_memory
from typing import List, Sequence, Set

import kvfence


def log(msg: str) -> None:
    print(msg, flush=True)


class PageAllocator:
    """A pool's page allocator with the canary rule, shared by this Pool and
    demo_rank.py's: a page is handed out only after its canary was checked,
    and goes back only through free(), which re-arms it first. Subclasses give
    check_canary(pages, when), write_canary(pg) and double_free(pages)."""

    def __init__(self, page_count: int) -> None:
        self._cv = threading.Condition()
        self._free: List[int] = list(range(page_count))
        self._used: Set[int] = set()

    def check_canary(self, pages: Sequence[int], when: str) -> int:
        raise NotImplementedError

    def write_canary(self, pg: int) -> None:
        raise NotImplementedError

    def double_free(self, pages: List[int]) -> None:
        raise NotImplementedError

    def alloc(self, n: int, stop: threading.Event) -> List[int]:
        with self._cv:
            while len(self._free) < n:
                if stop.is_set():
                    raise InterruptedError("stopping")
                self._cv.wait(0.2)
            random.shuffle(self._free)  # scattered pages: several ranges per lease
            pages, self._free = self._free[:n], self._free[n:]
            self._used.update(pages)
        self.check_canary(pages, "at allocation")
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Only from a release callback (or pages never granted): re-arm the
        canaries, then free."""
        for pg in pages:
            self.write_canary(pg)
        with self._cv:
            bad = [pg for pg in pages if pg not in self._used]
            if bad:
                self.double_free(bad)
            self._used.difference_update(pages)
            have = set(self._free)
            self._free.extend(pg for pg in pages if pg not in have)
            self._cv.notify_all()

    def free_pages(self) -> List[int]:
        with self._cv:
            return list(self._free)

    @property
    def used(self) -> int:
        with self._cv:
            return len(self._used)


class Pool(PageAllocator):
    """One engine rank's KV buffer: a POSIX shm object registered with its
    node, a page allocator and the canary bookkeeping."""

    def __init__(self, stats: "Stats", tag: str, node: kvfence.NodeClient, rank: int,
                 page_size: int, page_count: int) -> None:
        super().__init__(page_count)
        self.stats = stats
        self.tag = tag
        self.page_size = page_size
        self.page_count = page_count
        self.shm = shared_memory.SharedMemory(
            name="kvf-demo-%d-%s" % (os.getpid(), tag), create=True, size=page_size * page_count)
        self.buf = self.shm.buf
        self._salt = sum(tag.encode()) & 0xFF
        for pg in range(page_count):
            self.write(pg, self.canary(pg))
        self.pool_id = node.register_pool_shm(self.shm.name, page_size, page_count,
                                              rank=rank).pool_id

    def canary(self, pg: int) -> bytes:
        unit = b"CANARY" + struct.pack("<BBI", self._salt, 0xC3, pg) + bytes(range(0xE0, 0xF6))
        return (unit * (self.page_size // len(unit) + 1))[:self.page_size]

    def read(self, pg: int) -> bytes:
        return bytes(self.buf[pg * self.page_size:(pg + 1) * self.page_size])

    def write(self, pg: int, data: bytes) -> None:
        self.buf[pg * self.page_size:(pg + 1) * self.page_size] = data

    def check_canary(self, pages: Sequence[int], when: str) -> int:
        bad = [pg for pg in pages if self.read(pg) != self.canary(pg)]
        if bad:
            self.stats.corrupted(len(bad), "%s pool %s: pages %s lost their canary (%s)" %
                                 (self.tag, self.pool_id, bad[:8], when))
        return len(bad)

    def write_canary(self, pg: int) -> None:
        self.write(pg, self.canary(pg))

    def double_free(self, pages: List[int]) -> None:
        self.stats.corrupted(0, "%s: double free of pages %s" % (self.tag, pages[:8]))

    def close(self) -> None:
        self.buf = None
        try:
            self.shm.close()
            self.shm.unlink()
        except (OSError, BufferError):
            pass



class Stats:
    """What a Pool reports: corrupted pages and problems (the demo's run
    counters are demo.py's RunStats)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.corrupted_pages = 0
        self.problems: List[str] = []

    def corrupted(self, n: int, msg: str) -> None:
        with self.lock:
            self.corrupted_pages += n
            self.problems.append(msg)
        log("CORRUPTION: " + msg)

    def problem(self, msg: str) -> None:
        with self.lock:
            self.problems.append(msg)
        log("problem: " + msg)
