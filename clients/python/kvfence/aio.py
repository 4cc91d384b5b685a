"""kvfence.aio: the asyncio clients of kvfence (grpc.aio), beside the sync
ones in client.py: AsyncControlClient (engines) and AsyncAdminClient.

    from kvfence.aio import AsyncControlClient
    async with AsyncControlClient("127.0.0.1:7070") as ctl:
        j = await ctl.join_room(room_id, Participant("n2", 0, Role.SINK), pool_id, [(16, 8)])
        await ctl.abort_room(j.room)
        await ctl.wait_released(j.lease_id, timeout=30)   # only now are the pages free

Same calls, arguments, values and exceptions as the sync clients: the
requests are built and the replies converted by the same functions
(_convert.py), and a failed call raises the same kvfence.KvfenceError
subclass. The rule is the sync client's: pages granted to a room are the
engine's again only when kvfence reports the lease RELEASED (watch_leases,
wait_released), never on a CompleteRoom or AbortRoom reply, never on a
timer.

DESIGN: a client and its streams belong to the event loop that was running
when the client was made (grpc.aio's rule): make it inside a coroutine and
use it from that loop only. Nothing here starts a thread; a WatchLeases
message costs the loop one wake-up, and a busy loop delays it just as it
delays everything else on it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Dict, Iterable, Optional, Sequence, Set, Tuple, Union

import grpc
import grpc.aio

from . import _convert, errors
from ._proto.v1 import control_pb2, control_pb2_grpc
from .client import (DEFAULT_FEATURES, DEFAULT_PROTOCOL, DEFAULT_TIMEOUT_S, _RETRY_SLEEP_S,
                     AbortResult, JoinResult, Lease, LeaseReleased, Participant, RangesLike,
                     RoomInfo, RoomKey, RoomState, WatchEvent, _ChannelOwner, _event_from)

__all__ = ["AsyncControlClient", "AsyncAdminClient", "AsyncLeaseWatch"]


class _AsyncClient(_ChannelOwner):
    """A grpc.aio channel, a default timeout, error mapping and an async
    context manager (the sync _Client's twin)."""

    def __init__(self, target: Optional[str] = None, *,
                 channel: Optional[grpc.aio.Channel] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(grpc.aio, target, channel, credentials, options, timeout)

    async def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Waits until the channel is connected; DeadlineExceeded otherwise."""
        t = self.timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self.channel.channel_ready(), t)
        except asyncio.TimeoutError:
            raise errors.DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          "%s not ready within %.1f s" % (self.target, t)) from None

    async def _unary(self, name: str, fn: Callable[..., Awaitable[Any]], req: Any,
                     timeout: Optional[float]) -> Any:
        try:
            return await fn(req, timeout=self.timeout if timeout is None else timeout)
        except grpc.aio.AioRpcError as e:
            raise errors.from_rpc_error(e, name) from None

    async def close(self) -> None:
        """Closes the channel if this client opened it (idempotent)."""
        if self._closing():
            await self.channel.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncLeaseWatch:
    """An open WatchLeases stream: `async for ev in watch` for events
    (LeaseReleased, RoomStateChanged, WatchSynced; kinds this client does not
    know are skipped). cancel() (or leaving the `async with` block) ends it,
    and the iteration then just stops. A stream error raises the matching
    KvfenceError (Unavailable on server shutdown: resubscribe, and
    deduplicate by lease_id)."""

    _rpc = "Control.WatchLeases"

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def __aiter__(self) -> "AsyncLeaseWatch":
        return self

    async def __anext__(self) -> WatchEvent:
        while True:
            try:
                m = await self._call.read()
            except grpc.aio.AioRpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    raise StopAsyncIteration from None
                raise errors.from_rpc_error(e, self._rpc) from None
            except asyncio.CancelledError:
                if self._cancelled:  # our cancel(), not the task's
                    raise StopAsyncIteration from None
                raise
            if m is grpc.aio.EOF:
                raise StopAsyncIteration
            ev = _event_from(m)
            if ev is not None:
                return ev

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> "AsyncLeaseWatch":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.cancel()


class AsyncControlClient(_AsyncClient):
    """kvfence.v1.Control on kvfence-control ("host:port"), on asyncio; see
    the sync ControlClient for each call's contract."""

    def __init__(self, target: Optional[str] = None, **kw: Any) -> None:
        super().__init__(target, **kw)
        self._stub = control_pb2_grpc.ControlStub(self.channel)
        self._admin = control_pb2_grpc.AdminStub(self.channel)

    async def join_room(self, room_id: int, participant: Participant, pool_id: int,
                        ranges: RangesLike = (), *, pages: _convert.PagesLike = None,
                        expected_sources: int = 1,
                        expected_sinks: int = 1, features: Iterable[str] = DEFAULT_FEATURES,
                        protocol: Tuple[int, int] = DEFAULT_PROTOCOL,
                        timeout: Optional[float] = None, retry_s: float = 0.0) -> JoinResult:
        """Grants `participant`'s lease on `ranges` of `pool_id` to room
        `room_id`, or on `pages` (a PageSet or page indices, as the sync
        client takes them). retry_s > 0 retries NOT_FOUND and UNAVAILABLE for
        that long (a pool registered a moment ago)."""
        req = _convert.join_room_request(room_id, participant, pool_id, ranges, pages,
                                         expected_sources, expected_sinks, features, protocol)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                r = await self._unary("Control.JoinRoom", self._stub.JoinRoom, req, timeout)
                return _convert.join_result(r)
            except _convert.JOIN_RETRY:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_RETRY_SLEEP_S)

    async def extend_lease(self, room: RoomKey, lease_id: int, ranges: RangesLike = (), *,
                           pages: _convert.PagesLike = None,
                           timeout: Optional[float] = None) -> Lease:
        """Adds pages to a lease (chunked prefill), as `ranges` or `pages`;
        returns the whole lease."""
        req = _convert.extend_lease_request(room, lease_id, ranges, pages)
        r = await self._unary("Control.ExtendLease", self._stub.ExtendLease, req, timeout)
        return _convert.extend_lease_result(r)

    async def complete_room(self, room: RoomKey, participant: Participant, *,
                            timeout: Optional[float] = None) -> RoomState:
        """Declares `participant` finished; the room's state. Not a release."""
        req = _convert.complete_room_request(room, participant)
        r = await self._unary("Control.CompleteRoom", self._stub.CompleteRoom, req, timeout)
        return _convert.complete_room_result(r)

    async def abort_room(self, room: Union[RoomKey, int], detail: str = "", *,
                         timeout: Optional[float] = None) -> AbortResult:
        """Aborts a room-generation (an int or generation 0: the current one).
        Idempotent. Not a release."""
        req = _convert.abort_room_request(room, detail)
        r = await self._unary("Control.AbortRoom", self._stub.AbortRoom, req, timeout)
        return _convert.abort_room_result(r)

    async def get_room(self, room: Union[RoomKey, int], *,
                       timeout: Optional[float] = None) -> RoomInfo:
        """One room-generation (an int or generation 0: the current one) with
        its participants (Admin.GetRoom on the same channel: with mutual TLS
        the client's identity must be one of the control plane's
        --admin-identities, else PermissionDenied; docs/security.md)."""
        req = _convert.get_room_request(room)
        return RoomInfo._from(await self._unary("Admin.GetRoom", self._admin.GetRoom, req,
                                                timeout))

    def watch_leases(self, *, node_id: str = "", ranks: Iterable[int] = (),
                     lease_ids: Iterable[int] = (), include_room_states: bool = False,
                     timeout: Optional[float] = None) -> AsyncLeaseWatch:
        """Opens a WatchLeases stream (no deadline unless `timeout`): replayed
        releases, one WatchSynced, then live events; iterate it with
        `async for`."""
        req = _convert.watch_leases_request(node_id, ranks, lease_ids, include_room_states)
        return AsyncLeaseWatch(self._stub.WatchLeases(req, timeout=timeout))

    async def wait_released(self, lease_id: int, timeout: float) -> Lease:
        """Waits until lease `lease_id` is RELEASED and returns it.
        DeadlineExceeded after `timeout` seconds: the pages are then still NOT
        free. Resubscribes if the server restarts."""
        return (await self.wait_all_released([lease_id], timeout))[lease_id]

    async def wait_all_released(self, lease_ids: Iterable[int],
                                timeout: float) -> Dict[int, Lease]:
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
                async with self.watch_leases(lease_ids=sorted(want - set(got)),
                                             timeout=left) as w:
                    async for ev in w:
                        if isinstance(ev, LeaseReleased) and ev.lease.lease_id in want:
                            got[ev.lease.lease_id] = ev.lease
                            if len(got) == len(want):
                                return got
            except errors.Unavailable:
                await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            except errors.DeadlineExceeded:
                break
        raise _convert.not_released(sorted(want - set(got)), timeout)


class AsyncAdminClient(_AsyncClient):
    """kvfence.v1.Admin on kvfence-control, on asyncio (operators, tools)."""

    def __init__(self, target: Optional[str] = None, **kw: Any) -> None:
        super().__init__(target, **kw)
        self._stub = control_pb2_grpc.AdminStub(self.channel)

    async def ping(self, *, timeout: Optional[float] = None) -> None:
        await self._unary("Admin.Ping", self._stub.Ping, control_pb2.PingRequest(), timeout)
