#!/usr/bin/python3
"""kvfence demo load generator: plays prefill and decode engines against a
running kvfence-control and two kvfence-node processes (scripts/run.sh starts
them), with random aborts, and verifies with canary patterns that no byte
lands in a page after kvfence released it.

Topology (TP fan-out): node 1 hosts the prefill engine, TP ranks 0..K-1 (one
SOURCE participant each, each rank its own shm pool = its own pages); node 2
hosts the decode engine, rank 0 (one SINK participant, one shm pool). The
sink's lease is split between the ranks: rank r writes its slice of it.

Per room: the sink allocates pages and joins (WRITE lease); each source
allocates pages for its slice, fills them with a room-specific pattern and
joins with its first chunk's pages (READ lease); the last join makes the room
ACTIVE; then the chunks (1..--chunks per source, chunked prefill) are
submitted to node 1, each later chunk's pages first added by ExtendLease; the
sources declare CompleteRoom. A share of the rooms is aborted at a random
moment: while OPENING, between chunks, right after a chunk was admitted
(mid-transfer) or from a timer racing the submits.

Pages go back to an allocator ONLY in the release callback of its lease (one
ReleaseWatcher per node). Canary rule: every free page holds its canary;
a released page is checked (sink pages of a COMPLETED room must hold exactly
the source bytes) and then overwritten with its canary; on every allocation
and at the end (every room terminal, every lease released) each free page
must still hold its canary. A difference is a byte written after release: a
corrupted page.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import sys
import threading
import time
import urllib.request
from multiprocessing import shared_memory
from typing import Dict, List, Optional, Sequence

import kvfence
from kvfence import Lease, Participant, RoomKey, RoomState, Role

ABORT_METRIC = "kvfence_abort_to_released_seconds"


def scrape_abort_histogram(address: str) -> Optional[Dict[float, float]]:
    """The control plane's abort -> released histogram from its /metrics
    (cumulative count per upper bound, +Inf included), or None when it cannot
    be read."""
    try:
        with urllib.request.urlopen("http://%s/metrics" % address, timeout=5) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    buckets: Dict[float, float] = {}
    prefix = ABORT_METRIC + "_bucket{le=\""
    for line in text.splitlines():
        if line.startswith(prefix):
            le, _, value = line[len(prefix):].partition("\"}")
            buckets[float("inf") if le == "+Inf" else float(le)] = float(value.split()[0])
    return buckets or None


def histogram_quantile(q: float, before: Dict[float, float],
                       after: Dict[float, float]) -> Optional[float]:
    """Quantile q of the observations made between two scrapes, interpolated
    linearly inside its bucket as Prometheus' histogram_quantile does."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if b == float("inf"):
                return lower
            return lower + (b - lower) * ((rank - below) / (c - below) if c > below else 1.0)
        lower, below = b, c
    return lower


RELEASE_WAIT_S = 10.0  # a room not released by then is aborted by the demo (watchdog)
DRAIN_WAIT_S = 90.0  # after an abort: the control plane's drain deadline is 60 s
ABORT_POINTS = ("opening", "between_chunks", "mid_transfer", "timer")


def log(msg: str) -> None:
    print(msg, flush=True)


class Pool:
    """One engine rank's KV buffer: a POSIX shm object registered with its
    node, a page allocator and the canary bookkeeping."""

    def __init__(self, stats: "Stats", tag: str, node: kvfence.NodeClient, rank: int,
                 page_size: int, page_count: int) -> None:
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
        self._cv = threading.Condition()
        self._free: List[int] = list(range(page_count))
        self._used: set = set()

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
        """Only from a release callback: re-arm the canary, then free."""
        for pg in pages:
            self.write(pg, self.canary(pg))
        with self._cv:
            bad = [pg for pg in pages if pg not in self._used]
            if bad:
                self.stats.corrupted(0, "%s: double free of pages %s" % (self.tag, bad[:8]))
            self._used.difference_update(pages)
            self._free.extend(pg for pg in pages if pg not in self._free)
            self._cv.notify_all()

    @property
    def used(self) -> int:
        with self._cv:
            return len(self._used)

    def close(self) -> None:
        self.buf = None
        try:
            self.shm.close()
            self.shm.unlink()
        except (OSError, BufferError):
            pass


def pattern(room_id: int, rank: int, j: int, page_size: int) -> bytes:
    """The bytes of page j of source rank `rank` in room `room_id`."""
    unit = struct.pack("<QIIQ", room_id, rank, j, (room_id * 2654435761 + j * 97 + rank) &
                       0xFFFFFFFFFFFFFFFF) + b"kvfence-demo-pg!"
    return (unit * (page_size // len(unit) + 1))[:page_size]


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.completed = 0
        self.aborted = 0
        self.aborted_by_demo = 0  # planned aborts that took effect
        self.aborted_other = 0  # the cluster aborted (e.g. TRANSFER_FAILED) or an error
        self.abort_points: Dict[str, int] = {}
        self.failed = 0  # no terminal state / leases not released
        self.in_flight = 0
        self.bytes_moved = 0
        self.late_refused_node = 0  # SubmitChunk refused by the node after the abort
        self.latencies: List[float] = []
        self.corrupted_pages = 0
        self.stuck = 0  # rooms the watchdog had to abort: not released after RELEASE_WAIT_S
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


class Room:
    def __init__(self, room_id: int) -> None:
        self.room_id = room_id
        self.key: Optional[RoomKey] = None
        self.leases: Dict[int, str] = {}  # lease_id -> "sink" / "src<r>"
        self.released: Dict[int, float] = {}
        self.event = threading.Event()
        self.sink_pages: List[int] = []
        self.expected: List[bytes] = []  # per sink page, the source bytes it must receive
        self.sink_mismatch = 0
        self.t_abort: Optional[float] = None
        self.abort_lock = threading.Lock()


class Demo:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.stats = Stats()
        self.stop = threading.Event()
        self.rng_lock = threading.Lock()
        self.rng = random.Random(a.seed)
        self.lock = threading.Lock()
        self.grants: Dict[int, tuple] = {}  # lease_id -> (room, pool, pages, role)
        self.early: Dict[int, Lease] = {}  # released before the grant was recorded
        self.released_ids: set = set()
        self.control = kvfence.ControlClient(a.control)
        self.admin = kvfence.AdminClient(a.control)
        self.n1 = kvfence.NodeClient(a.node1_socket)
        self.n2 = kvfence.NodeClient(a.node2_socket)
        self.pools_src: List[Pool] = []
        self.pool_sink: Optional[Pool] = None
        self.watchers: List[kvfence.ReleaseWatcher] = []
        self.next_room = 0
        self.room_base = (int(time.time() * 1000) % (1 << 40)) << 20  # fresh ids on a reused cluster
        self.abort_hist0: Optional[Dict[float, float]] = None

    # ---- setup --------------------------------------------------------------------

    def setup(self) -> None:
        a = self.a
        self.admin.wait_ready(10.0)
        per_rank = -(-a.pages_max // a.tp)
        src_pages = max(64, 2 * a.concurrency * per_rank)
        sink_pages = max(64, 2 * a.concurrency * a.pages_max)
        for r in range(a.tp):
            self.pools_src.append(Pool(self.stats, "p%d" % r, self.n1, r, a.page_size, src_pages))
        self.pool_sink = Pool(self.stats, "d0", self.n2, 0, a.page_size, sink_pages)
        for nid in (a.node1_id, a.node2_id):
            self.watchers.append(self.control.release_watcher(self.on_released, node_id=nid)
                                 .start(10.0))
        s = self.admin.stats()
        self.late0 = int(s.get("reports_stale", 0)) + int(s.get("reports_unknown", 0))
        self.abort_hist0 = scrape_abort_histogram(a.metrics) if a.metrics else None
        self.tokenless0 = int(s.get("reports_tokenless", 0))

    def close(self) -> None:
        for w in self.watchers:
            w.stop()
        for c in (self.control, self.admin, self.n1, self.n2):
            c.close()
        for p in self.pools_src + ([self.pool_sink] if self.pool_sink else []):
            p.close()

    # ---- releases: the only place pages go back ---------------------------------------

    def on_released(self, lease: Lease) -> None:
        with self.lock:
            g = self.grants.pop(lease.lease_id, None)
            if g is None:
                self.early[lease.lease_id] = lease
                return
            self.released_ids.add(lease.lease_id)
        self._free(g, lease)

    def _grant(self, room: Room, lease_id: int, pool: Pool, pages: List[int], role: str) -> None:
        """Records pages granted (or about to be granted by ExtendLease) to a lease."""
        with self.lock:
            room.leases[lease_id] = role
            if lease_id in self.released_ids:
                lease = None  # already released: these pages never joined it
            elif lease_id in self.early:
                lease = self.early.pop(lease_id)
                self.released_ids.add(lease_id)
            else:
                g = self.grants.get(lease_id)
                if g is not None:  # ExtendLease: more pages of the same lease
                    g[2].extend(pages)
                else:
                    self.grants[lease_id] = (room, pool, list(pages), role)
                return
        if lease is None:
            pool.free(pages)
        else:
            self._free((room, pool, list(pages), role), lease)

    def _free(self, g: tuple, lease: Lease) -> None:
        room, pool, pages, role = g
        if set(lease.pages()) - set(pages):
            self.stats.problem("room %s lease %d released with pages %d != granted %d" %
                               (room.key, lease.lease_id, len(lease.pages()), len(pages)))
        if role == "sink":
            pos = {pg: i for i, pg in enumerate(room.sink_pages)}
            room.sink_mismatch = sum(1 for pg in pages
                                     if pool.read(pg) != room.expected[pos[pg]])
        pool.free(pages)
        with self.lock:
            room.released[lease.lease_id] = time.monotonic()
            if set(room.released) >= set(room.leases):
                room.event.set()

    # ---- one room -----------------------------------------------------------------------

    def run_room(self, idx: int) -> None:
        a = self.a
        with self.rng_lock:
            r = random.Random(self.rng.getrandbits(64))
        room = Room(self.room_base + idx)
        abort_at = r.choice(ABORT_POINTS) if r.random() < a.abort_share else None
        n_pages = r.randint(a.pages_min, a.pages_max)
        tp = a.tp
        ps = a.page_size
        slices = [list(range(n_pages))[k::tp] for k in range(tp)]  # sink page positions per rank
        slices = [s for s in slices if s]
        ranks = len(slices)
        chunks: List[List[List[int]]] = []  # per rank: chunks of sink positions
        for s in slices:
            k = min(len(s), r.randint(1, a.chunks))
            cuts = sorted(r.sample(range(1, len(s)), k - 1)) if k > 1 else []
            bounds = [0] + cuts + [len(s)]
            chunks.append([s[bounds[i]:bounds[i + 1]] for i in range(k)])
        if abort_at == "between_chunks" and max(len(c) for c in chunks) < 2:
            abort_at = "mid_transfer"
        sink_pool = self.pool_sink
        # ---- sink (decode) joins first with pages from its allocator ----
        room.sink_pages = sink_pool.alloc(n_pages, self.stop)
        room.expected = [b""] * n_pages
        src_pages: List[List[int]] = []
        sink_part = Participant(a.node2_id, 0, Role.SINK)
        seq = 0
        timer: Optional[threading.Timer] = None
        room.granted_src = [set() for _ in range(ranks)]
        joined = [False] * ranks
        try:
            try:
                j = self.control.join_room(room.room_id, sink_part, sink_pool.pool_id,
                                           kvfence.ranges_from_pages(room.sink_pages),
                                           expected_sources=ranks, expected_sinks=1, retry_s=5.0)
            except kvfence.KvfenceError:
                sink_pool.free(room.sink_pages)  # never granted: still ours
                raise
            room.key = j.room
            self._grant(room, j.lease_id, sink_pool, room.sink_pages, "sink")
            # ---- sources (prefill TP ranks) fill their pages and join ----
            for k in range(ranks):
                pool = self.pools_src[k]
                pages = pool.alloc(len(slices[k]), self.stop)
                src_pages.append(pages)
                for i, pos in enumerate(slices[k]):
                    data = pattern(room.room_id, k, i, ps)
                    pool.write(pages[i], data)
                    room.expected[pos] = data
            lease_of: Dict[int, int] = {}
            opening_cut = r.randint(0, ranks - 1)
            state = j.state
            for k in range(ranks):
                if abort_at == "opening" and k == opening_cut:
                    self.abort(room, "opening")
                    break
                first = [src_pages[k][slices[k].index(p)] for p in chunks[k][0]]
                jk = self.control.join_room(room.room_id, Participant(a.node1_id, k, Role.SOURCE),
                                            self.pools_src[k].pool_id,
                                            kvfence.ranges_from_pages(first),
                                            expected_sources=ranks, expected_sinks=1, retry_s=5.0)
                if jk.room != room.key:
                    raise RuntimeError("source joined %s, sink %s" % (jk.room, room.key))
                lease_of[k] = jk.lease_id
                joined[k] = True
                room.granted_src[k].update(first)
                self._grant(room, jk.lease_id, self.pools_src[k], first, "src%d" % k)
                state = jk.state
            if room.t_abort is None:
                if state != RoomState.ACTIVE:
                    self.admin.wait_room_state(room.key, RoomState.ACTIVE, 10.0)
                if abort_at == "timer":
                    timer = threading.Timer(r.uniform(0.0, 0.03), self.abort, (room, "timer"))
                    timer.start()
                total_chunks = sum(len(c) for c in chunks)
                cut = r.randint(0, total_chunks - 1)  # which submit the abort follows
                order = [(c, k) for c in range(max(len(x) for x in chunks)) for k in range(ranks)
                         if c < len(chunks[k])]
                if abort_at == "between_chunks":
                    firsts = [i for i, (c, _) in enumerate(order) if c > 0]
                    cut = r.choice(firsts) - 1  # after a submit, before a later chunk
                for n, (c, k) in enumerate(order):
                    if room.t_abort is not None:
                        break
                    spos = chunks[k][c]
                    src = [src_pages[k][slices[k].index(p)] for p in spos]
                    dst = [room.sink_pages[p] for p in spos]
                    last = c == len(chunks[k]) - 1
                    seq += 1
                    if not self.submit(room, k, lease_of[k], c, seq, src, dst, last):
                        break
                    with self.stats.lock:
                        self.stats.bytes_moved += len(src) * ps
                    if last and room.t_abort is None:
                        try:
                            self.control.complete_room(room.key,
                                                       Participant(a.node1_id, k, Role.SOURCE))
                        except (kvfence.Aborted, kvfence.FailedPrecondition):
                            pass
                    if abort_at in ("mid_transfer", "between_chunks") and n == cut:
                        self.abort(room, abort_at)
        except InterruptedError:
            if room.key is not None:
                self.abort(room, "stopping")
        except kvfence.KvfenceError as e:
            self.stats.problem("room %s: %s" % (room.key or room.room_id, e))
            if room.key is not None:
                self.abort(room, "error")
        finally:
            if timer is not None:
                timer.cancel()
            # source pages allocated but never granted (no join, no ExtendLease) are ours again
            for k, pages in enumerate(src_pages):
                rest = [pg for pg in pages if pg not in room.granted_src[k]]
                if rest:
                    self.pools_src[k].free(rest)
        self.finish(room)

    def submit(self, room: Room, k: int, lease_id: int, c: int, seq: int, src: List[int],
               dst: List[int], last: bool) -> bool:
        a = self.a
        src_r = kvfence.ranges_from_pages(src)
        deadline = time.monotonic() + 5.0
        try:
            if c > 0:
                # recorded first: a release racing the ExtendLease frees them too
                room.granted_src[k].update(src)
                self._grant(room, lease_id, self.pools_src[k], src, "src%d" % k)
                self.control.extend_lease(room.key, lease_id, src_r)
            while True:
                try:
                    self.n1.submit_chunk(
                        room.key, seq, source_rank=k, source_pool_id=self.pools_src[k].pool_id,
                        source_ranges=src_r, sink_node_id=a.node2_id, sink_rank=0,
                        sink_pool_id=self.pool_sink.pool_id,
                        sink_ranges=kvfence.ranges_from_pages(dst), last_chunk=last,
                        retry_unavailable_s=max(0.0, deadline - time.monotonic()))
                    return True
                except kvfence.FailedPrecondition as e:
                    # after ExtendLease, until the node has the room's update
                    if ("outside" not in e.details or time.monotonic() >= deadline or
                            room.t_abort is not None):
                        raise
                    time.sleep(0.005)
        except (kvfence.Aborted, kvfence.FailedPrecondition, kvfence.Unavailable) as e:
            if room.t_abort is not None or isinstance(e, kvfence.Aborted):
                with self.stats.lock:
                    self.stats.late_refused_node += 1
                return False  # the room is aborting: nothing more is admitted
            raise

    def abort(self, room: Room, why: str, force: bool = False) -> None:
        with room.abort_lock:
            if room.key is None or (room.t_abort is not None and not force):
                return
            if room.t_abort is None:
                room.t_abort = time.monotonic()
                room.why = why
        try:
            self.control.abort_room(room.key, "demo: " + why)
        except kvfence.FailedPrecondition:
            pass  # already COMPLETED: not an abort
        except kvfence.KvfenceError as e:
            self.stats.problem("room %s: abort: %s" % (room.key, e))

    def finish(self, room: Room) -> None:
        """Waits until every granted lease of the room is released; the room's
        terminal state decides what is checked."""
        if not room.leases:
            with self.stats.lock:
                self.stats.done += 1
                self.stats.aborted += 1
                self.stats.aborted_other += 1
            return
        if not room.event.wait(RELEASE_WAIT_S):
            detail = ""
            try:
                ri = self.admin.room(room.key)
                detail = " (state %s; %s)" % (getattr(ri.state, "name", ri.state), ", ".join(
                    "%s/%d/%s completed=%s lease=%s" % (
                        p.participant.node_id, p.participant.rank,
                        getattr(p.participant.role, "name", p.participant.role), p.completed,
                        getattr(p.lease.state, "name", p.lease.state) if p.lease else None)
                    for p in ri.participants))
            except kvfence.KvfenceError:
                pass
            with self.stats.lock:
                self.stats.stuck += 1
            self.stats.problem("room %s not released after %.0f s%s: aborting it" %
                               (room.key, RELEASE_WAIT_S, detail))
            self.abort(room, "watchdog", force=True)
            room.event.wait(DRAIN_WAIT_S)
        state = None
        try:
            state = self.admin.room(room.key).state
        except kvfence.KvfenceError as e:
            self.stats.problem("room %s: GetRoom: %s" % (room.key, e))
        with self.stats.lock:
            s = self.stats
            s.done += 1
            if not room.event.is_set() or state not in (RoomState.COMPLETED, RoomState.ABORTED):
                s.failed += 1
                s.problems.append("room %s: state %s, leases released %d/%d" %
                                  (room.key, getattr(state, "name", state), len(room.released),
                                   len(room.leases)))
                return
            if state == RoomState.COMPLETED:
                s.completed += 1
            else:
                s.aborted += 1
                why = getattr(room, "why", None)
                if why and why not in ("error", "watchdog", "stopping"):
                    s.aborted_by_demo += 1
                    s.abort_points[why] = s.abort_points.get(why, 0) + 1
                else:
                    s.aborted_other += 1
                if room.t_abort is not None:
                    s.latencies.append(max(room.released.values()) - room.t_abort)
        if state == RoomState.COMPLETED and room.sink_mismatch:
            self.stats.corrupted(room.sink_mismatch, "room %s COMPLETED but %d sink pages differ "
                                 "from the source bytes" % (room.key, room.sink_mismatch))

    # ---- driver -------------------------------------------------------------------------

    def worker(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                idx = self.next_room
                if idx >= self.a.rooms:
                    return
                self.next_room += 1
            with self.stats.lock:
                self.stats.in_flight += 1
            try:
                self.run_room(idx)
            except Exception as e:  # noqa: BLE001 - counted, never silent
                with self.stats.lock:
                    self.stats.done += 1
                    self.stats.failed += 1
                self.stats.problem("room index %d: %r" % (idx, e))
            finally:
                with self.stats.lock:
                    self.stats.in_flight -= 1

    def progress(self, t0: float) -> str:
        s = self.stats
        el = time.monotonic() - t0
        return ("[%6.1fs] rooms %d/%d  completed %d  aborted %d  in flight %d  %.1f MB/s" %
                (el, s.done, self.a.rooms, s.completed, s.aborted, s.in_flight,
                 s.bytes_moved / 1e6 / max(el, 1e-9)))

    def run(self) -> int:
        a = self.a
        self.setup()
        log("demo: %d rooms, abort share %.2f, TP %d (prefill %s) -> decode %s, %d..%d pages of "
            "%d B, <= %d chunks/source, concurrency %d, seed %s" %
            (a.rooms, a.abort_share, a.tp, a.node1_id, a.node2_id, a.pages_min, a.pages_max,
             a.page_size, a.chunks, a.concurrency, a.seed))
        t0 = time.monotonic()
        threads = [threading.Thread(target=self.worker, daemon=True, name="room-%d" % i)
                   for i in range(a.concurrency)]
        for t in threads:
            t.start()
        interrupted = False
        try:
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=max(0.0, 1.0 / len(threads)))
                if not a.json:
                    log(self.progress(t0))
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: aborting the rooms in flight")
            self.stop.set()
            for t in threads:
                t.join(timeout=DRAIN_WAIT_S)
        elapsed = time.monotonic() - t0
        # every lease released: wait for the watchers to have freed every page
        deadline = time.monotonic() + 10.0
        pools = self.pools_src + [self.pool_sink]
        while any(p.used for p in pools) and time.monotonic() < deadline:
            time.sleep(0.05)
        leaked = sum(p.used for p in pools)
        if leaked:
            self.stats.problem("%d pages still not released at the end" % leaked)
        for p in pools:
            with p._cv:
                free = list(p._free)
            p.check_canary(free, "at the end")
        st = self.admin.stats()
        late = int(st.get("reports_stale", 0)) + int(st.get("reports_unknown", 0)) - self.late0
        tokenless = int(st.get("reports_tokenless", 0)) - self.tokenless0
        server = None
        if self.a.metrics:
            after = scrape_abort_histogram(self.a.metrics)
            if after is None:
                self.stats.problem("cannot read %s from %s/metrics" % (ABORT_METRIC, self.a.metrics))
            else:
                server = {}
                for name, q in (("p50", 0.5), ("p99", 0.99)):
                    v = histogram_quantile(q, self.abort_hist0 or {}, after)
                    server[name] = None if v is None else round(v * 1000.0, 3)
                server["count"] = int(after[float("inf")] - (self.abort_hist0 or {}).get(
                    float("inf"), 0.0))
        ok = self.summary(elapsed, late, tokenless, leaked, interrupted, server)
        return 0 if ok else (130 if interrupted else 1)

    def summary(self, elapsed: float, late: int, tokenless: int, leaked: int,
                interrupted: bool, server: Optional[Dict[str, Optional[float]]] = None) -> bool:
        s = self.stats
        lat = sorted(s.latencies)

        def pct(p: float) -> float:
            if not lat:
                return 0.0
            return lat[min(len(lat) - 1, int(round(p / 100.0 * (len(lat) - 1))))] * 1000.0

        not_terminal = s.failed + (self.a.rooms - s.done)
        # A room that needed the watchdog is a failure too: nothing in a healthy
        # run takes seconds, and a stalled room is the bug class the demo exists
        # to show (the watchdog's abort only lets the run finish).
        ok = (s.corrupted_pages == 0 and not_terminal == 0 and leaked == 0 and s.stuck == 0
              and not interrupted)
        res = {
            "rooms": self.a.rooms, "completed": s.completed, "aborted": s.aborted,
            "aborted_planned": s.aborted_by_demo, "aborted_other": s.aborted_other,
            "abort_points": s.abort_points, "not_terminal": not_terminal,
            "bytes_moved": s.bytes_moved, "elapsed_s": round(elapsed, 3),
            "throughput_mb_s": round(s.bytes_moved / 1e6 / max(elapsed, 1e-9), 2),
            "abort_to_released_ms": {"count": len(lat), "p50": round(pct(50), 3),
                                     "p99": round(pct(99), 3),
                                     "max": round(lat[-1] * 1000.0 if lat else 0.0, 3)},
            "control_plane_abort_to_released_ms": server,
            "late_messages_rejected": {"control_plane": late, "control_plane_tokenless": tokenless,
                                       "node_submits_refused": s.late_refused_node},
            "pages_not_released": leaked, "corrupted_pages": s.corrupted_pages,
            "stuck_rooms_aborted_by_watchdog": s.stuck,
            "problems": s.problems[:20], "ok": ok,
        }
        if self.a.json:
            print(json.dumps(res, indent=2), flush=True)
        log("")
        log("==== kvfence demo summary ====")
        log("rooms: %d  completed: %d  aborted: %d (planned %d %s, other %d)  not terminal: %d" %
            (self.a.rooms, s.completed, s.aborted, s.aborted_by_demo,
             json.dumps(s.abort_points, sort_keys=True), s.aborted_other, not_terminal))
        log("bytes moved: %.1f MB in %.2f s  throughput: %.1f MB/s" %
            (s.bytes_moved / 1e6, elapsed, res["throughput_mb_s"]))
        log("abort -> released latency: p50 %.1f ms  p99 %.1f ms  max %.1f ms  (%d rooms)" %
            (pct(50), pct(99), res["abort_to_released_ms"]["max"], len(lat)))
        if server and server.get("p50") is not None:
            log("  the control plane's own view (ABORTING -> ABORTED, from /metrics, bucket-"
                "interpolated): p50 %.1f ms  p99 %.1f ms  (%d rooms)" %
                (server["p50"], server["p99"], server["count"]))
        log("late messages rejected: %d (control plane: stale/unknown reports %d, tokenless %d; "
            "node: submits refused after abort %d)" %
            (late + tokenless + s.late_refused_node, late, tokenless, s.late_refused_node))
        log("pages not released: %d" % leaked)
        log("corrupted pages: %d" % s.corrupted_pages)
        log("stuck rooms (aborted by the demo's %.0f s watchdog): %d" % (RELEASE_WAIT_S, s.stuck))
        if s.problems:
            log("problems (%d):" % len(s.problems))
            for p in s.problems[:20]:
                log("  " + p)
        log("result: %s" % ("OK" if ok else "FAILED"))
        return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--control", default="127.0.0.1:7070", help="kvfence-control host:port")
    ap.add_argument("--node1-socket", required=True, help="prefill node's NodeLocal socket")
    ap.add_argument("--node2-socket", required=True, help="decode node's NodeLocal socket")
    ap.add_argument("--node1-id", default="n1")
    ap.add_argument("--node2-id", default="n2")
    ap.add_argument("--rooms", type=int, default=2000)
    ap.add_argument("--abort-share", type=float, default=0.2)
    ap.add_argument("--tp", type=int, default=2, help="prefill TP ranks (sources) per room")
    ap.add_argument("--pages-min", type=int, default=8)
    ap.add_argument("--pages-max", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16384)
    ap.add_argument("--chunks", type=int, default=3, help="at most this many chunks per source")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--metrics", default=None, metavar="HOST:PORT",
                    help="kvfence-control's metrics address: also report its own abort -> "
                         "released histogram")
    ap.add_argument("--json", action="store_true", help="the summary as JSON too; no progress")
    a = ap.parse_args(argv)
    if a.seed is None:
        a.seed = random.randrange(1 << 31)
    if not (1 <= a.pages_min <= a.pages_max) or a.tp < 1 or a.chunks < 1 or a.concurrency < 1 \
            or a.rooms < 0 or not 0.0 <= a.abort_share <= 1.0 or a.page_size < 64:
        ap.error("bad option values")
    # started in the background by scripts/run.sh, SIGINT may be ignored: restore
    # Ctrl-C, and make SIGTERM stop the same way (pools unlinked on the way out)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    d = Demo(a)
    try:
        return d.run()
    except KeyboardInterrupt:
        return 130
    finally:
        d.close()


if __name__ == "__main__":
    sys.exit(main())
