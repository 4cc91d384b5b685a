"""NodeClient's streaming and pool calls against a real control plane and two
real nodes (conftest.py): watch (aux bytes and transfer_done at the sink,
chunk_done at the source, filter errors), submit_chunks (pipelined, in order,
a refused chunk does not end the stream) and unregister_pool."""
import os
import threading

import grpc
import pytest

import kvfence
from kvfence import ChunkRequest, RoomState

from conftest import PAGE_COUNT, PAGE_SIZE, canary
from test_client import SRC, WAIT_S, join_pair, submit

# Every byte value, and more than one frame's worth of structure: exact bytes must come back.
AUX = bytes(range(256)) * 3 + b"\x00end\x00"


def wait_active(watch, room):
    """Reads `watch` until the node reports `room` ACTIVE (it then admits chunks)."""
    for ev in watch:
        if isinstance(ev, kvfence.NodeRoomState) and ev.room == room and \
                ev.state == RoomState.ACTIVE:
            return
    pytest.fail("watch ended before room %s was ACTIVE" % room)


def test_watch_delivers_exact_aux_and_transfer_done_at_the_sink(cluster):
    ctl, n1, n2 = cluster.control(), cluster.node("n1"), cluster.node("n2")
    a, b = join_pair(cluster, ctl, 401, src_ranges=[(0, 4)], snk_ranges=[(16, 4)])
    with n2.watch(rooms=[a.room.room_id], timeout=WAIT_S) as w:
        # The first event proves the stream is registered, so nothing below can be missed.
        first = next(w)
        assert isinstance(first, kvfence.NodeRoomState) and first.room == a.room
        assert submit(cluster, n1, a.room, 1, [(0, 2)], [(16, 2)], False) == 1
        assert n1.submit_chunk(a.room, 2, source_rank=0, source_pool_id=cluster.pools["n1"].pool_id,
                               source_ranges=[(2, 2)], sink_node_id="n2", sink_rank=0,
                               sink_pool_id=cluster.pools["n2"].pool_id, sink_ranges=[(18, 2)],
                               last_chunk=True, aux=AUX, retry_unavailable_s=WAIT_S) == 2
        auxes = []
        for ev in w:
            assert ev.room == a.room  # the filter holds
            if isinstance(ev, kvfence.AuxReceived):
                auxes.append(ev)
            elif isinstance(ev, kvfence.TransferDone):
                done = ev
                break
    assert len(auxes) == 1, auxes
    assert auxes[0].data == AUX and auxes[0].source_rank == 0 and auxes[0].sink_rank == 0
    assert done.ok and done.error == "" and done.source_node_id == "n1"
    assert done.source_rank == 0 and done.sink_rank == 0
    assert ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)
    assert bytes(cluster.pools["n2"].buf[16 * PAGE_SIZE:20 * PAGE_SIZE]) == canary(1, 0, 4)


def test_watch_filter_errors_and_close(cluster):
    n2 = cluster.node("n2")
    w = n2.watch(rooms=[0], timeout=WAIT_S)
    with pytest.raises(kvfence.InvalidArgument) as ei:
        next(w)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rooms" in ei.value.details and ei.value.method == "NodeLocal.Watch"
    # close() ends an idle stream: the iteration just stops, no exception.
    w = n2.watch()
    w.close()
    assert list(w) == []


def test_unregister_pool(cluster):
    n1 = cluster.node("n1")
    with pytest.raises(kvfence.NotFound) as ei:
        n1.unregister_pool(987654)
    e = ei.value
    assert e.code == grpc.StatusCode.NOT_FOUND and e.method == "NodeLocal.UnregisterPool"
    assert "pool_id" in e.details and "987654" in e.details
    with pytest.raises(kvfence.InvalidArgument) as ei:
        n1.unregister_pool(0)
    assert "pool_id" in ei.value.details
    # A pool no room uses goes away; a second unregister no longer finds it.
    pid = cluster.pools["n1"].pool_id
    n1.unregister_pool(pid)
    with pytest.raises(kvfence.NotFound):
        n1.unregister_pool(pid)


def test_watch_says_active_only_once_every_sink_is_known(cluster):
    """A room the control plane made ACTIVE is ACTIVE on n1's Watch only once
    n1 knows the sink's lease: n2 holds its RoomUpdates (unacknowledged), so
    the control plane does not publish n2's lease to n1. An engine that waits
    for ACTIVE on its node and then submits is never refused."""
    ctl, admin, n1 = cluster.control(), cluster.admin(), cluster.node("n1")
    cluster.set_faults("n2", "hold_room_update=1\n")
    a, b = join_pair(cluster, ctl, 511, src_ranges=[(0, 2)], snk_ranges=[(16, 2)])
    admin.wait_room_state(a.room, RoomState.ACTIVE, WAIT_S)
    states = []
    seen_active = threading.Event()
    w = n1.watch(rooms=[a.room], timeout=WAIT_S)

    def read():
        for ev in w:
            if isinstance(ev, kvfence.NodeRoomState) and ev.room == a.room:
                states.append(ev.state)
                if ev.state == RoomState.ACTIVE:
                    seen_active.set()
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # However long n2 holds, n1 does not report the room ACTIVE.
        assert not seen_active.wait(0.7), states
        cluster.set_faults("n2", "hold_room_update=0\n")
        assert seen_active.wait(WAIT_S), states
    finally:
        w.close()
        reader.join(WAIT_S)
    assert states[-1] == RoomState.ACTIVE and RoomState.ACTIVE not in states[:-1], states
    p1, p2 = cluster.pools["n1"].pool_id, cluster.pools["n2"].pool_id
    # No retry: ACTIVE on the node means the sink is known.
    n1.submit_chunk(a.room, 1, source_rank=0, source_pool_id=p1, source_ranges=[(0, 2)],
                    sink_node_id="n2", sink_rank=0, sink_pool_id=p2, sink_ranges=[(16, 2)],
                    last_chunk=True)
    ctl.complete_room(a.room, SRC)
    admin.wait_room_state(a.room, RoomState.COMPLETED, WAIT_S)


def test_submit_chunks_pipelines_in_order_and_the_room_completes(cluster):
    ctl, admin, n1 = cluster.control(), cluster.admin(), cluster.node("n1")
    p1, p2 = cluster.pools["n1"].pool_id, cluster.pools["n2"].pool_id
    a, b = join_pair(cluster, ctl, 501, src_ranges=[(0, 8)], snk_ranges=[(16, 8)])

    def chunk(seq, last=False):
        return ChunkRequest(a.room, seq, 0, p1, [(seq - 1, 1)], "n2", 0, p2, [(15 + seq, 1)],
                            last_chunk=last, aux=b"done" if last else b"")

    with n1.watch(rooms=[a.room], include_chunks=True, timeout=WAIT_S) as w:
        wait_active(w, a.room)
        # seq 2 twice: the second is refused (ALREADY_EXISTS) and the stream goes on.
        reqs = [chunk(1), chunk(2), chunk(2)] + [chunk(s) for s in range(3, 8)] + [chunk(8, True)]
        with n1.submit_chunks(reqs, window=4, timeout=WAIT_S) as stream:
            results = list(stream)
        assert [r.chunk_seq for r in results] == [1, 2, 2, 3, 4, 5, 6, 7, 8]
        refused = results[2]
        assert not refused.ok and refused.code == grpc.StatusCode.ALREADY_EXISTS
        assert "chunk_seq" in refused.message
        assert isinstance(refused.error(), kvfence.AlreadyExists)
        assert all(r.ok and r.error() is None for i, r in enumerate(results) if i != 2), results
        done = set()
        for ev in w:
            if isinstance(ev, kvfence.ChunkDone):
                assert ev.ok, ev
                assert ev.transport == kvfence.TransportKind.TCP, ev  # n1 -> n2, no RDMA
                done.add(ev.chunk_seq)
                if len(done) == 8:
                    break
    assert done == set(range(1, 9))
    ctl.complete_room(a.room, SRC)
    info = admin.wait_room_state(a.room, RoomState.COMPLETED, WAIT_S)
    assert all(p.completed for p in info.participants)
    pool = cluster.pools["n2"]
    assert bytes(pool.buf[16 * PAGE_SIZE:24 * PAGE_SIZE]) == canary(1, 0, 8)
    assert bytes(pool.buf[24 * PAGE_SIZE:]) == canary(0xA5, 24, PAGE_COUNT - 24)


def test_submit_chunks_window_is_checked(cluster):
    with pytest.raises(ValueError):
        cluster.node("n1").submit_chunks([], window=65)


def test_register_pool_fd_hands_a_memfd_to_the_node(cluster):
    """Memory the engine owns goes to the node as a descriptor (socket.send_fds on
    the fd socket), never as a name the node opens with its own privileges."""
    n1 = cluster.node("n1")
    fd = os.memfd_create("kvf-py-memfd")
    try:
        os.ftruncate(fd, PAGE_SIZE * 4)
        pool = n1.register_pool_fd(fd, PAGE_SIZE, 4)
        assert pool.pool_id > cluster.pools["n1"].pool_id
        n1.unregister_pool(pool.pool_id, timeout=WAIT_S)
    finally:
        os.close(fd)


def test_register_pool_fd_refuses_a_read_only_descriptor(cluster):
    """The node maps pools read-write: a descriptor open read-only is refused."""
    n1 = cluster.node("n1")
    fd = os.memfd_create("kvf-py-memfd-ro")
    try:
        os.ftruncate(fd, PAGE_SIZE * 4)
        ro = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY)
        try:
            with pytest.raises(kvfence.KvfenceError) as e:
                n1.register_pool_fd(ro, PAGE_SIZE, 4)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        finally:
            os.close(ro)
    finally:
        os.close(fd)
