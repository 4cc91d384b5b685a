"""kill -9 of kvfence-control under load (issue 14, chaos part 1).

Each cycle starts kvfence-control on one data directory, checks that every
change acknowledged in earlier cycles is there exactly as acknowledged, puts
a concurrent load on it (LOAD_THREADS client threads: JoinRoom of a sink and a
source, then AbortRoom, or the nodes' Completed and CompleteRoom, or nothing)
and kills it with SIGKILL at a random moment. Only replies with status OK
count: a lease id, an abort token, a room state. A change in flight at the
kill may have become durable without its reply, so the check allows more than
was acknowledged (a later state, an extra participant), never less or other.

Recovery time is measured from the kill to the port file of the next run
(the gRPC port opens only once the log is replayed), and the server's own
"recovered from ..." figure is read from its log.
"""

import random
import re
import statistics
import threading
import time

import grpc

from kvfence.v1 import control_pb2, node_pb2, types_pb2

from conftest import env_int, figure
from kvf_harness import RPC_TIMEOUT_S, FakeNode, admin, control, join_request, token_of
from kvf_store import QUIET_TIMERS, get_room, segments, snapshots

CYCLES = env_int("KVF_CHAOS_CYCLES", 3)
LOAD_THREADS = 4
SRC, SNK = "chaos-src", "chaos-snk"
ARGS = QUIET_TIMERS + ["--snapshot-every", 300]
ROLE_NODE = {types_pb2.ROLE_SOURCE: SRC, types_pb2.ROLE_SINK: SNK}
ABORTED_STATES = (types_pb2.ROOM_STATE_ABORTING, types_pb2.ROOM_STATE_ABORTED)


class Acked:
    """What one room was acknowledged to be."""

    def __init__(self):
        self.generation = None
        self.leases = {}  # role -> lease_id
        self.token = None  # AbortRoom's token
        self.completed = False  # CompleteRoom answered COMPLETED

    def changes(self):
        return len(self.leases) + (self.token is not None) + self.completed


class Load:
    """Client threads that drive rooms through joins, aborts and completions
    as fast as they can, keeping only what was acknowledged."""

    def __init__(self, srv, nodes, next_room, seed):
        self.ctl = control(srv.channel())
        self.nodes = nodes
        self.lock = threading.Lock()
        self.next_room = next_room
        self.rng = random.Random(seed)
        self.acked = {}  # room_id -> Acked
        self.killed = threading.Event()
        self.errors = []

    def _take(self):
        with self.lock:
            room_id = self.next_room
            self.next_room += 1
            return room_id, self.rng.random()

    def _join(self, room_id, role, rec):
        # Pages are unique per room: a sink's write lease never meets another.
        j = self.ctl.JoinRoom(join_request(room_id, ROLE_NODE[role], role, first=2 * room_id,
                                           count=2), timeout=RPC_TIMEOUT_S)
        with self.lock:
            rec.generation = j.room.generation
            rec.leases[role] = j.lease_id
        return j

    def _complete(self, room, rec):
        for role, node in ((types_pb2.ROLE_SOURCE, SRC), (types_pb2.ROLE_SINK, SNK)):
            self.nodes[node].send(completed=node_pb2.Completed(room=room, rank=0, role=role))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            r = self.ctl.CompleteRoom(control_pb2.CompleteRoomRequest(
                room=room, participant=types_pb2.Participant(node_id=SRC, rank=0,
                                                             role=types_pb2.ROLE_SOURCE)),
                timeout=RPC_TIMEOUT_S)
            if r.state == types_pb2.ROOM_STATE_COMPLETED:
                with self.lock:
                    rec.completed = True
                return
            time.sleep(0.005)

    def run(self):
        while True:
            room_id, dice = self._take()
            rec = Acked()
            with self.lock:
                self.acked[room_id] = rec
            try:
                self._join(room_id, types_pb2.ROLE_SINK, rec)
                j = self._join(room_id, types_pb2.ROLE_SOURCE, rec)
                if dice < 0.45:
                    a = self.ctl.AbortRoom(control_pb2.AbortRoomRequest(room=j.room,
                                                                        detail="chaos"),
                                           timeout=RPC_TIMEOUT_S)
                    with self.lock:
                        rec.token = token_of(a.token)
                elif dice < 0.9:
                    self._complete(j.room, rec)
            except grpc.RpcError as e:
                if not self.killed.is_set():
                    self.errors.append("room %d: %s %s" % (room_id, e.code(), e.details()))
                return
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append("room %d: %r" % (room_id, e))
                return


def check_acked(ch, acked):
    """Every acknowledged change is there as acknowledged. Returns how many
    changes were checked."""
    checked = 0
    for room_id, rec in sorted(acked.items()):
        if rec.generation is None:
            continue  # nothing about it was acknowledged
        try:
            info = get_room(ch, room_id, rec.generation)
        except grpc.RpcError as e:
            raise AssertionError("room %d:%d acknowledged, now %s %s" % (
                room_id, rec.generation, e.code(), e.details()))
        where = "room %d:%d" % (room_id, rec.generation)
        assert info.room.generation == rec.generation, (where, info)
        leases = {p.participant.role: p.lease for p in info.participants}
        for role, lease_id in rec.leases.items():
            assert role in leases, "%s: acknowledged %s lease %d is gone: %s" % (
                where, types_pb2.Role.Name(role), lease_id, info)
            assert leases[role].lease_id == lease_id, "%s: lease id %d became %d" % (
                where, lease_id, leases[role].lease_id)
        state = types_pb2.RoomState.Name(info.state)
        if len(rec.leases) == 2:
            assert info.state != types_pb2.ROOM_STATE_OPENING, (where, state)
        if rec.token is not None:
            assert info.state in ABORTED_STATES, "%s: acknowledged abort, now %s" % (where, state)
            assert token_of(info.token) == rec.token, "%s: abort token changed" % where
            for lease in leases.values():
                assert lease.state in (types_pb2.LEASE_STATE_RELEASING,
                                       types_pb2.LEASE_STATE_RELEASED), (where, lease)
        if rec.completed:
            assert info.state == types_pb2.ROOM_STATE_COMPLETED, (
                "%s: acknowledged COMPLETED, now %s" % (where, state))
            for lease in leases.values():
                assert lease.state == types_pb2.LEASE_STATE_RELEASED, (where, lease)
        checked += rec.changes()
    return checked


def _recovered_ms(srv):
    for m in srv.log_messages():
        hit = re.search(r"recovered from .*?([0-9.]+) ms", m)
        if hit:
            return float(hit.group(1))
    return None


def test_kill9_under_load_loses_no_acknowledged_change(servers, tmp_path):
    data = tmp_path / "data"
    rng = random.Random(0xC4A05)
    acked = {}
    next_room = 1
    recovery_s, server_ms, checked_per_cycle = [], [], []
    t_kill = None
    snapshots_seen = 0

    for cycle in range(CYCLES + 1):
        srv = servers(data, *ARGS)
        srv.wait_serving(timeout=30.0)
        if t_kill is not None:
            recovery_s.append(time.monotonic() - t_kill)
            ms = _recovered_ms(srv)
            if ms is not None:
                server_ms.append(ms)
        ch = srv.channel()
        checked_per_cycle.append(check_acked(ch, acked))
        if cycle == CYCLES:
            break

        # The same incarnations each cycle: a re-attach gets the pending
        # notices, which auto_drain answers at once.
        nodes = {n: FakeNode(srv.channel(), n, incarnation=1, auto_drain=True) for n in (SRC, SNK)}
        for n in nodes.values():
            n.recv("welcome")
        load = Load(srv, nodes, next_room, seed=cycle)
        threads = [threading.Thread(target=load.run, daemon=True) for _ in range(LOAD_THREADS)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.3, 1.2))
        load.killed.set()
        srv.kill9(close_channels=False)
        t_kill = time.monotonic()
        for t in threads:
            t.join(timeout=2 * RPC_TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), "a client thread hangs"
        for n in nodes.values():
            n.close()
        srv.close_channels()
        assert not load.errors, load.errors[:5]
        assert not srv.log_errors(), srv.log_errors()[:5]
        done = {k: v for k, v in load.acked.items() if v.generation is not None}
        assert done, "cycle %d acknowledged nothing" % cycle
        acked.update(done)
        next_room = load.next_room
        assert segments(data), "no log segment"
        snapshots_seen += len(snapshots(data))

    stats = admin(ch).GetStats(control_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)
    assert stats.rooms.completed >= sum(1 for r in acked.values() if r.completed), stats
    assert not srv.log_errors(), srv.log_errors()[:5]
    assert srv.terminate() == 0, srv.stderr_tail()

    changes = sum(r.changes() for r in acked.values())
    figure("kill9.cycles", CYCLES)
    figure("kill9.rooms_acknowledged", len(acked))
    figure("kill9.changes_acknowledged", changes)
    figure("kill9.changes_checked_total", sum(checked_per_cycle))
    figure("kill9.kinds", {
        "joins": sum(len(r.leases) for r in acked.values()),
        "aborts": sum(1 for r in acked.values() if r.token is not None),
        "completions": sum(1 for r in acked.values() if r.completed)})
    figure("kill9.lost", 0)
    figure("kill9.snapshots_seen_after_kills", snapshots_seen)
    figure("kill9.recovery_s_kill_to_serving", {
        "min": round(min(recovery_s), 3), "median": round(statistics.median(recovery_s), 3),
        "max": round(max(recovery_s), 3)})
    if server_ms:
        figure("kill9.recovery_ms_server_replay", {
            "min": min(server_ms), "median": statistics.median(server_ms), "max": max(server_ms)})
