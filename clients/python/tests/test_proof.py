"""Issue 12, item 3, with real processes: pools outlive node processes. A
restarted kvfence-node whose engine registers the same shared memory again
(a fresh pool id) must not let a new room write pages that a lease of its
old incarnation still holds (RELEASING: the old room waits for its peer)."""
import os
import signal

import grpc
import pytest

import kvfence
from kvfence import Participant, Role, RoomState, LeaseState

from conftest import PAGE_COUNT, PAGE_SIZE, Proc

WAIT_S = 10.0
SRC = Participant("n1", 0, Role.SOURCE)
SNK = Participant("n2", 0, Role.SINK)


def restart_node(cl, nid):
    """SIGKILL node `nid` and start it again on the same socket (a new
    incarnation); the fixture's teardown stops the new process."""
    old, sock = cl.nodes[nid]
    old.proc.kill()
    old.proc.wait()
    old._log.close()
    pf = str(cl.workdir / (nid + ".port"))
    os.unlink(pf)
    new = Proc(nid + "-restarted", [os.environ["KVF_NODE_BIN"], "--control", cl.address,
                                    "--node-id", nid, "--local-socket", sock, "--port-file", pf,
                                    "--data-host", "127.0.0.1", "--data-port", "0",
                                    "--drain-timeout-ms", "3000"], cl.workdir)
    new.wait_file(pf, 2)
    old.__dict__.update(new.__dict__)  # the fixture's teardown stops this one


def test_pool_registered_again_after_restart_refuses_pages_still_held(cluster):
    ctl, admin = cluster.control(), cluster.admin()
    a = ctl.join_room(901, SRC, cluster.pools["n1"].pool_id, [(0, 8)], retry_s=WAIT_S)
    b = ctl.join_room(901, SNK, cluster.pools["n2"].pool_id, [(16, 8)], retry_s=WAIT_S)
    assert b.state == RoomState.ACTIVE
    n1 = cluster.node_pid("n1")
    os.kill(n1, signal.SIGSTOP)  # n1 cannot drain: room 901 stays ABORTING
    try:
        restart_node(cluster, "n2")
        with cluster.node("n2") as nc:
            pool_id = nc.register_pool_shm(cluster.pools["n2"].name, PAGE_SIZE,
                                           PAGE_COUNT).pool_id
        info = admin.room(a.room)
        assert info.state == RoomState.ABORTING
        sink = [p for p in info.participants if p.participant.node_id == "n2"][0]
        assert sink.lease.state == LeaseState.RELEASING
        # The same memory: pages 16..24 are still held by lease b.
        with pytest.raises(kvfence.KvfenceError) as ei:
            ctl.join_room(902, SNK, pool_id, [(20, 8)], retry_s=WAIT_S)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "901:" in str(ei.value)
        # Pages nobody holds are free.
        c = ctl.join_room(903, SNK, pool_id, [(32, 8)], retry_s=WAIT_S)
        assert c.lease_id > b.lease_id
    finally:
        os.kill(n1, signal.SIGCONT)
