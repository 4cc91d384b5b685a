"""Pools an engine hands over from Python, moved between two real nodes
(conftest.py): CUDA memory by pointer or by exported IPC handle. This machine
has no GPU, so the device memory is kvfence.FakeDeviceBuffer, whose fake
handle goes through the same register_pool_cuda and the same RegisterPool
field (cuda_ipc) as a real one; the nodes run with --test-fake-device-pools
and copy such pools only as they copy CUDA memory (counted, and logged when
the pool is unregistered)."""
import os
import time

import pytest

import kvfence
from kvfence import RoomState

from conftest import FAKE_DEVICE_PREFIX, PAGE_COUNT, PAGE_SIZE, canary
from test_client import SNK, SRC, WAIT_S, submit

POOL_BYTES = PAGE_SIZE * PAGE_COUNT


def fake_name(tag):
    return "%s%d-%s-%d" % (FAKE_DEVICE_PREFIX, os.getpid(), tag, time.monotonic_ns() % 1000000)


def node_log(cluster, nid):
    with open(cluster.nodes[nid][0].log_path, "rb") as f:
        return f.read().decode(errors="replace")


def wait_log(cluster, nid, needle):
    deadline = time.monotonic() + WAIT_S
    while needle not in node_log(cluster, nid):
        if time.monotonic() > deadline:
            pytest.fail("%s never logged %r" % (nid, needle))
        time.sleep(0.01)


def unregister(node, pool_id):
    """UnregisterPool, retried while the room's lifetime is still open."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            node.unregister_pool(pool_id, timeout=WAIT_S)
            return
        except kvfence.FailedPrecondition:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def move_pages(cluster, room_id, sink_pool_id):
    """n1's host pool pages [0, 8) -> n2's pool `sink_pool_id` pages [16, 24)
    in one chunk; returns when both leases are RELEASED."""
    ctl, n1 = cluster.control(), cluster.node("n1")
    a = ctl.join_room(room_id, SRC, cluster.pools["n1"].pool_id, [(0, 8)], retry_s=WAIT_S)
    b = ctl.join_room(room_id, SNK, sink_pool_id, [(16, 8)], retry_s=WAIT_S)
    assert b.state == RoomState.ACTIVE and b.room == a.room
    assert n1.submit_chunk(a.room, 1, source_rank=0, source_pool_id=cluster.pools["n1"].pool_id,
                           source_ranges=[(0, 8)], sink_node_id="n2", sink_rank=0,
                           sink_pool_id=sink_pool_id, sink_ranges=[(16, 8)], last_chunk=True,
                           retry_unavailable_s=WAIT_S) == 1
    assert ctl.complete_room(a.room, SRC) in (RoomState.ACTIVE, RoomState.COMPLETED)
    ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)


def move_into(cluster, room_id, sink_pool_id, sink_view, skip=0):
    """move_pages(); the sink's bytes (`sink_view`, canary 0xA5 before) then
    hold the copy and every other page its canary."""
    move_pages(cluster, room_id, sink_pool_id)
    mem = bytes(sink_view[skip:skip + POOL_BYTES])
    assert mem[16 * PAGE_SIZE:24 * PAGE_SIZE] == canary(1, 0, 8)
    assert mem[:16 * PAGE_SIZE] == canary(0xA5, 0, 16)
    assert mem[24 * PAGE_SIZE:] == canary(0xA5, 24, PAGE_COUNT - 24)


def test_cuda_pool_by_pointer_moves_between_nodes(cluster):
    """register_pool_cuda(ptr=...): the pointer is exported (its offset in the
    allocation comes along) and the node writes the pool only through the
    device path: one device write per frame."""
    n2 = cluster.node("n2")
    skip = 3 * 4096
    with kvfence.FakeDeviceBuffer(fake_name("ptr"), skip + POOL_BYTES) as dev:
        dev.mem[skip:] = canary(0xA5, 0, PAGE_COUNT)
        pool = n2.register_pool_cuda(PAGE_SIZE, PAGE_COUNT, ptr=dev.ptr + skip)
        assert pool.page_size == PAGE_SIZE and pool.page_count == PAGE_COUNT
        move_into(cluster, 501, pool.pool_id, dev.mem, skip)
        assert bytes(dev.mem[:skip]) == bytes(skip)  # before the pool: untouched
        unregister(n2, pool.pool_id)
        wait_log(cluster, "n2", "device pool %d (fake device (test)): writes=1 write_bytes=%d "
                 "reads=0" % (pool.pool_id, 8 * PAGE_SIZE))


def test_cuda_pool_by_exported_handle(cluster):
    """The export (kvfence.device.export) and the registration apart, as an
    engine does with torch's own export; a fake handle outside the node's
    --test-fake-device-pools is refused naming cuda_ipc.ipc_handle, and
    nothing is registered."""
    n2 = cluster.node("n2")
    with kvfence.FakeDeviceBuffer(fake_name("ipc"), POOL_BYTES + 8192) as dev:
        dev.mem[8192:] = canary(0xA5, 0, PAGE_COUNT)
        ipc = kvfence.device.export(dev.ptr + 8192)
        assert len(ipc.handle) == 64 and ipc.offset == 8192 and ipc.device == 0
        pool = n2.register_pool_cuda(PAGE_SIZE, PAGE_COUNT, ipc=ipc)
        move_into(cluster, 502, pool.pool_id, dev.mem, 8192)
    with kvfence.FakeDeviceBuffer("/kvf-pyother-%d" % os.getpid(), POOL_BYTES) as other:
        with pytest.raises(kvfence.InvalidArgument, match="cuda_ipc.ipc_handle"):
            n2.register_pool_cuda(PAGE_SIZE, PAGE_COUNT, ptr=other.ptr)
    with pytest.raises(ValueError):
        n2.register_pool_cuda(PAGE_SIZE, PAGE_COUNT)


# A sink pool of 4 layers x (K, V) slots of 480 bytes and one 256-byte aux
# slot: 4096 bytes a page, the page size of n1's host pool, which sends them.
LAYOUT = [480] * 8 + [256]
assert sum(LAYOUT) == PAGE_SIZE


def slot_fill(seed, b, page, n):
    return bytes(((seed * 29 + b * 97 + page * 157 + i * 3) & 0xFF for i in range(n)))


def make_buffers(tag):
    """Fake device memory for the K buffers (even), host shm for V and aux;
    each filled with its own canary."""
    from multiprocessing import shared_memory
    bufs = []
    for b, ps in enumerate(LAYOUT):
        size = ps * PAGE_COUNT
        if b % 2 == 0 and b < 8:
            dev = kvfence.FakeDeviceBuffer(fake_name("%s%d" % (tag, b)), size)
            mem, spec = dev.mem, kvfence.PoolBuffer(ps, ptr=dev.ptr)
            closer = dev.close
        else:
            shm = shared_memory.SharedMemory(name="kvf-pyb-%d-%s%d" % (os.getpid(), tag, b),
                                             create=True, size=size)
            mem, spec = shm.buf, kvfence.PoolBuffer(ps, shm_name=shm.name)

            def closer(shm=shm):
                shm.close()
                shm.unlink()
        mem[:size] = b"".join(slot_fill(7, b, pg, ps) for pg in range(PAGE_COUNT))
        bufs.append((mem, spec, closer))
    return bufs


def test_multi_buffer_pool_takes_every_slot_of_a_page(cluster):
    """One lease and one chunk cover every buffer: n1's host pages [0, 8)
    land in slots [16, 24) of each of the sink's nine buffers (the first 480
    bytes of a page in buffer 0, the next in buffer 1, ...), every other slot
    keeps its canary, and every buffer was written through the device path."""
    n2 = cluster.node("n2")
    bufs = make_buffers("m")
    try:
        pool = n2.register_pool_buffers([spec for _, spec, _ in bufs], PAGE_COUNT)
        assert pool.page_size == PAGE_SIZE and pool.page_count == PAGE_COUNT
        move_pages(cluster, 503, pool.pool_id)
        src = canary(1, 0, 8)
        at = 0
        for bi, (mem, spec, _) in enumerate(bufs):
            ps = spec.page_size
            for pg in range(PAGE_COUNT):
                got = bytes(mem[pg * ps:(pg + 1) * ps])
                if 16 <= pg < 24:
                    k = pg - 16
                    want = src[k * PAGE_SIZE + at:k * PAGE_SIZE + at + ps]
                else:
                    want = slot_fill(7, bi, pg, ps)
                assert got == want, "buffer %d page %d" % (bi, pg)
            at += ps
        unregister(n2, pool.pool_id)
        wait_log(cluster, "n2", "pool %d buffer 8 (host_shm): writes=1 write_bytes=%d" %
                 (pool.pool_id, 8 * 256))
        wait_log(cluster, "n2", "pool %d buffer 0 (fake device (test)): writes=1 "
                 "write_bytes=%d" % (pool.pool_id, 8 * 480))
    finally:
        for _, _, closer in bufs:
            closer()


def test_bad_buffer_list_is_refused_naming_the_buffer(cluster):
    n2 = cluster.node("n2")
    bufs = make_buffers("bad")
    try:
        specs = [spec for _, spec, _ in bufs]
        bad = list(specs)
        bad[2] = kvfence.PoolBuffer(0, shm_name=specs[1].shm_name)
        with pytest.raises(kvfence.InvalidArgument, match=r"buffers\[2\]\.page_size"):
            n2.register_pool_buffers(bad, PAGE_COUNT)
        with pytest.raises(kvfence.InvalidArgument, match=r"buffers\[3\]\.cuda_ipc\.size"):
            n2.register_pool_buffers(specs[:3] + [kvfence.PoolBuffer(480, ptr=specs[0].ptr,
                                                                     size=100)], PAGE_COUNT)
        with pytest.raises(ValueError, match=r"buffers\[0\]"):
            n2.register_pool_buffers([kvfence.PoolBuffer(480)], PAGE_COUNT)
        # Nothing was registered: the next pool follows the fixture's.
        pool = n2.register_pool_buffers(specs, PAGE_COUNT)
        assert pool.pool_id == cluster.pools["n2"].pool_id + 1
        unregister(n2, pool.pool_id)
    finally:
        for _, _, closer in bufs:
            closer()


class FakeTensor:
    """What register_pool_vllm reads of a torch tensor, over fake device
    memory: data_ptr(), shape, element_size(), numel(), is_contiguous()."""

    def __init__(self, dev, shape, element_size=2):
        self.dev, self.shape, self._es = dev, shape, element_size

    def data_ptr(self):
        return self.dev.ptr

    def element_size(self):
        return self._es

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def is_contiguous(self):
        return True


def test_sglang_and_vllm_terms(cluster):
    """A sink registered in vLLM's terms (two layers [2, blocks, 8, 15] of
    2-byte elements: K and V of 240 bytes a block each, a third layer
    [blocks, 3136] of 1 byte: 4096 bytes a block in all) takes n1's host
    pages block for block; the same memory in SGLang's terms gives the same
    geometry; lists that do not divide are refused naming the entry."""
    n2 = cluster.node("n2")
    devs = [kvfence.FakeDeviceBuffer(fake_name("vl%d" % i), size)
            for i, size in enumerate((2 * 240 * PAGE_COUNT, 2 * 240 * PAGE_COUNT,
                                      3136 * PAGE_COUNT))]
    try:
        caches = {"layer.0": FakeTensor(devs[0], (2, PAGE_COUNT, 8, 15)),
                  "layer.1": FakeTensor(devs[1], (2, PAGE_COUNT, 8, 15)),
                  "layer.2": FakeTensor(devs[2], (PAGE_COUNT, 3136), 1)}
        pool = n2.register_pool_vllm(caches)
        assert pool.page_size == PAGE_SIZE and pool.page_count == PAGE_COUNT
        slots = [(devs[0], 0, 240), (devs[0], 240 * PAGE_COUNT, 240), (devs[1], 0, 240),
                 (devs[1], 240 * PAGE_COUNT, 240), (devs[2], 0, 3136)]
        move_pages(cluster, 504, pool.pool_id)
        src = canary(1, 0, 8)
        at = 0
        for dev, base, ps in slots:
            for k in range(8):
                got = bytes(dev.mem[base + (16 + k) * ps:base + (17 + k) * ps])
                assert got == src[k * PAGE_SIZE + at:k * PAGE_SIZE + at + ps], (at, k)
            assert bytes(dev.mem[base + 15 * ps:base + 16 * ps]) == bytes(ps)  # untouched
            at += ps
        unregister(n2, pool.pool_id)

        ptrs = [d.ptr + base for d, base, _ in slots]
        lens = [ps * PAGE_COUNT for _, _, ps in slots]
        items = [ps for _, _, ps in slots]
        sg = n2.register_pool_sglang(ptrs, lens, items)
        assert sg.page_size == PAGE_SIZE and sg.page_count == PAGE_COUNT
        unregister(n2, sg.pool_id)
        with pytest.raises(ValueError, match=r"kv_data_lens\[3\]"):
            n2.register_pool_sglang(ptrs, lens[:3] + [lens[3] - 240] + lens[4:], items)
        with pytest.raises(ValueError, match="'layer.0' has 64 blocks, not 63"):
            n2.register_pool_vllm({"layer.2": FakeTensor(devs[2], (PAGE_COUNT - 1, 3136), 1),
                                   "layer.0": caches["layer.0"]})
    finally:
        for d in devs:
            d.close()
