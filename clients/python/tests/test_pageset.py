"""kvfence.PageSet (pageset.py): the encoder against an independent decoder
written here from the contract (types.proto PageSet), its choice of form,
its wire size against protobuf's, bad input; the same choice and size as
libkvfence's kvf_page_set_encode (through ctypes, when KVF_LIBKVFENCE names
the library); then join_room and extend_lease with 32,768 scattered pages
against a real control plane and two real nodes (conftest.py)."""
import array
import ctypes
import os
import random
from multiprocessing import shared_memory

import pytest

import kvfence
from kvfence import PageSet, PageSetForm, Participant, Role, RoomState, LeaseState

WAIT_S = 10.0


# ---- an independent decoder ------------------------------------------------------


def decode(ps):
    """The pages of a PageSet message, ascending (contract: types.proto)."""
    m = ps._pb()
    forms = [f for f in ("ranges", "bitmap", "deltas") if (len(getattr(m, f)) > 0)]
    assert len(forms) == 1, forms
    out = []
    if m.ranges:
        for r in m.ranges:
            out.extend(range(r.first, r.first + r.count))
        return sorted(out)
    if m.bitmap:
        for j, b in enumerate(m.bitmap):
            for i in range(8):
                if b >> i & 1:
                    out.append(m.bitmap_first + 8 * j + i)
        return out
    assert m.bitmap_first == 0
    pos, prev = 0, -1
    d = m.deltas
    while pos < len(d):
        v = shift = 0
        while True:
            b = d[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        prev = prev + 1 + v
        out.append(prev)
    return out


def check(pages):
    ps = PageSet.from_pages(pages)
    want = sorted(pages)
    assert decode(ps) == want if want else ps.form == PageSetForm.EMPTY
    assert len(ps) == len(want)
    if want:
        assert ps.wire_size == ps._pb().ByteSize()
    return ps


# ---- the encoder -------------------------------------------------------------------


def test_forms_for_the_shapes_engines_send():
    assert check(list(range(0, 65536, 2))).form == PageSetForm.BITMAP
    rnd = random.Random(3)
    sparse = rnd.sample(range(1 << 20), 32768)
    ps = check(sparse)
    assert ps.form == PageSetForm.DELTAS
    assert ps.runs > 30000
    runs = [p for r in range(256) for p in range(r * 8192, r * 8192 + 4096)]
    ps = check(runs)
    assert ps.form == PageSetForm.RANGES and ps.runs == 256
    assert check(range(1000, 1000 + 100000)).runs == 1
    assert check([]).form == PageSetForm.EMPTY
    assert PageSet.from_pages([]).pb() is None


def test_random_sets_any_order_and_input_type():
    rnd = random.Random(9)
    for _ in range(200):
        span = 1 << rnd.randrange(1, 21)
        n = rnd.randrange(0, min(span, 5000) + 1)
        base = rnd.choice([0, rnd.randrange(100000), (1 << 32) - span])
        pages = [base + p for p in rnd.sample(range(span), n)]
        if rnd.random() < 0.5:
            pages.sort()
        check(pages)
        check(array.array("L", pages))
        check(tuple(pages))
    check([0])
    check([(1 << 32) - 1])
    check([(1 << 32) - 1, 0])
    assert decode(PageSet.from_pages(iter([5, 3, 4]))) == [3, 4, 5]


def test_bad_pages():
    with pytest.raises(ValueError, match=r"page 7 is listed twice"):
        PageSet.from_pages([1, 7, 3, 7])
    with pytest.raises(ValueError, match=r"page 2 is listed twice"):
        PageSet.from_pages([1, 2, 2])
    with pytest.raises(ValueError, match=r"-1"):
        PageSet.from_pages([4, -1])
    with pytest.raises(ValueError, match=r"4294967296"):
        PageSet.from_pages([0, 1 << 32])
    with pytest.raises(TypeError):
        PageSet.from_pages([1.5])


def _libkvfence():
    path = os.environ.get("KVF_LIBKVFENCE")
    if not path:
        pytest.skip("KVF_LIBKVFENCE not set (ctest sets it)")
    lib = ctypes.CDLL(path)
    lib.kvf_page_set_encode.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.kvf_page_set_form.argtypes = [ctypes.c_void_p]
    lib.kvf_page_set_wire_size.argtypes = [ctypes.c_void_p]
    lib.kvf_page_set_wire_size.restype = ctypes.c_size_t
    lib.kvf_page_set_destroy.argtypes = [ctypes.c_void_p]
    return lib


def test_same_choice_as_libkvfence():
    lib = _libkvfence()
    rnd = random.Random(17)
    for _ in range(300):
        span = 1 << rnd.randrange(1, 22)
        n = rnd.randrange(1, min(span, 4000) + 1)
        pages = rnd.sample(range(span), n)
        if rnd.random() < 0.3:  # runs
            pages = sorted({q for p in pages[: n // 16 + 1] for q in range(p, min(p + 40, span))})
        ps = PageSet.from_pages(pages)
        arr = (ctypes.c_uint32 * len(pages))(*pages)
        h = ctypes.c_void_p()
        assert lib.kvf_page_set_encode(arr, len(pages), ctypes.byref(h), None) == 0
        try:
            assert (lib.kvf_page_set_form(h), lib.kvf_page_set_wire_size(h)) == (
                int(ps.form), ps.wire_size), pages[:20]
        finally:
            lib.kvf_page_set_destroy(h)


# ---- a real control plane and two real nodes -----------------------------------------


BIG_PAGES = 1 << 19
BIG_PAGE_SIZE = 8


def test_join_and_extend_32k_scattered_pages(cluster):
    shms = []
    try:
        pools = {}
        for nid in ("n1", "n2"):
            shm = shared_memory.SharedMemory(create=True, size=BIG_PAGES * BIG_PAGE_SIZE)
            shms.append(shm)
            with kvfence.NodeClient("unix:" + cluster.socket(nid)) as nc:
                pools[nid] = nc.register_pool_shm("/" + shm.name, BIG_PAGE_SIZE,
                                                  BIG_PAGES).pool_id
        rnd = random.Random(23)
        kv_src = list(range(0, 65536, 2))  # every other slot: a bitmap
        kv_dst = rnd.sample(range(BIG_PAGES), 32768)  # random slots, random order: deltas
        ctl = cluster.control()
        src = Participant("n1", 0, Role.SOURCE)
        snk = Participant("n2", 0, Role.SINK)
        a = ctl.join_room(501, src, pools["n1"], pages=kv_src, retry_s=WAIT_S)
        assert a.state == RoomState.OPENING
        lease = ctl.extend_lease(a.room, a.lease_id, pages=PageSet.from_pages([65537, 65539]))
        assert lease.page_count() == 32770
        with pytest.raises(kvfence.InvalidArgument, match=r"page_set.* page 65539 .*already"):
            ctl.extend_lease(a.room, a.lease_id, pages=[65539])
        with pytest.raises(ValueError, match="ranges or pages"):
            ctl.extend_lease(a.room, a.lease_id, [(70000, 1)], pages=[70001])
        b = ctl.join_room(501, snk, pools["n2"], pages=kv_dst, retry_s=WAIT_S)
        assert b.state == RoomState.ACTIVE
        info = cluster.admin().room(a.room)
        by_role = {p.participant.role: p.lease for p in info.participants}
        assert by_role[Role.SINK].pages() == sorted(kv_dst)
        assert len(by_role[Role.SOURCE].ranges) == 32770
        ctl.abort_room(a.room, "page-set test")
        released = ctl.wait_all_released([a.lease_id, b.lease_id], WAIT_S)
        assert {l.state for l in released.values()} == {LeaseState.RELEASED}
        assert released[b.lease_id].page_count() == 32768
    finally:
        cluster.close_clients()
        for shm in shms:
            shm.close()
            shm.unlink()
