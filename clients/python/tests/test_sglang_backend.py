"""kvfence.sglang end to end: a prefill and a decode engine process
(tests/standins/sglang_engine.py, on the stand-in SGLang base classes), a real
kvfence-control and two real kvfence-node processes (conftest's cluster).

Every test ends with the same checks in both engines (engines_clean): no
page freed before its lease was RELEASED, none freed twice, every free page
and free aux slot still holds the engine's canary in every buffer."""
import signal
import time

import pytest

import kvfence
from kvfence import RoomState
from engine_procs import EngineProc

# The engines' KV buffers are one multi-buffer pool, which a node reads
# through its staging copy towards another node (docs/node.md "Pools").
pytestmark = pytest.mark.node_args("--staging", "host")


def start(cluster, tmp_path, *extra_prefill, decode_extra=()):
    p = EngineProc("sglang_engine.py", ["--mode", "prefill", "--control", cluster.address,
                                        "--node-id", "n1", "--socket", cluster.socket("n1")]
                   + list(extra_prefill), tmp_path, "sgl-prefill")
    d = EngineProc("sglang_engine.py", ["--mode", "decode", "--control", cluster.address,
                                        "--node-id", "n2", "--socket", cluster.socket("n2")]
                   + list(decode_extra), tmp_path, "sgl-decode")
    return p, d, p.ready["bootstrap"]


def engines_clean(*engines):
    for e in engines:
        if e.proc.poll() is not None:
            continue
        top = e.status()
        for st in top.get("ranks", [top]):
            rank_clean(e, st)


def rank_clean(e, st):
    """One rank: no bad free, canaries intact, each ended request freed once."""
    assert st["violations"] == [], (e.name, st["violations"])
    assert st["canaries"] == [], (e.name, st["canaries"])
    for room, r in st["requests"].items():
        assert r["freed"] == (1 if r["outcome"] else 0), (e.name, room, r)
    assert st["used"] == [], (e.name, "pages still allocated", st["used"])


@pytest.fixture
def engines(cluster, tmp_path):
    procs = []

    def make(*extra_prefill, decode_extra=()):
        p, d, boot = start(cluster, tmp_path, *extra_prefill, decode_extra=decode_extra)
        procs.extend([p, d])
        return p, d, boot

    yield make
    for e in procs:
        e.close()


def request_pair(p, d, boot, room, pages, chunk, p_kw=None, d_kw=None):
    d.call("request", room=room, pages=pages, bootstrap=boot, **(d_kw or {}))
    p.call("request", room=room, pages=pages, chunk=chunk, bootstrap=boot, **(p_kw or {}))


def test_chunked_prefill_lands_byte_exact(cluster, engines):
    p, d, boot = engines()
    admin = cluster.admin()
    rooms = {(1 << 62) + 11: (12, 5), (1 << 62) + 12: (7, 7), (1 << 62) + 13: (9, 2)}
    for room, (pages, chunk) in rooms.items():
        request_pair(p, d, boot, room, pages, chunk)
    # A prefill that sends no aux slot: decode does not wait for one.
    rooms[(1 << 62) + 14] = (4, 4)
    request_pair(p, d, boot, (1 << 62) + 14, 4, 4, p_kw={"aux": False}, d_kw={"aux": False})
    for room, (pages, chunk) in rooms.items():
        dr = d.wait_outcome(room)
        pr = p.wait_outcome(room)
        assert dr["outcome"] == "Success" and pr["outcome"] == "Success", (dr, pr)
        assert dr["verified"] == "ok", dr
        assert pr["chunks"] == -(-pages // chunk)
        assert admin.room(room).state == RoomState.COMPLETED
        # The pages were freed after the engines saw Success: RELEASED by then.
        assert all(l.state == kvfence.LeaseState.RELEASED for l in admin.leases(room_id=room))
    # Success never came before the release (the engines check at free), and
    # the transfer metric counts every buffer.
    st = p.status()["requests"][str((1 << 62) + 11)]
    assert st["metric"][1] == 12 * 4 * 1024 and st["metric"][0] > 0
    engines_clean(p, d)


def test_abort_in_every_state(cluster, engines):
    p, d, boot = engines()
    admin = cluster.admin()
    base = 5000
    cases = [
        # (room, who aborts, abort_at)
        (base + 1, "decode", "bootstrapping"),
        (base + 2, "prefill", "bootstrapping"),
        (base + 3, "decode", "waiting"),
        (base + 4, "prefill", "waiting"),
        (base + 5, "prefill", "transfer"),
        (base + 6, "decode", "success"),
        (base + 7, "prefill", "success"),
    ]
    for room, who, at in cases:
        kw = {"abort_at": at}
        if who == "prefill" and at == "bootstrapping":
            # Prefill aborts before decode's metadata can be there.
            p.call("request", room=room, pages=6, chunk=2, bootstrap=boot, **kw)
            p.wait_outcome(room)
            d.call("request", room=room, pages=6, bootstrap=boot)
            continue
        request_pair(p, d, boot, room, 6, 2, kw if who == "prefill" else None,
                     kw if who == "decode" else None)
    for room, who, at in cases:
        dr, pr = d.wait_outcome(room), p.wait_outcome(room)
        if at == "success":
            assert dr["outcome"] == pr["outcome"] == "Success", (room, dr, pr)
            assert dr["verified"] == "ok"
            mine = dr if who == "decode" else pr
            assert mine["after_abort"] == "Success", mine  # an abort after Success changes nothing
            assert admin.room(room).state == RoomState.COMPLETED
            continue
        assert dr["outcome"] == "Failed" and pr["outcome"] == "Failed", (room, who, at, dr, pr)
        assert "Success" not in dr["seen"] and "Success" not in pr["seen"]
        for r in (dr, pr):
            if r["lease_id"]:
                # Failed came only with the lease RELEASED in an ABORTED room.
                assert admin.room(room).state == RoomState.ABORTED
    # Mid-transfer: the prefill side had granted and sent a chunk.
    assert p.status()["requests"][str(base + 5)]["chunks"] == 1
    engines_clean(p, d)


def test_decode_abort_mid_transfer_waits_for_a_paused_node(cluster, engines):
    """The decode node is paused while the room aborts: neither engine may
    get Failed (and free) before the node runs again and drains."""
    p, d, boot = engines()
    admin = cluster.admin()
    room = 6001
    request_pair(p, d, boot, room, 8, 2, p_kw={"hold_after": 1})
    p.wait(lambda s: s["requests"][str(room)]["chunks"] == 1, what="chunk 1 sent")
    n2 = cluster.node_pid("n2")
    stopped = True
    import os
    os.kill(n2, signal.SIGSTOP)
    try:
        d.call("abort", room=room)
        time.sleep(1.0)
        info = admin.room(room)
        if info.state != RoomState.ABORTING:
            n2p = [x for x in info.participants if x.participant.node_id == "n2"]
            assert n2p and all(x.drained for x in n2p), info
            pytest.skip("n2 drained before it was frozen: the freeze raced the abort (%s)" %
                        (info,))
        for e in (p, d):
            r = e.status()["requests"][str(room)]
            assert r["outcome"] is None and r["freed"] == 0, (e.name, r)
            assert r["poll"] != "Failed"
        os.kill(n2, signal.SIGCONT)
        stopped = False
        dr, pr = d.wait_outcome(room), p.wait_outcome(room)
        assert dr["outcome"] == pr["outcome"] == "Failed"
        assert admin.room(room).state == RoomState.ABORTED
    finally:
        if stopped:
            os.kill(n2, signal.SIGCONT)
    engines_clean(p, d)


def test_killed_prefill_engine_and_paused_prefill_engine(cluster, engines):
    """The prefill engine process dies mid-transfer: decode's waiting timeout
    aborts (an abort, not a free); its pages come back when kvfence released
    them (n1 drained: the dead engine's node is alive). A paused prefill
    engine does not hold the decode side's release up either."""
    p, d, boot = engines()
    admin = cluster.admin()
    room = 7001
    request_pair(p, d, boot, room, 8, 2, p_kw={"hold_after": 1}, d_kw={"timeout_s": 1.0})
    p.wait(lambda s: s["requests"][str(room)]["chunks"] == 1, what="chunk 1 sent")
    p.kill(signal.SIGKILL)
    p.proc.wait()
    dr = d.wait_outcome(room)
    assert dr["outcome"] == "Failed", dr
    assert admin.room(room).state == RoomState.ABORTED
    engines_clean(d)

    p2, d2, boot2 = engines()
    room = 7002
    request_pair(p2, d2, boot2, room, 8, 2, p_kw={"hold_after": 1})
    p2.wait(lambda s: s["requests"][str(room)]["chunks"] == 1, what="chunk 1 sent")
    p2.kill(signal.SIGSTOP)
    try:
        d2.call("abort", room=room)
        dr = d2.wait_outcome(room)
        assert dr["outcome"] == "Failed", dr
    finally:
        p2.kill(signal.SIGCONT)
    p2.call("resume", room=room)
    pr = p2.wait_outcome(room)
    assert pr["outcome"] == "Failed", pr
    engines_clean(p2, d2)


def test_peer_without_quiesce_fails_before_any_transfer(cluster, engines):
    admin = cluster.admin()
    # A prefill rank that does not announce QUIESCE_V1 at the bootstrap
    # server: decode refuses it in init, grants nothing, posts nothing.
    p, d, boot = engines("--features", "")
    d.call("request", room=8001, pages=4, bootstrap=boot)
    dr = d.wait_outcome(8001)
    assert dr["outcome"] == "Failed" and "QUIESCE_V1" in dr["failure"], dr
    assert dr["lease_id"] == 0
    with pytest.raises(kvfence.NotFound):
        admin.room(8001)
    engines_clean(p, d)
    # One that announces it but joins without it: kvfence refuses the join
    # and aborts the room; decode's granted pages come back on RELEASED.
    p, d, boot = engines("--old-join")
    request_pair(p, d, boot, 8002, 4, 2)
    dr, pr = d.wait_outcome(8002), p.wait_outcome(8002)
    assert dr["outcome"] == pr["outcome"] == "Failed", (dr, pr)
    assert "QUIESCE_V1" in pr["failure"], pr
    # Nothing of prefill's was granted (send() queues chunks; the first
    # join was refused, the later chunks skipped), so nothing was read.
    assert pr["lease_id"] == 0 and pr["chunks"] >= 1
    info = admin.room(8002)
    assert info.state == RoomState.ABORTED
    assert info.abort_reason == kvfence.AbortReason.CAPABILITY
    engines_clean(p, d)


def test_reused_bootstrap_room_is_a_new_generation(cluster, engines):
    """The same bootstrap_room again (R13): a new room generation; a late
    abort of the old generation cannot touch it."""
    p, d, boot = engines()
    admin = cluster.admin()
    room = 9001
    request_pair(p, d, boot, room, 4, 2)
    assert d.wait_outcome(room)["outcome"] == p.wait_outcome(room)["outcome"] == "Success"
    old = admin.room(room).room
    request_pair(p, d, boot, room, 6, 4, p_kw={"hold_after": 1})
    p.wait(lambda s: s["requests"][str(room)]["chunks"] == 1, what="chunk 1 of the new room")
    new = admin.room(room).room
    assert new.generation > old.generation
    with pytest.raises(kvfence.FailedPrecondition):
        cluster.control().abort_room(old, "late abort of the old generation")
    admin.wait_room_state(new, RoomState.ACTIVE, 10)  # the late abort changed nothing
    p.call("resume", room=room)
    dr, pr = d.wait_outcome(room), p.wait_outcome(room)
    assert dr["outcome"] == pr["outcome"] == "Success" and dr["verified"] == "ok", (dr, pr)
    engines_clean(p, d)


def test_released_without_room_state_asks_how_the_room_ended(cluster):
    """A watcher that resubscribed replays releases but not room states: the
    backend then asks the control plane how the room ended (an AbortRoom of
    the ended room, which changes nothing) instead of polling forever."""
    import os
    from multiprocessing import shared_memory
    from types import SimpleNamespace

    from kvfence.enginekit import buffer_address
    from kvfence.sglang import KVArgs, KVBootstrapServer, KVManager, KVPoll, KVReceiver, KVSender

    boot = KVBootstrapServer("127.0.0.1", 0)
    shms, mgrs = [], []
    try:
        for mode, node in (("prefill", "n1"), ("decode", "n2")):
            s = shared_memory.SharedMemory(name="kvf-sgl-probe-%d-%s" % (os.getpid(), mode),
                                           create=True, size=2 * 16 * 1024)
            shms.append(s)
            a = KVArgs()
            a.engine_rank = 0
            base = buffer_address(s.buf)
            a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = [base, base + 16384], [16384] * 2, \
                [1024] * 2
            a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [], [], []
            m = KVManager(a, mode, SimpleNamespace(
                kvfence_control=cluster.address, kvfence_node_id=node,
                kvfence_node_socket=cluster.socket(node), disaggregation_bootstrap_port=boot.port))
            m.watcher._on_room_state = lambda ev: None  # as after a resubscription
            mgrs.append(m)
        for room, abort in ((9101, False), (9102, True)):
            recv = KVReceiver(mgrs[1], boot.address, room)
            recv.init(0)
            send = KVSender(mgrs[0], boot.address, room, [0], 0)
            deadline = time.monotonic() + 10
            while True:
                rp, sp = recv.poll(), send.poll()
                if rp == KVPoll.WaitingForInput:
                    recv.send_metadata([1, 3, 5, 7])
                if sp == KVPoll.WaitingForInput:
                    send.init(4)
                    send.send([0, 1])
                    if abort:
                        recv.abort()
                    else:
                        send.send([2, 3])
                if rp in (KVPoll.Success, KVPoll.Failed) and sp in (KVPoll.Success, KVPoll.Failed):
                    break
                assert time.monotonic() < deadline, (room, rp, sp)
                time.sleep(0.005)
            want = KVPoll.Failed if abort else KVPoll.Success
            assert rp == sp == want, (room, rp, sp)
            st = cluster.admin().room(room).state
            assert st == (RoomState.ABORTED if abort else RoomState.COMPLETED)
    finally:
        for m in mgrs:
            m.close()
        boot.close()
        for s in shms:
            s.close()
            s.unlink()


def test_tp2_prefill_to_tp2_decode(cluster, engines):
    """TP 2 on both sides: a room has two sources and two sinks, decode rank r
    pairs with prefill rank r; one abort fails every rank, and each rank frees
    only on its own lease's release."""
    p, d, boot = engines("--tp", "2", decode_extra=["--tp", "2"])
    admin = cluster.admin()
    request_pair(p, d, boot, 9201, 6, 2)
    request_pair(p, d, boot, 9202, 6, 2, p_kw={"hold_after": 1})

    def all_ranks(e, room):
        return e.wait(lambda s: all((r["requests"].get(str(room)) or {}).get("outcome")
                                    for r in s["ranks"]), 10, "room %d on every rank" % room)

    for e in (p, d):
        st = all_ranks(e, 9201)
        assert [r["requests"]["9201"]["outcome"] for r in st["ranks"]] == ["Success"] * 2, \
            (e.name, [r["requests"]["9201"] for r in st["ranks"]],
             [r["requests"]["9201"] for r in d.status()["ranks"]],
             [admin.room(x.room) for x in admin.rooms() if x.room.room_id == 9201])
    assert all(r["requests"]["9201"]["verified"] == "ok" for r in d.status()["ranks"])
    info = admin.room(9201)
    assert info.state == RoomState.COMPLETED and info.participant_count == 4
    p.wait(lambda s: all(r["requests"]["9202"]["chunks"] == 1 for r in s["ranks"]),
           what="chunk 1 on both prefill ranks")
    d.call("abort", room=9202)
    for e in (p, d):
        st = all_ranks(e, 9202)
        assert [r["requests"]["9202"]["outcome"] for r in st["ranks"]] == ["Failed"] * 2, e.name
    assert admin.room(9202).state == RoomState.ABORTED
    engines_clean(p, d)


def test_tp_sizes_must_match(cluster, engines):
    p, d, boot = engines("--tp", "2")
    d.call("request", room=9301, pages=4, bootstrap=boot)
    dr = d.wait_outcome(9301)
    assert dr["outcome"] == "Failed" and "TP" in dr["failure"] and dr["lease_id"] == 0, dr
    engines_clean(p, d)
