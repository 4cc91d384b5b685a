"""Crash safety of kvfence-control with --data-dir: restart, kill -9, a torn
log tail, a corrupt snapshot and an empty data directory.

Each test has its own data directory (pytest's tmp_path) and starts its own
servers on 127.0.0.1:0; the `servers` fixture kills whatever is left running.
Every RPC has a deadline (kvf_harness.RPC_TIMEOUT_S).

Timers are pushed far out (--node-ttl-ms, --join-timeout-ms,
--drain-deadline-ms, --resend-ms) so that nothing changes state on its own
while a test looks: a room changes only because of what the test did, and a
notice that arrives right after a re-attach cannot be a backoff re-send.
"""

import os
import random
import threading
import time

import grpc
import pytest

from kvfence.v1 import control_pb2, node_pb2, types_pb2

from kvf_harness import (
    RPC_TIMEOUT_S,
    FakeNode,
    admin,
    control,
    join_request,
    token_of,
)

try:
    from kvfstubs.grpc_health.v1 import health_pb2, health_pb2_grpc
except ImportError:  # grpc-proto was not installed when the stubs were made
    health_pb2 = health_pb2_grpc = None

QUIET_TIMERS = [
    "--node-ttl-ms", 600000,
    "--join-timeout-ms", 600000,
    "--drain-deadline-ms", 600000,
    "--resend-ms", 5000,  # the largest first re-send the server takes (its cap is 5 s)
]
CUT_MESSAGE = "of torn or corrupt tail"


def _serve(servers, data_dir, *extra_args):
    p = servers(data_dir, *extra_args)
    p.wait_serving()
    return p


def _counts(stats):
    r, l = stats.rooms, stats.leases
    return (
        (r.opening, r.active, r.aborting, r.completed, r.aborted),
        (l.active, l.releasing, l.released),
    )


def _stats(ch):
    return admin(ch).GetStats(control_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)


def _get_room(ch, room_id, generation=0):
    return admin(ch).GetRoom(
        control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=room_id, generation=generation)),
        timeout=RPC_TIMEOUT_S,
    )


def _files(data_dir, prefix, suffix):
    return sorted(f for f in os.listdir(data_dir) if f.startswith(prefix) and f.endswith(suffix))


def _assert_serving(ch):
    if health_pb2 is not None:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    else:
        admin(ch).Ping(control_pb2.PingRequest(), timeout=RPC_TIMEOUT_S)


def _make_changes(ch, node_id, count, first_room=1000):
    """`count` acknowledged changes on one attached node: joins, every third
    room aborted. Returns {room_id: (generation, lease_id, token or None)}."""
    ctl = control(ch)
    acked = {}
    made = 0
    room_id = first_room
    while made < count:
        j = ctl.JoinRoom(
            join_request(room_id, node_id, types_pb2.ROLE_SOURCE, first=room_id),
            timeout=RPC_TIMEOUT_S,
        )
        made += 1
        token = None
        if room_id % 3 == 0 and made < count:
            a = ctl.AbortRoom(control_pb2.AbortRoomRequest(room=j.room), timeout=RPC_TIMEOUT_S)
            token = token_of(a.token)
            made += 1
        acked[room_id] = (j.room.generation, j.lease_id, token)
        room_id += 1
    return acked


def _assert_rooms_survived(ch, acked):
    for room_id, (generation, lease_id, token) in sorted(acked.items()):
        try:
            info = _get_room(ch, room_id, generation)
        except grpc.RpcError as e:
            raise AssertionError(
                "acknowledged join of room %d:%d is gone: %s %s"
                % (room_id, generation, e.code(), e.details())
            )
        assert info.room.generation == generation, (room_id, info)
        assert [p.lease.lease_id for p in info.participants] == [lease_id], (room_id, info)
        if token is not None:
            assert info.state in (
                types_pb2.ROOM_STATE_ABORTING,
                types_pb2.ROOM_STATE_ABORTED,
            ), "acknowledged abort of room %d:%d lost: %s" % (
                room_id,
                generation,
                types_pb2.RoomState.Name(info.state),
            )
            assert token_of(info.token) == token, "room %d:%d: abort token changed" % (
                room_id,
                generation,
            )


# ---- 1 ----------------------------------------------------------------------


def test_restart_keeps_rooms_leases_and_tokens(servers, tmp_path):
    data = tmp_path / "data"
    srv = _serve(servers, data, *QUIET_TIMERS)
    ch = srv.channel()
    n1 = FakeNode(ch, "n1", incarnation=7)
    n2 = FakeNode(ch, "n2", incarnation=9)
    n1.recv("welcome")
    n2.recv("welcome")

    ctl = control(ch)
    src = ctl.JoinRoom(join_request(7, "n1", types_pb2.ROLE_SOURCE, first=0, count=16),
                       timeout=RPC_TIMEOUT_S)
    snk = ctl.JoinRoom(join_request(7, "n2", types_pb2.ROLE_SINK, first=32, count=16),
                       timeout=RPC_TIMEOUT_S)
    assert snk.state == types_pb2.ROOM_STATE_ACTIVE
    room = snk.room
    n1.recv("room_update")
    n2.recv("room_update")

    aborted = ctl.AbortRoom(control_pb2.AbortRoomRequest(room=room, detail="durability test"),
                            timeout=RPC_TIMEOUT_S)
    token = token_of(aborted.token)
    assert aborted.state == types_pb2.ROOM_STATE_ABORTING
    assert token_of(n1.recv("abort_notice").token) == token
    assert token_of(n2.recv("abort_notice").token) == token

    before = _counts(_stats(ch))
    n1.close()
    n2.close()
    assert srv.terminate() == 0, srv.stderr_tail()

    # ---- restart on the same directory
    srv = _serve(servers, data, *QUIET_TIMERS)
    ch = srv.channel()
    info = _get_room(ch, room.room_id)
    assert info.room == room
    assert info.state == types_pb2.ROOM_STATE_ABORTING, types_pb2.RoomState.Name(info.state)
    assert token_of(info.token) == token
    leases = {p.lease.lease_id: p.lease.state for p in info.participants}
    assert leases == {
        src.lease_id: types_pb2.LEASE_STATE_RELEASING,
        snk.lease_id: types_pb2.LEASE_STATE_RELEASING,
    }, info
    stats = _stats(ch)
    assert _counts(stats) == before, stats
    assert stats.nodes.attached == 0 and stats.nodes.suspect == 2, stats

    # A watcher that starts after the restart sees both releases.
    watch = control(ch).WatchLeases(
        control_pb2.WatchLeasesRequest(lease_ids=[src.lease_id, snk.lease_id]),
        timeout=4 * RPC_TIMEOUT_S,
    )
    events = iter(watch)
    first = next(events)
    assert first.WhichOneof("event") == "synced", first

    # Re-attach with the same incarnations: the pending notice comes at once.
    # The first re-send is due 5 s after the first send (--resend-ms; the
    # clock resumes where the log ends), so a notice within 1 s of the
    # Welcome is the re-attach's, not a backoff re-send.
    n1 = FakeNode(ch, "n1", incarnation=7)
    n2 = FakeNode(ch, "n2", incarnation=9)
    notices = {}
    for node in (n1, n2):
        node.recv("welcome")
        notice = node.recv("abort_notice", timeout=1.0)
        assert notice.room == room
        assert token_of(notice.token) == token, node.node_id
        notices[node.node_id] = notice
    for node in (n1, n2):
        notice = notices[node.node_id]
        node.send(drained=node_pb2.Drained(room=room, token=notice.token,
                                           notice_id=notice.notice_id))

    released = {}
    for event in events:
        which = event.WhichOneof("event")
        if which == "released":
            released[event.released.lease_id] = event.released
            if len(released) == 2:
                break
    watch.cancel()
    assert set(released) == {src.lease_id, snk.lease_id}
    for lease in released.values():
        assert lease.state == types_pb2.LEASE_STATE_RELEASED
        assert lease.room == room
    info = _get_room(ch, room.room_id)
    assert info.state == types_pb2.ROOM_STATE_ABORTED, types_pb2.RoomState.Name(info.state)
    assert token_of(info.token) == token
    n1.close()
    n2.close()
    assert srv.terminate() == 0, srv.stderr_tail()


# ---- 2 ----------------------------------------------------------------------


class _Load:
    """Client threads that join new rooms and abort some, as fast as they
    can, keeping only what was acknowledged."""

    def __init__(self, channel, node_id, next_room, next_page, seed):
        self.ctl = control(channel)
        self.node_id = node_id
        self.lock = threading.Lock()
        self.next_room = next_room
        self.next_page = next_page
        self.rng = random.Random(seed)
        self.acked = {}  # room_id -> [generation, lease_id, token or None]
        self.killed = threading.Event()
        self.errors = []

    def _take(self):
        with self.lock:
            room_id, page = self.next_room, self.next_page
            self.next_room += 1
            self.next_page += 2
            abort = self.rng.random() < 0.4
        return room_id, page, abort

    def run(self):
        while True:
            room_id, page, abort = self._take()
            try:
                j = self.ctl.JoinRoom(
                    join_request(room_id, self.node_id, types_pb2.ROLE_SOURCE, first=page,
                                 count=2),
                    timeout=RPC_TIMEOUT_S,
                )
                with self.lock:
                    self.acked[room_id] = [j.room.generation, j.lease_id, None]
                if abort:
                    a = self.ctl.AbortRoom(control_pb2.AbortRoomRequest(room=j.room),
                                           timeout=RPC_TIMEOUT_S)
                    with self.lock:
                        self.acked[room_id][2] = token_of(a.token)
            except grpc.RpcError as e:
                if not self.killed.is_set():
                    self.errors.append("room %d: %s %s" % (room_id, e.code(), e.details()))
                return
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append("room %d: %r" % (room_id, e))
                return


def test_kill9_loses_no_acknowledged_change(servers, tmp_path):
    data = tmp_path / "data"
    args = QUIET_TIMERS + ["--snapshot-every", 50]
    rng = random.Random(20240611)
    delays = [0.2, 1.0] + [rng.uniform(0.2, 1.0) for _ in range(3)]
    rng.shuffle(delays)
    acked = {}  # every acknowledged change of every round
    next_room, next_page = 1, 0
    snapshots_seen = 0

    for round_no, delay in enumerate(delays):
        srv = _serve(servers, data, *args)
        # Everything acknowledged in earlier rounds survived the kills.
        _assert_rooms_survived(srv.channel(), acked)

        node_ch = srv.channel()
        # The node drains every abort at once, so Drained reports are in the
        # log too and few notices stay pending (the many-notices case has its
        # own test below).
        node = FakeNode(node_ch, "load-node", incarnation=1, auto_drain=True)
        node.recv("welcome")
        load = _Load(srv.channel(), "load-node", next_room, next_page, seed=round_no)
        threads = [threading.Thread(target=load.run, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(delay)
        load.killed.set()
        srv.kill9(close_channels=False)
        for t in threads:
            t.join(timeout=2 * RPC_TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), "a client thread hangs"
        node.close()
        srv.close_channels()
        assert not srv.log_errors(), srv.log_errors()[:5]
        assert not load.errors, load.errors[:5]
        assert load.acked, "round %d acknowledged nothing in %.2f s" % (round_no, delay)
        acked.update({k: tuple(v) for k, v in load.acked.items()})
        next_room, next_page = load.next_room, load.next_page

        assert _files(data, "wal-", ".log"), sorted(os.listdir(data))
        snapshots_seen += len(_files(data, "snapshot-", ".snap"))

    # More than 50 records in all: snapshots were written mid-run.
    assert snapshots_seen > 0, sorted(os.listdir(data))
    srv = _serve(servers, data, *args)
    ch = srv.channel()
    _assert_rooms_survived(ch, acked)
    aborted = sum(1 for v in acked.values() if v[2] is not None)
    stats = _stats(ch)
    # A join or abort in flight at a kill may have become durable without
    # its reply: there may be more rooms, and more aborted, than acknowledged.
    r = stats.rooms
    assert r.opening + r.aborting + r.aborted >= len(acked), stats
    assert r.aborting + r.aborted >= aborted, stats
    assert not srv.log_errors(), srv.log_errors()[:5]
    assert srv.terminate() == 0, srv.stderr_tail()


# ---- 3 ----------------------------------------------------------------------


def test_torn_tail_is_cut_and_reported(servers, tmp_path):
    data = tmp_path / "data"
    srv = _serve(servers, data, *QUIET_TIMERS)
    ch = srv.channel()
    node = FakeNode(ch, "n1")
    node.recv("welcome")
    acked = _make_changes(ch, "n1", 12)
    node.close()
    assert srv.terminate() == 0, srv.stderr_tail()
    assert CUT_MESSAGE not in srv.stderr_text()

    segments = _files(data, "wal-", ".log")
    assert segments, sorted(os.listdir(data))
    newest = data / segments[-1]
    garbage = bytes(random.Random(37).getrandbits(8) for _ in range(37))
    with open(newest, "ab") as f:
        f.write(garbage)

    srv = _serve(servers, data, *QUIET_TIMERS)
    ch = srv.channel()
    _assert_serving(ch)
    cuts = [m for m in srv.log_messages() if CUT_MESSAGE in m]
    assert cuts, srv.stderr_tail()
    assert segments[-1] in cuts[0] and "37 bytes" in cuts[0], cuts
    _assert_rooms_survived(ch, acked)
    assert srv.terminate() == 0, srv.stderr_tail()

    # The cut is durable: the next start finds nothing to cut.
    srv = _serve(servers, data, *QUIET_TIMERS)
    assert not [m for m in srv.log_messages() if CUT_MESSAGE in m], srv.stderr_tail()
    _assert_rooms_survived(srv.channel(), acked)
    assert srv.terminate() == 0, srv.stderr_tail()


# ---- 4 ----------------------------------------------------------------------


def test_corrupt_snapshot_stops_startup(servers, tmp_path):
    data = tmp_path / "data"
    args = QUIET_TIMERS + ["--snapshot-every", 5]
    srv = _serve(servers, data, *args)
    ch = srv.channel()
    node = FakeNode(ch, "n1")
    node.recv("welcome")
    _make_changes(ch, "n1", 8)
    node.close()
    assert srv.terminate() == 0, srv.stderr_tail()

    snapshots = _files(data, "snapshot-", ".snap")
    assert snapshots, sorted(os.listdir(data))
    newest = data / snapshots[-1]
    raw = bytearray(newest.read_bytes())
    assert len(raw) > 64, len(raw)
    raw[len(raw) // 2] ^= 0x40
    newest.write_bytes(bytes(raw))

    srv = servers(data, *args)
    rc = srv.wait_exit(10.0)
    assert rc is not None, "kvfence-control still runs 10 s after start on a corrupt snapshot"
    assert rc != 0, srv.stderr_tail()
    assert not os.path.exists(srv.port_file), "port file written by a server that did not start"
    assert snapshots[-1] in srv.stderr_text(), srv.stderr_tail()


# ---- 5 ----------------------------------------------------------------------


@pytest.mark.parametrize("exists", [True, False], ids=["empty-dir", "absent-dir"])
def test_empty_data_dir_is_a_new_cluster(servers, tmp_path, exists):
    data = tmp_path / "data"
    if exists:
        data.mkdir()
    srv = _serve(servers, data)
    assert any("new cluster" in m for m in srv.log_messages()), srv.stderr_tail()
    stats = _stats(srv.channel())
    assert _counts(stats) == ((0, 0, 0, 0, 0), (0, 0, 0)), stats
    assert (stats.nodes.attached, stats.nodes.suspect, stats.nodes.lost) == (0, 0, 0), stats
    assert stats.generation == 0 and stats.notices_pending == 0, stats
    assert srv.terminate() == 0, srv.stderr_tail()
    assert os.path.isdir(data)


# ---- a node with many pending notices re-attaches -----------------------------


def test_reattach_with_many_pending_notices_survives_kill9(servers, tmp_path):
    """A re-attach re-sends every pending notice of the node at once, each
    with a random backoff jitter (8 bytes); the command must still be logged
    and the changes acknowledged after it must survive a kill -9."""
    data = tmp_path / "data"
    rooms = 600  # 600 pending AbortNotices -> 4800 random bytes on re-attach
    srv = _serve(servers, data, *QUIET_TIMERS)
    ch = srv.channel()
    node = FakeNode(ch, "n1")
    node.recv("welcome")
    ctl = control(ch)
    for room_id in range(1, rooms + 1):
        j = ctl.JoinRoom(join_request(room_id, "n1", types_pb2.ROLE_SOURCE, first=room_id),
                         timeout=RPC_TIMEOUT_S)
        ctl.AbortRoom(control_pb2.AbortRoomRequest(room=j.room), timeout=RPC_TIMEOUT_S)
    node.close()
    assert srv.terminate() == 0, srv.stderr_tail()

    srv = _serve(servers, data, *QUIET_TIMERS)
    ch = srv.channel()
    node = FakeNode(ch, "n1")
    node.recv("welcome")
    node.recv("abort_notice")
    j = control(ch).JoinRoom(
        join_request(rooms + 1, "n1", types_pb2.ROLE_SOURCE, first=rooms + 1),
        timeout=RPC_TIMEOUT_S,
    )
    acked = {rooms + 1: (j.room.generation, j.lease_id, None)}
    errors = srv.log_errors()
    srv.kill9()
    node.close()

    srv = _serve(servers, data, *QUIET_TIMERS)
    _assert_rooms_survived(srv.channel(), acked)
    assert not errors, errors
    assert srv.terminate() == 0, srv.stderr_tail()
