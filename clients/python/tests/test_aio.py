"""kvfence.aio (AsyncControlClient, AsyncAdminClient) against a real control
plane and two real nodes (conftest.py): the lifecycle with a transfer, an
abort seen through `async for` on watch_leases, wait_released with and
without a deadline, and the exception classes with their gRPC codes."""
import asyncio

import grpc
import pytest

import kvfence
from kvfence import LeaseState, Participant, RoomKey, RoomState, Role
from kvfence.aio import AsyncAdminClient, AsyncControlClient

from conftest import PAGE_COUNT, canary

WAIT_S = 10.0
SRC = Participant("n1", 0, Role.SOURCE)
SNK = Participant("n2", 0, Role.SINK)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def join_pair(cl, ctl, room_id, src=((0, 8),), snk=((16, 8),)):
    a = await ctl.join_room(room_id, SRC, cl.pools["n1"].pool_id, src, retry_s=WAIT_S)
    assert a.state == RoomState.OPENING and a.lease_id >= 1
    b = await ctl.join_room(room_id, SNK, cl.pools["n2"].pool_id, snk, retry_s=WAIT_S)
    assert b.state == RoomState.ACTIVE and b.room == a.room
    return a, b


def test_async_lifecycle_join_extend_transfer_complete_release(cluster):
    n1 = cluster.node("n1")

    async def main():
        async with AsyncControlClient(cluster.address) as ctl:
            a, b = await join_pair(cluster, ctl, 401, src=[(0, 4)], snk=[(16, 4)])
            la = await ctl.extend_lease(a.room, a.lease_id, [kvfence.PageRange(4, 4)])
            assert la.ranges == (kvfence.PageRange(0, 4), kvfence.PageRange(4, 4))
            lb = await ctl.extend_lease(b.room, b.lease_id, [(20, 4)])
            assert lb.pages() == list(range(16, 24)) and lb.mode == kvfence.LeaseMode.WRITE
            info = await ctl.get_room(a.room)
            assert info.state == RoomState.ACTIVE and info.participant_count == 2
            # The transfer: the sync NodeClient (the node's unix socket).
            n1.submit_chunk(a.room, 1, source_rank=0, source_pool_id=cluster.pools["n1"].pool_id,
                            source_ranges=[(0, 8)], sink_node_id="n2", sink_rank=0,
                            sink_pool_id=cluster.pools["n2"].pool_id, sink_ranges=[(16, 8)],
                            last_chunk=True, retry_unavailable_s=WAIT_S,
                            source_lease_pages=la.page_count(),
                            sink_lease_pages=lb.page_count())
            st = await ctl.complete_room(a.room, SRC)
            assert st in (RoomState.ACTIVE, RoomState.COMPLETED)
            got = await ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)
            assert {l.state for l in got.values()} == {LeaseState.RELEASED}
            assert got[b.lease_id].pages() == list(range(16, 24))
            info = await ctl.get_room(a.room.room_id)  # generation 0: the current one
            assert info.state == RoomState.COMPLETED and all(p.completed
                                                             for p in info.participants)
            # A released lease replays on a later watch, then synced.
            async with ctl.watch_leases(lease_ids=[b.lease_id], timeout=WAIT_S) as w:
                evs = [ev async for ev in _take(w, 2)]
            assert evs == [kvfence.LeaseReleased(got[b.lease_id]), kvfence.WatchSynced(1)]

    run(main())
    assert bytes(cluster.pools["n2"].buf[16 * 4096:24 * 4096]) == canary(1, 0, 8)


def test_async_page_sets_join_and_extend(cluster):
    """pages= (page indices, scattered) on join_room and extend_lease, as the
    sync client takes them: the same shared request builders."""
    async def main():
        async with AsyncControlClient(cluster.address) as ctl:
            a = await ctl.join_room(402, SRC, cluster.pools["n1"].pool_id,
                                    pages=[9, 1, 5, 3], retry_s=WAIT_S)
            b = await ctl.join_room(402, SNK, cluster.pools["n2"].pool_id,
                                    pages=kvfence.PageSet.from_pages([40, 42, 44, 46]),
                                    retry_s=WAIT_S)
            assert b.state == RoomState.ACTIVE
            la = await ctl.extend_lease(a.room, a.lease_id, pages=[7, 11])
            assert sorted(la.pages()) == [1, 3, 5, 7, 9, 11]  # in grant order
            with pytest.raises(ValueError):
                await ctl.extend_lease(a.room, a.lease_id, [(20, 1)], pages=[21])
            await ctl.abort_room(a.room)
            got = await ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)
            assert got[b.lease_id].pages() == [40, 42, 44, 46]

    run(main())


async def _take(w, n):
    async for ev in w:
        yield ev
        n -= 1
        if n == 0:
            return


def test_async_watch_sees_the_abort_and_the_release(cluster):
    async def main():
        async with AsyncControlClient(cluster.address) as ctl:
            w = ctl.watch_leases(node_id="n2", include_room_states=True)
            it = w.__aiter__()
            assert await it.__anext__() == kvfence.WatchSynced(0)
            a, b = await join_pair(cluster, ctl, 402)
            r1 = await ctl.abort_room(a.room.room_id, "aio abort")
            assert r1.room == a.room and not r1.already_aborting and not r1.token.is_zero
            assert r1.reason == kvfence.AbortReason.ENGINE
            r2 = await ctl.abort_room(a.room, "again")
            assert r2.already_aborting and r2.token == r1.token
            states = []
            async for ev in w:
                if isinstance(ev, kvfence.RoomStateChanged):
                    states.append(ev.new_state)
                elif isinstance(ev, kvfence.LeaseReleased):
                    assert ev.lease.lease_id == b.lease_id
                    assert ev.lease.state == LeaseState.RELEASED
                    break
            assert RoomState.ACTIVE in states and RoomState.ABORTING in states
            # cancel() ends the iteration quietly.
            w.cancel()
            assert [ev async for ev in w] == []
            assert (await ctl.wait_released(a.lease_id, WAIT_S)).lease_id == a.lease_id
            info = await ctl.get_room(a.room)
            assert info.state == RoomState.ABORTED and info.token == r1.token
            # Nothing more for the aborted room.
            with pytest.raises(kvfence.Aborted) as ei:
                await ctl.extend_lease(a.room, a.lease_id, [(30, 1)])
            assert ei.value.method == "Control.ExtendLease"
            with pytest.raises(kvfence.Aborted):
                await ctl.complete_room(a.room, SRC)

    run(main())
    assert bytes(cluster.pools["n2"].buf) == canary(0xA5, 0, PAGE_COUNT)


def test_async_wait_all_released_of_no_lease_returns_at_once(cluster):
    async def main():
        async with AsyncControlClient(cluster.address) as ctl:
            return await ctl.wait_all_released([], 5.0)

    assert run(main()) == {}


def test_async_errors_carry_the_grpc_status(cluster):
    p1 = cluster.pools["n1"].pool_id

    async def main():
        async with AsyncControlClient(cluster.address) as ctl, \
                AsyncAdminClient(cluster.address) as admin:
            await admin.wait_ready(WAIT_S)
            await admin.ping()
            with pytest.raises(kvfence.InvalidArgument) as ei:
                await ctl.join_room(0, SRC, p1, [(0, 1)])
            e = ei.value
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "room_id" in e.details
            assert e.method == "Control.JoinRoom"
            with pytest.raises(kvfence.InvalidArgument) as ei:
                await ctl.join_room(5, SRC, p1, [(PAGE_COUNT - 1, 2)], retry_s=WAIT_S)
            assert "page" in ei.value.details.lower() or "range" in ei.value.details.lower()
            with pytest.raises(kvfence.NotFound):
                await ctl.abort_room(RoomKey(987654, 0))
            with pytest.raises(kvfence.NotFound) as ei:
                await ctl.get_room(987654)
            assert ei.value.method == "Admin.GetRoom"
            # A lease that is not released: the wait ends with DeadlineExceeded.
            j = await ctl.join_room(403, SNK, cluster.pools["n2"].pool_id, [(0, 4)],
                                    retry_s=WAIT_S)
            with pytest.raises(kvfence.DeadlineExceeded, match="not free"):
                await ctl.wait_released(j.lease_id, 0.3)
            # A channel passed in is used and left open.
            ch = grpc.aio.insecure_channel(cluster.address)
            async with AsyncControlClient(channel=ch) as other:
                assert (await other.get_room(j.room)).state == RoomState.OPENING
            await AsyncAdminClient(channel=ch).ping()
            await ch.close()
        with pytest.raises(kvfence.DeadlineExceeded):
            async with AsyncAdminClient("127.0.0.1:1") as dead:
                await dead.wait_ready(0.2)

    run(main())
