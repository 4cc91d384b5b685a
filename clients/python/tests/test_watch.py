"""ReleaseWatcher against a real control plane and two real nodes
(conftest.py): exactly once per lease across a resubscription's replay, the
dedup window that bounds its memory (forgetting what the server would no
longer replay; keep_leases), and its own channel."""
import collections
import os
import threading
import time

import pytest

import kvfence
from kvfence import Participant, Role

WAIT_S = 10.0
SRC = Participant("n1", 0, Role.SOURCE)
SNK = Participant("n2", 0, Role.SINK)


class Recorder:
    """on_released: counts the deliveries of every lease."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = collections.Counter()

    def __call__(self, lease):
        with self.lock:
            self.count[lease.lease_id] += 1

    def total(self):
        with self.lock:
            return sum(self.count.values())

    def duplicates(self):
        with self.lock:
            return {lid: n for lid, n in self.count.items() if n != 1}


def abort_room(cl, ctl, room_id, first):
    """A room with a source lease on n1 and a sink lease on n2 (one page each,
    at `first`), aborted; its two lease ids."""
    a = ctl.join_room(room_id, SRC, cl.pools["n1"].pool_id, [(first, 1)], retry_s=WAIT_S)
    b = ctl.join_room(room_id, SNK, cl.pools["n2"].pool_id, [(first, 1)], retry_s=WAIT_S)
    ctl.abort_room(a.room, "test_watch")
    return a.lease_id, b.lease_id


def wait_until(pred, what, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.control_args("--tombstone-ttl-ms", "300")
def test_watcher_forgets_delivered_leases(cluster):
    """Tombstones kept 300 ms: four batches of 50 rooms, and after each,
    once the batch's tombstones expired, the next release makes the watcher
    check with the server (a replay without the batch) and forget it: the
    window holds only that room's two leases, and Lease objects are kept
    only for the last keep_leases releases. What the watcher keeps does not
    grow with the number of rooms it has seen."""
    ctl = cluster.control()
    rec = Recorder()
    w = ctl.release_watcher(rec, remember_s=0.2, keep_leases=8).start(WAIT_S)
    try:
        room_id = 7000
        first_ids = None
        for batch in range(4):
            for i in range(50):
                room_id += 1
                ids = abort_room(cluster, ctl, room_id, i % 32)
                first_ids = first_ids or ids
                for lid in ids:  # the pages are reused 32 rooms later
                    w.wait(lid, WAIT_S)
            assert w.remembered >= 2
            if batch == 0 and w.is_released(first_ids[0]):  # still in the window
                with pytest.raises(kvfence.NotFound, match="no longer kept"):
                    w.wait(first_ids[0], 0)  # but 99 releases ago: its Lease is gone
            time.sleep(1.0)  # > tombstone TTL and remember_s
            room_id += 1
            probe = abort_room(cluster, ctl, room_id, 40)
            for lid in probe:
                w.wait(lid, WAIT_S)
            # The probe's release started the check: only the probe room stays.
            wait_until(lambda: w.remembered == 2, "batch %d forgotten (%d ids kept)" %
                       (batch, w.remembered))
        assert rec.total() == 2 * 4 * 51 and not rec.duplicates()
        assert w.delivered == 2 * 4 * 51 and w.forgotten == w.delivered - 2
        assert w.verifications >= 4
        assert not w.is_released(first_ids[0])  # forgotten
        assert w.wait(probe[1], 0).lease_id == probe[1]
    finally:
        w.stop()


def test_replay_after_resubscription_is_delivered_once(cluster):
    """The stream ends (cancelled under the watcher: it resubscribes); the
    server's replay of the 10 releases delivers none of them again, and a
    release after the resubscription is delivered."""
    ctl = cluster.control()
    rec = Recorder()
    w = ctl.release_watcher(rec).start(WAIT_S)
    try:
        ids = [lid for i in range(5) for lid in abort_room(cluster, ctl, 7100 + i, i)]
        wait_until(lambda: rec.total() == 10, "10 releases delivered")
        assert w.syncs == 1
        w._watch.cancel()  # the stream ends; the watcher subscribes again
        wait_until(lambda: w.syncs == 2, "resubscribed and synced")
        more = abort_room(cluster, ctl, 7105, 5)
        for lid in more:
            w.wait(lid, WAIT_S)
        assert sorted(rec.count) == sorted(ids + list(more))
        assert not rec.duplicates()
    finally:
        w.stop()


def test_old_leases_the_server_still_replays_are_kept(cluster):
    """remember_s 0.2 s, tombstones kept 10 min (the default): past
    remember_s the watcher checks with the server, which still replays the
    leases, so none is forgotten, and a resubscription's replay delivers
    none of them again."""
    ctl = cluster.control()
    rec = Recorder()
    w = ctl.release_watcher(rec, remember_s=0.2).start(WAIT_S)
    try:
        first = abort_room(cluster, ctl, 7200, 0) + abort_room(cluster, ctl, 7201, 1)
        wait_until(lambda: rec.total() == 4, "4 releases delivered")
        time.sleep(0.3)
        last = abort_room(cluster, ctl, 7202, 2)  # a release: the old rooms are verified
        for lid in last:
            w.wait(lid, WAIT_S)
        wait_until(lambda: w.verifications >= 1, "the server asked")
        assert all(w.is_released(lid) for lid in first)
        w._watch.cancel()
        wait_until(lambda: w.syncs == 2, "resubscribed and synced")
        assert not rec.duplicates()
        assert sorted(rec.count) == sorted(first + last)
        assert w.verifications >= 1 and w.forgotten == 0 and w.remembered == 6
    finally:
        w.stop()


def test_watcher_reads_on_its_own_channel(cluster):
    """The watcher's stream is not on the engine's channel: closing the
    ControlClient it came from leaves it delivering."""
    ctl = cluster.control()
    rec = Recorder()
    w = ctl.release_watcher(rec).start(WAIT_S)
    try:
        ctl.close()
        other = cluster.control()
        a, b = abort_room(cluster, other, 7300, 0)
        assert w.wait(a, WAIT_S).lease_id == a and w.wait(b, WAIT_S).lease_id == b
        assert w.last_error is None
    finally:
        w.stop()


def test_libkvfence_backend_delivers_once_per_lease(cluster):
    """backend='libkvfence' (ctest sets KVFENCE_LIBRARY): libkvfence's own
    thread receives and queues, the watcher drains per wake-up; start()
    returns synced, every release is delivered once, stop() ends it."""
    if not os.environ.get("KVFENCE_LIBRARY"):
        pytest.skip("KVFENCE_LIBRARY is not set")
    ctl = cluster.control()
    rec = Recorder()
    states = []
    w = ctl.release_watcher(rec, node_id="n2", backend="libkvfence",
                            on_room_state=states.append).start(WAIT_S)
    try:
        assert w.syncs == 1
        sinks = [abort_room(cluster, ctl, 7400 + i, i)[1] for i in range(10)]
        for lid in sinks:
            assert w.wait(lid, WAIT_S).lease_id == lid
        assert sorted(rec.count) == sorted(sinks) and not rec.duplicates()
        assert any(s.new_state == kvfence.RoomState.ABORTED for s in states)
    finally:
        w.stop()
    assert not any(t.name == "kvfence-release-watcher" and t.is_alive()
                   for t in threading.enumerate())
    with pytest.raises(ValueError, match="backend"):
        ctl.release_watcher(rec, backend="nope")
