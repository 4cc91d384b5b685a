#!/usr/bin/python3
"""kvfence demo load generator: plays prefill and decode engines against a
running kvfence-control and two kvfence-node processes (scripts/run.sh starts
them), with random aborts, and verifies with canary patterns that no byte
lands in a page after kvfence released it.

Processes. Every engine rank is its own process (demo_rank.py, started with
multiprocessing's spawn): node 1 hosts the prefill engine, TP ranks 0..K-1
(one SOURCE participant each), node 2 the decode engine, rank 0 (one SINK
participant). Each rank owns a pool of several buffers, `--layers` x K/V
POSIX shm objects registered as one pool (register_pool_buffers: page i is
slot i of every buffer, `--page-size` bytes in each), its own allocator,
canaries in every buffer and its own ReleaseWatcher: its pages go back
ONLY in that watcher's callback. This process is the coordinator: it picks
rooms, tells the ranks what to do over multiprocessing queues, aborts, and
collects what the ranks report (grants, releases with their CLOCK_MONOTONIC
time, chunks admitted, canary checks).

Per room: the sink rank allocates pages and joins (WRITE lease) and reports
its pages; the coordinator hands each source rank its slice of them (rank r
writes sink positions r, r+K, ...) and the chunk plan (1..--chunks per
source, chunked prefill); each source allocates its pages, fills them with a
room-specific pattern (every buffer), joins with its first chunk's pages
(READ lease), waits for the coordinator's "go" (every source joined: the
room is ACTIVE), submits its chunks to node 1 (each later
chunk's pages first added by ExtendLease) and declares CompleteRoom. A
share of the rooms is aborted by the coordinator at a random moment: while
OPENING (after the sink joined, before any source), after a given chunk
was admitted (mid_transfer, between_chunks: while the sources go on) or
from a timer racing the submits.

Canary rule (demo_rank.py): every free page holds its canary in every
buffer; a released sink page of a COMPLETED room must hold exactly the
source bytes in every buffer; a released page is re-armed; on every
allocation and at the end (every room terminal, every lease released) each
free page must still hold its canaries. A difference is a byte written
after release: a corrupted page.

DESIGN

Threads (coordinator). `--concurrency` room threads each drive one room at
a time (plan, commands, wait for the releases, tally); the dispatcher
thread alone reads the ranks' queue and updates the rooms (under `lock`,
waking the room's thread through `cv`); aborts it decides (a chunk report)
run on a small executor, never on the dispatcher. Stats are under `lock`.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

import kvfence
from kvfence import RoomKey, RoomState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_rank  # noqa: E402
from demo_pool import Pool, Stats  # noqa: E402,F401  (tests/chaos imports them from here)

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
# a multi-buffer pool sends through the node's staging ring (run.sh: --staging host),
# whose buffers are 256 KiB: a page must fit in one (docs/node.md, "Limits")
STAGING_BUFFER = 256 * 1024


def log(msg: str) -> None:
    print(msg, flush=True)


class RunStats:
    """The coordinator's counters (under Demo.lock)."""

    def __init__(self) -> None:
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


class Room:
    def __init__(self, idx: int, room_id: int) -> None:
        self.idx = idx
        self.room_id = room_id
        self.key: Optional[RoomKey] = None
        self.joined = False
        self.join_failed: Optional[str] = None
        self.sink_pages: List[int] = []
        self.leases: set = set()
        self.released: Dict[int, float] = {}
        self.sources = 0  # dispatched
        self.sources_done = 0
        self.src_joined = 0
        self.went = False  # "go" sent to the sources
        self.timer_s: Optional[float] = None  # abort this long after every source joined
        self.timer: Optional[threading.Timer] = None
        self.dispatched = False  # every command sent
        self.sink_mismatch = 0
        self.cb_s = 0.0  # the longest release callback of its leases
        self.chunks_seen = 0
        self.abort_after: Optional[int] = None  # abort once this many chunks were admitted
        self.abort_at: Optional[str] = None
        self.t_abort: Optional[float] = None
        self.why: Optional[str] = None

    def settled(self) -> bool:
        return (self.dispatched and self.sources_done >= self.sources and bool(self.leases)
                and set(self.released) >= self.leases)


class Demo:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.stats = RunStats()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.rng = random.Random(a.seed)
        self.rooms: Dict[int, Room] = {}
        self.next_room = 0
        self.room_base = (int(time.time() * 1000) % (1 << 40)) << 20  # fresh ids on a reused cluster
        self.control = kvfence.ControlClient(a.control)
        self.admin = kvfence.AdminClient(a.control)
        self.ctx = multiprocessing.get_context("spawn")
        self.outq: Any = self.ctx.Queue()
        self.ranks: Dict[str, Dict[str, Any]] = {}  # tag -> inq, proc, ready info, final
        self.aborts = ThreadPoolExecutor(max_workers=4, thread_name_prefix="abort")
        self.fatal: List[str] = []
        self.abort_hist0: Optional[Dict[float, float]] = None
        self.dispatcher: Optional[threading.Thread] = None

    # ---- rank processes -------------------------------------------------------------

    def start_ranks(self) -> None:
        a = self.a
        per_rank = -(-a.pages_max // a.tp)
        specs = [("d0", "sink", 0, a.node2_id, a.node2_socket,
                  max(64, 2 * a.concurrency * a.pages_max))]
        specs += [("p%d" % k, "source", k, a.node1_id, a.node1_socket,
                   max(64, 2 * a.concurrency * per_rank)) for k in range(a.tp)]
        for tag, role, k, node_id, sock, pages in specs:
            cfg = {"role": role, "rank": k, "node_id": node_id, "socket": sock,
                   "control": a.control, "layers": a.layers, "page_size": a.page_size,
                   "page_count": pages, "concurrency": a.concurrency, "demo_pid": os.getpid(),
                   "parent": os.getpid(), "seed": self.rng.getrandbits(32),
                   "inject_late_writes": a.inject_late_writes}
            inq = self.ctx.Queue()
            p = self.ctx.Process(target=demo_rank.rank_main, args=(cfg, inq, self.outq),
                                 name="kvf-demo-" + tag, daemon=True)
            p.start()
            self.ranks[tag] = {"inq": inq, "proc": p, "cfg": cfg, "ready": None, "final": None}
        self.dispatcher = threading.Thread(target=self.dispatch, name="dispatcher", daemon=True)
        self.dispatcher.start()
        deadline = time.monotonic() + 60.0
        with self.cv:
            while not all(r["ready"] for r in self.ranks.values()):
                if self.fatal or time.monotonic() > deadline or \
                        any(not r["proc"].is_alive() for r in self.ranks.values()):
                    raise RuntimeError("rank processes did not start: %s" %
                                       ("; ".join(self.fatal) or "timeout"))
                self.cv.wait(0.2)

    def send(self, tag: str, cmd: tuple) -> None:
        self.ranks[tag]["inq"].put(cmd)

    def stop_ranks(self) -> None:
        for tag, r in self.ranks.items():
            try:
                r["inq"].put(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 3.0
        for tag, r in self.ranks.items():
            p = r["proc"]
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()  # its TERM handler unlinks its pool
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        # shm objects of a rank that could not unlink them (killed)
        for tag, r in self.ranks.items():
            for b in range(2 * self.a.layers):
                try:
                    os.unlink("/dev/shm/" + demo_rank.shm_name(os.getpid(), tag, b))
                except OSError:
                    pass

    def dispatch(self) -> None:
        """The only reader of the ranks' queue."""
        while True:
            try:
                m = self.outq.get(timeout=0.5)
            except queue.Empty:
                if self.stop.is_set() and not any(r["proc"].is_alive()
                                                  for r in self.ranks.values()):
                    return
                continue
            except (EOFError, OSError):
                return
            op = m[0]
            abort: Optional[Room] = None
            with self.cv:
                room = self.rooms.get(m[1]) if isinstance(m[1], int) else None
                s = self.stats
                if op == "ready":
                    self.ranks[m[1]]["ready"] = {"pid": m[2], "pool_id": m[3], "buffers": m[4]}
                elif op == "final":
                    self.ranks[m[1]]["final"] = m[2]
                elif op in ("fatal",):
                    self.fatal.append("%s: %s" % (m[1], m[2]))
                    s.problems.append("rank %s died: %s" % (m[1], m[2]))
                elif op == "problem":
                    s.problems.append(m[1])
                elif op == "corrupted":
                    s.corrupted_pages += m[1]
                    s.problems.append(m[2])
                    log("CORRUPTION: " + m[2])
                elif room is None:
                    pass
                elif op == "joined":
                    room.key = RoomKey(*m[2])
                    room.sink_pages = m[4]
                    room.joined = True
                elif op == "granted":
                    room.leases.add(m[2])
                elif op == "released":
                    room.released[m[2]] = m[3]
                    room.sink_mismatch += m[4]
                    room.cb_s = max(room.cb_s, m[5])
                elif op == "chunk":
                    s.bytes_moved += m[4]
                    room.chunks_seen += 1
                    if room.abort_after is not None and room.chunks_seen == room.abort_after:
                        abort = room
                elif op == "refused":
                    s.late_refused_node += 1
                elif op == "src_joined":
                    room.src_joined += 1
                    if room.src_joined == room.sources:
                        self.go(room)
                    if room.src_joined == room.sources and room.timer_s is not None:
                        room.timer = threading.Timer(room.timer_s, self.abort, (room, "timer"))
                        room.timer.start()
                elif op == "source_done":
                    room.sources_done += 1
                elif op == "failed":
                    if m[2] != "stopping":
                        s.problems.append("room %s: %s" % (room.key or room.room_id, m[2]))
                        log("problem: room %s: %s" % (room.key or room.room_id, m[2]))
                    if not room.joined:
                        room.join_failed = m[2]
                    elif room.t_abort is None:
                        abort = room
                        room.abort_at = "error" if m[2] != "stopping" else "stopping"
                self.cv.notify_all()
            if abort is not None:
                self.aborts.submit(self.abort, abort, abort.abort_at or "error")

    # ---- one room -------------------------------------------------------------------

    def go(self, room: Room) -> None:
        """Lets the sources submit (every one joined, or the room is aborting:
        their submits are refused then). Once per room; under cv."""
        if not room.went and room.sources:
            room.went = True
            for k in range(room.sources):
                self.send("p%d" % k, ("go", room.idx))

    def abort(self, room: Room, why: str, force: bool = False) -> None:
        with self.cv:
            if room.key is None or (room.t_abort is not None and not force):
                return
            if room.t_abort is None:
                room.t_abort = time.monotonic()
                room.why = why
            went = room.went
        try:
            self.control.abort_room(room.key, "demo: " + why)
        except kvfence.FailedPrecondition:
            pass  # already COMPLETED: not an abort
        except kvfence.KvfenceError as e:
            with self.cv:
                self.stats.problems.append("room %s: abort: %s" % (room.key, e))
        if not went:
            with self.cv:
                self.go(room)  # sources waiting for the others: their submits are refused

    def run_room(self, idx: int) -> None:
        a = self.a
        with self.cv:
            r = random.Random(self.rng.getrandbits(64))
            room = Room(idx, self.room_base + idx)
            self.rooms[idx] = room
        abort_at = r.choice(ABORT_POINTS) if r.random() < a.abort_share else None
        n_pages = r.randint(a.pages_min, a.pages_max)
        tp = a.tp
        slices = [s for s in (list(range(n_pages))[k::tp] for k in range(tp)) if s]
        ranks = len(slices)
        chunks: List[List[List[int]]] = []  # per rank: chunks of sink positions
        for s in slices:
            k = min(len(s), r.randint(1, a.chunks))
            cuts = sorted(r.sample(range(1, len(s)), k - 1)) if k > 1 else []
            bounds = [0] + cuts + [len(s)]
            chunks.append([s[bounds[i]:bounds[i + 1]] for i in range(k)])
        total = sum(len(c) for c in chunks)
        if abort_at == "between_chunks" and total == ranks:
            abort_at = "mid_transfer"
        self.send("d0", ("open", idx, room.room_id, n_pages, tp))
        with self.cv:
            room.abort_at = abort_at
            if not self.cv.wait_for(lambda: room.joined or room.join_failed or
                                    self.stop.is_set(), 15.0) and not self.stop.is_set():
                room.join_failed = "sink join: no answer within 15 s"
            if self.stop.is_set() and not room.joined:
                room.join_failed = "stopping"
            if room.join_failed:
                room.dispatched = True
                self.stats.done += 1
                self.stats.failed += 1
                self.stats.problems.append("room index %d: %s" % (idx, room.join_failed))
                return
        if abort_at == "opening" or self.stop.is_set():
            self.abort(room, "opening" if abort_at == "opening" else "stopping")
        else:
            with self.cv:
                room.sources = ranks
                if abort_at == "timer":  # started once every source joined (the dispatcher)
                    room.timer_s = r.uniform(0.0, 0.03)
                if abort_at == "mid_transfer":
                    room.abort_after = r.randint(1, total)
                elif abort_at == "between_chunks":
                    room.abort_after = r.randint(ranks, total - 1)  # after firsts, before the last
            key = (room.key.room_id, room.key.generation)  # type: ignore[union-attr]
            sink_pool = self.ranks["d0"]["ready"]["pool_id"]
            for k in range(ranks):
                plan = [[(pos // tp, room.sink_pages[pos]) for pos in c] for c in chunks[k]]
                self.send("p%d" % k, ("source", idx, room.room_id, key, ranks, a.node2_id,
                                      sink_pool, plan))
        with self.cv:
            room.dispatched = True
            ok = self.cv.wait_for(lambda: room.settled() or self.stop.is_set(), RELEASE_WAIT_S)
            timer = room.timer
        if timer is not None:
            timer.cancel()
        if self.stop.is_set() and not room.settled():
            with self.cv:  # interrupted: counted as not terminal, no watchdog
                self.stats.done += 1
                self.stats.failed += 1
            return
        if not ok:
            self.watchdog(room)
        self.finish(room)

    def watchdog(self, room: Room) -> None:
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
        with self.cv:
            detail += " (demo: leases released %d/%d, sources joined %d, done %d/%d)" % (
                len(set(room.released) & room.leases), len(room.leases), room.src_joined,
                room.sources_done, room.sources)
        msg = "room %s not released after %.0f s%s: aborting it" % (room.key, RELEASE_WAIT_S,
                                                                     detail)
        log("problem: " + msg)
        with self.cv:
            self.stats.stuck += 1
            self.stats.problems.append(msg)
        self.abort(room, "watchdog", force=True)
        with self.cv:
            self.cv.wait_for(room.settled, DRAIN_WAIT_S)

    def finish(self, room: Room) -> None:
        state = None
        try:
            state = self.admin.room(room.key).state
        except kvfence.KvfenceError as e:
            with self.cv:
                self.stats.problems.append("room %s: GetRoom: %s" % (room.key, e))
        with self.cv:
            s = self.stats
            s.done += 1
            if not room.settled() or state not in (RoomState.COMPLETED, RoomState.ABORTED):
                s.failed += 1
                s.problems.append("room %s: state %s, leases released %d/%d, sources done %d/%d" %
                                  (room.key, getattr(state, "name", state), len(room.released),
                                   len(room.leases), room.sources_done, room.sources))
                return
            if state == RoomState.COMPLETED:
                s.completed += 1
            else:
                s.aborted += 1
                why = room.why
                if why and why not in ("error", "watchdog", "stopping"):
                    s.aborted_by_demo += 1
                    s.abort_points[why] = s.abort_points.get(why, 0) + 1
                else:
                    s.aborted_other += 1
                if room.t_abort is not None:
                    s.latencies.append(max(room.released.values()) - room.t_abort)
            mismatch = room.sink_mismatch if state == RoomState.COMPLETED else 0
            del self.rooms[room.idx]
        if mismatch:
            msg = "room %s COMPLETED but %d sink pages differ from the source bytes" % (
                room.key, mismatch)
            log("CORRUPTION: " + msg)
            with self.cv:
                self.stats.corrupted_pages += mismatch
                self.stats.problems.append(msg)

    # ---- driver ---------------------------------------------------------------------

    def worker(self) -> None:
        while not self.stop.is_set():
            with self.cv:
                idx = self.next_room
                if idx >= self.a.rooms:
                    return
                self.next_room += 1
                self.stats.in_flight += 1
            try:
                self.run_room(idx)
            except Exception as e:  # noqa: BLE001 - counted, never silent
                with self.cv:
                    self.stats.done += 1
                    self.stats.failed += 1
                    self.stats.problems.append("room index %d: %r" % (idx, e))
                log("problem: room index %d: %r" % (idx, e))
            finally:
                with self.cv:
                    self.stats.in_flight -= 1

    def progress(self, t0: float) -> str:
        s = self.stats
        el = time.monotonic() - t0
        return ("[%6.1fs] rooms %d/%d  completed %d  aborted %d  in flight %d  %.1f MB/s" %
                (el, s.done, self.a.rooms, s.completed, s.aborted, s.in_flight,
                 s.bytes_moved / 1e6 / max(el, 1e-9)))

    def finals(self) -> Dict[str, Dict[str, Any]]:
        """Every rank waits for its pages to come back and checks every free page."""
        for tag in self.ranks:
            self.send(tag, ("final",))
        with self.cv:
            self.cv.wait_for(lambda: all(r["final"] for r in self.ranks.values()) or
                             any(not r["proc"].is_alive() for r in self.ranks.values()), 60.0)
            return {t: r["final"] for t, r in self.ranks.items() if r["final"]}

    def run(self) -> int:
        a = self.a
        self.admin.wait_ready(10.0)
        self.start_ranks()
        s = self.admin.stats()
        late0 = int(s.get("reports_stale", 0)) + int(s.get("reports_unknown", 0))
        tokenless0 = int(s.get("reports_tokenless", 0))
        self.abort_hist0 = scrape_abort_histogram(a.metrics) if a.metrics else None
        log("demo: %d rooms, abort share %.2f, TP %d (prefill %s) -> decode %s, %d..%d pages of "
            "%d layers x K/V x %d B, <= %d chunks/source, concurrency %d, seed %s" %
            (a.rooms, a.abort_share, a.tp, a.node1_id, a.node2_id, a.pages_min, a.pages_max,
             a.layers, a.page_size, a.chunks, a.concurrency, a.seed))
        log("rank processes: %s" % ", ".join(
            "%s pid %d (pool %d, %d buffers)" % (t, r["ready"]["pid"], r["ready"]["pool_id"],
                                                 r["ready"]["buffers"])
            for t, r in self.ranks.items()))
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
                if self.fatal:
                    raise RuntimeError("a rank process died: %s" % "; ".join(self.fatal))
        except KeyboardInterrupt:
            # Within run.sh's 10 s between TERM and KILL: abort what is in
            # flight (best effort: the cluster may be stopping too), then stop
            # the ranks (close()); a second Ctrl-C or TERM does not cut that short.
            interrupted = True
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            log("interrupted: aborting the rooms in flight")
            self.stop.set()
            with self.cv:
                live = [r for r in self.rooms.values() if r.key is not None]
                self.cv.notify_all()
            for room in live:
                try:
                    self.control.abort_room(room.key, "demo: stopping", timeout=0.5)
                except kvfence.KvfenceError:
                    pass
            for t in threads:
                t.join(timeout=0.2)
        elapsed = time.monotonic() - t0
        finals = self.finals() if not interrupted else {}
        leaked = sum(f["leaked"] for f in finals.values())
        if leaked:
            self.stats.problems.append("%d pages still not released at the end" % leaked)
        missing = sorted(set(self.ranks) - set(finals))
        if missing:
            self.stats.problems.append("ranks %s sent no final check" % missing)
        for t, f in finals.items():
            if f["callback_errors"]:
                self.stats.problems.append("rank %s: %d release callback errors" %
                                           (t, f["callback_errors"]))
        if interrupted:
            log("interrupted after %.1f s: %d rooms done, %d MB moved" %
                (elapsed, self.stats.done, self.stats.bytes_moved // 1000000))
            return 130
        st = self.admin.stats()
        late = int(st.get("reports_stale", 0)) + int(st.get("reports_unknown", 0)) - late0
        tokenless = int(st.get("reports_tokenless", 0)) - tokenless0
        server = None
        if a.metrics:
            after = scrape_abort_histogram(a.metrics)
            if after is None:
                self.stats.problems.append("cannot read %s from %s/metrics" %
                                           (ABORT_METRIC, a.metrics))
            else:
                server = {}
                for name, q in (("p50", 0.5), ("p99", 0.99)):
                    v = histogram_quantile(q, self.abort_hist0 or {}, after)
                    server[name] = None if v is None else round(v * 1000.0, 3)
                server["count"] = int(after[float("inf")] - (self.abort_hist0 or {}).get(
                    float("inf"), 0.0))
        ok = self.summary(elapsed, late, tokenless, leaked, interrupted, server, finals,
                          bool(missing))
        return 0 if ok else (130 if interrupted else 1)

    def close(self) -> None:
        self.stop.set()
        self.stop_ranks()
        self.aborts.shutdown(wait=False)
        for c in (self.control, self.admin):
            c.close()

    def summary(self, elapsed: float, late: int, tokenless: int, leaked: int,
                interrupted: bool, server: Optional[Dict[str, Optional[float]]],
                finals: Dict[str, Dict[str, Any]], missing: bool) -> bool:
        s = self.stats
        lat = sorted(s.latencies)

        def pct(p: float) -> float:
            if not lat:
                return 0.0
            return lat[min(len(lat) - 1, int(round(p / 100.0 * (len(lat) - 1))))] * 1000.0

        not_terminal = s.failed + (self.a.rooms - s.done)
        pids = {t: f["pid"] for t, f in finals.items()}
        separate = len(set(pids.values()) | {os.getpid()}) == len(pids) + 1
        nbuf = sum(f["buffers"] for f in finals.values())
        checked = sum(1 for f in finals.values() for c in f["slots_checked"] if c > 0)
        slots = sum(sum(f["slots_checked"]) for f in finals.values())
        # A room that needed the watchdog is a failure too: nothing in a healthy
        # run takes seconds, and a stalled room is the bug class the demo exists
        # to show (the watchdog's abort only lets the run finish). So is a
        # buffer no check ever read.
        ok = (s.corrupted_pages == 0 and not_terminal == 0 and leaked == 0 and s.stuck == 0
              and not interrupted and not missing and checked == nbuf and separate)
        ratio = None
        if server and server.get("p99") and lat:
            ratio = round(pct(99) / server["p99"], 2)  # type: ignore[operator]
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
            "engine_to_control_plane_p99_ratio": ratio,
            "rank_processes": {"coordinator": os.getpid(), "ranks": pids, "separate": separate},
            "buffers": {"total": nbuf, "checked": checked, "slot_checks": slots,
                        "layers": self.a.layers},
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
        log("rank processes: %d (%s; coordinator pid %d)%s" % (
            len(pids), ", ".join("%s pid %d" % kv for kv in sorted(pids.items())), os.getpid(),
            "" if separate else "  NOT SEPARATE"))
        log("buffers checked: %d/%d (%d layers x K/V per pool; %d page-buffer slot checks)" %
            (checked, nbuf, self.a.layers, slots))
        log("bytes moved: %.1f MB in %.2f s  throughput: %.1f MB/s" %
            (s.bytes_moved / 1e6, elapsed, res["throughput_mb_s"]))
        log("abort -> released latency: p50 %.1f ms  p99 %.1f ms  max %.1f ms  (%d rooms; "
            "as the engine processes see it)" %
            (pct(50), pct(99), res["abort_to_released_ms"]["max"], len(lat)))
        if server and server.get("p50") is not None:
            log("  the control plane's own view (ABORTING -> ABORTED, from /metrics, bucket-"
                "interpolated): p50 %.1f ms  p99 %.1f ms  (%d rooms)%s" %
                (server["p50"], server["p99"], server["count"],
                 "  engine/control p99: %.2fx" % ratio if ratio is not None else ""))
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
    ap.add_argument("--layers", type=int, default=8,
                    help="model layers: each rank's pool is this many x K/V shm buffers")
    ap.add_argument("--pages-min", type=int, default=8)
    ap.add_argument("--pages-max", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16384,
                    help="bytes per page in EACH buffer (one layer's K or V); a page moves "
                         "2 x layers x this")
    ap.add_argument("--chunks", type=int, default=3, help="at most this many chunks per source")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--metrics", default=None, metavar="HOST:PORT",
                    help="kvfence-control's metrics address: also report its own abort -> "
                         "released histogram")
    ap.add_argument("--json", action="store_true", help="the summary as JSON too; no progress")
    ap.add_argument("--inject-late-writes", type=int, default=0, metavar="N",
                    help="tests only: each rank writes one byte into N pages after their "
                         "release (each in another buffer), which the checks must count as "
                         "corrupted")
    a = ap.parse_args(argv)
    if a.seed is None:
        a.seed = random.randrange(1 << 31)
    if not (1 <= a.pages_min <= a.pages_max) or a.tp < 1 or a.chunks < 1 or a.concurrency < 1 \
            or a.rooms < 0 or not 0.0 <= a.abort_share <= 1.0 or a.page_size < 64 \
            or not 1 <= a.layers <= 64:
        ap.error("bad option values")
    if 2 * a.layers * a.page_size > STAGING_BUFFER:
        ap.error("--layers x 2 x --page-size = %d B a page: more than a node's staging buffer "
                 "(%d B), which a multi-buffer pool's page must fit" %
                 (2 * a.layers * a.page_size, STAGING_BUFFER))
    # started in the background by scripts/run.sh, SIGINT may be ignored: restore
    # Ctrl-C, and make SIGTERM stop the same way (rank processes stopped, pools
    # unlinked on the way out)
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
