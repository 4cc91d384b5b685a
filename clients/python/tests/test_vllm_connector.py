"""kvfence.vllm end to end: the connector loaded out of tree by
kv_connector_module_path in a prefill (kv_producer) and a decode
(kv_consumer) engine process (tests/standins/vllm_engine.py, on the stand-in
KVConnectorBase_V1), a real kvfence-control and two real kvfence-node
processes. Each test ends with both engines' checks: no block freed before
its lease was RELEASED, none twice, canaries intact, nothing left allocated."""
import os
import signal
import socket
import time

import pytest

import kvfence
from kvfence import RoomState
from engine_procs import EngineProc

# The engines' KV buffers are one multi-buffer pool, which a node reads
# through its staging copy towards another node (docs/node.md "Pools").
pytestmark = pytest.mark.node_args("--staging", "host")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engines(cluster, tmp_path):
    procs = []

    def make(*prefill_extra, decode_extra=()):
        rz = "127.0.0.1:%d" % free_port()
        p = EngineProc("vllm_engine.py", ["--role", "kv_producer", "--control", cluster.address,
                                          "--node-id", "n1", "--socket", cluster.socket("n1"),
                                          "--rendezvous", rz] + list(prefill_extra), tmp_path,
                       "vllm-prefill")
        procs.append(p)
        d = EngineProc("vllm_engine.py", ["--role", "kv_consumer", "--control", cluster.address,
                                          "--node-id", "n2", "--socket", cluster.socket("n2")]
                       + list(decode_extra), tmp_path, "vllm-decode")
        procs.append(d)
        return p, d

    yield make
    for e in procs:
        e.close()


def clean(*engines):
    for e in engines:
        if e.proc.poll() is not None:
            continue
        st = e.status()
        assert st["violations"] == [], (e.name, st["violations"])
        assert st["canaries"] == [], (e.name, st["canaries"])
        assert st["used"] == [], (e.name, "blocks still allocated", st["used"])
        for rid, r in st["requests"].items():
            assert r["freed"] == 1, (e.name, rid, r)


def done(e, rid, timeout=10.0):
    return e.wait(lambda s: s["requests"][rid]["freed"] >= 1, timeout,
                  "request %s freed" % rid)["requests"][rid]


def test_prefill_to_decode_blocks_freed_on_release(cluster, engines):
    p, d = engines()
    admin = cluster.admin()
    rooms = {}
    for i, n in enumerate((3, 8, 5)):
        rid = "req-%d" % i
        rep = p.call("request", req=rid, blocks=n, params={"do_remote_decode": True})
        assert rep["delay"] is True, rep  # a request with a room: blocks kept
        params = rep["params"]
        assert params["do_remote_prefill"] and params["kvfence_room"] > 0
        rooms[rid] = params["kvfence_room"]
        # Prefill's blocks stay until the decode side loaded them.
        assert p.status()["requests"][rid]["freed"] == 0
        d.call("request", req=rid, blocks=n, params=params)
    # A request without remote decode has no room: freed at once.
    assert p.call("request", req="local", blocks=2, params={})["delay"] is False
    for rid, room in rooms.items():
        dr, pr = done(d, rid), done(p, rid)
        assert dr["outcome"] == "loaded" and dr["verified"] == "ok", dr
        assert pr["outcome"] == "sent", pr
        assert admin.room(room).state == RoomState.COMPLETED
    clean(p, d)


def test_decode_aborts_before_and_after_it_granted(cluster, engines):
    p, d = engines()
    admin = cluster.admin()
    # (a) aborted in the step it was scheduled: the worker never grants; the
    # tombstone makes prefill abort its room; prefill's blocks come back on
    # RELEASED.
    rep = p.call("request", req="a", blocks=4, params={"do_remote_decode": True})
    d.call("request", req="a", blocks=4, params=rep["params"])
    d.call("abort", req="a")
    pr, dr = done(p, "a"), done(d, "a")
    assert pr["outcome"] == "sent" and dr["freed"] == 1
    assert admin.room(rep["params"]["kvfence_room"]).state == RoomState.ABORTED
    # (b) aborted after it joined: AbortRoom; both sides' blocks come back
    # on RELEASED, the decode side's through done_sending.
    n1 = cluster.node_pid("n1")
    rep = p.call("request", req="b", blocks=6, params={"do_remote_decode": True})
    room = rep["params"]["kvfence_room"]
    os.kill(n1, signal.SIGSTOP)  # prefill's node cannot submit or drain
    stopped = True
    try:
        d.call("request", req="b", blocks=6, params=rep["params"])
        d.wait(lambda s: s["requests"]["b"]["lease"] > 0, what="decode joined")
        assert d.call("abort", req="b")["delay"] is True
        time.sleep(0.8)
        info = admin.room(room)
        assert info.state == RoomState.ABORTING, info
        for e in (p, d):
            assert e.status()["requests"]["b"]["freed"] == 0, e.name
        os.kill(n1, signal.SIGCONT)
        stopped = False
        dr, pr = done(d, "b"), done(p, "b")
        assert dr["outcome"] == "aborted", dr
        assert admin.room(room).state == RoomState.ABORTED
    finally:
        if stopped:
            os.kill(n1, signal.SIGCONT)
    clean(p, d)


def test_killed_prefill_engine_is_a_load_error(cluster, engines):
    """The prefill engine dies after request_finished, before decode asked:
    decode's post to its rendezvous fails, decode aborts its own room, and the
    load ends as an error (blocks reported for recompute) once RELEASED. The
    dead engine's source lease (its node lives) is released by the drain."""
    p, d = engines()
    admin = cluster.admin()
    rep = p.call("request", req="k", blocks=4, params={"do_remote_decode": True})
    room = rep["params"]["kvfence_room"]
    p.wait(lambda s: s["requests"]["k"]["lease"] > 0, what="prefill joined")
    p.kill(signal.SIGKILL)
    p.proc.wait()
    d.call("request", req="k", blocks=4, params=rep["params"])
    dr = done(d, "k")
    assert dr["outcome"] == "load_error", dr
    info = admin.wait_room_state(room, RoomState.ABORTED, 10)
    assert all(x.lease.state == kvfence.LeaseState.RELEASED for x in info.participants)
    clean(d)


def test_unclaimed_prefill_request_is_aborted_not_freed(cluster, engines):
    """Decode never asks for a prefill request (the proxy lost it): after
    abort_unclaimed_after_s the room is aborted, and the blocks come back on
    the release, not on the timer; a decode that asks later is refused and
    its load ends as an error."""
    p, d = engines("--abort-unclaimed", "0.3")
    admin = cluster.admin()
    rep = p.call("request", req="u", blocks=3, params={"do_remote_decode": True})
    room = rep["params"]["kvfence_room"]
    pr = done(p, "u")
    assert pr["outcome"] == "sent"
    info = admin.room(room)
    assert info.state == RoomState.ABORTED and \
        all(x.lease.state == kvfence.LeaseState.RELEASED for x in info.participants)
    d.call("request", req="u", blocks=3, params=rep["params"])
    dr = done(d, "u")
    assert dr["outcome"] == "load_error", dr
    clean(p, d)


def test_load_ends_without_room_state_events(cluster, engines):
    """Decode's watcher sees releases but no room states (as after a
    resubscription): get_finished asks how the room ended and still reports
    a completed load as loaded, and an aborted one as a load error."""
    p, d = engines(decode_extra=["--drop-room-states"])
    rep = p.call("request", req="ok", blocks=3, params={"do_remote_decode": True})
    d.call("request", req="ok", blocks=3, params=rep["params"])
    dr = done(d, "ok")
    assert dr["outcome"] == "loaded" and dr["verified"] == "ok", dr
    rep = p.call("request", req="bad", blocks=3, params={"do_remote_decode": True})
    p.wait(lambda s: s["requests"]["bad"]["lease"] > 0, what="prefill joined")
    cluster.control().abort_room(rep["params"]["kvfence_room"], "operator")
    d.call("request", req="bad", blocks=3, params=rep["params"])
    assert done(d, "bad")["outcome"] == "load_error"
    done(p, "bad")
    clean(p, d)


def test_per_layer_fake_device_tensors_are_one_pool(cluster, engines):
    """Every layer's tensor its own FakeDeviceBuffer ("GPU" memory): the
    connector registers the 4 layers' K and V as ONE pool of 8 buffers by
    (fake) CUDA IPC handle, and a request's lease is its block ids as they
    are (before: "must share one" shm object)."""
    from conftest import FAKE_DEVICE_PREFIX
    extra = ["--layers", "4", "--memory", "fake-device", "--fake-prefix", FAKE_DEVICE_PREFIX]
    p, d = engines(*extra, decode_extra=extra)
    admin = cluster.admin()
    rep = p.call("request", req="g", blocks=7, params={"do_remote_decode": True})
    d.call("request", req="g", blocks=7, params=rep["params"])
    dr, pr = done(d, "g"), done(p, "g")
    assert dr["outcome"] == "loaded" and dr["verified"] == "ok", dr
    assert pr["outcome"] == "sent", pr
    room = rep["params"]["kvfence_room"]
    assert admin.room(room).state == RoomState.COMPLETED
    assert sorted(l.page_count() for l in admin.leases(room_id=room)) == [7, 7]
    pool = p.status()["pool"]
    assert pool["buffers"] == 8 and pool["page_size"] == 8 * 1024
    clean(p, d)
