"""kvfence as an SGLang disaggregation transfer backend.

SGLang picks a transfer backend by --disaggregation-transfer-backend; each
is a package with a manager (one per engine rank), a sender (prefill, one per
request), a receiver (decode, one per request) and a bootstrap server
(docs/engines.md). This is that package for kvfence: the bytes move through
the host's kvfence-node (SubmitChunk), and a request's pages are the engine's
again only when kvfence says its lease is RELEASED.

What the scheduler sees, per request (bootstrap_room is the kvfence room id):

  decode  KVReceiver.init()          Bootstrapping until the prefill rank is
                                     registered at the bootstrap server, then
                                     WaitingForInput
          send_metadata(kv_indices)  JoinRoom as SINK with those pages, THEN
                                     post them to prefill: Transferring
  prefill KVSender.poll()            Bootstrapping until decode's metadata is
                                     there, then WaitingForInput
          send(chunk) per chunk      JoinRoom as SOURCE (first chunk) or
                                     ExtendLease, then SubmitChunk; the last
                                     chunk carries the aux slot and is
                                     followed by CompleteRoom: Transferring
  both    poll() -> Success          the room is COMPLETED and this side's
                                     lease RELEASED (decode: aux written too)
          poll() -> Failed           the room is ABORTED and this side's lease
                                     RELEASED; a side that granted nothing is
                                     Failed once its abort was acknowledged
          abort()                    AbortRoom with the exact generation (or a
                                     tombstone at the bootstrap server when the
                                     generation is not known yet); frees nothing

So after Success or Failed the scheduler may free the request's pages (the
decode side: the pages it sent in send_metadata; the prefill side: every
chunk's pages), and never before. An abort never ends in Failed while a
transfer may still touch the pages: Failed waits for kvfence's proof (every
node drained or fenced).

Capabilities: every join announces QUIESCE_V1 (kvfence.DEFAULT_FEATURES); a
prefill rank registers its features at the bootstrap server, and a decode
receiver whose prefill lacks QUIESCE_V1 fails in init(), before it grants or
posts a page. kvfence itself refuses (and aborts) a room that a participant
without QUIESCE_V1 joins.

DESIGN. Threads: the scheduler's (every call of the sender/receiver API);
the ReleaseWatcher's (lease releases and room states, into the manager's
tables); on prefill, one transfer thread per manager that runs the chunks
send() queued, in order (ExtendLease, SubmitChunk, CompleteRoom), so send()
waits on kvfence only for the first chunk's JoinRoom (why: send()); on decode, one NodeClient.watch reader
(aux bytes into the aux buffers, and the node's view of room states). The
manager's tables are guarded by the manager's lock. A request's fields are
the scheduler thread's, except lease_id, aborted, failed and the count of
queued chunks, which the transfer thread also writes: those change under the
request's lock, and a request that aborts with a chunk still queued is
Failed only once that chunk is over (it may still grant pages). poll()
derives the state from the tables (released lease ids, room states by
RoomKey) each time, so an event that arrives before the join reply is
recorded is not lost. Lock order: a request's lock, then the manager's or
the watcher's; the watcher and node-watch threads take no request lock.
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import errors
from ..client import (DEFAULT_FEATURES, AuxReceived, ControlClient, Lease, NodeClient,
                      NodeRoomState, Participant, Role, RoomKey, RoomState, RoomStateChanged,
                      TransferDone, ranges_from_pages)
from ..enginekit.memory import KvMemory, register_kv_memory
from ..enginekit.rendezvous import Rendezvous, RendezvousError, RendezvousServer
from ..enginekit.rooms import ended_state

try:  # the engine's own interfaces when SGLang is installed
    from sglang.srt.disaggregation.base.conn import (BaseKVBootstrapServer, BaseKVManager,
                                                     BaseKVReceiver, BaseKVSender, KVArgs,
                                                     KVPoll)
    try:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric
    except ImportError:  # pragma: no cover
        KVTransferMetric = None  # type: ignore[assignment,misc]
except ImportError:  # pragma: no cover - importable without SGLang (docs, tools)
    import enum

    class KVPoll(enum.IntEnum):  # type: ignore[no-redef]
        Failed = 0
        Bootstrapping = 1
        WaitingForInput = 2
        Transferring = 3
        Success = 4

    class KVArgs:  # type: ignore[no-redef]
        pass

    BaseKVManager = BaseKVSender = BaseKVReceiver = BaseKVBootstrapServer = object  # type: ignore
    KVTransferMetric = None  # type: ignore[assignment,misc]

if KVTransferMetric is None:
    from dataclasses import dataclass as _dc

    @_dc
    class KVTransferMetric:  # type: ignore[no-redef]
        latency_s: Optional[float] = None
        transferred_bytes: Optional[int] = None

__all__ = ["KVManager", "KVSender", "KVReceiver", "KVBootstrapServer", "KVPoll", "KVArgs",
           "KVTransferError", "KVTransferMetric", "QUIESCE_FEATURE"]

log = logging.getLogger("kvfence.sglang")

QUIESCE_FEATURE = "QUIESCE_V1"
_MAILBOX_POLL_S = 0.05  # how often a waiting side looks for a tombstone
_JOIN_RETRY_S = 5.0  # a pool registered a moment ago, a SUSPECT node
# How long a chunk waits for the nodes to learn the room (UNAVAILABLE: "no room
# update yet", "node n2 has not acknowledged the room yet") before the request
# is aborted; kvfence_submit_retry_s / $KVFENCE_SUBMIT_RETRY_S. Liveness only:
# an abort still frees nothing before RELEASED.
_SUBMIT_RETRY_S = 15.0
_END_GRACE_S = 1.0  # released, room end not seen: ask after this long


class KVTransferError(Exception):
    """failure_exception(): why a request failed (room, detail)."""

    def __init__(self, bootstrap_room: int, detail: str) -> None:
        super().__init__("kvfence room %d: %s" % (bootstrap_room, detail))
        self.bootstrap_room = bootstrap_room
        self.detail = detail


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "value", mode)).lower()


def _setting(server_args: Any, name: str, env: str, default: Any = None) -> Any:
    v = getattr(server_args, name, None)
    if v is None or v == "":
        v = os.environ.get(env, default)
    return v


class KVManager(BaseKVManager):
    """One per engine rank: the kvfence clients, the KV pool, the release
    watcher, and (prefill) the rank's registration at the bootstrap server.

    Settings, from server_args attributes or else the environment:
    kvfence_control / KVFENCE_CONTROL (host:port of kvfence-control),
    kvfence_node_id / KVFENCE_NODE_ID and kvfence_node_socket /
    KVFENCE_NODE_SOCKET (this host's kvfence-node), kvfence_features /
    KVFENCE_FEATURES (comma separated; default QUIESCE_V1);
    disaggregation_bootstrap_port and host (prefill: where the bootstrap
    server is)."""

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        self.kv_args = args
        self.mode = _mode_name(disaggregation_mode)
        if self.mode not in ("prefill", "decode"):
            raise ValueError("disaggregation_mode: %r is neither prefill nor decode" %
                             (disaggregation_mode,))
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        control = _setting(server_args, "kvfence_control", "KVFENCE_CONTROL")
        self.node_id = _setting(server_args, "kvfence_node_id", "KVFENCE_NODE_ID")
        socket_path = _setting(server_args, "kvfence_node_socket", "KVFENCE_NODE_SOCKET")
        for name, v in (("kvfence_control", control), ("kvfence_node_id", self.node_id),
                        ("kvfence_node_socket", socket_path)):
            if not v:
                raise ValueError("%s: not set (server_args.%s or $%s)" %
                                 (name, name, name.upper()))
        feats = _setting(server_args, "kvfence_features", "KVFENCE_FEATURES")
        if isinstance(feats, str):
            feats = [f for f in feats.split(",") if f]
        self.features = tuple(feats) if feats is not None else DEFAULT_FEATURES
        self.submit_retry_s = float(_setting(server_args, "kvfence_submit_retry_s",
                                             "KVFENCE_SUBMIT_RETRY_S", _SUBMIT_RETRY_S))
        self.rank = int(args.engine_rank)
        # Prefill and decode with the same TP size: decode rank r pairs with
        # prefill rank r, and a room has tp_size sources and tp_size sinks.
        self.tp_size = int(getattr(server_args, "tp_size", None) or 1)
        self.role = Role.SOURCE if self.mode == "prefill" else Role.SINK
        self.participant = Participant(self.node_id, self.rank, self.role)
        self.control = ControlClient(control)
        self.node = NodeClient(socket_path if socket_path.startswith("unix:")
                               else "unix:" + socket_path)
        self.memory: KvMemory = register_kv_memory(self.node, args.kv_data_ptrs,
                                                   args.kv_data_lens, args.kv_item_lens,
                                                   rank=self.rank)
        self._lock = threading.Lock()
        self._room_states: Dict[RoomKey, RoomState] = {}
        self._aux_done: Dict[RoomKey, bool] = {}
        self._aux_slots: Dict[RoomKey, int] = {}
        self._closed = False
        self.watcher = self.control.release_watcher(
            self._on_released, node_id=self.node_id, ranks=[self.rank],
            on_room_state=self._on_room_state).start()
        self._node_watch = None
        self._node_thread: Optional[threading.Thread] = None
        if self.mode == "decode":
            self._node_watch = self.node.watch(ranks=[self.rank])
            self._node_thread = threading.Thread(target=self._read_node, daemon=True,
                                                 name="kvfence-sglang-node-watch")
            self._node_thread.start()
        self._tx: "queue.Queue[Optional[Tuple[KVSender, List[int], int, bool, bool]]]" = \
            queue.Queue()
        self._tx_thread: Optional[threading.Thread] = None
        self.bootstrap_addr: Optional[str] = None
        if self.mode == "prefill":
            self._tx_thread = threading.Thread(target=self._tx_loop, daemon=True,
                                               name="kvfence-sglang-transfer")
            self._tx_thread.start()
            port = getattr(server_args, "disaggregation_bootstrap_port", None)
            host = getattr(server_args, "kvfence_bootstrap_host", None) or "127.0.0.1"
            if port:
                self.bootstrap_addr = "%s:%d" % (host, int(port))
                self.register_to_bootstrap()

    # ---- the tables (watcher and node-watch threads write, poll reads) ----------

    def _on_released(self, lease: Lease) -> None:
        log.debug("lease %d of room %s released", lease.lease_id, lease.room)

    def _on_room_state(self, ev: RoomStateChanged) -> None:
        self._note_state(ev.room, ev.new_state)

    def _note_state(self, room: RoomKey, state: RoomState) -> None:
        with self._lock:
            old = self._room_states.get(room)
            if isinstance(old, RoomState) and old.terminal:
                return  # a terminal state stays
            self._room_states[room] = state

    def _read_node(self) -> None:
        try:
            for ev in self._node_watch:
                if isinstance(ev, AuxReceived):
                    self._write_aux(ev.room, ev.data)
                elif isinstance(ev, TransferDone) and ev.ok:
                    # The node orders a room's events: an aux comes before the
                    # ok transfer_done, so a room without one by now has none
                    # (a prefill that sent no aux slot): do not wait for it.
                    with self._lock:
                        if ev.room in self._aux_done:
                            self._aux_done[ev.room] = True
                elif isinstance(ev, NodeRoomState) and isinstance(ev.state, RoomState):
                    with self._lock:
                        if ev.state.terminal:
                            self._room_states[ev.room] = ev.state
                        else:
                            self._room_states.setdefault(ev.room, ev.state)
        except errors.KvfenceError as e:
            if not self._closed:
                log.warning("node watch ended: %s", e)

    def _write_aux(self, room: RoomKey, data: bytes) -> None:
        """The source's aux bytes, into this request's slot of each aux buffer
        (the slot was leased with the room: only the request's receiver posted
        it, and only this room's aux reaches it)."""
        with self._lock:
            slot = self._aux_slots.get(room)
        if slot is None:
            log.warning("aux of room %s: no slot known; dropped", room)
            return
        a = self.kv_args
        off = 0
        for ptr, item in zip(a.aux_data_ptrs, a.aux_item_lens):
            part = data[off:off + item]
            ctypes.memmove(int(ptr) + slot * int(item), part, len(part))
            off += item
        with self._lock:
            self._aux_done[room] = True

    def read_aux(self, slot: int) -> bytes:
        """The aux bytes of `slot` across every aux buffer (what prefill sends)."""
        a = self.kv_args
        return b"".join(ctypes.string_at(int(p) + slot * int(n), int(n))
                        for p, n in zip(getattr(a, "aux_data_ptrs", []) or [],
                                        getattr(a, "aux_item_lens", []) or []))

    def _expect_aux(self, room: RoomKey, slot: Optional[int]) -> None:
        if slot is not None and getattr(self.kv_args, "aux_data_ptrs", None):
            with self._lock:
                self._aux_slots[room] = int(slot)
                self._aux_done.setdefault(room, False)

    def room_state(self, room: Optional[RoomKey]) -> Optional[RoomState]:
        if room is None:
            return None
        with self._lock:
            return self._room_states.get(room)

    def aux_ok(self, room: RoomKey) -> bool:
        with self._lock:
            return self._aux_done.get(room, True)

    def forget(self, room: Optional[RoomKey]) -> None:
        if room is None:
            return
        with self._lock:
            self._room_states.pop(room, None)
            self._aux_done.pop(room, None)
            self._aux_slots.pop(room, None)

    def _tx_loop(self) -> None:
        """Prefill: the chunks that send() queued, in order (one thread, so a
        request's chunks keep their order and the scheduler never waits on
        kvfence)."""
        while True:
            item = self._tx.get()
            if item is None:
                return
            sender, idx, start, is_last, first = item
            try:
                sender._transfer(idx, start, is_last, first)
            except Exception:  # a bug must not stop every later request's chunks
                log.exception("room %d: chunk at %d failed", sender.bootstrap_room, start)
                sender._chunk_done("chunk at %d: internal error" % start)

    # ---- bootstrap --------------------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Prefill: tells the bootstrap server where this rank is and what it
        speaks (its features, its page geometry)."""
        if self.bootstrap_addr is None:
            return
        Rendezvous(self.bootstrap_addr).put_rank(self.rank, {
            "node_id": self.node_id, "features": list(self.features),
            "item_lens": list(self.memory.item_lens),
            "tp_size": self.tp_size})

    def close(self) -> None:
        self._closed = True
        if self._tx_thread is not None:
            self._tx.put(None)
            self._tx_thread.join(timeout=10.0)
        self.watcher.stop()
        if self._node_watch is not None:
            self._node_watch.close()
        if self._node_thread is not None:
            self._node_thread.join(timeout=5.0)
        self.control.close()
        self.node.close()


class _Request:
    """What a sender and a receiver share: the room, the lease, the abort,
    and poll() from kvfence's word."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int) -> None:
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.rendezvous = Rendezvous(bootstrap_addr)
        self.room: Optional[RoomKey] = None
        self.lease_id = 0
        self.phase = KVPoll.Bootstrapping
        self.aborted = ""  # why, once anyone aborted (or refused) the room
        self.failed = False  # granted nothing and aborted: Failed at once
        self._final: Optional[KVPoll] = None
        # Prefill: chunks queued for the transfer thread and not yet done. The
        # thread writes room/lease_id/aborted too, so these change under _lock.
        self._lock = threading.Lock()
        self._inflight = 0
        self._released_at: Optional[float] = None
        self._next_mailbox = 0.0

    def _state(self) -> KVPoll:
        if self._final is None:
            with self._lock:
                self._final = self._derive()
        return self._final if self._final is not None else self.phase

    def _derive(self) -> Optional[KVPoll]:
        """Success or Failed from kvfence's word (once reached, poll() keeps
        it: clear() forgets the tables); None while neither."""
        if self.failed:
            return KVPoll.Failed
        if self.lease_id and self.mgr.watcher.is_released(self.lease_id):
            st = self.mgr.room_state(self.room)
            if st is None or not st.terminal:
                # Released, the end not seen (a resubscribed watcher replays
                # releases, not room states): ask, after a grace period.
                now = time.monotonic()
                if self._released_at is None:
                    self._released_at = now
                elif now - self._released_at > _END_GRACE_S and self.room is not None:
                    end = ended_state(self.mgr.control, self.room)
                    if end == RoomState.UNSPECIFIED:
                        # Ended, but how is lost: fail the request (safe, the
                        # pages are released), never claim its data arrived.
                        self.aborted = self.aborted or ("room %s ended, its outcome unknown "
                                                        "(generation replaced)" % (self.room,))
                        return KVPoll.Failed
                    if end is not None:
                        st = end
                        self.mgr._note_state(self.room, end)
            if st == RoomState.COMPLETED and self.mgr.aux_ok(self.room):
                return KVPoll.Success
            if st == RoomState.ABORTED:
                self.aborted = self.aborted or "room %s aborted" % (self.room,)
                return KVPoll.Failed
        elif self.lease_id:
            st = self.mgr.room_state(self.room)
            if st in (RoomState.ABORTING, RoomState.ABORTED) and not self.aborted:
                self.aborted = "room %s aborted" % (self.room,)
        return None

    def _note_abort(self, detail: str) -> None:
        with self._lock:
            self.aborted = self.aborted or detail
            if not self.lease_id and not self._inflight:
                self.failed = True  # nothing of ours is granted: nothing to wait for

    def _abort_key(self, room: RoomKey, detail: str) -> None:
        try:
            self.mgr.control.abort_room(room, detail)
        except (errors.FailedPrecondition, errors.NotFound) as e:
            # COMPLETED (nothing to abort: the release comes anyway) or a
            # generation that is not current any more: it cannot touch a
            # newer room with this id.
            log.info("abort of room %s: %s", room, e.details)

    def failure_exception(self) -> None:
        raise KVTransferError(self.bootstrap_room, self.aborted or "failed")

    def _mailbox_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_mailbox:
            return False
        self._next_mailbox = now + _MAILBOX_POLL_S
        return True


class KVSender(_Request, BaseKVSender):
    """Prefill side of one request."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Optional[List[int]] = None, pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        if mgr.mode != "prefill":
            raise ValueError("KVSender needs a prefill manager, got %s" % mgr.mode)
        _Request.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self.dest_tp_ranks = list(dest_tp_ranks or [])
        self.pp_rank = pp_rank
        self.num_kv_indices = 0
        self.aux_index: Optional[int] = None
        self.curr_idx = 0
        self.chunk_seq = 0
        self.sink: Optional[Dict[str, Any]] = None
        self.lease_pages = 0
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None
        self._bytes = 0

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index

    def _fetch_sink(self) -> None:
        if self.sink is not None or self.failed or not self._mailbox_due():
            return
        try:
            e = self.rendezvous.room(self.bootstrap_room, self.mgr.rank)
        except RendezvousError as err:
            log.warning("%s", err)
            return
        if e.get("aborted") and e.get("sink") is None:
            self._note_abort("decode aborted before it granted pages: %s" % e["aborted"])
        elif e.get("sink") is not None:
            self.sink = e["sink"]
            self.room = RoomKey(*self.sink["room"])
            if self.phase == KVPoll.Bootstrapping:
                self.phase = KVPoll.WaitingForInput

    def poll(self) -> KVPoll:
        if self.phase == KVPoll.Bootstrapping:
            self._fetch_sink()
        return self._state()

    def send(self, kv_indices: Sequence[int], state_indices: Any = None,
             token_position_offset: int = 0) -> None:
        """One prefill chunk: these pages' KV is computed. The first chunk's
        pages join the room here (JoinRoom, one call); every chunk is then
        queued for the manager's transfer thread, which grants the later
        chunks' pages (ExtendLease) before the node reads them and submits
        them against the decode pages at the same token positions; the chunk
        that reaches num_kv_indices is the last.

        Why the join is not queued: a room is ACTIVE, and its chunks admitted,
        only once every rank joined, and the transfer thread handles one
        chunk at a time; a join queued behind another room's chunk that waits
        for this rank's join of that room would wait for it in turn (TP 2:
        rank 0 on room A, rank 1 on room B, each waiting for the other)."""
        if self.sink is None:
            raise RuntimeError("room %d: send() before the decode side's metadata (poll "
                               "is Bootstrapping)" % self.bootstrap_room)
        idx = [int(i) for i in kv_indices]
        start, end = self.curr_idx, self.curr_idx + len(idx)
        if end > self.num_kv_indices:
            raise ValueError("room %d: %d pages sent, more than init's num_kv_indices %d" %
                             (self.bootstrap_room, end, self.num_kv_indices))
        with self._lock:
            if self.aborted:
                return  # an aborted room takes nothing more
            first = not self.lease_id
        if self._t0 is None:
            self._t0 = time.monotonic()
        self.phase = KVPoll.Transferring
        if first and not self._join(idx):
            return
        with self._lock:
            self._inflight += 1
        self.curr_idx = end
        self.mgr._tx.put((self, idx, start, end >= self.num_kv_indices, first))

    def _join(self, idx: List[int]) -> bool:
        """Scheduler thread: the first chunk's pages join the room (the
        generation decode granted); False when refused (nothing granted)."""
        mem = self.mgr.memory
        sink = self.sink
        assert sink is not None
        try:
            j = self.mgr.control.join_room(
                self.bootstrap_room, self.mgr.participant, mem.pool_id,
                pages=mem.pool_pages(idx), expected_sources=self.mgr.tp_size,
                expected_sinks=int(sink.get("tp_size", 1)), features=self.mgr.features,
                retry_s=_JOIN_RETRY_S)
        except (errors.Aborted, errors.FailedPrecondition, errors.NotFound,
                errors.Unavailable, errors.InvalidArgument, errors.AlreadyExists,
                errors.ResourceExhausted) as e:
            # Refused (an aborted room, a capability refusal: kvfence aborted
            # the room; more runs of pages than a lease takes): nothing of
            # ours is granted.
            self._note_abort("%s: %s" % (e.method, e.details))
            return False
        with self._lock:
            self.lease_id = j.lease_id
            self.lease_pages = len(idx)
        if j.room != self.room:
            # The id is another generation than decode granted: not ours.
            wrong, self.room = self.room, j.room
            self._abort_key(j.room, "generation differs from decode's %s" % (wrong,))
            self._note_abort("room %s is not the generation decode granted" % (j.room,))
            return False
        return True

    def _chunk_done(self, failure: str = "") -> None:
        """Transfer thread: one queued chunk is over (sent, refused or skipped)."""
        with self._lock:
            self._inflight -= 1
            if failure:
                self.aborted = self.aborted or failure
            if self.aborted and not self.lease_id and not self._inflight:
                self.failed = True

    def _transfer(self, idx: List[int], start: int, is_last: bool, first: bool) -> None:
        """Transfer thread: grant (but the first chunk: joined in send()),
        submit and (last chunk) complete one chunk."""
        with self._lock:
            skip = bool(self.aborted)
            lease_id = self.lease_id
        if skip:
            self._chunk_done()
            return
        mem = self.mgr.memory
        sink = self.sink
        assert sink is not None and self.room is not None
        src = mem.ranges(idx)
        dst = ranges_from_pages(sink["kv_indices"][start:start + len(idx)])
        try:
            if not first:
                lease = self.mgr.control.extend_lease(self.room, lease_id,
                                                      pages=mem.pool_pages(idx))
                self.lease_pages = lease.page_count()
            self.chunk_seq += 1
            aux = b""
            if is_last and self.aux_index is not None:
                aux = self.mgr.read_aux(int(self.aux_index))
            self.mgr.node.submit_chunk(
                self.room, self.chunk_seq, source_rank=self.mgr.rank,
                source_pool_id=mem.pool_id, source_ranges=src, sink_node_id=sink["node_id"],
                sink_rank=int(sink["rank"]), sink_pool_id=int(sink["pool_id"]),
                sink_ranges=dst, last_chunk=is_last, aux=aux,
                retry_unavailable_s=self.mgr.submit_retry_s, source_lease_pages=self.lease_pages,
                sink_lease_pages=len(sink["kv_indices"]))
            self._bytes += len(idx) * mem.page_size
            if is_last:
                self.mgr.control.complete_room(self.room, self.mgr.participant)
        except (errors.Aborted, errors.FailedPrecondition, errors.NotFound,
                errors.Unavailable, errors.InvalidArgument, errors.ResourceExhausted) as e:
            # Refused: an aborted room (kvfence refuses every later chunk), a
            # capability refusal (kvfence aborted the room), a lost peer.
            # Nothing more is sent; Failed comes with the release.
            if self.lease_id:
                self._abort_key(self.room, "prefill: %s" % e.details)
            self._chunk_done("%s: %s" % (e.method, e.details))
            return
        self._chunk_done()

    def get_transfer_metric(self) -> KVTransferMetric:
        st = self._state()
        if st == KVPoll.Success and self._t1 is None and self._t0 is not None:
            self._t1 = time.monotonic()
        lat = (self._t1 - self._t0) if (self._t0 is not None and self._t1 is not None) else None
        return KVTransferMetric(latency_s=lat, transferred_bytes=self._bytes or None)

    def abort(self) -> None:
        """AbortRoom (exact generation); frees nothing: poll() says Failed once
        kvfence released this side's lease."""
        detail = "prefill aborted room %d" % self.bootstrap_room
        if self.room is not None:
            self._abort_key(self.room, detail)
        else:
            try:  # the decode side may have granted meanwhile: abort by its key
                e = self.rendezvous.abort(self.bootstrap_room, self.mgr.rank, detail)
                if e.get("sink") is not None:
                    self.room = RoomKey(*e["sink"]["room"])
                    self._abort_key(self.room, detail)
            except RendezvousError as err:
                log.warning("%s", err)
        self._note_abort(detail)

    def clear(self) -> None:
        try:
            self.rendezvous.delete(self.bootstrap_room, self.mgr.rank)
        except RendezvousError:
            pass
        self.mgr.forget(self.room)


class KVReceiver(_Request, BaseKVReceiver):
    """Decode side of one request."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None) -> None:
        if mgr.mode != "decode":
            raise ValueError("KVReceiver needs a decode manager, got %s" % mgr.mode)
        if bootstrap_room is None:
            raise ValueError("bootstrap_room: required (it is the kvfence room id)")
        _Request.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self.prefill_rank: Optional[int] = None
        self.prefill: Optional[Dict[str, Any]] = None
        self.kv_indices: List[int] = []

    def init(self, prefill_dp_rank: int = 0) -> None:
        # Same TP size on both sides: this rank's peer is the prefill rank of
        # the same number.
        self.prefill_rank = self.mgr.rank
        self._lookup()

    def _lookup(self) -> None:
        if self.prefill is not None or self.failed or self.prefill_rank is None:
            return
        try:
            info = self.rendezvous.get_rank(self.prefill_rank)
        except RendezvousError as err:
            log.warning("%s", err)
            return
        if info is None:
            return
        missing = [f for f in (QUIESCE_FEATURE,) if f not in info.get("features", [])]
        if missing:
            self._note_abort("prefill rank %d on %s lacks %s: refused before any transfer" %
                             (self.prefill_rank, info.get("node_id"), ", ".join(missing)))
            return
        mem = self.mgr.memory
        if int(info.get("tp_size", 1)) != self.mgr.tp_size:
            self._note_abort("prefill has TP %s, this decode TP %d: not supported (same TP size "
                             "on both sides)" % (info.get("tp_size"), self.mgr.tp_size))
            return
        if not mem.same_layout(info):
            self._note_abort("prefill rank %d has KV buffers of %s bytes per page, this rank "
                             "%s" % (self.prefill_rank, info.get("item_lens"),
                                     list(mem.item_lens)))
            return
        self.prefill = info
        self.phase = KVPoll.WaitingForInput

    def poll(self) -> KVPoll:
        if self.phase == KVPoll.Bootstrapping:
            self._lookup()
        return self._state()

    def send_metadata(self, kv_indices: Sequence[int], aux_index: Optional[int] = None,
                      state_indices: Any = None, decode_prefix_len: Optional[int] = None) -> None:
        """Grants kv_indices to the room (JoinRoom as SINK), THEN tells the
        prefill rank where to write: kvfence admits its chunks only into these
        pages, and after an abort they stay leased until every write drained."""
        if self.aborted or self.failed:
            return
        if self.prefill is None:
            raise RuntimeError("room %d: send_metadata() before init() found the prefill rank"
                               % self.bootstrap_room)
        mem = self.mgr.memory
        self.kv_indices = [int(i) for i in kv_indices]
        try:
            j = self.mgr.control.join_room(
                self.bootstrap_room, self.mgr.participant, mem.pool_id,
                pages=mem.pool_pages(self.kv_indices),
                expected_sources=int(self.prefill.get("tp_size", 1)),
                expected_sinks=self.mgr.tp_size, features=self.mgr.features,
                retry_s=_JOIN_RETRY_S)
        except (errors.Aborted, errors.FailedPrecondition, errors.NotFound, errors.Unavailable,
                errors.InvalidArgument, errors.AlreadyExists, errors.ResourceExhausted) as e:
            # ResourceExhausted: e.g. more runs of pages than a lease takes.
            self._note_abort("%s: %s" % (e.method, e.details))  # nothing granted
            return
        self.room, self.lease_id = j.room, j.lease_id
        self.mgr._expect_aux(j.room, aux_index)
        self.phase = KVPoll.Transferring
        info = dict(mem.describe(), room=[j.room.room_id, j.room.generation],
                    node_id=self.mgr.node_id, rank=self.mgr.rank, tp_size=self.mgr.tp_size,
                    kv_indices=self.kv_indices,
                    aux_index=aux_index)
        try:
            tomb = self.rendezvous.put_sink(self.bootstrap_room, self.prefill_rank or 0, info)
        except RendezvousError as err:
            tomb = "bootstrap server unreachable: %s" % err
        if tomb is not None:
            # Prefill aborted before it knew our generation: abort it ourselves.
            self._abort_key(j.room, "prefill aborted: %s" % tomb)
            self.aborted = self.aborted or "prefill aborted: %s" % tomb

    def abort(self) -> None:
        detail = "decode aborted room %d" % self.bootstrap_room
        if self.room is not None:
            self._abort_key(self.room, detail)
        else:
            try:
                self.rendezvous.abort(self.bootstrap_room, self.prefill_rank or self.mgr.rank,
                                      detail)
            except RendezvousError as err:
                log.warning("%s", err)
        self._note_abort(detail)

    def clear(self) -> None:
        self.mgr.forget(self.room)


class KVBootstrapServer(BaseKVBootstrapServer):
    """The rendezvous of prefill and decode ranks (HTTP on `host`:`port`;
    port 0 picks one: .port)."""

    def __init__(self, host: str, port: int, *args: Any, **kw: Any) -> None:
        self._srv = RendezvousServer(host, int(port))
        self.host = host
        self.port = self._srv.port

    @property
    def address(self) -> str:
        return self._srv.address

    def close(self) -> None:
        self._srv.close()
