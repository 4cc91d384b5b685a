"""kvfence.enginekit without a cluster: how register_kv_memory turns an
engine's buffers into ONE multi-buffer pool (each buffer its own memory:
host shm by object and offset, FakeDeviceBuffer "GPU" memory by CUDA IPC
handle), what it refuses (with a message naming the buffer, before the node
is asked), the vLLM tensor layout, and the rendezvous's tombstones."""
import os
from multiprocessing import shared_memory
from types import SimpleNamespace

import pytest

import kvfence
from kvfence.enginekit import Rendezvous, RendezvousServer, buffer_address, register_kv_memory
from kvfence.enginekit.memory import shm_region
from kvfence.vllm import kv_cache_buffers, kv_cache_pool_buffers
from kvfence import PageRange, Pool, PoolKind


@pytest.fixture
def shm():
    objs = []

    def make(size):
        s = shared_memory.SharedMemory(name="kvf-ek-%d-%d" % (os.getpid(), len(objs)),
                                       create=True, size=size)
        objs.append(s)
        return s

    yield make
    for s in objs:
        s.close()
        s.unlink()


class NoNode:
    def register_pool_buffers(self, *a, **kw):  # pragma: no cover - must not be reached
        raise AssertionError("refused memory reached the node")


class RecordingNode:
    """What register_kv_memory asks of the node: one register_pool_buffers."""

    def __init__(self):
        self.calls = []

    def register_pool_buffers(self, buffers, page_count, **kw):
        self.calls.append((list(buffers), page_count, kw))
        return Pool(7, PoolKind.HOST_SHM, sum(b.page_size for b in buffers), page_count)


def test_shm_region_finds_the_object_and_offset(shm):
    s = shm(4 * 4096)
    name, off = shm_region(buffer_address(s.buf) + 8192, 4096)
    assert name == "/" + s.name and off == 8192


def test_buffers_in_separate_shm_objects_are_one_pool(shm):
    """Each buffer its own shm object (one at an offset in it), pages of
    different sizes: ONE pool of 3 buffers, and a lease is the engine's page
    indices as they are. Before: "lie in 3 shm objects ... must share one"."""
    a, b, c = shm(8 * 1024), shm(8 * 2048), shm(4096 + 8 * 512)
    node = RecordingNode()
    mem = register_kv_memory(node, [buffer_address(a.buf), buffer_address(b.buf),
                                    buffer_address(c.buf) + 4096],
                             [8 * 1024, 8 * 2048, 8 * 512], [1024, 2048, 512], rank=3)
    (bufs, count, kw), = node.calls
    assert count == 8 and kw["rank"] == 3
    assert [(x.shm_name, x.offset, x.size, x.page_size) for x in bufs] == [
        ("/" + a.name, 0, 8192, 1024), ("/" + b.name, 0, 16384, 2048),
        ("/" + c.name, 4096, 4096, 512)]
    assert mem.item_lens == (1024, 2048, 512) and mem.page_size == 3584 and mem.buffers == 3
    # One pool page per engine page, whatever the buffer count.
    assert mem.pool_pages([5, 1, 2]) == [5, 1, 2]
    assert mem.ranges([1, 2, 3, 7]) == [PageRange(1, 3), PageRange(7, 1)]
    assert mem.same_layout(mem.describe())
    assert not mem.same_layout({"item_lens": [1024, 512, 2048]})


def test_fake_device_buffer_goes_by_cuda_ipc(shm):
    """FakeDeviceBuffer memory (host shm underneath) is device memory: its
    (fake) CUDA IPC handle, with the buffer's offset in the allocation."""
    name = "/kvf-ek-fdev-%d" % os.getpid()
    with kvfence.FakeDeviceBuffer(name, 3 * 4096) as dev:
        s = shm(4 * 4096)
        node = RecordingNode()
        register_kv_memory(node, [dev.ptr + 4096, buffer_address(s.buf)], [8192, 16384],
                           [1024, 2048])
        (bufs, _, _), = node.calls
        assert bufs[0].ipc is not None and bufs[0].shm_name is None
        assert bufs[0].ipc.offset == 4096 and bufs[0].ipc.handle.startswith(b"KVFFAKE1")
        assert name.encode() in bufs[0].ipc.handle
        assert bufs[1].shm_name == "/" + s.name and bufs[1].ipc is None


def test_refused_memory_names_the_buffer(shm):
    a = shm(8 * 1024)
    pa = buffer_address(a.buf)
    with pytest.raises(ValueError, match=r"kv_data_lens\[1\]: 2048 bytes, not 4 pages of 1024"):
        register_kv_memory(NoNode(), [pa, pa + 4096], [4096, 2048], [1024, 1024])
    with pytest.raises(ValueError, match=r"kv_item_lens\[1\]"):
        register_kv_memory(NoNode(), [pa, pa + 4096], [4096, 0], [1024, 0])
    with pytest.raises(ValueError, match=r"runs past its mapping"):
        register_kv_memory(NoNode(), [pa + 4096], [8192], [1024])
    heap = bytearray(8192)
    with pytest.raises(ValueError, match=r"kv_data_ptrs\[1\]: .* neither host shm"):
        register_kv_memory(NoNode(), [pa, buffer_address(heap)], [4096, 4096], [1024, 1024])
    with pytest.raises(ValueError, match="must be equal"):
        register_kv_memory(NoNode(), [pa], [4096, 4096], [1024])


def test_vllm_kv_cache_layout():
    t = lambda ptr, shape, n: SimpleNamespace(data_ptr=lambda: ptr, shape=shape, nbytes=n)
    ptrs, lens, items = kv_cache_buffers({"l1": t(20000, (2, 4, 8, 16), 2048),
                                          "l0": t(10000, (2, 4, 8, 16), 2048),
                                          "mla": t(30000, (4, 64), 1024)})
    assert ptrs == [10000, 11024, 20000, 21024, 30000]   # by layer name; K then V
    assert lens == [1024, 1024, 1024, 1024, 1024]
    assert items == [256, 256, 256, 256, 256]


def test_vllm_per_layer_tensors_by_their_memory(shm):
    """kv_cache_pool_buffers: one PoolBuffer per K and V half of each layer,
    each from its own tensor's memory (here each layer its own shm object)."""
    s0, s1 = shm(2 * 4 * 512), shm(2 * 4 * 512)
    t = lambda s: SimpleNamespace(data_ptr=lambda: buffer_address(s.buf), shape=(2, 4, 512),
                                  nbytes=4096)
    bufs = kv_cache_pool_buffers({"l1": t(s1), "l0": t(s0)})
    assert [(b.shm_name, b.offset, b.page_size) for b in bufs] == [
        ("/" + s0.name, 0, 512), ("/" + s0.name, 2048, 512),
        ("/" + s1.name, 0, 512), ("/" + s1.name, 2048, 512)]


def test_rendezvous_tombstones():
    srv = RendezvousServer("127.0.0.1", 0)
    try:
        rz = Rendezvous(srv.address)
        assert rz.get_rank(0) is None
        rz.put_rank(0, {"node_id": "n1"})
        assert rz.get_rank(0) == {"node_id": "n1"}
        # Metadata first: the abort reads it back (to abort by its key).
        assert rz.put_sink(7, 0, {"room": [7, 1]}) is None
        assert rz.abort(7, 0, "gone")["sink"] == {"room": [7, 1]}
        # Tombstone first: later metadata is refused with the reason.
        rz.abort(8, 0, "client left")
        assert rz.put_sink(8, 0, {"room": [8, 1]}) == "client left"
        rz.delete(8, 0)  # a tombstone outlives clear()
        assert rz.room(8, 0)["aborted"] == "client left"
        rz.delete(7, 0)
        rz.delete(9, 0)
        assert rz.room(9, 0) == {"sink": None, "aborted": None}
    finally:
        srv.close()
