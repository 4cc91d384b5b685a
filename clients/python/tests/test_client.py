"""ControlClient / NodeClient / AdminClient against a real control plane and
two real nodes (conftest.py): happy paths, the exception classes with their
gRPC codes and messages, and wait_released with a deadline."""
import time

import grpc
import pytest

import kvfence
from kvfence import Participant, RoomKey, RoomState, Role, LeaseState

from conftest import PAGE_COUNT, canary

WAIT_S = 10.0
SRC = Participant("n1", 0, Role.SOURCE)
SNK = Participant("n2", 0, Role.SINK)


def join_pair(cl, ctl, room_id, src_ranges=((0, 8),), snk_ranges=((16, 8),)):
    a = ctl.join_room(room_id, SRC, cl.pools["n1"].pool_id, src_ranges, retry_s=WAIT_S)
    assert a.state == RoomState.OPENING and a.lease_id >= 1 and a.room.generation >= 1
    b = ctl.join_room(room_id, SNK, cl.pools["n2"].pool_id, snk_ranges, retry_s=WAIT_S)
    assert b.state == RoomState.ACTIVE and b.room == a.room
    return a, b


def submit(cl, node, room, seq, src, dst, last, retry_s=WAIT_S, **versions):
    return node.submit_chunk(room, seq, source_rank=0, source_pool_id=cl.pools["n1"].pool_id,
                             source_ranges=src, sink_node_id="n2", sink_rank=0,
                             sink_pool_id=cl.pools["n2"].pool_id, sink_ranges=dst,
                             last_chunk=last, retry_unavailable_s=retry_s, **versions)


def test_extended_sink_pages_named_wait_for_the_sink_node(cluster):
    """The sink's node holds its RoomUpdates (fault hold_room_update), so the
    source's node does not know the extension yet: a chunk naming the sink
    lease's new version is UNAVAILABLE, one naming none is refused; once the
    update goes through, the named chunk is admitted and the room completes."""
    ctl, n1 = cluster.control(), cluster.node("n1")
    a, b = join_pair(cluster, ctl, 102, src_ranges=[(0, 8)], snk_ranges=[(16, 4)])
    assert submit(cluster, n1, a.room, 1, [(0, 4)], [(16, 4)], False) == 1
    cluster.set_faults("n2", "hold_room_update=1\n")
    lb = ctl.extend_lease(b.room, b.lease_id, [(20, 4)])
    assert lb.page_count() == 8
    with pytest.raises(kvfence.errors.Unavailable, match="sink_lease_pages"):
        submit(cluster, n1, a.room, 2, [(4, 4)], [(20, 4)], True, retry_s=0,
               sink_lease_pages=lb.page_count())
    with pytest.raises(kvfence.errors.FailedPrecondition, match="sink_ranges"):
        submit(cluster, n1, a.room, 2, [(4, 4)], [(20, 4)], True, retry_s=0)
    cluster.set_faults("n2", "hold_room_update=0\n")
    assert submit(cluster, n1, a.room, 2, [(4, 4)], [(20, 4)], True,
                  sink_lease_pages=lb.page_count()) == 2
    assert ctl.complete_room(a.room, SRC) in (RoomState.ACTIVE, RoomState.COMPLETED)
    released = ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)
    assert {l.state for l in released.values()} == {LeaseState.RELEASED}
    assert admin_state(cluster, a.room) == RoomState.COMPLETED
    assert bytes(cluster.pools["n2"].buf[16 * 4096:24 * 4096]) == canary(1, 0, 8)


def admin_state(cluster, room):
    return cluster.admin().room(room).state


def test_join_extend_transfer_complete_release(cluster):
    ctl, admin, n1 = cluster.control(), cluster.admin(), cluster.node("n1")
    a, b = join_pair(cluster, ctl, 101, src_ranges=[(0, 4)], snk_ranges=[(16, 4)])
    # Chunked prefill: both sides grow their leases while the room is ACTIVE.
    la = ctl.extend_lease(a.room, a.lease_id, [kvfence.PageRange(4, 4)])
    assert la.ranges == (kvfence.PageRange(0, 4), kvfence.PageRange(4, 4))
    assert la.mode == kvfence.LeaseMode.READ and la.state == LeaseState.ACTIVE
    lb = ctl.extend_lease(b.room, b.lease_id, [(20, 4)])
    assert lb.pages() == list(range(16, 24)) and lb.mode == kvfence.LeaseMode.WRITE
    assert submit(cluster, n1, a.room, 1, [(0, 4)], [(16, 4)], False) == 1
    # n1 learns the sink's new pages only once n2 acknowledged them: naming
    # the versions makes a late update UNAVAILABLE (retried), not refused.
    assert submit(cluster, n1, a.room, 2, [(4, 4)], [(20, 4)], True,
                  source_lease_pages=la.page_count(), sink_lease_pages=lb.page_count()) == 2
    assert ctl.complete_room(a.room, SRC) in (RoomState.ACTIVE, RoomState.COMPLETED)
    released = ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)
    assert {l.state for l in released.values()} == {LeaseState.RELEASED}
    assert released[b.lease_id].pages() == list(range(16, 24))
    info = admin.room(a.room)
    assert info.state == RoomState.COMPLETED and info.participant_count == 2
    assert all(p.completed for p in info.participants)
    pool = cluster.pools["n2"]
    assert bytes(pool.buf[16 * 4096:24 * 4096]) == canary(1, 0, 8)
    assert bytes(pool.buf[:16 * 4096]) == canary(0xA5, 0, 16)
    assert bytes(pool.buf[24 * 4096:]) == canary(0xA5, 24, PAGE_COUNT - 24)
    # A released lease replays on a later watch (tombstone kept), then synced.
    with ctl.watch_leases(lease_ids=[b.lease_id], timeout=WAIT_S) as w:
        assert next(w) == kvfence.LeaseReleased(released[b.lease_id])
        assert next(w) == kvfence.WatchSynced(1)


def test_abort_is_idempotent_and_releases_through_watch(cluster):
    ctl, admin = cluster.control(), cluster.admin()
    with ctl.watch_leases(node_id="n2", include_room_states=True) as w:
        assert next(w) == kvfence.WatchSynced(0)
        a, b = join_pair(cluster, ctl, 202)
        r1 = ctl.abort_room(a.room.room_id, "test abort")  # generation 0: the current one
        assert r1.room == a.room and not r1.already_aborting and not r1.token.is_zero
        assert r1.state in (RoomState.ABORTING, RoomState.ABORTED)
        assert r1.reason == kvfence.AbortReason.ENGINE
        r2 = ctl.abort_room(a.room, "again")
        assert r2.already_aborting and r2.token == r1.token
        states = []
        for ev in w:
            if isinstance(ev, kvfence.RoomStateChanged):
                states.append(ev.new_state)
            elif isinstance(ev, kvfence.LeaseReleased):
                assert ev.lease.lease_id == b.lease_id and ev.lease.state == LeaseState.RELEASED
                break
    assert RoomState.ACTIVE in states and RoomState.ABORTING in states
    assert ctl.wait_released(a.lease_id, WAIT_S).lease_id == a.lease_id
    info = admin.wait_room_state(a.room, RoomState.ABORTED, WAIT_S)
    assert info.token == r1.token and info.abort_reason == kvfence.AbortReason.ENGINE
    # Nothing more is admitted for the aborted room.
    with pytest.raises((kvfence.Aborted, kvfence.FailedPrecondition)) as ei:
        submit(cluster, cluster.node("n1"), a.room, 1, [(0, 8)], [(16, 8)], True)
    assert ei.value.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(kvfence.Aborted) as ei:
        ctl.extend_lease(a.room, a.lease_id, [(30, 1)])
    assert ei.value.code == grpc.StatusCode.ABORTED and ei.value.method == "Control.ExtendLease"
    with pytest.raises(kvfence.Aborted):
        ctl.complete_room(a.room, SRC)
    # The pool's pages were never written.
    assert bytes(cluster.pools["n2"].buf) == canary(0xA5, 0, PAGE_COUNT)


def test_errors_carry_the_grpc_status(cluster):
    ctl, admin = cluster.control(), cluster.admin()
    p1 = cluster.pools["n1"].pool_id
    with pytest.raises(kvfence.InvalidArgument) as ei:
        ctl.join_room(0, SRC, p1, [(0, 1)])
    e = ei.value
    assert isinstance(e, kvfence.KvfenceError) and e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "room_id" in e.details and e.method == "Control.JoinRoom"
    assert kvfence.status_class(grpc.StatusCode.INVALID_ARGUMENT) is kvfence.InvalidArgument
    with pytest.raises(kvfence.InvalidArgument) as ei:
        ctl.join_room(5, SRC, p1, [(PAGE_COUNT - 1, 2)])  # past the pool's end
    assert "page" in ei.value.details.lower() or "range" in ei.value.details.lower()
    with pytest.raises(kvfence.NotFound) as ei:
        ctl.join_room(5, Participant("nope", 0, Role.SOURCE), p1, [(0, 1)])
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(kvfence.NotFound):
        ctl.abort_room(RoomKey(987654, 0))
    with pytest.raises(kvfence.NotFound):
        admin.room(987654)
    # OPENING room: completion is refused; a conflicting write lease is named.
    a = ctl.join_room(303, SNK, cluster.pools["n2"].pool_id, [(0, 4)], retry_s=WAIT_S)
    with pytest.raises(kvfence.FailedPrecondition) as ei:
        ctl.complete_room(a.room, SNK)
    assert "OPENING" in ei.value.details
    with pytest.raises(kvfence.FailedPrecondition) as ei:
        ctl.join_room(304, SNK, cluster.pools["n2"].pool_id, [(2, 4)])
    assert "303" in ei.value.details
    with pytest.raises(kvfence.FailedPrecondition) as ei:
        ctl.extend_lease(RoomKey(303, a.room.generation + 100), a.lease_id, [(8, 1)])
    # Missing QUIESCE_V1: refused, and the room is aborted.
    with pytest.raises(kvfence.FailedPrecondition) as ei:
        ctl.join_room(305, SRC, p1, [(40, 1)], features=())
    assert "QUIESCE_V1" in ei.value.details
    # The node refuses chunks of a room it does not know: UNAVAILABLE (retry).
    with pytest.raises(kvfence.Unavailable) as ei:
        submit_once = cluster.node("n1").submit_chunk
        submit_once(RoomKey(999, 1), 1, source_rank=0, source_pool_id=p1, source_ranges=[(0, 1)],
                    sink_node_id="n2", sink_rank=0, sink_pool_id=1, sink_ranges=[(0, 1)])
    assert isinstance(ei.value, ConnectionError)
    with pytest.raises(kvfence.NotFound):
        cluster.node("n1").register_pool_shm("kvf-py-no-such-object", 4096, 4)
    ctl.abort_room(a.room)


def test_wait_released_honours_its_deadline(cluster):
    ctl = cluster.control()
    a, b = join_pair(cluster, ctl, 404)
    t0 = time.monotonic()
    with pytest.raises(kvfence.DeadlineExceeded) as ei:
        ctl.wait_released(b.lease_id, 0.3)
    took = time.monotonic() - t0
    assert 0.25 <= took < 3.0
    assert isinstance(ei.value, TimeoutError) and ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(b.lease_id) in ei.value.details and "not free" in ei.value.details
    ctl.abort_room(a.room, "done")
    assert ctl.wait_released(b.lease_id, WAIT_S).state == LeaseState.RELEASED


def test_wait_all_released_of_no_lease_returns_at_once(cluster):
    """No lease ids: nothing to wait for (an empty filter would watch every
    lease, and the call used to sit out its whole timeout, then raise)."""
    ctl = cluster.control()
    join_pair(cluster, ctl, 405)  # a lease that is not released meanwhile
    assert ctl.wait_all_released([], 5.0) == {}


def test_admin_views_and_context_managers(cluster):
    admin = cluster.admin()
    nodes = {n.node_id: n for n in admin.nodes()}
    assert set(nodes) == {"n1", "n2"}
    assert nodes["n1"].state == kvfence.NodeState.ATTACHED
    n2 = admin.node("n2")  # GetNode: with capabilities, endpoints and pools
    assert n2.incarnation == nodes["n2"].incarnation and "QUIESCE_V1" in n2.features
    # (Admin.GetNode does not fill pools and endpoints yet: not asserted.)
    with pytest.raises(kvfence.NotFound):
        admin.node("n9")
    with kvfence.ControlClient(cluster.address) as ctl:
        ctl.wait_ready(5)
        join_pair(cluster, ctl, 505)
    with pytest.raises(ValueError):  # the channel is closed with the block
        ctl.abort_room(505)
    ctl.close()  # idempotent
    s = admin.stats()
    assert s["rooms"]["active"] == 1 and s["nodes"]["attached"] == 2 and s["generation"] >= 1
    assert [r.room.room_id for r in admin.rooms(states=[RoomState.ACTIVE])] == [505]
    assert len(admin.leases(room_id=505)) == 2
    with kvfence.ControlClient(cluster.address) as ctl:
        ctl.abort_room(505)


def test_ranges_from_pages():
    assert kvfence.ranges_from_pages([]) == []
    assert kvfence.ranges_from_pages([3]) == [kvfence.PageRange(3, 1)]
    assert kvfence.ranges_from_pages([1, 2, 3, 7, 8, 5]) == [
        kvfence.PageRange(1, 3), kvfence.PageRange(7, 2), kvfence.PageRange(5, 1)]
