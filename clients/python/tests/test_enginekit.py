"""kvfence.enginekit without a cluster: which memory register_kv_memory
refuses today (with a message naming the buffer), the vLLM tensor layout,
and the rendezvous's tombstones."""
import os
from multiprocessing import shared_memory
from types import SimpleNamespace

import pytest

from kvfence.enginekit import Rendezvous, RendezvousServer, buffer_address, register_kv_memory
from kvfence.enginekit.memory import ranges_for, shm_region
from kvfence.vllm import kv_cache_buffers
from kvfence import PageRange


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
    def register_pool_shm(self, *a, **kw):  # pragma: no cover - must not be reached
        raise AssertionError("refused memory reached the node")


def test_shm_region_finds_the_object_and_offset(shm):
    s = shm(4 * 4096)
    name, off = shm_region(buffer_address(s.buf) + 8192, 4096)
    assert name == "/" + s.name and off == 8192


def test_refused_memory_names_the_buffer(shm):
    a, b = shm(8 * 1024), shm(8 * 1024)
    pa, pb = buffer_address(a.buf), buffer_address(b.buf)
    with pytest.raises(ValueError, match="2 shm objects"):
        register_kv_memory(NoNode(), [pa, pb], [8192, 8192], [1024, 1024])
    with pytest.raises(ValueError, match=r"kv_data_ptrs\[1\].*not on a page boundary"):
        register_kv_memory(NoNode(), [pa, pa + 100], [2048, 2048], [1024, 1024])
    with pytest.raises(ValueError, match="same page size"):
        register_kv_memory(NoNode(), [pa, pa + 4096], [4096, 2048], [1024, 512])
    with pytest.raises(ValueError, match=r"kv_data_lens\[1\]"):
        register_kv_memory(NoNode(), [pa, pa + 4096], [4096, 2048], [1024, 1024])
    heap = bytearray(8192)
    with pytest.raises(ValueError, match="not in a shared /dev/shm mapping"):
        register_kv_memory(NoNode(), [buffer_address(heap)], [8192], [1024])


def test_ranges_for_every_buffer_in_order():
    assert ranges_for([0, 100], [3, 4, 9]) == [PageRange(3, 2), PageRange(9, 1),
                                                PageRange(103, 2), PageRange(109, 1)]


def test_vllm_kv_cache_layout():
    t = lambda ptr, shape, n: SimpleNamespace(data_ptr=lambda: ptr, shape=shape, nbytes=n)
    ptrs, lens, items = kv_cache_buffers({"l1": t(20000, (2, 4, 8, 16), 2048),
                                          "l0": t(10000, (2, 4, 8, 16), 2048),
                                          "mla": t(30000, (4, 64), 1024)})
    assert ptrs == [10000, 11024, 20000, 21024, 30000]   # by layer name; K then V
    assert lens == [1024, 1024, 1024, 1024, 1024]
    assert items == [256, 256, 256, 256, 256]


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
