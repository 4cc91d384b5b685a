"""Request builders and response conversions of the Control calls, shared by
the sync client (client.py) and the asyncio client (aio.py): one place
that turns arguments into protobuf requests and replies into kvfence values,
so the two clients cannot drift apart. Nothing here does I/O.
"""
from __future__ import annotations

from typing import Iterable, Sequence, Tuple, Type, Union

import grpc

from . import errors
from ._proto.v1 import control_pb2, types_pb2
from .client import (AbortReason, AbortResult, JoinResult, Lease, Participant, RangesLike,
                     RoomKey, RoomState, Token, _enum, _pages_arg, _ranges, _room_key)
from .pageset import PageSet, PageSetForm

#: join_room's and extend_lease's `pages`: a PageSet, page indices, or None.
PagesLike = Union[PageSet, Iterable[int], None]

#: Errors that join_room(retry_s=...) retries: a pool registered a moment
#: ago reaches the control plane by the node's PoolUpdate.
JOIN_RETRY: Tuple[Type[errors.KvfenceError], ...] = (errors.NotFound, errors.Unavailable)

RoomLike = Union[RoomKey, int, Tuple[int, int]]


def join_room_request(room_id: int, participant: Participant, pool_id: int, ranges: RangesLike,
                      pages: PagesLike, expected_sources: int, expected_sinks: int,
                      features: Iterable[str],
                      protocol: Tuple[int, int]) -> control_pb2.JoinRoomRequest:
    """`ranges`, or `pages` (a PageSet or page indices: sent as a page set in
    its smallest form); neither: an empty lease."""
    ps = _pages_arg(ranges, pages)
    req = control_pb2.JoinRoomRequest(
        room_id=room_id, expected_sources=expected_sources, expected_sinks=expected_sinks,
        participant=participant._pb(),
        engine_capabilities=types_pb2.CapabilitySet(protocol_min=protocol[0],
                                                    protocol_max=protocol[1],
                                                    features=list(features)),
        pool_id=pool_id, ranges=_ranges(ranges) if ps is None else ())
    if ps is not None and ps.form != PageSetForm.EMPTY:
        req.page_set.CopyFrom(ps._pb())
    return req


def join_result(r: control_pb2.JoinRoomResponse) -> JoinResult:
    return JoinResult(RoomKey._from(r.room), r.lease_id, _enum(RoomState, r.state),
                      r.protocol_version)


def extend_lease_request(room: RoomKey, lease_id: int, ranges: RangesLike,
                         pages: PagesLike) -> control_pb2.ExtendLeaseRequest:
    """`ranges` or `pages` as join_room_request takes them; ValueError for an
    empty page set (nothing to add)."""
    ps = _pages_arg(ranges, pages)
    req = control_pb2.ExtendLeaseRequest(room=room._pb(), lease_id=lease_id,
                                         ranges=_ranges(ranges) if ps is None else ())
    if ps is not None:
        if ps.form == PageSetForm.EMPTY:
            raise ValueError("pages: empty (nothing to add)")
        req.page_set.CopyFrom(ps._pb())
    return req


def extend_lease_result(r: control_pb2.ExtendLeaseResponse) -> Lease:
    return Lease._from(r.lease)


def complete_room_request(room: RoomKey,
                          participant: Participant) -> control_pb2.CompleteRoomRequest:
    return control_pb2.CompleteRoomRequest(room=room._pb(), participant=participant._pb())


def complete_room_result(r: control_pb2.CompleteRoomResponse) -> RoomState:
    return _enum(RoomState, r.state)


def abort_room_request(room: RoomLike, detail: str) -> control_pb2.AbortRoomRequest:
    return control_pb2.AbortRoomRequest(room=_room_key(room)._pb(), detail=detail)


def abort_room_result(r: control_pb2.AbortRoomResponse) -> AbortResult:
    return AbortResult(RoomKey._from(r.room), Token._from(r.token), _enum(RoomState, r.state),
                       r.already_aborting, _enum(AbortReason, r.reason))


def get_room_request(room: RoomLike) -> control_pb2.GetRoomRequest:
    return control_pb2.GetRoomRequest(room=_room_key(room)._pb())


def watch_leases_request(node_id: str, ranks: Iterable[int], lease_ids: Iterable[int],
                         include_room_states: bool) -> control_pb2.WatchLeasesRequest:
    return control_pb2.WatchLeasesRequest(node_id=node_id, ranks=list(ranks),
                                          lease_ids=list(lease_ids),
                                          include_room_states=include_room_states)


def not_released(missing: Sequence[int], timeout: float) -> errors.DeadlineExceeded:
    """wait_released's error: the pages of `missing` are still not free."""
    return errors.DeadlineExceeded(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "lease(s) %s not released within %.3g s; their pages are not free" %
        (", ".join(map(str, missing)), timeout), "Control.WatchLeases")
