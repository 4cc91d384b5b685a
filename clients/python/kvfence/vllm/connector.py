"""kvfence as a vLLM KV connector (V1), loaded out of tree:

    --kv-transfer-config '{"kv_connector": "KvfenceConnector",
                           "kv_connector_module_path": "kvfence.vllm",
                           "kv_role": "kv_producer",   # prefill; "kv_consumer": decode
                           "kv_connector_extra_config": {
                               "control": "127.0.0.1:7070", "node_id": "n1",
                               "node_socket": "/run/kvfence/n1.sock",
                               "rendezvous": "127.0.0.1:7600"}}'

A request's KV moves from the prefill engine's blocks into the decode
engine's blocks through the kvfence-nodes, and the blocks of both sides are
freed only when kvfence says the request's lease is RELEASED: the timer that
vLLM's NIXL connector uses instead (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s,
after which prefill frees blocks that decode may still read) has no place
here. No timer releases anything.

The flow (a request's room id is a random 63-bit integer, or the proxy's
"kvfence_room"):

  prefill  request_finished(req, blocks)   the request asked for remote decode
                                           ("do_remote_decode"): delay_free=True,
                                           and kv_transfer_params for decode
                                           {"do_remote_prefill", "kvfence_room",
                                           "remote_rendezvous", "remote_rank"}
           worker, next step               JoinRoom as SOURCE with those blocks;
                                           once decode's metadata is at the
                                           rendezvous, SubmitChunk (last_chunk) and
                                           CompleteRoom
           get_finished -> done_sending    only when the lease is RELEASED
  decode   get_num_new_matched_tokens      every prompt token not computed, async
           update_state_after_alloc        the blocks to load into
           worker, next step               JoinRoom as SINK with those blocks,
                                           THEN post them to the prefill's
                                           rendezvous
           get_finished -> done_recving    the lease RELEASED (room COMPLETED, or
                                           ABORTED: then its blocks are in
                                           get_block_ids_with_load_errors)
           request_finished while loading  AbortRoom; delay_free=True, and the id
           (an abort)                      comes back in done_sending once RELEASED

DESIGN. Scheduler side: one thread (vLLM's), plain dicts. Worker side: the
model runner's thread calls the connector API; the ReleaseWatcher thread
records releases and room states (its own tables, behind a lock); one
sender thread (producer) waits for decode's metadata and submits chunks.
The worker's request tables are guarded by one lock: the runner thread
adds and removes requests, the sender thread moves them to "sent".
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from .. import errors
from ..client import (DEFAULT_FEATURES, ControlClient, Lease, NodeClient, Participant, Role,
                      RoomKey, RoomState, RoomStateChanged, ranges_from_pages)
from .. import device as _device
from ..client import PoolBuffer
from ..enginekit.memory import KvMemory, kv_buffer, register_kv_memory
from ..enginekit.rendezvous import Rendezvous, RendezvousError, RendezvousServer
from ..enginekit.rooms import ended_state

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                  KVConnectorMetadata,
                                                                  KVConnectorRole)
except ImportError:  # pragma: no cover - importable without vLLM (docs, tools)
    import enum

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._role = role

        def bind_connector_metadata(self, m: Any) -> None:
            self._connector_metadata = m

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            return self._connector_metadata

__all__ = ["KvfenceConnector", "KvfenceConnectorMetadata", "kv_cache_buffers",
           "kv_cache_pool_buffers"]

log = logging.getLogger("kvfence.vllm")

_RETRY_S = 5.0  # joins: a pool registered a moment ago, a SUSPECT node
_SUBMIT_RETRY_S = 15.0  # a chunk waiting for the nodes to learn the room (liveness only)
_SENDER_POLL_S = 0.005
_END_GRACE_S = 1.0  # released, room end not seen: ask after this long


@dataclass
class KvfenceConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: rooms to grant as source (prefill),
    rooms to grant as sink (decode), rooms to abort."""
    to_send: Dict[str, Tuple[int, List[int]]] = field(default_factory=dict)
    to_recv: Dict[str, Tuple[int, List[int], str, int]] = field(default_factory=dict)
    to_abort: Dict[str, Tuple[int, str, int]] = field(default_factory=dict)


def kv_cache_buffers(kv_caches: Dict[str, Any]) -> Tuple[List[int], List[int], List[int]]:
    """(ptrs, lens, item_lens) of vLLM's per-layer KV cache tensors, in layer
    name order: a tensor whose first dimension is 2 holds K and V (two
    buffers of num_blocks pages, dimension 1); otherwise dimension 0 is the
    block. Needs data_ptr(), nbytes and shape (torch.Tensor has them)."""
    ptrs: List[int] = []
    lens: List[int] = []
    items: List[int] = []
    for name in sorted(kv_caches):
        t = kv_caches[name]
        shape = tuple(t.shape)
        total = int(t.nbytes)
        if len(shape) >= 2 and shape[0] == 2:
            half = total // 2
            blocks = int(shape[1])
            for k in range(2):
                ptrs.append(int(t.data_ptr()) + k * half)
                lens.append(half)
                items.append(half // blocks)
        else:
            blocks = int(shape[0])
            ptrs.append(int(t.data_ptr()))
            lens.append(total)
            items.append(total // blocks)
    return ptrs, lens, items


def kv_cache_pool_buffers(kv_caches: Dict[str, Any]) -> List[PoolBuffer]:
    """The PoolBuffers of kv_cache_buffers(kv_caches), in its order: a torch
    CUDA tensor by torch's own IPC export (kvfence.device.export_tensor, as
    NodeClient.register_pool_vllm does; its V half at the K half's offset
    plus half its bytes), anything else by its address (enginekit.kv_buffer:
    host shm, or device memory exported by pointer)."""
    ptrs, lens, items = kv_cache_buffers(kv_caches)
    out: List[PoolBuffer] = []
    b = 0
    for name in sorted(kv_caches):
        t = kv_caches[name]
        shape = tuple(t.shape)
        parts = 2 if len(shape) >= 2 and shape[0] == 2 else 1
        base = _device.export_tensor(t) if getattr(t, "is_cuda", False) else None
        for k in range(parts):
            if base is not None:
                ipc = _device.CudaIpc(base.handle, base.device, base.offset + k * lens[b])
                out.append(PoolBuffer(items[b], ipc=ipc, size=lens[b]))
            else:
                out.append(kv_buffer(ptrs[b], lens[b], items[b],
                                     what="layer %r buffer %d" % (name, k)))
            b += 1
    return out


def _extra(vllm_config: Any) -> Dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def _setting(extra: Dict[str, Any], key: str, env: str) -> Optional[str]:
    v = extra.get(key)
    return str(v) if v not in (None, "") else os.environ.get(env)


@dataclass
class _Req:
    req_id: str
    room_id: int
    blocks: List[int]
    room: Optional[RoomKey] = None
    lease_id: int = 0
    rendezvous: str = ""
    remote_rank: int = 0
    sent: bool = False
    aborted: str = ""
    by_scheduler: bool = False  # decode: the scheduler aborted it (free on release)
    granted_at: float = 0.0
    released_at: float = 0.0


class KvfenceConnector(KVConnectorBase_V1):
    """The connector; see the module text."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.kv_role = getattr(ktc, "kv_role", "kv_both")
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError("kv_role: %r (kv_producer, kv_consumer or kv_both)" % (self.kv_role,))
        extra = _extra(vllm_config)
        self.control_target = _setting(extra, "control", "KVFENCE_CONTROL")
        self.node_id = _setting(extra, "node_id", "KVFENCE_NODE_ID")
        self.node_socket = _setting(extra, "node_socket", "KVFENCE_NODE_SOCKET")
        self.rendezvous_addr = _setting(extra, "rendezvous", "KVFENCE_RENDEZVOUS")
        self.rank = int(extra.get("rank", getattr(ktc, "kv_rank", 0) or 0))
        feats = extra.get("features")
        self.features = tuple(feats) if feats is not None else DEFAULT_FEATURES
        # Producer: abort a room whose decode side has not asked for it after
        # this long (None: never). An abort, not a free: the blocks come back
        # on the release that follows, as for any abort.
        t = extra.get("abort_unclaimed_after_s", os.environ.get("KVFENCE_ABORT_UNCLAIMED_S"))
        self.abort_unclaimed_after_s = float(t) if t not in (None, "") else None
        self.is_scheduler = getattr(role, "name", str(role)) == "SCHEDULER"
        if self.is_scheduler:
            self._pending = KvfenceConnectorMetadata()
            self._loading: Dict[str, Tuple[int, str, int]] = {}  # decode: req -> room
            self._loaded: Set[str] = set()
            self._has_room: Set[str] = set()
        else:
            for name, v in (("control", self.control_target), ("node_id", self.node_id),
                            ("node_socket", self.node_socket)):
                if not v:
                    raise ValueError("kv_connector_extra_config.%s: not set (or $KVFENCE_%s)" %
                                     (name, name.upper()))
            self.control = ControlClient(self.control_target)
            sock = self.node_socket or ""
            self.node = NodeClient(sock if sock.startswith("unix:") else "unix:" + sock)
            self.memory: Optional[KvMemory] = None
            self._lock = threading.Lock()
            self._sending: Dict[str, _Req] = {}
            self._recving: Dict[str, _Req] = {}
            self._room_states: Dict[RoomKey, RoomState] = {}
            self._load_errors: Set[int] = set()
            self._stop = threading.Event()
            self._server: Optional[RendezvousServer] = None
            self._sender: Optional[threading.Thread] = None
            self.watcher = self.control.release_watcher(
                self._on_released, node_id=self.node_id, ranks=[self.rank],
                on_room_state=self._on_room_state).start()

    # ======================= scheduler side ==========================================

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        p = getattr(request, "kv_transfer_params", None) or {}
        if p.get("do_remote_prefill") and p.get("kvfence_room"):
            n = int(request.num_tokens) - int(num_computed_tokens)
            return max(0, n), n > 0
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        p = getattr(request, "kv_transfer_params", None) or {}
        if not (p.get("do_remote_prefill") and p.get("kvfence_room")) or not num_external_tokens:
            return
        ids = list(blocks.get_block_ids()[0])
        room = int(p["kvfence_room"])
        rz = str(p.get("remote_rendezvous") or "")
        rank = int(p.get("remote_rank") or 0)
        self._pending.to_recv[request.request_id] = (room, ids, rz, rank)
        self._loading[request.request_id] = (room, rz, rank)
        self._has_room.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KvfenceConnectorMetadata:
        meta, self._pending = self._pending, KvfenceConnectorMetadata()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            if rid in self._loading:
                del self._loading[rid]
                self._loaded.add(rid)
        for rid in getattr(connector_output, "finished_sending", None) or ():
            self._has_room.discard(rid)
            self._loaded.discard(rid)

    def request_finished(self, request: Any,
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """True (keep the blocks until get_finished reports this id) for every
        request with a room whose lease is not yet RELEASED."""
        rid = request.request_id
        p = getattr(request, "kv_transfer_params", None) or {}
        if rid in self._loading:
            # Decode, finished while its KV is loading: an abort. The blocks
            # stay until the room's release (done_sending).
            room, rz, rank = self._loading.pop(rid)
            self._pending.to_abort[rid] = (room, rz, rank)
            # Not yet seen by the worker: it never grants (the abort leaves a tombstone).
            self._pending.to_recv.pop(rid, None)
            return True, None
        if rid in self._loaded:
            self._loaded.discard(rid)
            self._has_room.discard(rid)
            return False, None  # loaded: its lease is RELEASED already
        if p.get("do_remote_decode") and not _aborted(request) and block_ids:
            room = int(p.get("kvfence_room") or random.getrandbits(63) or 1)
            self._pending.to_send[rid] = (room, list(block_ids))
            self._has_room.add(rid)
            return True, {"do_remote_prefill": True, "do_remote_decode": False,
                          "kvfence_room": room, "remote_rendezvous": self.rendezvous_addr,
                          "remote_rank": self.rank}
        return False, None

    # ======================= worker side ==============================================

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """Registers every layer's K and V with this host's kvfence-node as ONE
        pool of 2 x layers buffers (enginekit.register_kv_memory; block i is
        slot i of every buffer, so a request's lease is its block ids)."""
        ptrs, lens, items = kv_cache_buffers(kv_caches)
        self.memory = register_kv_memory(self.node, ptrs, lens, items, rank=self.rank,
                                         buffers=kv_cache_pool_buffers(kv_caches))
        if self.kv_role in ("kv_producer", "kv_both") and self.rendezvous_addr:
            host, _, port = self.rendezvous_addr.rpartition(":")
            self._server = RendezvousServer(host, int(port))
            self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                            name="kvfence-vllm-sender")
            self._sender.start()

    def _on_released(self, lease: Lease) -> None:
        pass  # the watcher's own table (is_released) is what get_finished reads

    def _on_room_state(self, ev: RoomStateChanged) -> None:
        with self._lock:
            self._room_states[ev.room] = ev.new_state

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if meta is None:
            return
        for rid, (room_id, blocks) in meta.to_send.items():
            self._grant_source(rid, room_id, blocks)
        for rid, (room_id, blocks, rz, rank) in meta.to_recv.items():
            self._grant_sink(rid, room_id, blocks, rz, rank)
        for rid, (room_id, rz, rank) in meta.to_abort.items():
            self._abort_recv(rid, room_id, rz, rank)

    def _grant_source(self, rid: str, room_id: int, blocks: List[int]) -> None:
        assert self.memory is not None
        r = _Req(rid, room_id, blocks)
        try:
            j = self.control.join_room(room_id, Participant(self.node_id, self.rank, Role.SOURCE),
                                       self.memory.pool_id, pages=self.memory.pool_pages(blocks),
                                       features=self.features, retry_s=_RETRY_S)
            r.room, r.lease_id = j.room, j.lease_id
            r.granted_at = time.monotonic()
        except errors.KvfenceError as e:
            r.aborted = "%s: %s" % (e.method, e.details)  # nothing granted: done at once
        with self._lock:
            self._sending[rid] = r

    def _grant_sink(self, rid: str, room_id: int, blocks: List[int], rz: str, rank: int) -> None:
        assert self.memory is not None
        r = _Req(rid, room_id, blocks, rendezvous=rz, remote_rank=rank)
        try:
            j = self.control.join_room(room_id, Participant(self.node_id, self.rank, Role.SINK),
                                       self.memory.pool_id, pages=self.memory.pool_pages(blocks),
                                       features=self.features, retry_s=_RETRY_S)
            r.room, r.lease_id = j.room, j.lease_id
        except errors.KvfenceError as e:
            r.aborted = "%s: %s" % (e.method, e.details)
        if r.lease_id:
            info = dict(self.memory.describe(), room=[r.room.room_id, r.room.generation],
                        node_id=self.node_id, rank=self.rank, kv_indices=blocks)
            try:
                tomb = Rendezvous(rz).put_sink(room_id, rank, info)
            except (RendezvousError, ValueError) as e:
                tomb = "prefill unreachable: %s" % e
            if tomb is not None:
                self._abort_key(r.room, tomb)
                r.aborted = tomb
        with self._lock:
            self._recving[rid] = r

    def _abort_recv(self, rid: str, room_id: int, rz: str, rank: int) -> None:
        with self._lock:
            r = self._recving.get(rid)
        if r is None:  # never granted: leave a tombstone for the prefill side
            r = _Req(rid, room_id, [], rendezvous=rz, remote_rank=rank)
            try:
                e = Rendezvous(rz).abort(room_id, rank, "decode aborted request %s" % rid)
                if e.get("sink"):
                    self._abort_key(RoomKey(*e["sink"]["room"]), "decode aborted")
            except (RendezvousError, ValueError) as err:
                log.warning("%s", err)
            with self._lock:
                self._recving[rid] = r
        elif r.room is not None:
            self._abort_key(r.room, "decode aborted request %s" % rid)
        r.by_scheduler = True
        r.aborted = r.aborted or "aborted by the scheduler"

    def _abort_key(self, room: RoomKey, detail: str) -> None:
        try:
            self.control.abort_room(room, detail[:200])
        except (errors.FailedPrecondition, errors.NotFound) as e:
            log.info("abort of room %s: %s", room, e.details)

    def _send_loop(self) -> None:
        """Producer: for every granted source room, wait for decode's metadata
        at the rendezvous (or its tombstone), then submit the whole request
        as one chunk and declare it complete."""
        assert self._server is not None and self.memory is not None
        rz = Rendezvous(self._server.address)
        while not self._stop.is_set():
            with self._lock:
                todo = [r for r in self._sending.values() if not r.sent and r.lease_id and
                        not r.aborted]
            for r in todo:
                try:
                    e = rz.room(r.room_id, self.rank)
                except RendezvousError:
                    continue
                if e.get("aborted") and not e.get("sink"):
                    self._abort_key(r.room, "decode aborted: %s" % e["aborted"])
                    r.aborted, r.sent = str(e["aborted"]), True
                    continue
                sink = e.get("sink")
                if not sink:
                    limit = self.abort_unclaimed_after_s
                    with self._lock:
                        ended = self._room_states.get(r.room) in (RoomState.ABORTING,
                                                                  RoomState.ABORTED)
                    if ended or (limit is not None and
                                 time.monotonic() - r.granted_at > limit):
                        # Aborted before decode asked (by anyone), or decode never
                        # asked (its proxy lost the request?): abort. Unlike NIXL's
                        # timer this frees nothing; the release does.
                        detail = ("room %s aborted before decode asked" % (r.room,) if ended
                                  else "unclaimed for %.3g s" % limit)
                        try:  # a decode that asks later is refused (409), not left waiting
                            late = rz.abort(r.room_id, self.rank, detail).get("sink")
                        except RendezvousError:
                            late = None
                        self._abort_key(r.room, detail)
                        r.aborted, r.sent = detail, True
                        if late:  # decode posted meanwhile
                            log.info("room %s: decode posted while it was aborted", r.room)
                            theirs = RoomKey(*late["room"])
                            if theirs != r.room:
                                # Its join came after ours ended and made a new
                                # generation, which no prefill will ever serve:
                                # abort that one too, or decode waits for ever.
                                self._abort_key(theirs, "prefill's generation %s ended" %
                                                (r.room,))
                    continue
                r.sent = True
                if RoomKey(*sink["room"]) != r.room:
                    # Decode joined another generation (ours ended first, and its
                    # join made a new one): neither can complete; abort both.
                    self._abort_key(r.room, "decode joined generation %s" % (sink["room"],))
                    self._abort_key(RoomKey(*sink["room"]), "prefill's generation %s ended" %
                                    (r.room,))
                    continue
                if not self.memory.same_layout(sink):
                    # Another model or layout: its pages cannot take ours.
                    detail = ("decode's KV buffers have %s bytes per page, prefill's %s" %
                              (sink.get("item_lens"), list(self.memory.item_lens)))
                    self._abort_key(r.room, detail)
                    r.aborted = detail
                    continue
                try:
                    self.node.submit_chunk(
                        r.room, 1, source_rank=self.rank, source_pool_id=self.memory.pool_id,
                        source_ranges=self.memory.ranges(r.blocks), sink_node_id=sink["node_id"],
                        sink_rank=int(sink["rank"]), sink_pool_id=int(sink["pool_id"]),
                        sink_ranges=ranges_from_pages(sink["kv_indices"]),
                        last_chunk=True, retry_unavailable_s=_SUBMIT_RETRY_S)
                    self.control.complete_room(r.room, Participant(self.node_id, self.rank,
                                                                   Role.SOURCE))
                except errors.KvfenceError as err:
                    self._abort_key(r.room, "prefill: %s" % err.details)
                    r.aborted = err.details
            self._stop.wait(_SENDER_POLL_S)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, finished before the request runs

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # sent after the request finished, every layer at once

    def wait_for_save(self) -> None:
        return

    def _released(self, r: _Req) -> bool:
        return not r.lease_id or self.watcher.is_released(r.lease_id)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                 Optional[Set[str]]]:
        """(done_sending, done_recving): request ids whose lease is RELEASED.
        done_sending: prefill requests (free the blocks now), and decode
        requests the scheduler aborted; done_recving: decode requests whose
        load ended (ABORTED ones also have their blocks in
        get_block_ids_with_load_errors)."""
        sending: Set[str] = set()
        recving: Set[str] = set()
        unsent: List[_Req] = []
        with self._lock:
            for rid, r in list(self._sending.items()):
                if self._released(r):
                    sending.add(rid)
                    del self._sending[rid]
                    if not r.sent:
                        unsent.append(r)
            for rid, r in list(self._recving.items()):
                if not self._released(r):
                    continue
                st = self._room_states.get(r.room) if r.room is not None else None
                if st is None and r.room is not None and not r.by_scheduler:
                    # Released, its end not seen (a resubscribed watcher replays
                    # releases only): ask how it ended, after a grace period.
                    now = time.monotonic()
                    r.released_at = r.released_at or now
                    if now - r.released_at > _END_GRACE_S:
                        end = ended_state(self.control, r.room)
                        st = RoomState.ABORTED if end == RoomState.UNSPECIFIED else end
                if r.by_scheduler:
                    sending.add(rid)
                elif st == RoomState.COMPLETED:
                    recving.add(rid)
                elif st == RoomState.ABORTED or r.aborted or not r.lease_id:
                    self._load_errors.update(r.blocks)
                    recving.add(rid)
                else:
                    continue  # released, state not seen yet: next step
                del self._recving[rid]
                if r.room is not None:
                    self._room_states.pop(r.room, None)
        for r in unsent:
            self._refuse_late_decode(r)
        return sending or None, recving or None

    def _refuse_late_decode(self, r: _Req) -> None:
        """Producer: a room released before decode asked (aborted by anyone):
        leave a tombstone, so that a decode that asks later is refused at the
        rendezvous instead of waiting in a room of its own; if it posted
        meanwhile, abort the room it joined."""
        if self._server is None:
            return
        try:
            e = Rendezvous(self._server.address).abort(r.room_id, self.rank,
                                                       "prefill's room %s ended" % (r.room,))
        except RendezvousError as err:
            log.warning("%s", err)
            return
        if e.get("sink"):
            self._abort_key(RoomKey(*e["sink"]["room"]), "prefill's room %s ended" % (r.room,))

    def get_block_ids_with_load_errors(self) -> Set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def lease_of(self, req_id: str) -> int:
        """The lease of a request in flight (0: none, or not in flight)."""
        with self._lock:
            r = self._sending.get(req_id) or self._recving.get(req_id)
            return r.lease_id if r else 0

    def room_of(self, req_id: str) -> Optional[RoomKey]:
        """The room-generation of a request in flight (None: none yet)."""
        with self._lock:
            r = self._sending.get(req_id) or self._recving.get(req_id)
            return r.room if r else None

    def get_handshake_metadata(self) -> Any:
        return None  # the rendezvous address travels in kv_transfer_params

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        return None

    def shutdown(self) -> None:
        if self.is_scheduler:
            return
        self._stop.set()
        if self._sender is not None:
            self._sender.join(timeout=5.0)
        if self._server is not None:
            self._server.close()
        self.watcher.stop()
        self.control.close()
        self.node.close()


def _aborted(request: Any) -> bool:
    st = getattr(request, "status", None)
    return "ABORT" in str(getattr(st, "name", st) or "").upper()
