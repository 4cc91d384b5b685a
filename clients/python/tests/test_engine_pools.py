"""The engine backends on multi-buffer pools (enginekit.register_kv_memory):
each KV buffer allocated on its own (its own shm object, or a
FakeDeviceBuffer "GPU" buffer that the node opens by its fake CUDA IPC
handle), all of them ONE pool, so a request's lease is its kv_indices as they
are. The stand-in SGLang engines in real processes on conftest's cluster
(nodes with --staging host: a multi-buffer pool is read through the staging
copy towards another node; and --test-fake-device-pools).

Before multi-buffer pools the buffers had to share one shm object ("must
share one") and a lease named each buffer's slots separately, so a 32k-token
scattered prompt over 8 buffers was 262,144 runs, over the lease's 65,536."""
import os
import time

import pytest

from kvfence import LeaseState, RoomState
from conftest import FAKE_DEVICE_PREFIX
from engine_procs import EngineProc
from test_sglang_backend import engines_clean

pytestmark = pytest.mark.node_args("--staging", "host")


def start(cluster, tmp_path, procs, *extra):
    p = EngineProc("sglang_engine.py", ["--mode", "prefill", "--control", cluster.address,
                                        "--node-id", "n1", "--socket", cluster.socket("n1")]
                   + list(extra), tmp_path, "sgl-prefill")
    procs.append(p)
    d = EngineProc("sglang_engine.py", ["--mode", "decode", "--control", cluster.address,
                                        "--node-id", "n2", "--socket", cluster.socket("n2")]
                   + list(extra), tmp_path, "sgl-decode")
    procs.append(d)
    return p, d, p.ready["bootstrap"]


@pytest.fixture
def procs():
    ps = []
    yield ps
    for e in ps:
        e.close()


def node_log(cluster, nid):
    with open(cluster.nodes[nid][0].log_path, "rb") as f:
        return f.read().decode(errors="replace")


def test_32k_scattered_prompt_over_8_buffers_moves_and_releases(cluster, tmp_path, procs):
    """4 layers (8 buffers, each its own shm object) of 65,536 pages; a
    32,768-token prompt on every other page (32,768 runs) in 4 chunks. One
    lease per side of 32,768 pool pages; before: refused at JoinRoom (the
    lease named 8 x 32,768 runs)."""
    tokens, chunk = 32768, 8192
    p, d, boot = start(cluster, tmp_path, procs, "--layers", "4", "--pages", "65536",
                       "--item-len", "256", "--scatter")
    room = (1 << 61) + 32
    d.call("request", room=room, pages=tokens, bootstrap=boot, timeout=30)
    p.call("request", room=room, pages=tokens, chunk=chunk, bootstrap=boot, timeout=30)
    dr = d.wait_outcome(room, timeout=60)
    pr = p.wait_outcome(room, timeout=60)
    assert dr["outcome"] == "Success" and pr["outcome"] == "Success", (dr, pr)
    assert dr["verified"] == "ok", dr
    assert pr["chunks"] == tokens // chunk
    admin = cluster.admin()
    assert admin.room(room).state == RoomState.COMPLETED
    leases = admin.leases(room_id=room)
    assert len(leases) == 2 and all(l.state == LeaseState.RELEASED for l in leases)
    # The lease is the engine's pages as they are: one pool page per token.
    assert sorted(l.page_count() for l in leases) == [tokens, tokens]
    st = p.status()
    assert st["pool"]["page_count"] == 65536 and st["pool"]["page_size"] == 8 * 256
    assert st["requests"][str(room)]["metric"][1] == tokens * 8 * 256
    engines_clean(p, d)


def test_separate_shm_buffers_of_different_page_sizes(cluster, tmp_path, procs):
    """Each buffer its own shm object, V pages twice K's; chunked, with an
    abort mid-transfer beside it. Before: "lie in 4 shm objects ... must
    share one" (and "the same page size")."""
    p, d, boot = start(cluster, tmp_path, procs, "--item-len", "512", "--v-item-len", "1024")
    ok, ab = (1 << 61) + 41, (1 << 61) + 42
    d.call("request", room=ok, pages=10, bootstrap=boot)
    p.call("request", room=ok, pages=10, chunk=3, bootstrap=boot)
    d.call("request", room=ab, pages=6, bootstrap=boot)
    p.call("request", room=ab, pages=6, chunk=2, bootstrap=boot, abort_at="transfer")
    dr, pr = d.wait_outcome(ok), p.wait_outcome(ok)
    assert dr["outcome"] == pr["outcome"] == "Success", (dr, pr)
    assert dr["verified"] == "ok", dr
    assert p.status()["requests"][str(ok)]["metric"][1] == 10 * 2 * (512 + 1024)
    dr, pr = d.wait_outcome(ab), p.wait_outcome(ab)
    assert dr["outcome"] == pr["outcome"] == "Failed", (dr, pr)
    assert cluster.admin().room(ab).state == RoomState.ABORTED
    engines_clean(p, d)


def test_fake_device_buffers_through_cuda_ipc(cluster, tmp_path, procs):
    """Every KV buffer a FakeDeviceBuffer ("GPU" memory): registered by its
    (fake) CUDA IPC handle, moved byte exact, and each buffer's copies
    counted by the node as fake device memory."""
    p, d, boot = start(cluster, tmp_path, procs, "--memory", "fake-device",
                       "--fake-prefix", FAKE_DEVICE_PREFIX, "--v-item-len", "2048")
    rooms = {(1 << 61) + 51: (9, 4), (1 << 61) + 52: (5, 5)}
    for room, (pages, chunk) in rooms.items():
        d.call("request", room=room, pages=pages, bootstrap=boot)
        p.call("request", room=room, pages=pages, chunk=chunk, bootstrap=boot)
    for room in rooms:
        dr, pr = d.wait_outcome(room), p.wait_outcome(room)
        assert dr["outcome"] == pr["outcome"] == "Success", (dr, pr)
        assert dr["verified"] == "ok", dr
    engines_clean(p, d)
    pool = d.status()["pool"]
    assert pool["page_size"] == 2 * (1024 + 2048)
    d.close()  # unregisters its pool: the node logs each buffer's copies
    deadline = time.monotonic() + 10
    want = ["pool %d buffer %d (fake device (test)): writes=" % (pool["id"], b)
            for b in range(4)]
    while not all(w in node_log(cluster, "n2") for w in want):
        assert time.monotonic() < deadline, (want, node_log(cluster, "n2")[-3000:])
        time.sleep(0.05)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(FAKE_DEVICE_PREFIX[1:] +
                                                                   str(d.pid))]


def test_prompt_over_the_run_limit_fails_cleanly(cluster, tmp_path, procs):
    """65,537 scattered pages are more runs than a lease takes (65,536), now
    whatever the buffer count: decode's JoinRoom is refused
    (RESOURCE_EXHAUSTED), the request is Failed with nothing granted and its
    pages freed once; prefill gives up waiting (an abort, never a free).
    Before, the refusal escaped send_metadata into the scheduler."""
    tokens = 65537
    p, d, boot = start(cluster, tmp_path, procs, "--layers", "1", "--pages", str(2 * tokens),
                       "--item-len", "256", "--scatter")
    room = (1 << 61) + 61
    d.call("request", room=room, pages=tokens, bootstrap=boot, timeout=30)
    p.call("request", room=room, pages=tokens, chunk=8192, bootstrap=boot, timeout_s=2)
    dr = d.wait_outcome(room, timeout=30)
    assert dr["outcome"] == "Failed" and "runs" in (dr["failure"] or ""), dr
    assert dr["lease_id"] == 0, dr  # nothing granted
    pr = p.wait_outcome(room, timeout=30)
    assert pr["outcome"] == "Failed", pr
    engines_clean(p, d)


@pytest.mark.node_args()  # this test's nodes: the default --staging none
def test_nodes_without_staging_fail_the_request_cleanly(cluster, tmp_path, procs):
    """A multi-buffer pool is sent to another node through the staging copy;
    a source node started without it refuses the first chunk
    (FAILED_PRECONDITION naming --staging): the room is aborted, both sides
    Failed once released, every page freed once, nothing hangs."""
    p, d, boot = start(cluster, tmp_path, procs)
    room = (1 << 61) + 71
    d.call("request", room=room, pages=6, bootstrap=boot)
    p.call("request", room=room, pages=6, chunk=3, bootstrap=boot)
    dr, pr = d.wait_outcome(room), p.wait_outcome(room)
    assert dr["outcome"] == pr["outcome"] == "Failed", (dr, pr)
    # The refusal's text, or the abort that it caused, whichever prefill heard first.
    assert "staging" in (pr["failure"] or "") or "aborted" in (pr["failure"] or ""), pr
    assert cluster.admin().room(room).state == RoomState.ABORTED
    engines_clean(p, d)
