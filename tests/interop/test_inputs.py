"""Input discipline of kvfence-control, on the wire: every RPC validates its
input before it touches state (control.proto: "A failed call changes
nothing, except where an RPC says otherwise").

For each bad input a test checks the gRPC status code, that the status
message names what is at fault (the field, page, pool size, room,
participant or limit), and that the control plane's state is unchanged
afterwards: GetStats (room, lease and node counts, the last generation) and
GetRoom of the rooms involved. The one documented exception, a capability
refusal (which also aborts the room), is checked for exactly that change.

Each test gets a fresh kvfence-control (conftest.py) and fake nodes
(kvf_harness.FakeNode) attached with pool 1 of POOL_PAGES pages. Every call
has a deadline.
"""

import time

import grpc
import pytest

from kvfence.v1 import control_pb2, node_pb2, node_pb2_grpc, types_pb2

from kvf_harness import RPC_TIMEOUT_S, FakeNode, admin, control, join_request

ERROR_DETAIL_KEY = "kvfence-error-bin"
POOL_PAGES = 100
SRC = types_pb2.ROLE_SOURCE
SNK = types_pb2.ROLE_SINK
R = types_pb2.PageRange
# How long a test waits for something that must not arrive (a RoomUpdate).
QUIET_S = 0.3


# ---- helpers ------------------------------------------------------------------


def _stats(ch):
    return admin(ch).GetStats(control_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)


def _state_of(stats):
    """The parts of Stats that only a state change moves (counters of sends,
    re-sends and reports, and the uptime, are left out)."""
    r, l, n = stats.rooms, stats.leases, stats.nodes
    return {
        "rooms": (r.opening, r.active, r.aborting, r.completed, r.aborted),
        "leases": (l.active, l.releasing, l.released),
        "nodes": (n.attached, n.suspect, n.lost),
        "generation": stats.generation,
    }


def _get_room(ch, room_id, generation=0):
    return admin(ch).GetRoom(
        control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=room_id, generation=generation)),
        timeout=RPC_TIMEOUT_S,
    )


def _room_view(info):
    """A RoomInfo without what time moves on its own (age_ms, state_age_ms,
    and notice_attempts, which re-sends of a pending abort notice raise)."""
    copy = type(info)()
    copy.CopyFrom(info)
    copy.age_ms = 0
    copy.state_age_ms = 0
    for p in copy.participants:
        p.notice_attempts = 0
    return copy


def _snapshot(ch, room_ids=()):
    """State that a refused call must not change: Stats and the given rooms
    (None for a room that does not exist)."""
    rooms = {}
    for room_id in room_ids:
        try:
            rooms[room_id] = _room_view(_get_room(ch, room_id))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, "%s: %s" % (e.code(), e.details())
            rooms[room_id] = None
    return _state_of(_stats(ch)), rooms


def _assert_unchanged(ch, before):
    state, rooms = before
    after_state, after_rooms = _snapshot(ch, rooms.keys())
    assert after_state == state, "GetStats changed: %s -> %s" % (state, after_state)
    for room_id, info in rooms.items():
        assert after_rooms[room_id] == info, "room %d changed:\n%s\n->\n%s" % (
            room_id,
            info,
            after_rooms[room_id],
        )


def _error_detail(err):
    for key, value in err.trailing_metadata() or ():
        if key == ERROR_DETAIL_KEY:
            detail = types_pb2.ErrorDetail()
            detail.ParseFromString(value)  # must parse when present
            return detail
    return None


def _refused(call, code, *needles, field=None):
    """Runs call(); asserts that it fails with `code` (or one of a tuple) and
    that the status message contains every needle. If an ErrorDetail is
    attached and names a field, it must start with `field`. Returns the
    error."""
    codes = code if isinstance(code, tuple) else (code,)
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    details = err.details() or ""
    assert err.code() in codes, "%s (wanted %s): %s" % (err.code(), codes, details)
    for needle in needles:
        assert str(needle) in details, "%r not in status message %r" % (needle, details)
    detail = _error_detail(err)
    if detail is not None and detail.field and field is not None:
        assert detail.field.startswith(field), str(detail)
    return err


def _join(ch, request):
    return control(ch).JoinRoom(request, timeout=RPC_TIMEOUT_S)


def _request(room_id, node_id="n1", role=SRC, first=0, count=1, **kw):
    return join_request(room_id, node_id, role, first, count=count, **kw)


def _received_kinds(node):
    """The kinds of the messages a FakeNode has received so far (not consumed)."""
    return [m.WhichOneof("msg") for m in list(node._received.queue) if m is not None
            and not isinstance(m, grpc.RpcError)]


@pytest.fixture
def nodes(channel):
    """Two fake nodes, n1 and n2, attached with pool 1 of POOL_PAGES pages."""
    attached = []

    def attach(node_id, page_count=POOL_PAGES, **kw):
        node = FakeNode(channel, node_id, page_count=page_count, **kw)
        attached.append(node)
        node.recv("welcome")
        return node

    attach("n1")
    attach("n2")
    yield attach
    for node in attached:
        node.close()


# ---- JoinRoom: shape of the request -------------------------------------------


@pytest.mark.parametrize("room_id", [0, 1 << 63, (1 << 64) - 1])
def test_join_room_id_out_of_range(channel, nodes, room_id):
    before = _snapshot(channel)
    _refused(
        lambda: _join(channel, _request(room_id)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "room_id",
        field="room_id",
    )
    _assert_unchanged(channel, before)


@pytest.mark.parametrize("field", ["expected_sources", "expected_sinks"])
def test_join_expected_count_zero(channel, nodes, field):
    before = _snapshot(channel, [31])
    request = _request(31)
    setattr(request, field, 0)
    _refused(lambda: _join(channel, request), grpc.StatusCode.INVALID_ARGUMENT, field, field=field)
    _assert_unchanged(channel, before)


@pytest.mark.parametrize("field", ["expected_sources", "expected_sinks"])
def test_join_expected_counts_differ_from_room(channel, nodes, field):
    _join(channel, _request(32, "n1", SRC))
    before = _snapshot(channel, [32])
    request = _request(32, "n2", SNK)
    setattr(request, field, 2)
    _refused(
        lambda: _join(channel, request), grpc.StatusCode.INVALID_ARGUMENT, field, "32", field=field
    )
    _assert_unchanged(channel, before)


def test_join_missing_participant(channel, nodes):
    before = _snapshot(channel, [33])
    request = _request(33)
    request.ClearField("participant")
    _refused(
        lambda: _join(channel, request),
        grpc.StatusCode.INVALID_ARGUMENT,
        "participant",
        field="participant",
    )
    _assert_unchanged(channel, before)


@pytest.mark.parametrize("role", [types_pb2.ROLE_UNSPECIFIED, 7])
def test_join_bad_role(channel, nodes, role):
    before = _snapshot(channel, [34])
    _refused(
        lambda: _join(channel, _request(34, role=role)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "role",
        field="participant.role",
    )
    _assert_unchanged(channel, before)


def test_join_unknown_node_is_not_found(channel, nodes):
    before = _snapshot(channel, [35])
    _refused(
        lambda: _join(channel, _request(35, node_id="ghost-node-9")),
        grpc.StatusCode.NOT_FOUND,
        "ghost-node-9",
        field="participant",
    )
    _assert_unchanged(channel, before)


def test_join_pool_not_on_node_is_not_found(channel, nodes):
    before = _snapshot(channel, [36])
    request = _request(36)
    request.pool_id = 9
    _refused(
        lambda: _join(channel, request), grpc.StatusCode.NOT_FOUND, "pool", "9", "n1", field="pool_id"
    )
    _assert_unchanged(channel, before)


@pytest.mark.parametrize(
    "first,count,page",
    [(POOL_PAGES, 1, POOL_PAGES), (POOL_PAGES - 1, 2, POOL_PAGES), (5000, 3, 5000)],
)
def test_join_pages_outside_pool(channel, nodes, first, count, page):
    before = _snapshot(channel, [37])
    request = _request(37, first=0, count=1)
    request.ranges.append(R(first=first, count=count))
    _refused(
        lambda: _join(channel, request),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ranges[1]",
        "page %d" % page,
        "%d pages" % POOL_PAGES,
        field="ranges[1]",
    )
    _assert_unchanged(channel, before)


def test_join_range_count_zero(channel, nodes):
    before = _snapshot(channel, [38])
    request = _request(38, first=3, count=0)
    _refused(
        lambda: _join(channel, request),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ranges[0]",
        "count",
        field="ranges[0]",
    )
    _assert_unchanged(channel, before)


def test_join_range_overflowing_2_32(channel, nodes):
    before = _snapshot(channel, [39])
    request = _request(39, first=3, count=0xFFFFFFFF)
    _refused(
        lambda: _join(channel, request), grpc.StatusCode.INVALID_ARGUMENT, "ranges[0]", field="ranges[0]"
    )
    _assert_unchanged(channel, before)


def test_join_too_many_ranges(channel, nodes):
    nodes("big", page_count=70000)
    before = _snapshot(channel, [40])
    request = _request(40, node_id="big", first=0, count=1)
    del request.ranges[:]
    request.ranges.extend(R(first=i, count=1) for i in range(65537))
    _refused(
        lambda: _join(channel, request),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "ranges",
        "65536",
        field="ranges",
    )
    _assert_unchanged(channel, before)
    # One fewer is within the limit.
    del request.ranges[-1]
    reply = _join(channel, request)
    assert reply.state == types_pb2.ROOM_STATE_OPENING


# ---- JoinRoom: conflicts with other rooms' leases -------------------------------


@pytest.mark.parametrize("role", [SNK, SRC], ids=["write", "read"])
def test_join_over_another_rooms_write_lease(channel, nodes, role):
    owner = _join(channel, _request(41, "n2", SNK, first=10, count=5))
    before = _snapshot(channel, [41, 42])
    request = _request(42, "n2", role, first=0, count=2)
    request.ranges.append(R(first=12, count=1))
    _refused(
        lambda: _join(channel, request),
        grpc.StatusCode.FAILED_PRECONDITION,
        "page 12",
        "room 41",
        field="ranges[1]",
    )
    _assert_unchanged(channel, before)
    assert owner.room.room_id == 41


def test_join_write_over_another_rooms_read_lease(channel, nodes):
    _join(channel, _request(43, "n1", SRC, first=50, count=5))
    before = _snapshot(channel, [43, 44])
    _refused(
        lambda: _join(channel, _request(44, "n1", SNK, first=52, count=1)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "page 52",
        "room 43",
        field="ranges[0]",
    )
    _assert_unchanged(channel, before)


def test_join_read_over_another_rooms_read_lease_is_allowed(channel, nodes):
    """The positive side of the rule (shared prefixes): several rooms read a page."""
    _join(channel, _request(45, "n1", SRC, first=50, count=5))
    reply = _join(channel, _request(46, "n1", SRC, first=52, count=5))
    assert reply.state == types_pb2.ROOM_STATE_OPENING


def test_join_write_lease_ranges_overlapping_each_other(channel, nodes):
    before = _snapshot(channel, [47])
    request = _request(47, "n1", SNK, first=0, count=4)
    request.ranges.append(R(first=2, count=2))
    _refused(
        lambda: _join(channel, request),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
        "ranges[1]",
        "page 2",
    )
    _assert_unchanged(channel, before)


def test_join_read_lease_ranges_overlapping_each_other(channel, nodes):
    before = _snapshot(channel, [48])
    request = _request(48, "n1", SRC, first=0, count=4)
    request.ranges.append(R(first=2, count=2))
    _refused(
        lambda: _join(channel, request),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
        "ranges[1]",
        "page 2",
    )
    _assert_unchanged(channel, before)


# ---- JoinRoom: capabilities (the refusal aborts the room) -----------------------


@pytest.mark.parametrize(
    "caps,needle",
    [
        (types_pb2.CapabilitySet(protocol_min=1, protocol_max=1, features=["FENCE_V1"]), "QUIESCE_V1"),
        (types_pb2.CapabilitySet(protocol_min=5, protocol_max=6, features=["QUIESCE_V1"]), "protocol"),
    ],
    ids=["no-quiesce", "no-common-version"],
)
def test_join_engine_capability_refusal_aborts_room(channel, nodes, caps, needle):
    n1 = nodes("c1", auto_drain=True)
    n2 = nodes("c2", auto_drain=True)
    first = _join(channel, _request(50, "c1", SRC, first=0, count=2))
    before_state, _ = _snapshot(channel)
    request = _request(50, "c2", SNK, first=0, count=2)
    request.participant.rank = 3
    request.engine_capabilities.CopyFrom(caps)
    _refused(
        lambda: _join(channel, request),
        grpc.StatusCode.FAILED_PRECONDITION,
        "c2",
        "rank 3",
        needle,
        field="engine_capabilities",
    )
    info = _get_room(channel, 50)
    assert info.room == first.room, str(info)
    assert info.state in (types_pb2.ROOM_STATE_ABORTING, types_pb2.ROOM_STATE_ABORTED), str(info)
    assert info.abort_reason == types_pb2.ABORT_REASON_CAPABILITY, str(info)
    assert info.token.hi or info.token.lo, str(info)
    # The refused participant was not admitted; nobody got a page address.
    assert [p.participant.node_id for p in info.participants] == ["c1"], str(info)
    # The room's one node is told to drain (and does, auto_drain): then ABORTED.
    n1.recv("abort_notice")
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while info.state != types_pb2.ROOM_STATE_ABORTED and time.monotonic() < deadline:
        time.sleep(0.02)
        info = _get_room(channel, 50)
    assert info.state == types_pb2.ROOM_STATE_ABORTED, str(info)
    time.sleep(QUIET_S)
    for node in (n1, n2):
        assert "room_update" not in _received_kinds(node), (node.node_id, _received_kinds(node))
    assert "abort_notice" not in _received_kinds(n2), _received_kinds(n2)
    # No new generation was minted; the room moved OPENING -> ABORTED.
    after = _state_of(_stats(channel))
    assert after["generation"] == before_state["generation"], (before_state, after)
    o, a, ab, c, ad = before_state["rooms"]
    assert after["rooms"] == (o - 1, a, ab, c, ad + 1), (before_state, after)


def test_node_missing_quiesce_cannot_join(channel, nodes):
    """A node without QUIESCE_V1 never attaches (below), so a join naming it
    is NOT_FOUND like any unknown node."""
    _hello(channel, "noq", types_pb2.CapabilitySet(protocol_min=1, protocol_max=1))
    before = _snapshot(channel, [51])
    _refused(
        lambda: _join(channel, _request(51, node_id="noq")), grpc.StatusCode.NOT_FOUND, "noq"
    )
    _assert_unchanged(channel, before)


# ---- ExtendLease ----------------------------------------------------------------


@pytest.fixture
def lease(channel, nodes):
    """An OPENING room 60 with a read lease on n1 (pages 0..3) and a write
    lease on n2 (pages 0..3): (source reply, sink reply) of a 2+2 room."""
    src = _join(channel, _request(60, "n1", SRC, first=0, count=4, expected_sources=2, expected_sinks=2))
    snk = _join(channel, _request(60, "n2", SNK, first=0, count=4, expected_sources=2, expected_sinks=2))
    return src, snk


def _extend(ch, room, lease_id, ranges):
    return control(ch).ExtendLease(
        control_pb2.ExtendLeaseRequest(room=room, lease_id=lease_id, ranges=ranges),
        timeout=RPC_TIMEOUT_S,
    )


def test_extend_lease_stale_generation(channel, lease):
    src, _ = lease
    before = _snapshot(channel, [60])
    stale = types_pb2.RoomKey(room_id=60, generation=src.room.generation + 7)
    _refused(
        lambda: _extend(channel, stale, src.lease_id, [R(first=20, count=1)]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "generation",
        str(src.room.generation + 7),
    )
    _assert_unchanged(channel, before)


def test_extend_lease_generation_zero(channel, lease):
    src, _ = lease
    before = _snapshot(channel, [60])
    _refused(
        lambda: _extend(channel, types_pb2.RoomKey(room_id=60), src.lease_id, [R(first=20, count=1)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "generation",
        field="room.generation",
    )
    _assert_unchanged(channel, before)


@pytest.mark.parametrize("lease_id", [999, "sink"])
def test_extend_lease_unknown_lease(channel, lease, lease_id):
    """An id no one was granted, or a real lease of another room."""
    src, snk = lease
    other = _join(channel, _request(61, "n2", SNK, first=50, count=1))
    lid = 999 if lease_id == 999 else other.lease_id
    before = _snapshot(channel, [60, 61])
    _refused(
        lambda: _extend(channel, src.room, lid, [R(first=20, count=1)]),
        grpc.StatusCode.NOT_FOUND,
        "lease",
        str(lid),
    )
    _assert_unchanged(channel, before)


def test_extend_lease_unknown_room(channel, lease):
    src, _ = lease
    before = _snapshot(channel, [60, 777])
    _refused(
        lambda: _extend(
            channel, types_pb2.RoomKey(room_id=777, generation=1), src.lease_id, [R(first=20, count=1)]
        ),
        grpc.StatusCode.NOT_FOUND,
        "777",
    )
    _assert_unchanged(channel, before)


def test_extend_lease_bad_ranges(channel, lease):
    src, snk = lease
    before = _snapshot(channel, [60])
    _refused(
        lambda: _extend(channel, src.room, src.lease_id, [R(first=20, count=0)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ranges[0]",
        "count",
    )
    # control.proto lists pages outside the pool under FAILED_PRECONDITION for
    # ExtendLease and under INVALID_ARGUMENT for JoinRoom: either is accepted.
    _refused(
        lambda: _extend(channel, snk.room, snk.lease_id, [R(first=POOL_PAGES - 1, count=2)]),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
        "page %d" % POOL_PAGES,
        "%d pages" % POOL_PAGES,
    )
    _refused(
        lambda: _extend(channel, snk.room, snk.lease_id, [R(first=2, count=1)]),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
        "page 2",
    )
    _assert_unchanged(channel, before)


def test_extend_read_lease_with_pages_it_holds(channel, lease):
    src, _ = lease
    before = _snapshot(channel, [60])
    _refused(
        lambda: _extend(channel, src.room, src.lease_id, [R(first=2, count=1)]),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
        "page 2",
    )
    _assert_unchanged(channel, before)


def test_extend_lease_too_many_ranges(channel, nodes):
    nodes("big", page_count=70000)
    j = _join(channel, _request(62, "big", SNK, first=69999, count=1))
    before = _snapshot(channel, [62])
    ranges = [R(first=i, count=1) for i in range(65537)]
    _refused(
        lambda: _extend(channel, j.room, j.lease_id, ranges),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "65536",
    )
    _assert_unchanged(channel, before)


# ---- AbortRoom --------------------------------------------------------------------


def test_abort_room_id_zero(channel, nodes):
    before = _snapshot(channel)
    _refused(
        lambda: control(channel).AbortRoom(
            control_pb2.AbortRoomRequest(room=types_pb2.RoomKey(room_id=0)), timeout=RPC_TIMEOUT_S
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "room_id",
    )
    _assert_unchanged(channel, before)


def _abort(ch, room_id, generation=0):
    return control(ch).AbortRoom(
        control_pb2.AbortRoomRequest(room=types_pb2.RoomKey(room_id=room_id, generation=generation)),
        timeout=RPC_TIMEOUT_S,
    )


def test_abort_unknown_room(channel, nodes):
    _join(channel, _request(70, "n1", SRC))
    before = _snapshot(channel, [70, 71])
    _refused(lambda: _abort(channel, 71), grpc.StatusCode.NOT_FOUND, "71")
    # A generation room 70 never had: unknown, or not current (stale).
    _refused(
        lambda: _abort(channel, 70, 5),
        (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION),
        "70",
    )
    _assert_unchanged(channel, before)


def test_abort_completed_room(channel, nodes):
    n1 = nodes("d1")
    n2 = nodes("d2")
    _join(channel, _request(72, "d1", SRC, first=0, count=2))
    j = _join(channel, _request(72, "d2", SNK, first=0, count=2))
    assert j.state == types_pb2.ROOM_STATE_ACTIVE
    for node, role in ((n1, SRC), (n2, SNK)):
        update = node.recv("room_update")
        node.send(ack=node_pb2.Ack(notice_id=update.notice_id))
        node.send(completed=node_pb2.Completed(room=j.room, rank=0, role=role))
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while _get_room(channel, 72).state != types_pb2.ROOM_STATE_COMPLETED:
        assert time.monotonic() < deadline, str(_get_room(channel, 72))
        time.sleep(0.02)
    before = _snapshot(channel, [72])
    for call in (
        lambda: control(channel).AbortRoom(
            control_pb2.AbortRoomRequest(room=types_pb2.RoomKey(room_id=72)), timeout=RPC_TIMEOUT_S
        ),
        lambda: admin(channel).AdminAbortRoom(
            control_pb2.AdminAbortRoomRequest(room=j.room), timeout=RPC_TIMEOUT_S
        ),
    ):
        _refused(call, grpc.StatusCode.FAILED_PRECONDITION, "72", "COMPLETED")
    _assert_unchanged(channel, before)
    time.sleep(QUIET_S)
    for node in (n1, n2):
        assert "abort_notice" not in _received_kinds(node), _received_kinds(node)


# ---- Admin reads ----------------------------------------------------------------


@pytest.mark.parametrize("room_id,generation", [(80, 0), (81, 99)])
def test_get_room_unknown(channel, nodes, room_id, generation):
    _join(channel, _request(81, "n1", SRC))
    before = _snapshot(channel)
    _refused(
        lambda: _get_room(channel, room_id, generation), grpc.StatusCode.NOT_FOUND, str(room_id)
    )
    _assert_unchanged(channel, before)


def test_get_room_id_zero(channel, nodes):
    _refused(lambda: _get_room(channel, 0), grpc.StatusCode.INVALID_ARGUMENT, "room_id")


def test_get_node_unknown(channel, nodes):
    before = _snapshot(channel)
    _refused(
        lambda: admin(channel).GetNode(
            control_pb2.GetNodeRequest(node_id="ghost-node-3"), timeout=RPC_TIMEOUT_S
        ),
        grpc.StatusCode.NOT_FOUND,
        "ghost-node-3",
    )
    _refused(
        lambda: admin(channel).GetNode(control_pb2.GetNodeRequest(node_id=""), timeout=RPC_TIMEOUT_S),
        grpc.StatusCode.INVALID_ARGUMENT,
        "node_id",
    )
    _assert_unchanged(channel, before)


_LISTS = {
    "rooms": ("ListRooms", control_pb2.ListRoomsRequest),
    "nodes": ("ListNodes", control_pb2.ListNodesRequest),
    "leases": ("ListLeases", control_pb2.ListLeasesRequest),
}


_BAD_PAGING = [
    ({"page_token": "not-a-token"}, "page_token"),
    ({"page_token": "1x"}, "page_token"),
    ({"page_token": "-1"}, "page_token"),
    ({"page_size": 1001}, "page_size"),
    ({"page_size": 0xFFFFFFFF}, "page_size"),
]


@pytest.mark.parametrize("which", sorted(_LISTS))
def test_list_bad_paging(channel, nodes, which):
    _join(channel, _request(90, "n1", SRC))
    method, request_type = _LISTS[which]
    call = getattr(admin(channel), method)
    before = _snapshot(channel, [90])
    for kwargs, field in _BAD_PAGING:
        _refused(
            lambda: call(request_type(**kwargs), timeout=RPC_TIMEOUT_S),
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
            field=field,
        )
    _assert_unchanged(channel, before)
    # The limit itself is accepted.
    call(request_type(page_size=1000), timeout=RPC_TIMEOUT_S)


# ---- NodeSession: Hello ---------------------------------------------------------


def _hello(ch, node_id, caps):
    """Attach with one Hello; returns the RpcError the stream ended with.
    Fails if the control plane answered anything (a Welcome) instead."""
    hello = node_pb2.NodeMessage(
        hello=node_pb2.Hello(
            node_id=node_id,
            incarnation=1,
            capabilities=caps,
            pools=[types_pb2.Pool(pool_id=1, page_size=4096, page_count=POOL_PAGES)],
        )
    )
    call = node_pb2_grpc.NodeSessionStub(ch).Attach(iter([hello]), timeout=RPC_TIMEOUT_S)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in call:
            got.append(msg.WhichOneof("msg"))
    assert got == [], "refused node %s was sent %s" % (node_id, got)
    return info.value


@pytest.mark.parametrize(
    "caps,needles",
    [
        (types_pb2.CapabilitySet(protocol_min=1, protocol_max=1, features=["FENCE_V1", "TCP"]),
         ["QUIESCE_V1"]),
        (types_pb2.CapabilitySet(protocol_min=5, protocol_max=6, features=["QUIESCE_V1"]),
         ["protocol", "5", "6"]),
    ],
    ids=["no-quiesce", "protocol-5-6"],
)
def test_hello_refused(channel, nodes, caps, needles):
    before = _snapshot(channel)
    err = _hello(channel, "bad-node", caps)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, "%s: %s" % (err.code(), err.details())
    for needle in needles:
        assert needle in (err.details() or ""), err.details()
    _assert_unchanged(channel, before)
    _refused(
        lambda: admin(channel).GetNode(
            control_pb2.GetNodeRequest(node_id="bad-node"), timeout=RPC_TIMEOUT_S
        ),
        grpc.StatusCode.NOT_FOUND,
        "bad-node",
    )


# ---- NodeSession: Drained with a wrong token -------------------------------------


def test_drained_with_wrong_token_changes_nothing(channel, nodes):
    node = nodes("w1")
    j = _join(channel, _request(95, "w1", SRC, first=0, count=2))
    abort = control(channel).AbortRoom(control_pb2.AbortRoomRequest(room=j.room), timeout=RPC_TIMEOUT_S)
    notice = node.recv("abort_notice")
    assert (notice.token.hi, notice.token.lo) == (abort.token.hi, abort.token.lo)
    stale_before = _stats(channel).reports_stale
    before = _snapshot(channel, [95])
    wrong = types_pb2.AbortToken(hi=notice.token.hi ^ 1, lo=notice.token.lo)
    node.send(drained=node_pb2.Drained(room=j.room, token=wrong, notice_id=notice.notice_id))
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while _stats(channel).reports_stale < stale_before + 1:
        assert time.monotonic() < deadline, "the wrong-token Drained was not counted stale"
        time.sleep(0.02)
    assert _stats(channel).reports_stale == stale_before + 1
    _assert_unchanged(channel, before)
    info = _get_room(channel, 95)
    assert info.state == types_pb2.ROOM_STATE_ABORTING, str(info)
    assert [p.drained for p in info.participants] == [False], str(info)
    assert [p.lease.state for p in info.participants] == [types_pb2.LEASE_STATE_RELEASING]
