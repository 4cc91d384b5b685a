"""The SGLang-shaped adapter (examples/sglang_adapter.py) end to end against
a real control plane and two real nodes: a chunked transfer lands byte-exact
in the decode pool and every page comes back; an abort mid-way frees pages
only after kvfence reports the leases released; a reused bootstrap_room gets
a new generation that a late abort of the old one cannot touch."""
import os
import signal
import sys
import time

import pytest

import kvfence
from kvfence import LeaseState, NodeState, RoomState

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import sglang_adapter as sa  # noqa: E402

PAGE = 4096
PAGES = 32


def managers(cluster):
    boot = sa.Bootstrap()
    p = sa.KVManager(sa.KVArgs(0, "n1", cluster.socket("n1"), PAGE, PAGES),
                     sa.DisaggregationMode.PREFILL, cluster.address, boot)
    d = sa.KVManager(sa.KVArgs(0, "n2", cluster.socket("n2"), PAGE, PAGES),
                     sa.DisaggregationMode.DECODE, cluster.address, boot)
    return p, d


def test_adapter_example_end_to_end(cluster):
    sa.run_demo(cluster.address, sa.KVArgs(0, "n1", cluster.socket("n1"), PAGE, PAGES),
                sa.KVArgs(0, "n2", cluster.socket("n2"), PAGE, PAGES), room_id=7001, chunks=3,
                pages_per_chunk=4)
    info = cluster.admin().room(7001)
    assert info.state == RoomState.COMPLETED


def test_adapter_example_as_a_script(cluster, capsys):
    assert sa.main(["--control", cluster.address, "--prefill-socket", cluster.socket("n1"),
                    "--decode-socket", cluster.socket("n2"), "--pages", "16", "--room", "7002"]) == 0
    assert "landed byte-exact" in capsys.readouterr().out


def test_abort_mid_way_frees_pages_only_when_released(cluster):
    admin = cluster.admin()
    p_mgr, d_mgr = managers(cluster)
    stopped = False
    try:
        room_id = 7100
        d_pages = d_mgr.allocator.alloc(8)
        recv = sa.KVReceiver(d_mgr, room_id)
        recv.init(d_pages)
        p_pages = p_mgr.allocator.alloc(8)
        sender = sa.KVSender(p_mgr, room_id)
        sender.init(8)
        assert sender.send(p_pages[:4])  # chunk 1 of 2
        room = sender.room
        assert recv.room == room

        # Every free() must happen with both leases RELEASED at the control plane.
        seen_states = []
        for mgr in (p_mgr, d_mgr):
            real_free = mgr.allocator.free

            def checked_free(pages, _real=real_free):
                seen_states.append({l.lease_id: l.state for l in admin.leases(room_id=room_id)})
                _real(pages)

            mgr.allocator.free = checked_free

        # The decode node is frozen: it cannot drain, so nothing may be released.
        n2_before = admin.node("n2").incarnation
        os.kill(cluster.node_pid("n2"), signal.SIGSTOP)
        stopped = True
        recv.abort("client went away")
        assert recv.poll() == sa.KVPoll.Failed
        # Wait until n1 (prefill) has drained: it closed admission for the room.
        deadline = time.monotonic() + 10
        while not any(p.drained for p in admin.room(room).participants
                      if p.participant.node_id == "n1"):
            assert time.monotonic() < deadline, "n1 never drained"
            time.sleep(0.02)
        # R10: the next chunk of the aborted room is refused, nothing written.
        assert sender.send(p_pages[4:]) is False
        assert sender.poll() == sa.KVPoll.Failed
        time.sleep(0.5)
        info = admin.room(room)
        if info.state != RoomState.ABORTING:
            # Only legitimate if n2 itself reported Drained, i.e. it handled
            # the abort before the freeze took hold (a scheduling race of the
            # test, not of kvfence): then the premise of this test did not
            # hold. A release without n2's drain would be the bug it guards.
            n2 = [p for p in info.participants if p.participant.node_id == "n2"]
            assert n2 and all(p.drained for p in n2), info
            os.kill(cluster.node_pid("n2"), signal.SIGCONT)
            stopped = False
            pytest.skip("n2 drained before it was frozen: the freeze raced the abort")
        # R1 / R8: neither side got its pages back while n2 may still write.
        assert all(d_mgr.allocator.is_allocated(pg) for pg in d_pages)
        assert all(p_mgr.allocator.is_allocated(pg) for pg in p_pages[:4])
        assert d_mgr.allocator.free_log == [] and p_mgr.allocator.free_log == []
        assert not d_mgr.released_log and not p_mgr.released_log

        os.kill(cluster.node_pid("n2"), signal.SIGCONT)
        stopped = False
        admin.wait_room_state(room, RoomState.ABORTED, 10)
        d_lease = d_mgr.room_state(room_id).lease_id
        p_lease = p_mgr.room_state(room_id).lease_id
        assert d_mgr.watcher.wait(d_lease, 10).state == LeaseState.RELEASED
        assert p_mgr.watcher.wait(p_lease, 10).state == LeaseState.RELEASED
        assert sorted(d_mgr.allocator.free_log[0]) == sorted(d_pages)
        assert p_mgr.allocator.free_log == [p_pages[:4]]  # only the granted chunk's pages
        assert d_mgr.watcher.callback_errors == [] and p_mgr.watcher.callback_errors == []
        assert len(seen_states) == 2
        for states in seen_states:
            assert states[d_lease] == LeaseState.RELEASED and states[p_lease] == LeaseState.RELEASED
        p_mgr.allocator.free(p_pages[4:])  # never granted: the engine frees it itself

        # Frozen past its self-fence margin, n2 fences itself when it runs
        # again and comes back as a new incarnation (new endpoints and keys),
        # at a moment of its own; a room made before that would name the old
        # one. The control plane does not yet hold a room's updates until every
        # member node has settled (issue 12, item 4), so the next room waits
        # here: n2 attached as a new incarnation, or still the old one well
        # past the node ttl (3 s) plus the self-fence margin.
        deadline = time.monotonic() + 15
        settled = time.monotonic() + 5
        while True:
            info = admin.node("n2")
            if info.state == NodeState.ATTACHED and (info.incarnation != n2_before or
                                                     time.monotonic() > settled):
                break
            assert time.monotonic() < deadline, "n2 did not attach again: %s" % (info,)
            time.sleep(0.02)

        # R13: the same bootstrap_room again is a new generation; a late abort
        # of the old generation changes nothing in the new one.
        d2 = d_mgr.allocator.alloc(4)
        recv2 = sa.KVReceiver(d_mgr, room_id)
        recv2.init(d2)
        assert recv2.room.room_id == room_id and recv2.room.generation > room.generation
        with pytest.raises(kvfence.FailedPrecondition) as ei:
            d_mgr.control.abort_room(room, "late abort of the old generation")
        assert "not current" in ei.value.details
        assert cluster.admin().room(recv2.room).state == RoomState.OPENING
        p2 = p_mgr.allocator.alloc(4)
        sender2 = sa.KVSender(p_mgr, room_id)
        sender2.init(4)
        assert sender2.send(p2)
        assert sa.wait_poll(recv2, [sa.KVPoll.Success, sa.KVPoll.Failed]) == sa.KVPoll.Success
        assert sa.wait_poll(sender2, [sa.KVPoll.Success, sa.KVPoll.Failed]) == sa.KVPoll.Success
        # Success is the room's COMPLETED; the pages come back when the lease
        # watcher sees RELEASED, a moment later.
        deadline = time.monotonic() + 10
        while not (d_mgr.allocator.available == PAGES and p_mgr.allocator.available == PAGES):
            assert time.monotonic() < deadline, (d_mgr.allocator.available,
                                                 p_mgr.allocator.available)
            time.sleep(0.02)
    finally:
        if stopped:
            os.kill(cluster.node_pid("n2"), signal.SIGCONT)
        p_mgr.close()
        d_mgr.close()
