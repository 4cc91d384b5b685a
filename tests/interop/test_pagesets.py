"""Page sets on the wire (types.proto PageSet; JoinRoomRequest.page_set,
ExtendLeaseRequest.page_set), encoded here by hand so that the control
plane is checked against the contract and not against kvfence's own
encoders.

Accepted: 32,768 scattered pages as deltas and as a bitmap, ranges inside a
page set, an idempotent re-join, ExtendLease with a page set, a page-set lease
that survives a restart (replayed from the write-ahead log). Refused, each
with the field named and the state unchanged (GetStats and GetRoom): ranges
and page_set both, two forms at once, an empty page set, bitmap_first without
a bitmap, pages past the pool, a truncated or overlong varint, overlapping
ranges inside the set, more runs than the limit (RESOURCE_EXHAUSTED), a page
already in the lease, and pages of another room's lease in either direction
(a page-set lease against a range lease and back).
"""

import random

import grpc
import pytest

from kvfence.v1 import control_pb2, types_pb2

from kvf_harness import CAPS, RPC_TIMEOUT_S, FakeNode, admin, control

POOL_PAGES = 1 << 20
SMALL_POOL = 100
SRC = types_pb2.ROLE_SOURCE
SNK = types_pb2.ROLE_SINK
INVALID = grpc.StatusCode.INVALID_ARGUMENT


# ---- encoding by hand (the contract, not the clients' encoders) ------------------


def deltas(pages):
    """ascending pages -> LEB128 varints: the first page, then gaps - 1."""
    out = bytearray()
    prev = -1
    for p in pages:
        v = p - prev - 1
        prev = p
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def bitmap(pages):
    first = min(pages)
    bm = bytearray((max(pages) - first) // 8 + 1)
    for p in pages:
        bm[(p - first) >> 3] |= 1 << ((p - first) & 7)
    return types_pb2.PageSet(bitmap=bytes(bm), bitmap_first=first)


def runs(pages):
    """pages -> [(first, count)] of the sorted set."""
    out = []
    for p in sorted(pages):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return [tuple(r) for r in out]


# ---- helpers -------------------------------------------------------------------


def _request(room_id, node_id, role, page_set=None, ranges=(), expected_sinks=1):
    rq = control_pb2.JoinRoomRequest(
        room_id=room_id,
        expected_sources=1,
        expected_sinks=expected_sinks,
        participant=types_pb2.Participant(node_id=node_id, rank=0, role=role),
        engine_capabilities=CAPS,
        pool_id=1,
        ranges=[types_pb2.PageRange(first=f, count=c) for f, c in ranges],
    )
    if page_set is not None:
        rq.page_set.CopyFrom(page_set)
    return rq


def _join(ch, rq):
    return control(ch).JoinRoom(rq, timeout=RPC_TIMEOUT_S)


def _extend(ch, room, lease_id, page_set):
    return control(ch).ExtendLease(
        control_pb2.ExtendLeaseRequest(room=room, lease_id=lease_id, page_set=page_set),
        timeout=RPC_TIMEOUT_S,
    )


def _get_room(ch, room_id):
    return admin(ch).GetRoom(
        control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=room_id)),
        timeout=RPC_TIMEOUT_S,
    )


def _lease_runs(info, role):
    for p in info.participants:
        if p.participant.role == role:
            return [(r.first, r.count) for r in p.lease.ranges]
    raise AssertionError("no participant of role %d" % role)


def _snapshot(ch, room_ids=()):
    s = admin(ch).GetStats(control_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)
    rooms = {}
    for room_id in room_ids:
        info = _get_room(ch, room_id)
        info.age_ms = 0
        info.state_age_ms = 0
        rooms[room_id] = info
    r, l = s.rooms, s.leases
    return ((r.opening, r.active, r.aborting), (l.active, l.releasing, l.released),
            s.generation), rooms


def _refused(ch, call, code, *needles, rooms=()):
    """call() fails with `code`, its message holds every needle, and nothing
    changed."""
    before = _snapshot(ch, rooms)
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, "%s (wanted %s): %s" % (err.code(), code, err.details())
    for needle in needles:
        assert str(needle) in err.details(), "%r not in %r" % (needle, err.details())
    assert _snapshot(ch, rooms) == before
    return err


@pytest.fixture
def nodes(channel):
    """n1 with a pool of 2^20 pages, n2 with one of 100."""
    attached = [FakeNode(channel, "n1", page_count=POOL_PAGES),
                FakeNode(channel, "n2", page_count=SMALL_POOL)]
    for n in attached:
        n.recv("welcome")
    yield attached
    for n in attached:
        n.close()


# ---- accepted -------------------------------------------------------------------


def test_join_32k_scattered_pages_as_deltas(channel, nodes):
    rnd = random.Random(5)
    pages = sorted(rnd.sample(range(POOL_PAGES), 32768))
    r = _join(channel, _request(1, "n1", SNK, types_pb2.PageSet(deltas=deltas(pages))))
    assert r.lease_id >= 1
    assert _lease_runs(_get_room(channel, 1), SNK) == runs(pages)


def test_join_every_other_page_as_bitmap(channel, nodes):
    pages = list(range(1000, 1000 + 65536, 2))
    _join(channel, _request(2, "n1", SRC, bitmap(pages)))
    got = _lease_runs(_get_room(channel, 2), SRC)
    assert len(got) == 32768
    assert got == runs(pages)


def test_page_set_ranges_and_idempotent_rejoin(channel, nodes):
    ps = types_pb2.PageSet(ranges=[types_pb2.PageRange(first=50, count=10),
                                   types_pb2.PageRange(first=5, count=3)])
    a = _join(channel, _request(3, "n1", SNK, ps))
    b = _join(channel, _request(3, "n1", SNK, ps))
    assert a.lease_id == b.lease_id
    assert _lease_runs(_get_room(channel, 3), SNK) == [(50, 10), (5, 3)]


def test_extend_with_page_set(channel, nodes):
    j = _join(channel, _request(4, "n1", SNK, types_pb2.PageSet(deltas=deltas([10, 12]))))
    lease = _extend(channel, j.room, j.lease_id, bitmap([11, 13, 15])).lease
    assert [(r.first, r.count) for r in lease.ranges] == [(10, 1), (12, 1), (11, 1), (13, 1),
                                                          (15, 1)]
    err = _refused(channel, lambda: _extend(channel, j.room, j.lease_id,
                                            types_pb2.PageSet(deltas=deltas([14, 15]))),
                   INVALID, "page_set.deltas", "page 15", "already in this lease", rooms=[4])
    assert "ranges[" not in err.details()
    _refused(channel, lambda: _extend(channel, j.room, j.lease_id, types_pb2.PageSet()), INVALID,
             "page_set", rooms=[4])


def test_page_set_lease_survives_restart(servers, tmp_path):
    data = tmp_path / "data"
    srv = servers(data, "--join-timeout-ms", "600000")
    srv.wait_serving()
    ch = srv.channel()
    n1 = FakeNode(ch, "n1", page_count=POOL_PAGES)
    n1.recv("welcome")
    pages = list(range(7, 7 + 3 * 20000, 3))
    _join(ch, _request(5, "n1", SNK, types_pb2.PageSet(deltas=deltas(pages))))
    n1.close()
    assert srv.terminate() == 0, srv.stderr_tail()
    srv = servers(data, "--join-timeout-ms", "600000")
    srv.wait_serving()
    assert _lease_runs(_get_room(srv.channel(), 5), SNK) == runs(pages)
    assert srv.terminate() == 0, srv.stderr_tail()


# ---- refused, nothing changed ----------------------------------------------------


def test_ranges_and_page_set_both(channel, nodes):
    rq = _request(10, "n1", SNK, types_pb2.PageSet(deltas=deltas([1])), ranges=[(5, 1)])
    _refused(channel, lambda: _join(channel, rq), INVALID, "page_set", "ranges")


@pytest.mark.parametrize("ps,needle", [
    (types_pb2.PageSet(deltas=b"\x01", bitmap=b"\x01"), "page_set"),
    (types_pb2.PageSet(deltas=b"\x01", ranges=[types_pb2.PageRange(first=9, count=1)]),
     "page_set"),
    (types_pb2.PageSet(), "page_set"),
    (types_pb2.PageSet(deltas=b"\x01", bitmap_first=4), "page_set.bitmap_first"),
    (types_pb2.PageSet(bitmap=b"\x00\x00"), "page_set.bitmap"),
    (types_pb2.PageSet(deltas=b"\x05\x80"), "page_set.deltas: varint at byte 1 is truncated"),
    (types_pb2.PageSet(deltas=b"\x80\x80\x80\x80\x80\x01"), "page_set.deltas"),
    (types_pb2.PageSet(ranges=[types_pb2.PageRange(first=9, count=0)]),
     "page_set.ranges[0].count"),
    (types_pb2.PageSet(ranges=[types_pb2.PageRange(first=9, count=4),
                               types_pb2.PageRange(first=11, count=1)]), "page_set.ranges[1]"),
])
def test_malformed_page_set(channel, nodes, ps, needle):
    _refused(channel, lambda: _join(channel, _request(11, "n1", SNK, ps)), INVALID, needle)


@pytest.mark.parametrize("ps,needle", [
    (types_pb2.PageSet(deltas=deltas([3, 99, 100])), "page_set.deltas: page 100"),
    (bitmap([98, 104]), "page_set.bitmap: page 104"),
    (types_pb2.PageSet(ranges=[types_pb2.PageRange(first=90, count=20)]),
     "page_set.ranges[0]: page 100"),
])
def test_pages_past_the_pool(channel, nodes, ps, needle):
    _refused(channel, lambda: _join(channel, _request(12, "n2", SNK, ps)), INVALID, needle,
             "100 pages")


def test_more_runs_than_the_limit(channel, nodes):
    pages = list(range(0, 2 * 65537, 2))  # 65,537 runs of one page
    for ps, field in [(types_pb2.PageSet(deltas=deltas(pages)), "page_set.deltas"),
                      (bitmap(pages), "page_set.bitmap")]:
        _refused(channel, lambda: _join(channel, _request(13, "n1", SNK, ps)),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, field, "65537", "65536")
    # 65,536 runs are within the limit.
    _join(channel, _request(13, "n1", SNK, types_pb2.PageSet(deltas=deltas(pages[:-1]))))


def test_overlap_page_set_against_range_lease(channel, nodes):
    _join(channel, _request(20, "n1", SNK, ranges=[(1000, 100)], expected_sinks=1))
    ps = types_pb2.PageSet(deltas=deltas(list(range(0, 4000, 7))))  # 1001 is in both
    _refused(channel, lambda: _join(channel, _request(21, "n1", SNK, ps)),
             grpc.StatusCode.FAILED_PRECONDITION, "page_set.deltas", "page 1001",
             "room 20:", rooms=[20])
    # A source (read) lease on a written page is refused too.
    _refused(channel, lambda: _join(channel, _request(21, "n1", SRC, bitmap([999, 1050]))),
             grpc.StatusCode.FAILED_PRECONDITION, "page_set.bitmap", "page 1050", "room 20:",
             rooms=[20])


def test_overlap_range_lease_against_page_set(channel, nodes):
    _join(channel, _request(22, "n1", SNK, bitmap(list(range(5000, 6000, 2)))))
    _refused(channel, lambda: _join(channel, _request(23, "n1", SNK, ranges=[(5901, 2)])),
             grpc.StatusCode.FAILED_PRECONDITION, "ranges[0]", "page 5902", "room 22:",
             rooms=[22])
    # Pages between the set's pages are free.
    _join(channel, _request(23, "n1", SNK, ranges=[(5901, 1)]))
