"""The kvfence clients: ControlClient (engines), NodeClient (an engine and its
host's kvfence-node, on the node's unix socket) and AdminClient (operators).

Every client owns one gRPC channel (or borrows one given to it), closes it on
close() or at the end of a `with` block, and raises a kvfence.KvfenceError
subclass (errors.py) for every failed call. Values come back as frozen
dataclasses and IntEnums, not protobuf messages.

The rule an engine must follow (control.proto): pages granted to a room are
the engine's again only when kvfence reports the lease RELEASED
(LeaseReleased from watch_leases, wait_released, or a ReleaseWatcher
callback); never on a CompleteRoom or AbortRoom reply, never on a timer.
"""
from __future__ import annotations

import enum
import errno
import logging
import operator
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import (Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence,
                    Set, Tuple, TypeVar, Union)

import grpc
import grpc.experimental

from . import device as _device
from . import errors
from ._proto.v1 import control_pb2, control_pb2_grpc, node_pb2, node_pb2_grpc, types_pb2
from .pageset import PageSet, PageSetForm, as_page_set

# The node's fd socket (common/kvf_fdpass.h).
_FDPASS_MAGIC = b"KVFD"
_FDPASS_TIMEOUT_S = 2.0

__all__ = [
    "Role", "RoomState", "LeaseState", "LeaseMode", "AbortReason", "NodeState", "PoolKind",
    "RoomKey", "PageRange", "Participant", "Token", "Lease", "JoinResult", "AbortResult", "Pool",
    "PoolBuffer",
    "LeaseReleased", "RoomStateChanged", "WatchSynced", "WatchEvent", "ParticipantInfo",
    "RoomInfo", "NodeInfo", "ranges_from_pages", "ControlClient", "NodeClient", "AdminClient",
    "LeaseWatch", "ReleaseWatcher", "DEFAULT_FEATURES", "DEFAULT_TIMEOUT_S", "LifetimeState",
    "NodeRoomState", "ChunkDone", "TransportKind", "AuxReceived", "TransferDone", "NodeEvent",
    "NodeWatch", "ChunkRequest", "ChunkResult", "ChunkStream", "PageSet", "PageSetForm",
]

log = logging.getLogger("kvfence")

#: Seconds a unary call may take unless the call or the client says otherwise.
DEFAULT_TIMEOUT_S = 5.0
#: Features an engine announces in JoinRoom ("QUIESCE_V1" is required).
DEFAULT_FEATURES: Tuple[str, ...] = ("QUIESCE_V1",)
#: Protocol range an engine announces in JoinRoom.
DEFAULT_PROTOCOL: Tuple[int, int] = (1, 1)

_RETRY_SLEEP_S = 0.02


# ---- enums (same numbers as the proto enums) ---------------------------------

class Role(enum.IntEnum):
    UNSPECIFIED = 0
    SOURCE = 1  # prefill: its pages are read (READ lease)
    SINK = 2  # decode: its pages are written (WRITE lease)


class RoomState(enum.IntEnum):
    UNSPECIFIED = 0
    OPENING = 1
    ACTIVE = 2
    ABORTING = 3
    COMPLETED = 4
    ABORTED = 5

    @property
    def terminal(self) -> bool:
        return self in (RoomState.COMPLETED, RoomState.ABORTED)


class LeaseState(enum.IntEnum):
    UNSPECIFIED = 0
    ACTIVE = 1
    RELEASING = 2
    RELEASED = 3


class LeaseMode(enum.IntEnum):
    UNSPECIFIED = 0
    READ = 1
    WRITE = 2


class AbortReason(enum.IntEnum):
    UNSPECIFIED = 0
    ENGINE = 1
    ADMIN = 2
    JOIN_TIMEOUT = 3
    TRANSFER_FAILED = 4
    NODE_LOST = 5
    CAPABILITY = 6


class NodeState(enum.IntEnum):
    UNSPECIFIED = 0
    ATTACHED = 1
    SUSPECT = 2
    LOST = 3


class PoolKind(enum.IntEnum):
    UNSPECIFIED = 0
    HOST_SHM = 1
    CUDA_IPC = 2


class LifetimeState(enum.IntEnum):
    """A node's lifetime of a room (admission and ops in flight)."""
    UNSPECIFIED = 0
    OPEN = 1
    CLOSED = 2
    DRAINED = 3
    QUARANTINED = 4


class TransportKind(enum.IntEnum):
    """How a chunk's bytes travelled (ChunkDone.transport)."""
    UNSPECIFIED = 0
    RDMA = 1
    TCP = 2
    LOCAL = 3


def _enum(cls: Any, value: int) -> Any:
    try:
        return cls(value)
    except ValueError:  # a newer server's value: keep the number
        return value


# ---- values ------------------------------------------------------------------

@dataclass(frozen=True)
class RoomKey:
    """A room-generation. generation 0 means "the current one" where a call allows it."""
    room_id: int
    generation: int = 0

    def __str__(self) -> str:
        return "%d:%d" % (self.room_id, self.generation)

    def _pb(self) -> types_pb2.RoomKey:
        return types_pb2.RoomKey(room_id=self.room_id, generation=self.generation)

    @classmethod
    def _from(cls, m: types_pb2.RoomKey) -> "RoomKey":
        return cls(m.room_id, m.generation)


class PageRange(NamedTuple):
    """Pages [first, first + count) of one pool. A tuple (immutable, and
    PageRange(4, 2) == (4, 2)): a lease of 32,768 scattered pages comes back
    as 32,768 of them, built in C (_ranges_from)."""
    first: int
    count: int

    @property
    def pages(self) -> range:
        return range(self.first, self.first + self.count)

    def _pb(self) -> types_pb2.PageRange:
        return types_pb2.PageRange(first=self.first, count=self.count)


RangesLike = Iterable[Union[PageRange, Tuple[int, int]]]


def _ranges(ranges: RangesLike) -> List[types_pb2.PageRange]:
    out = []
    for r in ranges:
        if isinstance(r, PageRange):
            out.append(r._pb())
        else:
            first, count = r
            out.append(types_pb2.PageRange(first=int(first), count=int(count)))
    return out


_first_count = operator.attrgetter("first", "count")


def _ranges_from(ms: Iterable[types_pb2.PageRange]) -> Tuple[PageRange, ...]:
    return tuple(map(PageRange._make, map(_first_count, ms)))


def _pages_arg(ranges: RangesLike, pages: Any) -> Optional[PageSet]:
    """join_room's and extend_lease's pages: None (use `ranges`) or a PageSet."""
    if pages is None:
        return None
    if ranges:
        raise ValueError("give ranges or pages, not both")
    return as_page_set(pages)


def ranges_from_pages(pages: Iterable[int]) -> List[PageRange]:
    """Page indices (e.g. SGLang's kv_indices) as ranges, in the given order:
    runs of consecutive ascending indices become one range each. Keeps the
    order, so it is what a chunk's source and sink pages need (page i goes to
    page i); for a lease, pass the indices to join_room(pages=...) instead: a
    PageSet is a few bytes a page and encodes in milliseconds where this
    builds one PageRange per scattered page.

    >>> ranges_from_pages([4, 5, 6, 9, 2, 3])
    [PageRange(first=4, count=3), PageRange(first=9, count=1), PageRange(first=2, count=2)]
    """
    out: List[PageRange] = []
    first = prev = None
    for p in pages:
        p = int(p)
        if first is not None and p == prev + 1:
            prev = p
            continue
        if first is not None:
            out.append(PageRange(first, prev - first + 1))
        first = prev = p
    if first is not None:
        out.append(PageRange(first, prev - first + 1))
    return out


@dataclass(frozen=True)
class Participant:
    """One (node, engine rank) of a room."""
    node_id: str
    rank: int
    role: Role

    def _pb(self) -> types_pb2.Participant:
        return types_pb2.Participant(node_id=self.node_id, rank=self.rank, role=int(self.role))

    @classmethod
    def _from(cls, m: types_pb2.Participant) -> "Participant":
        return cls(m.node_id, m.rank, _enum(Role, m.role))


@dataclass(frozen=True)
class Token:
    """The 128-bit abort token of an aborted room-generation (all zero: none)."""
    hi: int = 0
    lo: int = 0

    @property
    def is_zero(self) -> bool:
        return self.hi == 0 and self.lo == 0

    def __str__(self) -> str:
        return "%016x%016x" % (self.hi, self.lo)

    @classmethod
    def _from(cls, m: types_pb2.AbortToken) -> "Token":
        return cls(m.hi, m.lo)


@dataclass(frozen=True)
class Lease:
    """A page lease: the pages of `pool_id` that belong to `room`."""
    lease_id: int
    room: RoomKey
    participant: Participant
    pool_id: int
    ranges: Tuple[PageRange, ...]
    mode: LeaseMode
    state: LeaseState
    # RELEASING in an ended room, waiting for a proof from its lost node's own
    # host (that incarnation's Drained, or its death witnessed there).
    awaiting_host_proof: bool = False

    def pages(self) -> List[int]:
        """Every page index of the lease, in lease order."""
        return [p for r in self.ranges for p in r.pages]

    def page_count(self) -> int:
        """How many pages the lease holds: its version (a lease only grows),
        for submit_chunk's source_lease_pages / sink_lease_pages."""
        return sum(r.count for r in self.ranges)

    @classmethod
    def _from(cls, m: types_pb2.Lease) -> "Lease":
        return cls(m.lease_id, RoomKey._from(m.room), Participant._from(m.participant), m.pool_id,
                   _ranges_from(m.ranges), _enum(LeaseMode, m.mode), _enum(LeaseState, m.state),
                   m.awaiting_host_proof)


@dataclass(frozen=True)
class JoinResult:
    room: RoomKey  # with the generation minted by the control plane
    lease_id: int
    state: RoomState  # OPENING, or ACTIVE for the join that completed the room
    protocol_version: int


@dataclass(frozen=True)
class AbortResult:
    room: RoomKey
    token: Token
    state: RoomState  # ABORTING, or ABORTED when the proof is already complete
    already_aborting: bool
    reason: AbortReason


@dataclass(frozen=True)
class Pool:
    pool_id: int
    kind: PoolKind
    page_size: int
    page_count: int
    owner_rank: int = 0
    base_addr: int = 0
    rkey: int = 0
    cuda_device: int = 0

    @classmethod
    def _from(cls, m: types_pb2.Pool) -> "Pool":
        return cls(m.pool_id, _enum(PoolKind, m.kind), m.page_size, m.page_count, m.owner_rank,
                   m.base_addr, m.rkey, m.cuda_device)


@dataclass(frozen=True)
class PoolBuffer:
    """One buffer of a pool of several (NodeClient.register_pool_buffers):
    `page_size` bytes of it per page, and its memory, exactly one of
    shm_name (a POSIX shm object; `offset` bytes in), fd (an open shm or
    memfd descriptor; `offset` bytes in), ptr (a device pointer) or ipc (a
    kvfence.device.CudaIpc). size: its bytes (default page_size x the
    pool's page_count)."""
    page_size: int
    shm_name: Optional[str] = None
    fd: Optional[int] = None
    ptr: Optional[int] = None
    ipc: Optional[_device.CudaIpc] = None
    offset: int = 0
    size: Optional[int] = None


@dataclass(frozen=True)
class LeaseReleased:
    """WatchLeases: the lease is RELEASED; its pages are the engine's again."""
    lease: Lease


@dataclass(frozen=True)
class RoomStateChanged:
    """WatchLeases (include_room_states): a room changed state."""
    room: RoomKey
    old_state: RoomState
    new_state: RoomState
    reason: AbortReason
    token: Token


@dataclass(frozen=True)
class WatchSynced:
    """WatchLeases: the replay of past releases is over; live events follow."""
    replayed: int


WatchEvent = Union[LeaseReleased, RoomStateChanged, WatchSynced]


def _event_from(m: control_pb2.LeaseEvent) -> Optional[WatchEvent]:
    which = m.WhichOneof("event")
    if which == "released":
        return LeaseReleased(Lease._from(m.released))
    if which == "room_state":
        rs = m.room_state
        return RoomStateChanged(RoomKey._from(rs.room), _enum(RoomState, rs.old_state),
                                _enum(RoomState, rs.new_state), _enum(AbortReason, rs.reason),
                                Token._from(rs.token))
    if which == "synced":
        return WatchSynced(m.synced.replayed)
    return None  # an event kind this client does not know


@dataclass(frozen=True)
class NodeRoomState:
    """NodeClient.watch: a room's state as the node knows it (the first event
    per matching room, then on every change)."""
    room: RoomKey
    state: RoomState
    lifetime: LifetimeState
    reason: AbortReason


@dataclass(frozen=True)
class ChunkDone:
    """NodeClient.watch (include_chunks): a chunk a local source submitted finished."""
    room: RoomKey
    source_rank: int
    sink_rank: int
    chunk_seq: int
    ok: bool
    error: str
    transport: "TransportKind" = TransportKind.UNSPECIFIED  # TCP, LOCAL or RDMA


@dataclass(frozen=True)
class AuxReceived:
    """NodeClient.watch: the aux bytes of a source's last chunk reached a
    sink rank on this node (byte-exact)."""
    room: RoomKey
    source_rank: int
    sink_rank: int
    data: bytes


@dataclass(frozen=True)
class TransferDone:
    """NodeClient.watch: a source's transfer to a sink rank on this node
    ended (ok: the source reported success and every chunk arrived)."""
    room: RoomKey
    source_node_id: str
    source_rank: int
    sink_rank: int
    ok: bool
    error: str


NodeEvent = Union[NodeRoomState, ChunkDone, AuxReceived, TransferDone]


def _node_event_from(m: node_pb2.NodeEvent) -> Optional[NodeEvent]:
    room = RoomKey._from(m.room)
    which = m.WhichOneof("event")
    if which == "room_state":
        e = m.room_state
        return NodeRoomState(room, _enum(RoomState, e.state), _enum(LifetimeState, e.lifetime),
                             _enum(AbortReason, e.reason))
    if which == "chunk_done":
        c = m.chunk_done
        return ChunkDone(room, c.source_rank, c.sink_rank, c.chunk_seq, c.ok, c.error,
                         _enum(TransportKind, c.transport))
    if which == "aux":
        return AuxReceived(room, m.aux.source_rank, m.aux.sink_rank, bytes(m.aux.data))
    if which == "transfer_done":
        t = m.transfer_done
        return TransferDone(room, t.source_node_id, t.source_rank, t.sink_rank, t.ok, t.error)
    return None  # an event kind this client does not know


@dataclass(frozen=True)
class ChunkRequest:
    """One chunk for NodeClient.submit_chunks: the arguments of submit_chunk."""
    room: RoomKey
    chunk_seq: int
    source_rank: int
    source_pool_id: int
    source_ranges: RangesLike
    sink_node_id: str
    sink_rank: int
    sink_pool_id: int
    sink_ranges: RangesLike
    last_chunk: bool = False
    aux: bytes = b""
    source_lease_pages: int = 0
    sink_lease_pages: int = 0

    def _pb(self) -> node_pb2.SubmitChunkRequest:
        return node_pb2.SubmitChunkRequest(
            room=self.room._pb(), chunk_seq=self.chunk_seq, source_rank=self.source_rank,
            source_pool_id=self.source_pool_id, source_ranges=_ranges(self.source_ranges),
            sink_node_id=self.sink_node_id, sink_rank=self.sink_rank,
            sink_pool_id=self.sink_pool_id, sink_ranges=_ranges(self.sink_ranges),
            last_chunk=self.last_chunk, aux=self.aux,
            source_lease_pages=self.source_lease_pages, sink_lease_pages=self.sink_lease_pages)


_CODE_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True)
class ChunkResult:
    """NodeClient.submit_chunks: the node's answer to one request. code OK:
    admitted (as a submit_chunk reply); otherwise the code submit_chunk would
    have raised, and `message` names the field. error() is that exception."""
    chunk_seq: int
    code: grpc.StatusCode
    message: str

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def error(self) -> Optional[errors.KvfenceError]:
        if self.ok:
            return None
        return errors.make_error(self.code, self.message, "NodeLocal.SubmitChunks")


@dataclass(frozen=True)
class ParticipantInfo:
    participant: Participant
    node_incarnation: int
    lease: Optional[Lease]
    completed: bool
    drained: bool
    fenced: bool
    notice_attempts: int


@dataclass(frozen=True)
class RoomInfo:
    room: RoomKey
    state: RoomState
    abort_reason: AbortReason
    token: Token
    expected_sources: int
    expected_sinks: int
    protocol_version: int
    age_ms: int
    state_age_ms: int
    past_drain_deadline: bool
    participant_count: int
    participants: Tuple[ParticipantInfo, ...] = ()

    @classmethod
    def _from(cls, m: control_pb2.RoomInfo) -> "RoomInfo":
        parts = tuple(
            ParticipantInfo(Participant._from(p.participant), p.node_incarnation,
                            Lease._from(p.lease) if p.HasField("lease") else None, p.completed,
                            p.drained, p.fenced, p.notice_attempts) for p in m.participants)
        return cls(RoomKey._from(m.room), _enum(RoomState, m.state),
                   _enum(AbortReason, m.abort_reason), Token._from(m.token), m.expected_sources,
                   m.expected_sinks, m.protocol_version, m.age_ms, m.state_age_ms,
                   m.past_drain_deadline, m.participant_count, parts)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    incarnation: int
    state: NodeState
    protocol_version: int
    features: Tuple[str, ...]
    endpoints: Tuple[Tuple[int, str], ...]  # (EndpointKind number, address)
    pools: Tuple[Pool, ...]
    room_count: int
    state_age_ms: int
    last_seen_ms: int
    notices_pending: int

    @classmethod
    def _from(cls, m: control_pb2.NodeInfo) -> "NodeInfo":
        return cls(m.node_id, m.incarnation, _enum(NodeState, m.state), m.protocol_version,
                   tuple(m.capabilities.features), tuple((e.kind, e.address) for e in m.endpoints),
                   tuple(Pool._from(p) for p in m.pools), m.room_count, m.state_age_ms,
                   m.last_seen_ms, m.notices_pending)


def _msg_dict(m: Any) -> Dict[str, Any]:
    """A message with scalar and nested-message fields as a plain dict (ints stay ints)."""
    out: Dict[str, Any] = {}
    for f in m.DESCRIPTOR.fields:
        v = getattr(m, f.name)
        out[f.name] = _msg_dict(v) if f.message_type is not None and f.label != f.LABEL_REPEATED \
            else v
    return out


def _room_key(room: Union[RoomKey, int, Tuple[int, int]]) -> RoomKey:
    if isinstance(room, RoomKey):
        return room
    if isinstance(room, tuple):
        return RoomKey(int(room[0]), int(room[1]))
    return RoomKey(int(room), 0)


# ---- channel plumbing -----------------------------------------------------------

class _ChannelOwner:
    """What the sync client and its grpc.aio twin (aio._AsyncClient) share:
    the target, the default timeout, and the channel, opened here from
    `grpc_mod` (grpc or grpc.aio) unless one is passed in, in which case the
    caller keeps it and close() leaves it open."""

    def __init__(self, grpc_mod: Any, target: Optional[str], channel: Any,
                 credentials: Optional[grpc.ChannelCredentials],
                 options: Optional[Sequence[Tuple[str, Any]]], timeout: float) -> None:
        if channel is None and target is None:
            raise ValueError("a target or a channel is required")
        self.target = target
        self.timeout = timeout
        self._owns_channel = channel is None
        if channel is None:
            channel = (grpc_mod.secure_channel(target, credentials, options=options)
                       if credentials else grpc_mod.insecure_channel(target, options=options))
        self.channel = channel
        self._closed = False

    def _closing(self) -> bool:
        """Marks the client closed; True once, when its own channel must be
        closed now (close() is idempotent)."""
        if self._closed:
            return False
        self._closed = True
        return self._owns_channel


class _Client(_ChannelOwner):
    """A channel, a default timeout, error mapping and a context manager."""

    def __init__(self, target: Optional[str] = None, *, channel: Optional[grpc.Channel] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(grpc, target, channel, credentials, options, timeout)
        # What made the channel, for a second one to the same server
        # (ReleaseWatcher's own); None for a channel passed in.
        self._channel_args: Optional[Tuple[Optional[grpc.ChannelCredentials],
                                           Optional[Sequence[Tuple[str, Any]]]]] = \
            (credentials, options) if channel is None else None

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Waits until the channel is connected; DeadlineExceeded otherwise."""
        t = self.timeout if timeout is None else timeout
        try:
            grpc.channel_ready_future(self.channel).result(timeout=t)
        except grpc.FutureTimeoutError:
            raise errors.DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          "%s not ready within %.1f s" % (self.target, t)) from None

    def _unary(self, name: str, fn: Callable[..., Any], req: Any,
               timeout: Optional[float]) -> Any:
        try:
            return fn(req, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, name) from None

    def close(self) -> None:
        """Closes the channel if this client opened it (idempotent)."""
        if self._closing():
            self.channel.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_E = TypeVar("_E")


class _EventStream(Iterator[_E]):
    """One server stream of events: next() skips messages that carry no known
    event; cancel() ends it, and the iteration then just stops. Subclasses
    name the RPC (for errors) and the message-to-event converter."""

    _rpc = ""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def _convert(self, m: Any) -> Optional[_E]:
        raise NotImplementedError

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> _E:
        while True:
            try:
                m = next(self._call)
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    raise StopIteration from None
                raise errors.from_rpc_error(e, self._rpc) from None
            ev = self._convert(m)
            if ev is not None:
                return ev

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


class LeaseWatch(_EventStream[WatchEvent]):
    """An open WatchLeases stream: iterate it for events; cancel() (or leaving
    the `with` block) ends it, and the iteration then just stops. A stream
    error raises the matching KvfenceError (Unavailable on server shutdown:
    resubscribe, and deduplicate by lease_id)."""

    _rpc = "Control.WatchLeases"

    def _convert(self, m: Any) -> Optional[WatchEvent]:
        return _event_from(m)


class NodeWatch(_EventStream[NodeEvent]):
    """An open NodeLocal.Watch stream: iterate it for NodeEvents; close() (or
    cancel(), or leaving the `with` block) ends it, and the iteration then
    just stops. A stream error raises the matching KvfenceError (Unavailable
    when the node shuts down; InvalidArgument naming the filter field)."""

    _rpc = "NodeLocal.Watch"

    def _convert(self, m: Any) -> Optional[NodeEvent]:
        return _node_event_from(m)

    def close(self) -> None:
        self.cancel()


class ChunkStream(Iterator[ChunkResult]):
    """An open NodeLocal.SubmitChunks stream (NodeClient.submit_chunks):
    iterate it for one ChunkResult per request, in request order. The
    requests are sent from gRPC's own thread, at most `window` without a
    result (the node ends a stream with more than 64 outstanding). close()
    (or cancel(), or leaving the `with` block) stops sending and ends the
    stream; requests sent by then may or may not have been admitted (Watch's
    chunk_done tells). A stream error raises the matching KvfenceError
    (Unavailable when the node shuts down)."""

    def __init__(self, stub: Any, requests: Iterable[ChunkRequest], window: int,
                 timeout: Optional[float]) -> None:
        self._slots = threading.Semaphore(window)
        self._cancelled = threading.Event()
        self._call = stub.SubmitChunks(self._send(iter(requests)), timeout=timeout)

    def _send(self, reqs: Iterator[ChunkRequest]) -> Iterator[node_pb2.SubmitChunkRequest]:
        # Runs on gRPC's request-consuming thread: block for a window slot,
        # but wake up to see a cancel.
        for r in reqs:
            while not self._slots.acquire(timeout=0.1):
                if self._cancelled.is_set():
                    return
            if self._cancelled.is_set():
                return
            yield r._pb()

    def __iter__(self) -> "ChunkStream":
        return self

    def __next__(self) -> ChunkResult:
        try:
            m = next(self._call)
        except grpc.RpcError as e:
            if self._cancelled.is_set() and e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise errors.from_rpc_error(e, "NodeLocal.SubmitChunks") from None
        self._slots.release()
        return ChunkResult(m.chunk_seq, _CODE_BY_NUMBER.get(m.code, grpc.StatusCode.UNKNOWN),
                           m.message)

    def cancel(self) -> None:
        self._cancelled.set()
        self._call.cancel()

    close = cancel

    def __enter__(self) -> "ChunkStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


# ---- Control ----------------------------------------------------------------------

# A ControlClient's own channel serves its streams (WatchLeases) on grpcio's
# single-threaded path: the thread that iterates polls the call itself, with
# the GIL released, instead of being handed each message by the channel's
# spin thread (two contended GIL acquisitions per message under load;
# watch.py, bench/README.md "Python release watcher"). Unary calls do not
# change. A channel passed in keeps its own options.
_WATCH_CHANNEL_OPTIONS: Tuple[Tuple[str, Any], ...] = (
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)


class ControlClient(_Client):
    """kvfence.v1.Control on kvfence-control ("host:port").

        with ControlClient("127.0.0.1:7070") as ctl:
            j = ctl.join_room(room_id, Participant("n2", 0, Role.SINK), pool_id, [(16, 8)])
    """

    def __init__(self, target: Optional[str] = None, **kw: Any) -> None:
        if kw.get("channel") is None:
            options = tuple(kw.get("options") or ())
            kw["options"] = options + tuple(o for o in _WATCH_CHANNEL_OPTIONS
                                            if o not in options)
        super().__init__(target, **kw)
        self._stub = control_pb2_grpc.ControlStub(self.channel)

    def join_room(self, room_id: int, participant: Participant, pool_id: int,
                  ranges: RangesLike = (), *, pages: Union[PageSet, Iterable[int], None] = None,
                  expected_sources: int = 1, expected_sinks: int = 1,
                  features: Iterable[str] = DEFAULT_FEATURES,
                  protocol: Tuple[int, int] = DEFAULT_PROTOCOL, timeout: Optional[float] = None,
                  retry_s: float = 0.0) -> JoinResult:
        """Grants `participant`'s lease on `ranges` of `pool_id` to room `room_id`,
        or on `pages`: a PageSet or page indices in any order, each once
        (e.g. SGLang's kv_indices), sent as a page set in its smallest form.
        Give one of ranges and pages (neither: an empty lease).

        retry_s > 0 retries NOT_FOUND and UNAVAILABLE for that long: a pool
        registered a moment ago reaches the control plane by the node's
        PoolUpdate, which may come after this call.
        """
        req = _convert.join_room_request(room_id, participant, pool_id, ranges, pages,
                                         expected_sources, expected_sinks, features, protocol)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                r = self._unary("Control.JoinRoom", self._stub.JoinRoom, req, timeout)
                return _convert.join_result(r)
            except _convert.JOIN_RETRY:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_RETRY_SLEEP_S)

    def extend_lease(self, room: RoomKey, lease_id: int, ranges: RangesLike = (), *,
                     pages: Union[PageSet, Iterable[int], None] = None,
                     timeout: Optional[float] = None) -> Lease:
        """Adds pages to a lease (chunked prefill), as `ranges` or as `pages`
        (a PageSet or page indices, as join_room takes them); returns the
        whole lease."""
        req = _convert.extend_lease_request(room, lease_id, ranges, pages)
        r = self._unary("Control.ExtendLease", self._stub.ExtendLease, req, timeout)
        return _convert.extend_lease_result(r)

    def complete_room(self, room: RoomKey, participant: Participant, *,
                      timeout: Optional[float] = None) -> RoomState:
        """Declares `participant` finished; returns the room's state. Not a
        release: the pages come back through watch_leases."""
        req = _convert.complete_room_request(room, participant)
        r = self._unary("Control.CompleteRoom", self._stub.CompleteRoom, req, timeout)
        return _convert.complete_room_result(r)

    def abort_room(self, room: Union[RoomKey, int], detail: str = "", *,
                   timeout: Optional[float] = None) -> AbortResult:
        """Aborts a room-generation (an int or generation 0: the current one).
        Idempotent. Not a release: the pages come back through watch_leases."""
        req = _convert.abort_room_request(room, detail)
        r = self._unary("Control.AbortRoom", self._stub.AbortRoom, req, timeout)
        return _convert.abort_room_result(r)

    def watch_leases(self, *, node_id: str = "", ranks: Iterable[int] = (),
                     lease_ids: Iterable[int] = (), include_room_states: bool = False,
                     timeout: Optional[float] = None) -> LeaseWatch:
        """Opens a WatchLeases stream (no deadline unless `timeout`): replayed
        releases, one WatchSynced, then live events."""
        req = _convert.watch_leases_request(node_id, ranks, lease_ids, include_room_states)
        return LeaseWatch(self._stub.WatchLeases(req, timeout=timeout))

    def wait_released(self, lease_id: int, timeout: float) -> Lease:
        """Blocks until lease `lease_id` is RELEASED and returns it (final state
        and ranges). Raises DeadlineExceeded after `timeout` seconds: the pages
        are then still NOT free. Resubscribes if the server restarts."""
        return self.wait_all_released([lease_id], timeout)[lease_id]

    def wait_all_released(self, lease_ids: Iterable[int], timeout: float) -> Dict[int, Lease]:
        """wait_released for several leases: every one of them, or DeadlineExceeded.
        No lease ids: {} at once (an empty filter would watch every lease)."""
        want: Set[int] = set(lease_ids)
        got: Dict[int, Lease] = {}
        if not want:
            return got
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with self.watch_leases(lease_ids=sorted(want - set(got)), timeout=left) as w:
                    for ev in w:
                        if isinstance(ev, LeaseReleased) and ev.lease.lease_id in want:
                            got[ev.lease.lease_id] = ev.lease
                            if len(got) == len(want):
                                return got
            except errors.Unavailable:
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            except errors.DeadlineExceeded:
                break
        raise _convert.not_released(sorted(want - set(got)), timeout)

    def release_watcher(self, on_released: Callable[[Lease], None], **kw: Any) -> "ReleaseWatcher":
        """A ReleaseWatcher on this client (not started); see ReleaseWatcher."""
        return ReleaseWatcher(self, on_released, **kw)


# ---- NodeLocal --------------------------------------------------------------------

class NodeClient(_Client):
    """kvfence.v1.NodeLocal on a kvfence-node's unix socket ("unix:/path", or a
    bare absolute path)."""

    def __init__(self, target: Optional[str] = None, **kw: Any) -> None:
        if target is not None and target.startswith("/"):
            target = "unix:" + target
        super().__init__(target, **kw)
        self._stub = node_pb2_grpc.NodeLocalStub(self.channel)
        # The fd socket beside the NodeLocal socket (register_pool_fd).
        self._fd_socket: Optional[str] = None
        if target is not None and target.startswith("unix:"):
            self._fd_socket = target[len("unix:"):] + ".fds"

    def register_pool_shm(self, shm_name: str, page_size: int, page_count: int, *,
                          rank: int = 0, offset: int = 0, size: Optional[int] = None,
                          timeout: Optional[float] = None) -> Pool:
        """Registers a POSIX shared memory object (the shm_open name; a missing
        leading "/" is added, as multiprocessing.shared_memory names lack it)
        as a pool of page_count pages of page_size bytes; returns the pool with
        its node-assigned id.

        This process opens the object read-write itself and hands the
        descriptor to the node on its fd socket (register_pool_fd), so the
        node maps only memory this process may use (docs/security.md,
        "NodeLocal"). A node without the fd socket, or an object this process
        cannot open, is asked by name: the node then answers NotFound, or
        PermissionDenied naming host_shm.shm_name unless every caller of its
        socket could open the object."""
        if not shm_name.startswith("/"):
            shm_name = "/" + shm_name
        if size is None:
            size = page_size * page_count
        try:
            fd: Optional[int] = os.open("/dev/shm" + shm_name,
                                        os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            fd = None
        if fd is not None:
            try:
                handle = self._hand_over(fd)
            finally:
                os.close(fd)
            if handle is not None:
                return self._register_handle(handle, page_size, page_count, rank, offset, size,
                                             timeout)
        req = node_pb2.RegisterPoolRequest(
            host_shm=node_pb2.HostShmMemory(shm_name=shm_name, offset=offset, size=size),
            page_size=page_size, page_count=page_count, rank=rank)
        r = self._unary("NodeLocal.RegisterPool", self._stub.RegisterPool, req, timeout)
        return Pool._from(r.pool)

    def register_pool_fd(self, fd: int, page_size: int, page_count: int, *, rank: int = 0,
                         offset: int = 0, size: Optional[int] = None,
                         timeout: Optional[float] = None) -> Pool:
        """Registers the memory of `fd` (a POSIX shm object or an os.memfd_create
        descriptor, open read-write; the caller keeps it) as a pool: the
        descriptor goes to the node on its fd socket (socket.send_fds), and
        RegisterPool names the one-time handle the node answered (host_fd).
        Unavailable when the node has no fd socket."""
        if size is None:
            size = page_size * page_count
        handle = self._hand_over(fd)
        if handle is None:
            raise errors.make_error(grpc.StatusCode.UNAVAILABLE,
                                    "no fd socket at %s (a node older than it?)" % self._fd_socket,
                                    "NodeLocal.RegisterPool")
        return self._register_handle(handle, page_size, page_count, rank, offset, size, timeout)

    def _register_handle(self, handle: bytes, page_size: int, page_count: int, rank: int,
                         offset: int, size: int, timeout: Optional[float]) -> Pool:
        req = node_pb2.RegisterPoolRequest(
            host_fd=node_pb2.HostFdMemory(handle=handle, offset=offset, size=size),
            page_size=page_size, page_count=page_count, rank=rank)
        r = self._unary("NodeLocal.RegisterPool", self._stub.RegisterPool, req, timeout)
        return Pool._from(r.pool)

    def _hand_over(self, fd: int) -> Optional[bytes]:
        """Sends `fd` on the fd socket (common/kvf_fdpass.h: "KVFD" + version 1
        with the descriptor; the answer "KVFD" + errno + a 16-byte handle).
        The handle, or None when no node serves the fd socket."""
        method = "NodeLocal.RegisterPool"
        if self._fd_socket is None:
            return None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(_FDPASS_TIMEOUT_S)
            try:
                s.connect(self._fd_socket)
            except (FileNotFoundError, ConnectionRefusedError):
                return None
            except OSError as e:
                raise errors.make_error(grpc.StatusCode.UNAVAILABLE,
                                        "fd socket %s: %s" % (self._fd_socket, e), method) from None
            try:
                socket.send_fds(s, [_FDPASS_MAGIC + struct.pack("<I", 1)], [fd])
                rep = b""
                while len(rep) < 24:
                    part = s.recv(24 - len(rep))
                    if not part:
                        break
                    rep += part
            except OSError as e:
                raise errors.make_error(grpc.StatusCode.UNAVAILABLE,
                                        "fd socket %s: %s" % (self._fd_socket, e), method) from None
        if len(rep) != 24 or rep[:4] != _FDPASS_MAGIC:
            raise errors.make_error(grpc.StatusCode.UNAVAILABLE,
                                    "fd socket %s: not a kvfence fd socket" % self._fd_socket,
                                    method)
        err = struct.unpack("<I", rep[4:8])[0]
        if err:
            code = {errno.EACCES: grpc.StatusCode.PERMISSION_DENIED,
                    errno.ENOSPC: grpc.StatusCode.RESOURCE_EXHAUSTED}.get(
                        err, grpc.StatusCode.INVALID_ARGUMENT)
            raise errors.make_error(code, "fd socket %s: the node refused the descriptor: %s"
                                    % (self._fd_socket, os.strerror(err)), method)
        return rep[8:24]

    def register_pool_cuda(self, page_size: int, page_count: int, *, ptr: Optional[int] = None,
                           ipc: Optional[_device.CudaIpc] = None, size: Optional[int] = None,
                           rank: int = 0, pool_key: str = "",
                           timeout: Optional[float] = None) -> Pool:
        """Registers CUDA device memory as a pool of page_count pages of
        page_size bytes (page i at ptr + i * page_size): either `ptr`, a
        device pointer (an int: a tensor's data_ptr()), which this process
        exports (kvfence.device.export: cudaIpcGetMemHandle, or the fake
        handle of a FakeDeviceBuffer), or `ipc`, an export made elsewhere
        (kvfence.device.export_tensor, torch's _share_cuda_()). The node opens
        the handle (cuda_ipc): FailedPrecondition when it was built without
        CUDA or lacks the device, InvalidArgument naming cuda_ipc.ipc_handle
        when the CUDA runtime refuses it. pool_key: the memory's identity
        across node restarts (device memory has no name the node could see)."""
        if (ptr is None) == (ipc is None):
            raise ValueError("register_pool_cuda: give exactly one of ptr and ipc")
        if ipc is None:
            ipc = _device.export(int(ptr))  # type: ignore[arg-type]
        req = node_pb2.RegisterPoolRequest(
            cuda_ipc=self._cuda_memory(ipc, page_size * page_count if size is None else size),
            page_size=page_size, page_count=page_count, rank=rank, pool_key=pool_key)
        r = self._unary("NodeLocal.RegisterPool", self._stub.RegisterPool, req, timeout)
        return Pool._from(r.pool)

    def register_pool_buffers(self, buffers: Sequence["PoolBuffer"], page_count: int, *,
                              rank: int = 0, pool_key: str = "",
                              timeout: Optional[float] = None) -> Pool:
        """Registers several buffers as one pool of page_count pages: page i is
        slot i of every buffer (bytes [i * b.page_size, (i + 1) * b.page_size)
        of buffer b), so one lease and one chunk cover them all; the pool's
        page_size is the sum of the buffers' and a page travels as their
        slots in buffer order (the sink's pool must list the same sizes in
        the same order). Each PoolBuffer names its memory: shm_name or fd
        (host memory, handed over as a descriptor), ptr (device memory,
        exported here) or ipc (exported elsewhere). A bad buffer raises
        InvalidArgument (NotFound, ...) naming it, "buffers[3].page_size",
        and nothing is registered."""
        req = node_pb2.RegisterPoolRequest(page_count=page_count, rank=rank, pool_key=pool_key)
        for i, b in enumerate(buffers):
            pb = req.buffers.add(page_size=b.page_size)
            size = b.page_size * page_count if b.size is None else b.size
            given = [x is not None for x in (b.shm_name, b.fd, b.ptr, b.ipc)]
            if sum(given) != 1:
                raise ValueError("register_pool_buffers: buffers[%d]: give exactly one of "
                                 "shm_name, fd, ptr and ipc" % i)
            if b.ptr is not None or b.ipc is not None:
                ipc = b.ipc if b.ipc is not None else _device.export(int(b.ptr))  # type: ignore
                pb.cuda_ipc.CopyFrom(self._cuda_memory(ipc, size))
                continue
            handle = None
            if b.fd is not None:
                handle = self._hand_over(b.fd)
                if handle is None:
                    raise errors.make_error(grpc.StatusCode.UNAVAILABLE,
                                            "buffers[%d].fd: no fd socket at %s" %
                                            (i, self._fd_socket), "NodeLocal.RegisterPool")
            else:
                name = str(b.shm_name)
                if not name.startswith("/"):
                    name = "/" + name
                try:
                    fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    fd = -1
                if fd >= 0:
                    try:
                        handle = self._hand_over(fd)
                    finally:
                        os.close(fd)
                if handle is None:
                    pb.host_shm.CopyFrom(node_pb2.HostShmMemory(shm_name=name, offset=b.offset,
                                                                size=size))
                    continue
            pb.host_fd.CopyFrom(node_pb2.HostFdMemory(handle=handle, offset=b.offset, size=size))
        r = self._unary("NodeLocal.RegisterPool", self._stub.RegisterPool, req, timeout)
        return Pool._from(r.pool)

    def register_pool_sglang(self, kv_data_ptrs: Sequence[int], kv_data_lens: Sequence[int],
                             kv_item_lens: Sequence[int], *, page_count: Optional[int] = None,
                             rank: int = 0, pool_key: str = "",
                             timeout: Optional[float] = None) -> Pool:
        """Registers SGLang's KV buffers as one pool, in its own terms
        (KVArgs.kv_data_ptrs / kv_data_lens / kv_item_lens: per buffer its
        device address, bytes and bytes per page). Page i is slot i of every
        buffer, as SGLang's kv_indices index every layer at once.
        page_count: default lens[0] // item_lens[0], which every buffer must
        then hold exactly (ValueError naming kv_data_lens[i] otherwise).
        SGLang's aux buffers are indexed by request, not by page: register
        them as a pool of their own."""
        if not (len(kv_data_ptrs) == len(kv_data_lens) == len(kv_item_lens)) or \
                not kv_data_ptrs:
            raise ValueError("register_pool_sglang: three lists of one length (>= 1)")
        exact = page_count is None
        if page_count is None:
            page_count = kv_data_lens[0] // kv_item_lens[0] if kv_item_lens[0] else 0
        bufs = []
        for i, (ptr, size, item) in enumerate(zip(kv_data_ptrs, kv_data_lens, kv_item_lens)):
            pages = size // item if item else 0
            if not item or pages < page_count or (exact and pages != page_count) or \
                    not page_count:
                raise ValueError("register_pool_sglang: kv_data_lens[%d]: %d bytes hold %d "
                                 "pages of %d bytes, not %d" % (i, size, pages, item, page_count))
            bufs.append(PoolBuffer(int(item), ptr=int(ptr), size=int(size)))
        return self.register_pool_buffers(bufs, page_count, rank=rank, pool_key=pool_key,
                                          timeout=timeout)

    def register_pool_vllm(self, kv_caches: Dict[str, Any], *, num_blocks: Optional[int] = None,
                           rank: int = 0, pool_key: str = "",
                           timeout: Optional[float] = None) -> Pool:
        """Registers vLLM's KV caches (KVConnector.register_kv_caches: layer
        name -> tensor, block i = page i) as one pool, layers in the dict's
        order (the sink must register the same model in the same order). A
        tensor of shape [2, num_blocks, ...] (FlashAttention) is two buffers,
        its K and V halves; [num_blocks, ...] (FlashInfer, MLA) is one.
        num_blocks: default the tensors' (shape[1] of a [2, ...] tensor,
        else shape[0]). Each tensor must be contiguous device memory (a torch
        CUDA tensor, exported with torch's IPC export; or anything with
        data_ptr(), shape, element_size() and numel(), e.g. a test's fake)."""
        if not kv_caches:
            raise ValueError("register_pool_vllm: no layers")
        bufs = []
        for name, t in kv_caches.items():
            shape = tuple(t.shape)
            if hasattr(t, "is_contiguous") and not t.is_contiguous():
                raise ValueError("register_pool_vllm: layer %r is not contiguous" % name)
            # [2, num_blocks, ...] unless the blocks are known to be 2 and
            # shape[1] is not (then it is [num_blocks=2, ...]).
            split = len(shape) >= 2 and shape[0] == 2 and \
                not (num_blocks == 2 and shape[1] != 2)
            blocks = shape[1] if split else shape[0]
            if num_blocks is None:
                num_blocks = blocks
            if blocks != num_blocks:
                raise ValueError("register_pool_vllm: layer %r has %d blocks, not %d" %
                                 (name, blocks, num_blocks))
            nbytes = int(t.numel()) * int(t.element_size())
            parts = 2 if split else 1
            if nbytes % (parts * num_blocks):
                raise ValueError("register_pool_vllm: layer %r: %d bytes are not %d x %d "
                                 "blocks" % (name, nbytes, parts, num_blocks))
            half = nbytes // parts
            base = _device.export_tensor(t)
            for k in range(parts):
                ipc = _device.CudaIpc(base.handle, base.device, base.offset + k * half)
                bufs.append(PoolBuffer(half // num_blocks, ipc=ipc, size=half))
        return self.register_pool_buffers(bufs, num_blocks,  # type: ignore[arg-type]
                                          rank=rank, pool_key=pool_key, timeout=timeout)

    @staticmethod
    def _cuda_memory(ipc: _device.CudaIpc, size: int) -> node_pb2.CudaIpcMemory:
        return node_pb2.CudaIpcMemory(ipc_handle=ipc.handle, offset=ipc.offset, size=size,
                                      device=ipc.device)

    def unregister_pool(self, pool_id: int, *, timeout: Optional[float] = None) -> None:
        """Unregisters a pool. NotFound for an unknown pool_id; FailedPrecondition
        (naming the pool and the room) while a room whose lease on this node
        uses the pool has not drained: retry later."""
        req = node_pb2.UnregisterPoolRequest(pool_id=pool_id)
        self._unary("NodeLocal.UnregisterPool", self._stub.UnregisterPool, req, timeout)

    def watch(self, rooms: Optional[Iterable[Union[RoomKey, int, Tuple[int, int]]]] = None,
              ranks: Optional[Iterable[int]] = None, include_chunks: bool = False, *,
              timeout: Optional[float] = None) -> NodeWatch:
        """Opens a Watch stream of the rooms on this node (no deadline unless
        `timeout`): one NodeRoomState per matching room whose lifetime has not
        drained, then live events (NodeRoomState, AuxReceived, TransferDone,
        and ChunkDone with include_chunks). rooms: RoomKeys or ids (an int
        or generation 0: any generation); None or empty: all. ranks: local
        ranks; None or empty: all."""
        req = node_pb2.WatchRequest(rooms=[_room_key(r)._pb() for r in (rooms or ())],
                                    ranks=list(ranks or ()), include_chunks=include_chunks)
        return NodeWatch(self._stub.Watch(req, timeout=timeout))

    def submit_chunks(self, requests: Iterable[ChunkRequest], *, window: int = 64,
                      timeout: Optional[float] = None) -> ChunkStream:
        """Submits ChunkRequests pipelined on one SubmitChunks stream; iterate
        the result for one ChunkResult per request, in order. A refused
        chunk is a result with its code (ChunkResult.error()), not an
        exception, and later requests are still handled; stop feeding
        requests if nothing may follow a refused one. No deadline unless
        `timeout`. window (1..64): requests in flight without a result."""
        if not 1 <= window <= 64:
            raise ValueError("window: must be in 1..64, got %r" % (window,))
        return ChunkStream(self._stub, requests, window, timeout)

    def submit_chunk(self, room: RoomKey, chunk_seq: int, *, source_rank: int,
                     source_pool_id: int, source_ranges: RangesLike, sink_node_id: str,
                     sink_rank: int, sink_pool_id: int, sink_ranges: RangesLike,
                     last_chunk: bool = False, aux: bytes = b"", timeout: Optional[float] = None,
                     retry_unavailable_s: float = 0.0, source_lease_pages: int = 0,
                     sink_lease_pages: int = 0) -> int:
        """Submits one chunk (source pages on this node -> sink pages on
        `sink_node_id`); returns its chunk_seq once admitted (queued or
        posted, not done). retry_unavailable_s > 0 retries UNAVAILABLE (the
        node has not yet received the room's update) for that long.
        source_lease_pages / sink_lease_pages: the page count of each lease
        as the caller knows it (Lease.page_count() after extend_lease, 0:
        not given). Name them after an extend_lease: this node learns the
        extension only once the lease's own node acknowledged it, and until
        then it answers UNAVAILABLE (retried) instead of FAILED_PRECONDITION."""
        req = node_pb2.SubmitChunkRequest(
            room=room._pb(), chunk_seq=chunk_seq, source_rank=source_rank,
            source_pool_id=source_pool_id, source_ranges=_ranges(source_ranges),
            sink_node_id=sink_node_id, sink_rank=sink_rank, sink_pool_id=sink_pool_id,
            sink_ranges=_ranges(sink_ranges), last_chunk=last_chunk, aux=aux,
            source_lease_pages=source_lease_pages, sink_lease_pages=sink_lease_pages)
        deadline = time.monotonic() + retry_unavailable_s
        while True:
            try:
                r = self._unary("NodeLocal.SubmitChunk", self._stub.SubmitChunk, req, timeout)
                return int(r.chunk_seq)
            except errors.Unavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_RETRY_SLEEP_S / 2)


# ---- Admin ------------------------------------------------------------------------

class AdminClient(_Client):
    """kvfence.v1.Admin on kvfence-control (operators, tests, tools)."""

    def __init__(self, target: Optional[str] = None, **kw: Any) -> None:
        super().__init__(target, **kw)
        self._stub = control_pb2_grpc.AdminStub(self.channel)

    def ping(self, *, timeout: Optional[float] = None) -> None:
        self._unary("Admin.Ping", self._stub.Ping, control_pb2.PingRequest(), timeout)

    def stats(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """GetStats as a dict: {"rooms": {"opening": ..}, "leases": {..}, "nodes": {..}, ...}."""
        r = self._unary("Admin.GetStats", self._stub.GetStats, control_pb2.GetStatsRequest(),
                        timeout)
        return _msg_dict(r)

    def room(self, room: Union[RoomKey, int], *, timeout: Optional[float] = None) -> RoomInfo:
        """One room-generation (an int or generation 0: the current one) with its participants."""
        req = _convert.get_room_request(room)
        return RoomInfo._from(self._unary("Admin.GetRoom", self._stub.GetRoom, req, timeout))

    def rooms(self, *, states: Iterable[RoomState] = (), node_id: str = "",
              min_age_ms: int = 0, timeout: Optional[float] = None) -> List[RoomInfo]:
        """Every room matching the filters (all pages), without participants."""
        out: List[RoomInfo] = []
        token = ""
        while True:
            req = control_pb2.ListRoomsRequest(states=[int(s) for s in states], node_id=node_id,
                                               min_age_ms=min_age_ms, page_token=token)
            r = self._unary("Admin.ListRooms", self._stub.ListRooms, req, timeout)
            out.extend(RoomInfo._from(m) for m in r.rooms)
            token = r.next_page_token
            if not token:
                return out

    def nodes(self, *, states: Iterable[NodeState] = (),
              timeout: Optional[float] = None) -> List[NodeInfo]:
        """Every node (current incarnations), all pages."""
        out: List[NodeInfo] = []
        token = ""
        while True:
            req = control_pb2.ListNodesRequest(states=[int(s) for s in states], page_token=token)
            r = self._unary("Admin.ListNodes", self._stub.ListNodes, req, timeout)
            out.extend(NodeInfo._from(m) for m in r.nodes)
            token = r.next_page_token
            if not token:
                return out

    def node(self, node_id: str, *, timeout: Optional[float] = None) -> NodeInfo:
        req = control_pb2.GetNodeRequest(node_id=node_id)
        return NodeInfo._from(self._unary("Admin.GetNode", self._stub.GetNode, req, timeout))

    def leases(self, *, room_id: int = 0, states: Iterable[LeaseState] = (),
               timeout: Optional[float] = None) -> List[Lease]:
        """Every lease matching the filters, all pages."""
        out: List[Lease] = []
        token = ""
        while True:
            req = control_pb2.ListLeasesRequest(room_id=room_id, states=[int(s) for s in states],
                                                page_token=token)
            r = self._unary("Admin.ListLeases", self._stub.ListLeases, req, timeout)
            out.extend(Lease._from(m) for m in r.leases)
            token = r.next_page_token
            if not token:
                return out

    def wait_room_state(self, room: Union[RoomKey, int], want: RoomState,
                        timeout: float) -> RoomInfo:
        """Polls GetRoom until the room is in `want` (for a terminal state: and
        every lease RELEASED); DeadlineExceeded otherwise."""
        deadline = time.monotonic() + timeout
        last: Optional[RoomInfo] = None
        while True:
            last = self.room(room)
            done = last.state == want
            if done and want.terminal:
                done = all(p.lease is not None and p.lease.state == LeaseState.RELEASED
                           for p in last.participants)
            if done:
                return last
            if time.monotonic() >= deadline:
                raise errors.DeadlineExceeded(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "room %s: %s after %.3g s, want %s" % (last.room, last.state.name
                                                           if isinstance(last.state, RoomState)
                                                           else last.state, timeout, want.name),
                    "Admin.GetRoom")
            time.sleep(_RETRY_SLEEP_S)


# Modules that build on the definitions above: the request builders shared
# with the asyncio client, and ReleaseWatcher (importable from here too).
from . import _convert  # noqa: E402
from .watch import ReleaseWatcher  # noqa: E402
