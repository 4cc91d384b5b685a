#!/usr/bin/python3
"""An SGLang-shaped disaggregation backend on kvfence (integration example).

It keeps the shape of SGLang's Mooncake backend
(python/sglang/srt/disaggregation/mooncake/conn.py): a KVManager per engine
rank, a KVSender per request on the prefill (P) side, a KVReceiver per
request on the decode (D) side, both keyed by the router's bootstrap_room and
polled with KVPoll. What moves the bytes and who decides when pages are free
changes:

  SGLang/Mooncake today                     this adapter
  ---------------------------------------   --------------------------------------------
  D allocates pages, ZMQ-sends indices      D allocates pages, grants them to the room
                                            (JoinRoom as SINK), THEN sends the indices
  P RDMA-writes with batch_transfer_sync    P grants its source pages (JoinRoom as
                                            SOURCE / ExtendLease per chunk) and submits
                                            each chunk to its kvfence-node
  D polls until every P rank said Success   the room is COMPLETED once every node
                                            attested (bytes landed, ops finished)
  abort: clear state, free pages now        abort: AbortRoom; pages are freed ONLY in the
                                            WatchLeases "released" callback, after every
                                            node drained or was fenced

The races it closes: R1 (D frees pages that a late
write still lands in), R8 (P frees source pages while they are still read,
chunked prefill included), R10 (late chunk/aux for an aborted room written
into reused rows), R13 (a reused room id: late messages of the old room
counted for the new one). The comments at each step say which.

The engine side is simulated: a PageAllocator stands in for SGLang's token-to-
KV pool allocator, host shared memory for the KV buffers, and an in-process
Bootstrap for the ZeroMQ PUSH/PULL channel D -> P. Run it as a script against
a running kvfence-control and two kvfence-node processes:

    sglang_adapter.py --control 127.0.0.1:7070 --prefill-node n1 \
        --prefill-socket /run/kvfence/n1.sock --decode-node n2 \
        --decode-socket /run/kvfence/n2.sock
"""
from __future__ import annotations

import argparse
import enum
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Dict, List, Optional, Sequence

import kvfence
from kvfence import Lease, Participant, RoomKey, RoomState, Role


class KVPoll(enum.IntEnum):
    """SGLang's KVPoll (same numbers)."""
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class KVArgs:
    """What SGLang's KVArgs carries, reduced to one host KV buffer per rank."""
    engine_rank: int
    node_id: str  # the kvfence-node of this host
    node_socket: str  # its NodeLocal unix socket
    page_size: int  # bytes per KV page (all layers of one page, here)
    num_pages: int


class PageAllocator:
    """Stands in for SGLang's KV page allocator. free() of a page that is not
    allocated raises: a double free is the symptom of R1/R8."""

    def __init__(self, num_pages: int) -> None:
        self._lock = threading.Lock()
        self._free: List[int] = list(range(num_pages))
        self._used: set = set()
        self.free_log: List[List[int]] = []  # every free(), in order (for tests)

    def alloc(self, n: int) -> List[int]:
        with self._lock:
            if n > len(self._free):
                raise MemoryError("out of KV pages")
            pages, self._free = self._free[:n], self._free[n:]
            self._used.update(pages)
            return pages

    def free(self, pages: Sequence[int]) -> None:
        with self._lock:
            bad = [p for p in pages if p not in self._used]
            if bad:
                raise RuntimeError("free of pages not allocated: %s" % bad)
            self._used.difference_update(pages)
            self._free.extend(pages)
            self.free_log.append(list(pages))

    def is_allocated(self, page: int) -> bool:
        with self._lock:
            return page in self._used

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._free)


@dataclass
class DecodeInfo:
    """D -> P message of SGLang's bootstrap (TransferInfo): where to write.
    It carries the room-generation, not just bootstrap_room (R13)."""
    room: RoomKey
    node_id: str
    rank: int
    pool_id: int
    kv_indices: List[int]
    aux_index: int


class Bootstrap:
    """In-process stand-in for the ZeroMQ D -> P channel (one queue per room)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: Dict[int, "queue.Queue[DecodeInfo]"] = {}

    def _q(self, room_id: int) -> "queue.Queue[DecodeInfo]":
        with self._lock:
            return self._queues.setdefault(room_id, queue.Queue())

    def send(self, room_id: int, info: DecodeInfo) -> None:
        self._q(room_id).put(info)

    def recv(self, room_id: int, timeout: float) -> DecodeInfo:
        return self._q(room_id).get(timeout=timeout)


@dataclass
class _RoomState:
    """What a manager remembers per bootstrap_room (SGLang: request_status,
    transfer_infos). Keyed by room id, but every field is tied to one
    generation (R13)."""
    room: Optional[RoomKey] = None
    lease_id: int = 0
    pages: List[int] = field(default_factory=list)
    status: KVPoll = KVPoll.Bootstrapping
    terminal: Optional[RoomState] = None
    released: bool = False
    failure: str = ""


class KVManager:
    """One per engine rank (SGLang's MooncakeKVManager). Owns the KV buffer
    (host shm registered with the node), the page allocator, the Control and
    NodeLocal clients, and the release watcher that frees pages."""

    def __init__(self, args: KVArgs, mode: DisaggregationMode, control: str,
                 bootstrap: Bootstrap) -> None:
        self.args = args
        self.mode = mode
        self.bootstrap = bootstrap
        self.allocator = PageAllocator(args.num_pages)
        self.role = Role.SOURCE if mode == DisaggregationMode.PREFILL else Role.SINK
        self.participant = Participant(args.node_id, args.engine_rank, self.role)
        self.shm = shared_memory.SharedMemory(
            name="sglang-kv-%d-%s-%d" % (os.getpid(), mode.value, args.engine_rank), create=True,
            size=args.page_size * args.num_pages)
        self.kv_buffer = self.shm.buf
        self.control = kvfence.ControlClient(control)
        self.node = kvfence.NodeClient("unix:" + args.node_socket)
        self.pool = self.node.register_pool_shm(self.shm.name, args.page_size, args.num_pages,
                                                rank=args.engine_rank)
        self._lock = threading.Lock()
        self._rooms: Dict[int, _RoomState] = {}  # bootstrap_room -> state
        self._by_lease: Dict[int, int] = {}  # lease_id -> bootstrap_room
        self.released_log: List[int] = []  # lease ids, in release order (for tests)
        # The only place pages go back to the allocator. Started (and synced)
        # before any lease is granted, so no release can be missed.
        self.watcher = self.control.release_watcher(
            self._on_released, node_id=args.node_id, ranks=[args.engine_rank],
            on_room_state=self._on_room_state).start()

    # ---- the release callback: R1, R8 -------------------------------------------

    def _on_released(self, lease: Lease) -> None:
        """kvfence says the lease is RELEASED: every node of the room drained
        (or completed, or was fenced), so no write into our pages (R1) and no
        read of them (R8) can still happen. Only now are they free."""
        with self._lock:
            room_id = self._by_lease.pop(lease.lease_id, None)
            st = self._rooms.get(room_id) if room_id is not None else None
            if st is None or st.lease_id != lease.lease_id:
                return  # a lease of another manager or an older generation (R13)
            pages, st.pages = st.pages, []
            st.released = True
            self.released_log.append(lease.lease_id)
        # The lease's pages are exactly the pages granted (JoinRoom + every
        # ExtendLease); free what we allocated for the request.
        self.allocator.free(pages)

    def _on_room_state(self, ev: kvfence.RoomStateChanged) -> None:
        with self._lock:
            st = self._rooms.get(ev.room.room_id)
            if st is None or st.room != ev.room:
                return  # R13: a state change of another generation of this id
            if ev.new_state in (RoomState.ABORTING, RoomState.ABORTED):
                st.status = KVPoll.Failed
                st.failure = st.failure or "room %s aborted (%s)" % (ev.room, ev.reason.name)
            if ev.new_state.terminal:
                st.terminal = ev.new_state

    # ---- per-room bookkeeping ---------------------------------------------------------

    def _new_room(self, room_id: int) -> _RoomState:
        with self._lock:
            old = self._rooms.get(room_id)
            if old is not None and not old.released and old.lease_id:
                # SGLang would overwrite the old entry here (R13); we refuse:
                # the old generation's pages are not back yet.
                raise RuntimeError("room %d: previous generation %s not released yet" %
                                   (room_id, old.room))
            st = _RoomState()
            self._rooms[room_id] = st
            return st

    def _granted(self, room_id: int, room: RoomKey, lease_id: int, pages: List[int]) -> None:
        with self._lock:
            st = self._rooms[room_id]
            st.room, st.lease_id = room, lease_id
            st.pages.extend(pages)
            self._by_lease[lease_id] = room_id
        if self.watcher.is_released(lease_id):
            # Released before we recorded the grant (an abort right after the
            # join): the callback skipped it, so free here (idempotent).
            self._on_released(self.watcher.wait(lease_id, 0))

    def room_state(self, room_id: int) -> _RoomState:
        with self._lock:
            return self._rooms[room_id]

    def poll(self, room_id: int) -> KVPoll:
        with self._lock:
            st = self._rooms.get(room_id)
            if st is None:
                return KVPoll.Bootstrapping
            if st.status == KVPoll.Failed:
                return KVPoll.Failed
            if st.terminal == RoomState.COMPLETED and st.released:
                return KVPoll.Success  # every node attested: the bytes are in D's pages
            return st.status

    def abort(self, room_id: int, detail: str) -> None:
        """SGLang's abort: here only AbortRoom, with the exact generation (R13:
        an abort of the old room can never hit a new room reusing the id). The
        pages are NOT freed here (R1, R8): _on_released does it."""
        with self._lock:
            st = self._rooms.get(room_id)
            room = st.room if st else None
            if st is not None:
                st.status = KVPoll.Failed
                st.failure = st.failure or detail
        if room is not None:
            try:
                self.control.abort_room(room, detail)  # idempotent: same token twice
            except kvfence.FailedPrecondition:
                # Already COMPLETED (the release comes anyway), or the id was
                # reused and this generation is not current: kvfence refuses to
                # let it touch the new room (R13).
                pass

    def close(self) -> None:
        self.watcher.stop()
        self.control.close()
        self.node.close()
        self.kv_buffer = None
        self.shm.close()
        self.shm.unlink()


class KVReceiver:
    """Decode side of one request (SGLang's MooncakeKVReceiver)."""

    def __init__(self, mgr: KVManager, bootstrap_room: int, expected_sources: int = 1) -> None:
        assert mgr.mode == DisaggregationMode.DECODE
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.expected_sources = expected_sources
        mgr._new_room(bootstrap_room)

    def init(self, kv_indices: List[int], aux_index: int = 0) -> None:
        """D has allocated kv_indices. Grant them to the room BEFORE telling P
        where to write: kvfence admits P's chunks only into pages of D's WRITE
        lease, and once the room aborts no chunk is admitted and the pages stay
        leased until every write drained (R1). The generation in the reply goes
        into the message to P (R13). The indices go as a page set: with page
        size 1 they are one per token and scattered, a few bytes each this way
        instead of one PageRange each."""
        j = self.mgr.control.join_room(
            self.bootstrap_room, self.mgr.participant, self.mgr.pool.pool_id,
            pages=kv_indices, expected_sources=self.expected_sources,
            expected_sinks=1, retry_s=5.0)
        self.mgr._granted(self.bootstrap_room, j.room, j.lease_id, list(kv_indices))
        self.room = j.room
        self.mgr.room_state(self.bootstrap_room).status = KVPoll.WaitingForInput
        self.mgr.bootstrap.send(self.bootstrap_room, DecodeInfo(
            j.room, self.mgr.args.node_id, self.mgr.args.engine_rank, self.mgr.pool.pool_id,
            list(kv_indices), aux_index))

    def poll(self) -> KVPoll:
        return self.mgr.poll(self.bootstrap_room)

    def abort(self, detail: str = "decode abort") -> None:
        self.mgr.abort(self.bootstrap_room, detail)


class KVSender:
    """Prefill side of one request (SGLang's MooncakeKVSender): init(), then
    send() once per chunk (chunked prefill), poll(), abort()."""

    def __init__(self, mgr: KVManager, bootstrap_room: int, bootstrap_timeout: float = 10.0) -> None:
        assert mgr.mode == DisaggregationMode.PREFILL
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_timeout = bootstrap_timeout
        self.num_kv_indices = 0
        self.curr_idx = 0
        self.chunk_seq = 0
        self.decode: Optional[DecodeInfo] = None
        self.room: Optional[RoomKey] = None
        mgr._new_room(bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int = 0) -> None:
        self.num_kv_indices = num_kv_indices
        self.aux_index = aux_index

    def _bootstrap(self) -> DecodeInfo:
        if self.decode is None:
            info = self.mgr.bootstrap.recv(self.bootstrap_room, self.bootstrap_timeout)
            self.decode = info
            self.mgr.room_state(self.bootstrap_room).status = KVPoll.WaitingForInput
        return self.decode

    def send(self, kv_indices: List[int], aux: bytes = b"") -> bool:
        """Sends the next chunk: kv_indices are this chunk's source pages.
        Returns False when the room is aborted (nothing was, or will be,
        written for this chunk)."""
        info = self._bootstrap()
        start, end = self.curr_idx, self.curr_idx + len(kv_indices)
        is_last = end >= self.num_kv_indices
        src = kvfence.ranges_from_pages(kv_indices)
        dst = kvfence.ranges_from_pages(info.kv_indices[start:end])
        try:
            if self.room is None:
                # First chunk: grant the source pages to the same generation D
                # joined (R13). P's pages stay leased, hence not reusable,
                # until every read of them finished (R8).
                j = self.mgr.control.join_room(
                    self.bootstrap_room, self.mgr.participant, self.mgr.pool.pool_id,
                    pages=kv_indices, expected_sources=1, expected_sinks=1, retry_s=5.0)
                if j.room != info.room:
                    raise kvfence.FailedPrecondition(
                        kvfence.FailedPrecondition.code,
                        "room %s is not the generation D granted (%s)" % (j.room, info.room))
                self.room, self.lease_id = j.room, j.lease_id
                self.mgr._granted(self.bootstrap_room, j.room, j.lease_id, list(kv_indices))
                if j.state != RoomState.ACTIVE:
                    self._wait_active()
            else:
                # Chunked prefill: every chunk's pages join the READ lease
                # before they are read, so an abort between chunks keeps the
                # earlier chunks' pages locked until drained (R8).
                self.mgr.control.extend_lease(self.room, self.lease_id, pages=kv_indices)
                self.mgr._granted(self.bootstrap_room, self.room, self.lease_id,
                                  list(kv_indices))
            self.mgr.room_state(self.bootstrap_room).status = KVPoll.Transferring
            self.chunk_seq += 1
            # The node admits the chunk only while the room-generation is
            # ACTIVE and the pages lie in both leases: a chunk or aux bytes of
            # an aborted room are refused here, never written into pages or
            # rows that were handed to another request (R10).
            self._submit(info, src, dst, is_last, aux if is_last else b"")
        except (kvfence.Aborted, kvfence.FailedPrecondition) as e:
            # FAILED_PRECONDITION too: pages outside the leases (the room's
            # update was replaced by its abort) or a stale generation.
            if self.room is None or self.mgr.poll(self.bootstrap_room) == KVPoll.Failed or \
                    isinstance(e, kvfence.Aborted):
                st = self.mgr.room_state(self.bootstrap_room)
                st.status = KVPoll.Failed
                st.failure = st.failure or str(e)
                return False
            raise
        self.curr_idx = end
        if is_last:
            # A declaration, not a release: the pages come back via the watcher.
            try:
                self.mgr.control.complete_room(self.room, self.mgr.participant)
            except kvfence.Aborted:
                pass
        return True

    def _submit(self, info: DecodeInfo, src, dst, is_last: bool, aux: bytes,
                timeout: float = 5.0) -> None:
        """SubmitChunk, retrying while the node has not yet applied the room's
        update: UNAVAILABLE before the first one; after an ExtendLease the
        node answers FAILED_PRECONDITION ("outside the read lease") until the
        new RoomUpdate arrives, so that is retried too, as long as the room is
        not failed (then the pages are the abort's, and we stop)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.mgr.node.submit_chunk(
                    self.room, self.chunk_seq, source_rank=self.mgr.args.engine_rank,
                    source_pool_id=self.mgr.pool.pool_id, source_ranges=src,
                    sink_node_id=info.node_id, sink_rank=info.rank, sink_pool_id=info.pool_id,
                    sink_ranges=dst, last_chunk=is_last, aux=aux,
                    retry_unavailable_s=max(0.0, deadline - time.monotonic()))
                return
            except kvfence.FailedPrecondition as e:
                if ("outside" not in e.details or time.monotonic() >= deadline or
                        self.mgr.poll(self.bootstrap_room) == KVPoll.Failed):
                    raise
                time.sleep(0.01)

    def _wait_active(self, timeout: float = 10.0) -> None:
        """D joined first (it sends the indices after joining), so P's join
        normally makes the room ACTIVE. With several sources, the last one
        does: poll the room until then."""
        with kvfence.AdminClient(self.mgr.control.target) as admin:
            admin.wait_room_state(self.room, RoomState.ACTIVE, timeout)

    def poll(self) -> KVPoll:
        return self.mgr.poll(self.bootstrap_room)

    def abort(self, detail: str = "prefill abort") -> None:
        self.mgr.abort(self.bootstrap_room, detail)


# ---- a demo run ------------------------------------------------------------------

def wait_poll(obj, want: Sequence[KVPoll], timeout: float = 10.0) -> KVPoll:
    deadline = time.monotonic() + timeout
    while True:
        p = obj.poll()
        if p in want:
            return p
        if time.monotonic() > deadline:
            raise TimeoutError("poll() is %s after %.1f s, want %s" % (p.name, timeout, want))
        time.sleep(0.01)


def run_demo(control: str, prefill: KVArgs, decode: KVArgs, room_id: int = 4242,
             chunks: int = 3, pages_per_chunk: int = 4) -> None:
    """One request end to end: D allocates and grants, P sends `chunks`
    chunks, both see Success, the bytes landed, and every page is back."""
    boot = Bootstrap()
    p_mgr = KVManager(prefill, DisaggregationMode.PREFILL, control, boot)
    d_mgr = KVManager(decode, DisaggregationMode.DECODE, control, boot)
    try:
        n = chunks * pages_per_chunk
        d_pages = d_mgr.allocator.alloc(n)
        recv = KVReceiver(d_mgr, room_id)
        recv.init(d_pages)
        p_pages = p_mgr.allocator.alloc(n)
        for i, pg in enumerate(p_pages):  # "prefill computed the KV"
            ps = prefill.page_size
            p_mgr.kv_buffer[pg * ps:(pg + 1) * ps] = bytes([(i * 13 + 7) & 0xFF]) * ps
        sender = KVSender(p_mgr, room_id)
        sender.init(n)
        for c in range(chunks):
            assert sender.send(p_pages[c * pages_per_chunk:(c + 1) * pages_per_chunk])
        assert wait_poll(recv, [KVPoll.Success, KVPoll.Failed]) == KVPoll.Success
        assert wait_poll(sender, [KVPoll.Success, KVPoll.Failed]) == KVPoll.Success
        ps = decode.page_size
        for i, pg in enumerate(d_pages):
            assert bytes(d_mgr.kv_buffer[pg * ps:(pg + 1) * ps]) == bytes([(i * 13 + 7) & 0xFF]) * ps
        assert d_mgr.allocator.available == decode.num_pages
        assert p_mgr.allocator.available == prefill.num_pages
        print("room %d: %d pages landed byte-exact; all pages released" % (room_id, n))
    finally:
        p_mgr.close()
        d_mgr.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--control", required=True)
    ap.add_argument("--prefill-node", default="n1")
    ap.add_argument("--prefill-socket", required=True)
    ap.add_argument("--decode-node", default="n2")
    ap.add_argument("--decode-socket", required=True)
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--room", type=int, default=4242)
    a = ap.parse_args(argv)
    run_demo(a.control, KVArgs(0, a.prefill_node, a.prefill_socket, a.page_size, a.pages),
             KVArgs(0, a.decode_node, a.decode_socket, a.page_size, a.pages), a.room)
    return 0


if __name__ == "__main__":
    sys.exit(main())
