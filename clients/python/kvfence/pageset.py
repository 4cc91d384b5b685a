"""kvfence.PageSet: a set of page indices of one pool, encoded for JoinRoom
and ExtendLease in the smallest of three forms (types.proto PageSet):

    RANGES  runs of pages (repeated PageRange), when pages come in runs
    BITMAP  one bit a page from the lowest page, for a dense scatter
    DELTAS  LEB128 varints: the first page, then each gap minus one, for a
            sparse scatter (one byte a page while gaps stay under 128)

It picks the same form, with the same size, as libkvfence's
kvf_page_set_encode (ties: RANGES, then DELTAS, then BITMAP).

Engines that name every token's slot (SGLang with page size 1: kv_indices)
pass the indices as they are: `ctl.join_room(..., pages=kv_indices)`.

How it stays fast without numpy. Every pass over the pages runs inside
CPython's C code (max, map, bytearray methods, bytes.split, bytes.join);
no Python-level loop touches each page. The pages are scattered into a
bytearray of one byte per pool page (`ba[p] = 1` through map), which sorts
them and counts duplicates at once; `bytes(ba).split(b"\\x01")` then yields the
zero runs between set bytes, whose lengths are the delta form's values; the
bitmap comes from the same bytearray (translate to "0"/"1", int(..., 2),
to_bytes). Sets spread far wider than they are large (a span over 64 pages
a page) are sorted with sorted() instead. 32,768 pages encode in about 2 ms
(every other page) to 4 ms (random pages in random order); bench/README.md
has the figures.
"""
from __future__ import annotations

import enum
import operator
import re
from collections import deque
from itertools import repeat
from typing import Any, Iterable, List, Optional, Tuple

from ._proto.v1 import types_pb2

__all__ = ["PageSet", "PageSetForm"]

_PAGE_MAX = (1 << 32) - 1
# The scatter costs one byte per page of the span: used while the span is at
# most this many bytes per page of the set (plus a floor for small sets).
_SCATTER_PER_PAGE = 64
_SCATTER_FLOOR = 1 << 16
_TO_01 = bytes([0x30, 0x31]) + bytes(254)  # 0 -> "0", 1 -> "1"
_ONES = re.compile(b"\x01+")
_VARINT2: List[bytes] = []  # varints of 0 .. 2^14-1, built on first use


class PageSetForm(enum.IntEnum):
    """Which form a PageSet took (same numbers as libkvfence's enum)."""
    EMPTY = 0
    RANGES = 1
    BITMAP = 2
    DELTAS = 3


def _vsize(v: int) -> int:
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _range_size(first: int, count: int) -> int:
    body = (1 + _vsize(first) if first else 0) + 1 + _vsize(count)
    return 1 + _vsize(body) + body


def _bitmap_size(lo: int, hi: int) -> int:
    nb = (hi - lo + 8) // 8
    return 1 + _vsize(nb) + nb + (1 + _vsize(lo) if lo else 0)


def _deltas_floor(n: int) -> int:
    """No delta form of n pages is smaller (a byte a page at least)."""
    return 1 + _vsize(n) + n


def _varints(values: List[int], top: int) -> bytes:
    """LEB128 of every value (all >= 0, the largest `top`)."""
    if top < 0x80:
        return bytes(values)
    if top < (1 << 14):
        if not _VARINT2:
            _VARINT2.extend(_varint(v) for v in range(1 << 14))
        return b"".join(map(_VARINT2.__getitem__, values))
    return b"".join(map(_varint, values))


def _as_list(pages: Iterable[int]) -> List[int]:
    if isinstance(pages, list):
        return pages
    tolist = getattr(pages, "tolist", None)  # array.array, numpy, torch
    if tolist is not None:
        out = tolist()
        if isinstance(out, list):
            return out
    return list(pages)


def _duplicate(pages: List[int]) -> ValueError:
    seen = {}
    for i, p in enumerate(pages):
        if p in seen:
            return ValueError("pages[%d]: page %d is listed twice (also pages[%d])"
                              % (i, p, seen[p]))
        seen[p] = i
    return ValueError("pages: a page is listed twice")  # not reached


class PageSet:
    """An encoded set of pages; build it with PageSet.from_pages(). Immutable;
    `form`, `pages` (how many), `runs` (runs of consecutive pages) and
    `wire_size` (bytes of the PageSet message) describe it."""

    __slots__ = ("form", "pages", "runs", "wire_size", "_msg")

    def __init__(self, form: PageSetForm, pages: int, runs: int, wire_size: int,
                 msg: Optional[types_pb2.PageSet]) -> None:
        self.form = form
        self.pages = pages
        self.runs = runs
        self.wire_size = wire_size
        self._msg = msg

    def __len__(self) -> int:
        return self.pages

    def __repr__(self) -> str:
        return "PageSet(%s, pages=%d, runs=%d, wire_size=%d)" % (
            self.form.name, self.pages, self.runs, self.wire_size)

    def pb(self) -> Optional[types_pb2.PageSet]:
        """The PageSet message (a copy), or None for an empty set."""
        if self._msg is None:
            return None
        m = types_pb2.PageSet()
        m.CopyFrom(self._msg)
        return m

    def _pb(self) -> types_pb2.PageSet:
        assert self._msg is not None
        return self._msg

    @classmethod
    def from_pages(cls, pages: Iterable[int]) -> "PageSet":
        """Encodes page indices given in any order, each at most once (ints in
        0 .. 2^32-1: a list, a tuple, an array.array, anything with
        tolist(), any iterable). Raises ValueError naming a page listed twice
        or out of range, TypeError for a value that is not an int."""
        p = _as_list(pages)
        n = len(p)
        if n == 0:
            return cls(PageSetForm.EMPTY, 0, 0, 0, None)
        lo, hi = min(p), max(p)
        if lo < 0 or hi > _PAGE_MAX:
            bad = lo if lo < 0 else hi
            raise ValueError("pages: page %d is outside 0 .. 2^32-1" % bad)
        if hi < _SCATTER_PER_PAGE * n + _SCATTER_FLOOR:
            return cls._scattered(p, n, lo, hi)
        return cls._sorted(p, n, lo, hi)

    @classmethod
    def _scattered(cls, p: List[int], n: int, lo: int, hi: int) -> "PageSet":
        ba = bytearray(hi + 1)
        deque(map(ba.__setitem__, p, repeat(1)), maxlen=0)  # TypeError for a non-int
        if _deltas_floor(n) > _bitmap_size(lo, hi):
            # The bitmap beats the deltas (at least a byte a page): no need for
            # the gaps. Count pages and runs in C: a run starts at a set byte
            # after a clear one (or at page 0).
            if ba.count(1) != n:
                raise _duplicate(p)
            nruns = ba.count(b"\x00\x01") + (ba[0] == 1)
            return cls._choose(n, lo, hi, None, nruns, ba)
        # gaps[0] is the first page (the zeros before it); gaps[i] the zeros
        # between the (i-1)th and the ith page: the delta form's values.
        # bytes pieces (not bytearray ones): the empty and one-byte ones are
        # shared objects, and the rest are cheaper to make.
        gaps = list(map(len, bytes(ba).split(b"\x01")))
        gaps.pop()  # the zeros after the last page (none: hi is set)
        if len(gaps) != n:
            raise _duplicate(p)
        return cls._choose(n, lo, hi, gaps, n - gaps.count(0) + (gaps[0] == 0), ba)

    @classmethod
    def _sorted(cls, p: List[int], n: int, lo: int, hi: int) -> "PageSet":
        s = sorted(p)
        gaps = list(map(operator.sub, s, [-1] + s[:-1]))
        gaps = list(map(operator.sub, gaps, repeat(1)))
        if n > 1 and min(gaps[1:]) < 0:
            raise _duplicate(p)
        return cls._choose(n, lo, hi, gaps, n - gaps.count(0) + (gaps[0] == 0), None, s)

    @classmethod
    def _choose(cls, n: int, lo: int, hi: int, gaps: Optional[List[int]], nruns: int,
                ba: Optional[bytearray], s: Optional[List[int]] = None) -> "PageSet":
        """Sizes the forms and builds the smallest. `gaps` (the delta values)
        may be None only when the bitmap is smaller than any delta form."""
        span = hi - lo + 1
        nb = (span + 7) // 8
        bitmap_size = _bitmap_size(lo, hi)
        # Deltas cost at least a byte a page: computed only when they may win.
        deltas = None
        deltas_size = _deltas_floor(n)  # a lower bound
        if deltas_size <= bitmap_size:
            assert gaps is not None
            rest = gaps[1:]
            deltas = _varint(gaps[0]) + _varints(rest, max(rest) if rest else 0)
            deltas_size = 1 + _vsize(len(deltas)) + len(deltas)
        # A range costs at least 4 bytes: computed only when ranges may win.
        runs: Optional[List[Tuple[int, int]]] = None
        ranges_size = 4 * nruns
        if ranges_size <= min(bitmap_size, deltas_size):
            runs = cls._runs(ba, s)
            ranges_size = sum(_range_size(f, c) for f, c in runs)
        if runs is not None and ranges_size <= deltas_size and ranges_size <= bitmap_size:
            msg = types_pb2.PageSet(
                ranges=[types_pb2.PageRange(first=f, count=c) for f, c in runs])
            return cls(PageSetForm.RANGES, n, nruns, ranges_size, msg)
        if deltas is not None and deltas_size <= bitmap_size:
            return cls(PageSetForm.DELTAS, n, nruns, deltas_size, types_pb2.PageSet(deltas=deltas))
        if ba is None:  # never: a wide span makes the bitmap the largest form
            ba = bytearray(span)
            deque(map(ba.__setitem__, map(operator.sub, s or [], repeat(lo)), repeat(1)),
                  maxlen=0)
            lo_off = 0
        else:
            lo_off = lo
        digits = ba[lo_off:lo_off + span].translate(_TO_01)
        digits.reverse()  # bit 0 (page lo) is the last, least significant digit
        bm = int(digits, 2).to_bytes(nb, "little")
        return cls(PageSetForm.BITMAP, n, nruns, bitmap_size,
                   types_pb2.PageSet(bitmap=bm, bitmap_first=lo))

    @staticmethod
    def _runs(ba: Optional[bytearray], s: Optional[List[int]]) -> List[Tuple[int, int]]:
        if ba is not None:
            return [(m.start(), m.end() - m.start()) for m in _ONES.finditer(ba)]
        assert s is not None
        out: List[List[int]] = []
        for p in s:
            if out and out[-1][0] + out[-1][1] == p:
                out[-1][1] += 1
            else:
                out.append([p, 1])
        return [(f, c) for f, c in out]


def as_page_set(pages: Any) -> Optional[PageSet]:
    """A PageSet, or the pages encoded; None for None."""
    if pages is None or isinstance(pages, PageSet):
        return pages
    return PageSet.from_pages(pages)
