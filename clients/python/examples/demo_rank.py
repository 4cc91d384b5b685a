"""kvfence demo: one engine rank as its own process (demo.py starts one per
rank with multiprocessing's spawn and plays the coordinator).

A rank owns a multi-buffer pool on its node: `layers` x K/V POSIX shm
objects, one per buffer (`page_size` bytes of each per page), registered as
ONE pool with NodeClient.register_pool_buffers, so page i is slot i of every
buffer and one lease and one chunk cover every layer. It owns its page
allocator, its canaries (one per page and buffer) and its own ReleaseWatcher
(filtered to its node and rank): pages go back to the allocator ONLY in that
watcher's callback.

Roles. The decode rank (SINK, on n2) allocates a room's pages and joins;
each prefill TP rank (SOURCE, on n1) allocates its slice, fills it with the
room's pattern (every buffer), joins with its first chunk, waits for the
coordinator's go (every source joined), submits its
chunks (later chunks' pages first added by ExtendLease) and declares
CompleteRoom. The coordinator (demo.py) picks rooms, forwards the sink's
pages to the sources, aborts, and collects what every rank reports.

Canary rule (as before, now per buffer): every free page holds its canary in
every buffer; a released sink page of a COMPLETED room must hold exactly the
source bytes in every buffer; a released page is re-armed with its canaries;
on every allocation and at the end each free page must still hold them. A
difference is a byte written after release: a corrupted page. A slot is a
24-byte header (room id, rank, page, buffer; for a canary: pool salt,
buffer, page) and a body shared by many slots (a pattern's: per rank,
buffer and room id mod 41; a canary's: per buffer), so checks and fills are
memcmp/memcpy of cached bytes; bytes from another room of the same phase
landing in a COMPLETED room's sink page without touching its header would
pass the content check; a write after release, the corruption the demo
is about, is caught by the canaries, whose bodies differ from every pattern's.

DESIGN

Threads (in this process). The command thread reads the inbound queue and
hands each room command to a worker pool (`concurrency` threads); the
ReleaseWatcher's thread runs on_released. `lock` guards the grant book
(grants / early / released_ids / sink rooms); the allocator has its own
condition. Everything sent to the coordinator goes through one
multiprocessing queue; a lease's "granted" message is put before the lease
can be seen by on_released (under `lock`), so the coordinator always sees a
grant before its release.

Commands from the coordinator: ("open", idx, room_id, pages, tp) to the
sink; ("source", idx, room_id, room key, ranks, sink node, sink pool, chunk
plan) to a source, which joins and then waits for ("go", idx): every source
joined, or the room is aborting (then its submits are refused); ("final",):
wait for every page to come back and check every free page; ("stop",).
Messages to the coordinator: ("ready", rank tag, pid, pool_id, buffers),
("joined", idx, room key, lease_id, pages), ("granted", idx, lease_id),
("src_joined", idx, k), ("released", idx, lease_id, t_monotonic at the
callback's entry, sink_mismatch, callback seconds), ("chunk", idx, k, n,
bytes), ("refused", idx, k, why), ("source_done", idx, k), ("failed", idx,
why), ("problem", msg), ("corrupted", n, msg), ("final", tag, stats dict),
("fatal", tag, why), ("exited", tag). CLOCK_MONOTONIC is system-wide on
Linux, so release times compare with the coordinator's.
"""
from __future__ import annotations

import os
import queue
import random
import signal
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import kvfence
from kvfence import Lease, Participant, RoomKey, Role

from demo_pool import PageAllocator


def shm_name(demo_pid: int, tag: str, b: int) -> str:
    return "kvf-demo-%d-%s-b%d" % (demo_pid, tag, b)


HDR = 24  # a slot's header: who wrote it; the rest is a body from a cache
_PHASES = 41  # body unit length (prime): a room's body is its phase of the unit
_bodies: Dict[Tuple[int, int, int, int], bytes] = {}


def _body(rank: int, b: int, room_id: int, page_size: int) -> bytes:
    """The body of a pattern slot: rank and buffer in every unit, the room in
    its phase (room_id mod 41), and its exact id in the header. Cached per
    (rank, buffer, phase): 41 x 2 x layers slots of a rank."""
    ph = room_id % _PHASES
    body = _bodies.get((rank, b, ph, page_size))
    if body is None:
        unit = struct.pack("<HH", rank, b) + bytes((rank * 31 + b * 7 + x * 13) & 0xFF
                                                   for x in range(_PHASES - 4))
        body = (unit * (2 * page_size // _PHASES + 2))[ph:ph + page_size - HDR]
        _bodies[(rank, b, ph, page_size)] = body
    return body


def pattern(room_id: int, rank: int, j: int, b: int, page_size: int) -> Tuple[bytes, bytes]:
    """Page j of source rank `rank` in room `room_id`, buffer b: (header, body)."""
    return (struct.pack("<QIIII", room_id, rank, j, b, 0x6B76666E),
            _body(rank, b, room_id, page_size))


class Pool(PageAllocator):
    """One rank's KV cache: `nbuf` shm buffers as one kvfence pool, its page
    allocator (PageAllocator) and its canaries."""

    def __init__(self, rank: "Rank", tag: str, demo_pid: int, nbuf: int, page_size: int,
                 page_count: int) -> None:
        super().__init__(page_count)
        self.rank = rank
        self.tag = tag
        self.page_size = page_size  # per buffer
        self.page_count = page_count
        self.shms: List[shared_memory.SharedMemory] = []
        for b in range(nbuf):
            self.shms.append(shared_memory.SharedMemory(
                name=shm_name(demo_pid, tag, b), create=True, size=page_size * page_count))
        self.bufs = [s.buf for s in self.shms]
        self._salt = sum(tag.encode()) & 0xFF
        # a canary: header (pool, buffer, page) + one body per buffer
        self._canary_bodies = [((b"CANARY" + struct.pack("<BBH", self._salt, 0xC3, b) +
                                  bytes(range(0xE0, 0xF3))) * (page_size // 29 + 1))
                               [:page_size - HDR] for b in range(nbuf)]
        for pg in range(page_count):
            self.write_canary(pg)
        self.slots_checked = [0] * nbuf  # canary / content checks per buffer
        self.pool_id = 0

    def register(self, node: kvfence.NodeClient, rank: int) -> int:
        bufs = [kvfence.PoolBuffer(self.page_size, shm_name=s.name) for s in self.shms]
        self.pool_id = node.register_pool_buffers(bufs, self.page_count, rank=rank).pool_id
        return self.pool_id

    def canary(self, pg: int, b: int) -> Tuple[bytes, bytes]:
        return (struct.pack("<6sBBHIQxx", b"CANARY", self._salt, 0xC3, b, pg, 0x5AFE5AFE),
                self._canary_bodies[b])

    def same(self, pg: int, b: int, slot: Tuple[bytes, bytes]) -> bool:
        """Does slot pg of buffer b hold (header, body)? Two compares, no copy."""
        self.slots_checked[b] += 1
        buf, off = self.bufs[b], pg * self.page_size
        # bytes(view) == bytes is a memcmp; a memoryview compares item by item (30x slower)
        return (bytes(buf[off:off + HDR]) == slot[0] and
                bytes(buf[off + HDR:off + self.page_size]) == slot[1])

    def write(self, pg: int, b: int, slot: Tuple[bytes, bytes]) -> None:
        buf, off = self.bufs[b], pg * self.page_size
        buf[off:off + HDR] = slot[0]
        buf[off + HDR:off + self.page_size] = slot[1]

    def write_canary(self, pg: int) -> None:
        for b in range(len(self.bufs)):
            self.write(pg, b, self.canary(pg, b))

    def check_canary(self, pages: Sequence[int], when: str) -> int:
        bad: Dict[int, List[int]] = {}
        for pg in pages:
            for b in range(len(self.bufs)):
                if not self.same(pg, b, self.canary(pg, b)):
                    bad.setdefault(b, []).append(pg)
        n = len({pg for v in bad.values() for pg in v})
        if n:
            self.rank.send(("corrupted", n, "%s pool %d: pages lost their canary (%s): %s" % (
                self.tag, self.pool_id, when,
                "; ".join("buffer %d pages %s" % (b, v[:8]) for b, v in sorted(bad.items())))))
        return n

    def double_free(self, pages: List[int]) -> None:
        self.rank.send(("problem", "%s: double free of pages %s" % (self.tag, pages[:8])))

    def close(self) -> None:
        self.bufs = []
        for s in self.shms:
            try:
                s.close()
            except (OSError, BufferError):
                pass
            try:
                s.unlink()
            except OSError:
                pass


class Rank:
    """One engine rank: its clients, pool, watcher and grant book."""

    def __init__(self, cfg: Dict[str, Any], inq: Any, outq: Any) -> None:
        self.cfg = cfg
        self.inq = inq
        self.outq = outq
        self.role = cfg["role"]  # "sink" / "source"
        self.k = cfg["rank"]
        self.node_id = cfg["node_id"]
        self.tag = ("d%d" if self.role == "sink" else "p%d") % self.k
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.grants: Dict[int, Tuple[int, List[int]]] = {}  # lease_id -> (room idx, pages)
        self.early: Dict[int, Tuple[Lease, float]] = {}
        self.released_ids: Set[int] = set()
        self.injected: Set[int] = set()  # pages written after release (tests)
        self.go: Dict[int, threading.Event] = {}  # room idx -> every source joined
        self.sink_rooms: Dict[int, Tuple[int, int, List[int]]] = {}  # idx -> (room_id, tp, pages)
        self.control = kvfence.ControlClient(cfg["control"])
        self.admin = kvfence.AdminClient(cfg["control"])
        self.node = kvfence.NodeClient(cfg["socket"])
        self.pool: Optional[Pool] = None
        self.watcher: Optional[kvfence.ReleaseWatcher] = None
        self.submitted = 0

    def send(self, msg: tuple) -> None:
        self.outq.put(msg)

    # ---- setup --------------------------------------------------------------------

    def setup(self) -> None:
        c = self.cfg
        self.admin.wait_ready(10.0)
        self.pool = Pool(self, self.tag, c["demo_pid"], 2 * c["layers"], c["page_size"],
                         c["page_count"])
        self.pool.register(self.node, self.k)
        self.watcher = self.control.release_watcher(self.on_released, node_id=self.node_id,
                                                    ranks=[self.k]).start(10.0)
        self.send(("ready", self.tag, os.getpid(), self.pool.pool_id, 2 * c["layers"]))

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        for cl in (self.control, self.admin, self.node):
            cl.close()
        if self.pool is not None:
            self.pool.close()

    # ---- releases: the only place pages go back ---------------------------------------

    def on_released(self, lease: Lease) -> None:
        t = time.monotonic()  # when this rank learns it: the latency's end
        with self.lock:
            g = self.grants.pop(lease.lease_id, None)
            if g is None:
                self.early[lease.lease_id] = (lease, t)
                return
            self.released_ids.add(lease.lease_id)
        self._free(g, lease, t)

    def _grant(self, idx: int, lease_id: int, pages: List[int]) -> None:
        """Records pages granted (or about to be granted by ExtendLease) to a lease."""
        lease: Optional[Lease] = None
        t = 0.0
        with self.lock:
            if lease_id in self.released_ids:
                free_now = True  # already released: these pages never joined it
            elif lease_id in self.early:
                self.send(("granted", idx, lease_id))
                lease, t = self.early.pop(lease_id)
                self.released_ids.add(lease_id)
                free_now = False
            else:
                g = self.grants.get(lease_id)
                if g is not None:  # ExtendLease: more pages of the same lease
                    g[1].extend(pages)
                else:
                    self.send(("granted", idx, lease_id))
                    self.grants[lease_id] = (idx, list(pages))
                return
        assert self.pool is not None
        if free_now:
            self.pool.free(pages)
        else:
            self._free((idx, list(pages)), lease, t)  # type: ignore[arg-type]

    def _free(self, g: Tuple[int, List[int]], lease: Lease, t: float) -> None:
        idx, pages = g
        pool = self.pool
        assert pool is not None
        if set(lease.pages()) - set(pages):
            self.send(("problem", "%s: room %s lease %d released with pages outside the %d "
                       "granted" % (self.tag, lease.room, lease.lease_id, len(pages))))
        mismatch = 0
        if self.role == "sink":
            with self.lock:
                room_id, tp, sink_pages = self.sink_rooms.pop(idx, (0, 0, []))
            nbuf = len(pool.bufs)
            for pos, pg in enumerate(sink_pages):
                k, i = pos % tp, pos // tp
                if any(not pool.same(pg, b, pattern(room_id, k, i, b, pool.page_size))
                       for b in range(nbuf)):
                    mismatch += 1
        pool.free(pages)
        self._inject(pages)
        self.send(("released", idx, lease.lease_id, t, mismatch, time.monotonic() - t))

    def _inject(self, pages: Sequence[int]) -> None:
        """--inject-late-writes (tests): a byte written into a released page,
        as a transfer landing after the release would; every check after this
        must see it."""
        pool = self.pool
        assert pool is not None
        with self.lock:
            if len(self.injected) >= self.cfg.get("inject_late_writes", 0) or \
                    pages[0] in self.injected:
                return
            self.injected.add(pages[0])
            b = (len(self.injected) * 5 + self.k) % len(pool.bufs)
        pool.bufs[b][pages[0] * pool.page_size + pool.page_size // 2] ^= 0x5A

    # ---- commands -----------------------------------------------------------------------

    def open_sink(self, idx: int, room_id: int, n_pages: int, tp: int) -> None:
        """Decode rank: allocates the room's pages and joins first."""
        pool = self.pool
        assert pool is not None
        pages = pool.alloc(n_pages, self.stop)
        ranks = min(tp, n_pages)
        try:
            j = self.control.join_room(room_id, Participant(self.node_id, self.k, Role.SINK),
                                       pool.pool_id, pages=pages, expected_sources=ranks,
                                       expected_sinks=1, retry_s=5.0)
        except kvfence.KvfenceError:
            pool.free(pages)  # never granted: still ours
            raise
        with self.lock:
            self.sink_rooms[idx] = (room_id, tp, pages)
        self._grant(idx, j.lease_id, pages)
        self.send(("joined", idx, (j.room.room_id, j.room.generation), j.lease_id, pages))

    def run_source(self, idx: int, room_id: int, key_t: Tuple[int, int], ranks: int,
                   sink_node: str, sink_pool: int, chunks: List[List[Tuple[int, int]]]) -> None:
        """Prefill rank k: chunks of (slice index i, sink page), in order."""
        pool = self.pool
        assert pool is not None
        key = RoomKey(*key_t)
        ps = pool.page_size
        nbuf = len(pool.bufs)
        n = sum(len(c) for c in chunks)
        pages: List[int] = []
        granted: Set[int] = set()
        try:
            pages = pool.alloc(n, self.stop)
            src = {}
            it = iter(pages)
            for c in chunks:
                for i, _ in c:
                    pg = next(it)
                    src[i] = pg
                    for b in range(nbuf):
                        pool.write(pg, b, pattern(room_id, self.k, i, b, ps))
            first = [src[i] for i, _ in chunks[0]]
            me = Participant(self.node_id, self.k, Role.SOURCE)
            try:
                j = self.control.join_room(room_id, me, pool.pool_id, pages=first,
                                           expected_sources=ranks, expected_sinks=1, retry_s=5.0)
            except (kvfence.Aborted, kvfence.FailedPrecondition):
                return  # aborted before this rank joined
            granted.update(first)
            self._grant(idx, j.lease_id, first)
            if j.room != key:
                # the sink's generation was aborted before this rank joined (an
                # error elsewhere): this join opened the next one; abort it too,
                # the pages come back through its release
                self.control.abort_room(j.room, "demo: joined after its generation ended")
                return
            self.send(("src_joined", idx, self.k))
            # every source joined (or the room is aborting): the coordinator's "go"
            # (a GetRoom poll per source instead cost the control plane and the GIL)
            with self.lock:
                ev = self.go.setdefault(idx, threading.Event())
            ok = ev.wait(10.0)
            with self.lock:
                self.go.pop(idx, None)
            if not ok:
                raise RuntimeError("room %s: no go from the coordinator within 10 s" % key)
            lease_pages = len(first)
            for c, chunk in enumerate(chunks):
                s = [src[i] for i, _ in chunk]
                d = [dpg for _, dpg in chunk]
                if c > 0:
                    granted.update(s)  # recorded first: a release racing it frees them too
                    self._grant(idx, j.lease_id, s)
                    try:
                        lease_pages = self.control.extend_lease(key, j.lease_id,
                                                                pages=s).page_count()
                    except (kvfence.Aborted, kvfence.FailedPrecondition):
                        return
                try:
                    self.node.submit_chunk(
                        key, c * ranks + self.k + 1, source_rank=self.k, source_pool_id=pool.pool_id,
                        source_ranges=kvfence.ranges_from_pages(s), sink_node_id=sink_node,
                        sink_rank=0, sink_pool_id=sink_pool,
                        sink_ranges=kvfence.ranges_from_pages(d),
                        last_chunk=c == len(chunks) - 1, retry_unavailable_s=5.0,
                        source_lease_pages=lease_pages)
                except (kvfence.Aborted, kvfence.FailedPrecondition, kvfence.Unavailable) as e:
                    self.send(("refused", idx, self.k, str(e)))
                    return  # the room is aborting: nothing more is admitted
                self.send(("chunk", idx, self.k, c, len(s) * ps * nbuf))
            try:
                self.control.complete_room(key, me)
            except (kvfence.Aborted, kvfence.FailedPrecondition):
                pass
        finally:
            rest = [pg for pg in pages if pg not in granted]
            if rest:
                pool.free(rest)  # allocated, never granted: ours again
            self.send(("source_done", idx, self.k))

    def do(self, cmd: tuple) -> None:
        op, idx = cmd[0], cmd[1]
        try:
            if op == "open":
                self.open_sink(idx, *cmd[2:])
            elif op == "source":
                self.run_source(idx, *cmd[2:])
        except InterruptedError:
            self.send(("failed", idx, "stopping"))
        except Exception as e:  # noqa: BLE001 - reported, never silent
            self.send(("failed", idx, "%s %s: %r" % (self.tag, op, e)))

    def final(self) -> None:
        """At the end: wait for every page to be back, check every free page."""
        pool = self.pool
        assert pool is not None
        deadline = time.monotonic() + 10.0
        while pool.used and time.monotonic() < deadline:
            time.sleep(0.05)
        pool.check_canary(pool.free_pages(), "at the end")
        self.send(("final", self.tag, {"pid": os.getpid(), "pool_id": pool.pool_id,
                                       "buffers": len(pool.bufs), "leaked": pool.used,
                                       "slots_checked": list(pool.slots_checked),
                                       "callback_errors": len(self.watcher.callback_errors)
                                       if self.watcher else 0}))

    def serve(self) -> None:
        ex = ThreadPoolExecutor(max_workers=self.cfg["concurrency"] + 2)
        try:
            while True:
                try:
                    cmd = self.inq.get(timeout=0.5)
                except queue.Empty:
                    if os.getppid() != self.cfg["parent"]:
                        self.stop.set()  # the coordinator is gone
                        return
                    continue
                if cmd[0] == "stop":
                    self.stop.set()
                    return
                if cmd[0] == "go":
                    with self.lock:
                        self.go.setdefault(cmd[1], threading.Event()).set()
                    continue
                if cmd[0] == "final":
                    ex.shutdown(wait=True)
                    self.final()
                    continue
                ex.submit(self.do, cmd)
        finally:
            self.stop.set()
            ex.shutdown(wait=False)


def rank_main(cfg: Dict[str, Any], inq: Any, outq: Any) -> None:
    """The rank process' entry point (multiprocessing, spawn)."""
    # Ctrl-C goes to the whole process group: the coordinator decides; TERM
    # ends this rank (its shm objects unlinked on the way out).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    random.seed(cfg["seed"])
    r = Rank(cfg, inq, outq)
    rc = 0

    def orphan_check() -> None:  # the coordinator killed: unlink and go
        while os.getppid() == cfg["parent"]:
            time.sleep(0.5)
        if r.pool is not None:
            r.pool.close()
        os._exit(1)

    threading.Thread(target=orphan_check, name="orphan-check", daemon=True).start()
    try:
        r.setup()
        r.serve()
    except Exception as e:  # noqa: BLE001
        outq.put(("fatal", r.tag, repr(e)))
        rc = 1
    except SystemExit as e:
        rc = int(e.code or 0)
    finally:
        if r.pool is not None:
            r.pool.close()  # first: the shm objects go whatever blocks below
        r.stop.set()
        r.close()
        outq.put(("exited", r.tag))
        outq.close()
        outq.join_thread()
    # room threads may still sit in a call to a cluster that is gone: do not
    # wait for them at exit
    os._exit(rc)
