#!/usr/bin/python3
"""bench_pageset.py: the Python client's page sets (kvfence.PageSet).

Encode: for each shape (32,768 pages every other page, random pages in
random order, the same sorted; 1,048,576 pages in 4,096-page runs), the
median and best time of PageSet.from_pages over --reps runs, next to the old
way of sending such pages (ranges_from_pages, then the ranges' messages).
Lists are built with array.tolist(), as torch's tensor.tolist() builds
them (fresh int objects in list order).

With --target HOST:PORT, JoinRoom through ControlClient.join_room against a
running kvfence-control: a node session (NodeSession.Attach, Hello with a
pool of 2^21 pages) answers abort notices with Drained; each join (timed,
encode included or not: both are printed) is followed by an abort, the
release and a pause (untimed).

usage: PYTHONPATH=clients/python:build/clients/python \\
       bench/pageset/bench_pageset.py [--reps N] [--target HOST:PORT]
"""
import argparse
import array
import queue
import random
import statistics
import threading
import time

import grpc

import kvfence
from kvfence import PageSet, Participant, Role
from kvfence._proto.v1 import node_pb2, node_pb2_grpc, types_pb2

POOL_ID = 2
POOL_PAGES = 1 << 21


def shapes():
    rnd = random.Random(1)
    eo = array.array("I", range(0, 65536, 2)).tolist()
    r = array.array("I", rnd.sample(range(1 << 20), 32768)).tolist()
    s = array.array("I", sorted(r)).tolist()
    big = array.array("I", ((i // 4096) * 8192 + i % 4096 for i in range(1 << 20))).tolist()
    return [("32k every other page", eo), ("32k random, random order", r),
            ("32k random, sorted", s), ("1M in 4k-page runs", big)]


def timed(fn, reps):
    ts = []
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), min(ts), out


def old_way(pages):
    rs = kvfence.ranges_from_pages(pages)
    return [types_pb2.PageRange(first=r.first, count=r.count) for r in rs]


def bench_encode(reps):
    print("%-26s %-7s %8s %7s %18s %18s" % ("shape", "form", "bytes", "runs",
                                         "PageSet ms (best)", "old ranges ms"))
    for name, pages in shapes():
        n = reps if len(pages) < 100000 else max(3, reps // 10)
        med, best, ps = timed(lambda: PageSet.from_pages(pages), n)
        omed, obest, _ = timed(lambda: old_way(pages), max(3, n // 5))
        print("%-26s %-7s %8d %7d %9.2f (%5.2f) %10.1f (%5.1f)" % (
            name, ps.form.name.lower(), ps.wire_size, ps.runs, med, best, omed, obest))


class Node:
    """A node session that says Hello with one big pool and answers every
    AbortNotice with Drained."""

    def __init__(self, channel, node_id):
        self.q = queue.Queue()
        caps = types_pb2.CapabilitySet(protocol_min=1, protocol_max=1,
                                       features=["QUIESCE_V1", "FENCE_V1", "TCP"])
        self.q.put(node_pb2.NodeMessage(hello=node_pb2.Hello(
            node_id=node_id, incarnation=time.monotonic_ns(), capabilities=caps,
            pools=[types_pb2.Pool(pool_id=POOL_ID, kind=types_pb2.POOL_KIND_HOST_SHM,
                                  page_size=4096, page_count=POOL_PAGES)])))
        self.call = node_pb2_grpc.NodeSessionStub(channel).Attach(iter(self.q.get, None))
        self.welcome = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.welcome.wait(5):
            raise SystemExit("node session: no Welcome")

    def _read(self):
        try:
            for m in self.call:
                kind = m.WhichOneof("msg")
                if kind == "welcome":
                    self.welcome.set()
                elif kind == "abort_notice":
                    n = m.abort_notice
                    self.q.put(node_pb2.NodeMessage(drained=node_pb2.Drained(
                        room=n.room, token=n.token, notice_id=n.notice_id)))
        except grpc.RpcError:  # cancelled by close()
            pass

    def close(self):
        self.q.put(None)
        self.call.cancel()


def bench_join(target, reps):
    ctl = kvfence.ControlClient(target)
    node = Node(ctl.channel, "bench-pageset-py")
    who = Participant("bench-pageset-py", 0, Role.SINK)
    room = [1 << 40]
    print("\nJoinRoom over gRPC to %s (ControlClient.join_room; %d joins each)" % (target, reps))
    print("%-34s %14s %16s %10s" % ("request", "join ms", "encode+join ms", "x 1-range"))
    base = None
    rows = [("1 range of 16 pages", None)] + [(n, p) for n, p in shapes() if "sorted" not in n]
    for name, pages in rows:
        n = reps if pages is None or len(pages) < 100000 else max(3, reps // 10)
        joins, totals = [], []
        for _ in range(n):
            room[0] += 1
            t0 = time.perf_counter()
            ps = PageSet.from_pages(pages) if pages is not None else None
            t1 = time.perf_counter()
            if ps is None:
                j = ctl.join_room(room[0], who, POOL_ID, [(0, 16)], retry_s=5)
            else:
                j = ctl.join_room(room[0], who, POOL_ID, pages=ps, retry_s=5)
            t2 = time.perf_counter()
            joins.append((t2 - t1) * 1e3)
            totals.append((t2 - t0) * 1e3)
            ctl.abort_room(j.room)
            ctl.wait_released(j.lease_id, 10)
            time.sleep(0.003)
        med = statistics.median(joins)
        base = base or med
        print("%-34s %14.3f %16.3f %10.2f" % (name, med, statistics.median(totals), med / base))
    node.close()
    ctl.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--target")
    a = ap.parse_args()
    bench_encode(a.reps)
    if a.target:
        bench_join(a.target, a.reps)


if __name__ == "__main__":
    main()
