#!/usr/bin/python3
"""Request latency of kvfence.sglang on a local cluster (never run by ctest).

Starts kvfence-control and two kvfence-node processes from the build tree (TCP
transport, loopback), one prefill and one decode KVManager in this process
(host shm KV buffers: --layers layers, K and V each), and runs --requests
requests one after another, each --pages pages in --chunks chunks, as the
schedulers do: decode init + send_metadata, prefill send per chunk, both
polled every 1 ms until Success. Each KV buffer is its own shm object, and the
buffers are ONE multi-buffer pool (enginekit.register_kv_memory), so the nodes
run with --staging host (a multi-buffer pool is sent through the staging
copy). Then the same count of requests aborted by
decode after their first chunk, until both sides say Failed (ABORTED and
released). Prints p50/p99 per request and, for aborts, from abort() to the
last Failed.

    PYTHONPATH=clients/python:build/clients/python \
        /usr/bin/python3 bench/engines/bench_sglang_backend.py [--build-dir build]
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory
from types import SimpleNamespace

from kvfence.enginekit import buffer_address
from kvfence.sglang import KVArgs, KVBootstrapServer, KVManager, KVPoll, KVReceiver, KVSender


def wait_file(path, lines, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            parts = open(path).read().split("\n")
            if len(parts) > lines:
                return [p.strip() for p in parts[:lines]]
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise SystemExit("%s not written" % path)


def cluster(build, tmp, staging):
    procs = []
    log = open(os.path.join(tmp, "cluster.log"), "wb")
    procs.append(subprocess.Popen([os.path.join(build, "controlplane/kvfence-control"), "--listen",
                                   "127.0.0.1:0", "--port-file", tmp + "/c.port"],
                                  stdout=log, stderr=log))
    addr = "127.0.0.1:" + wait_file(tmp + "/c.port", 1)[0]
    socks = {}
    for n in ("n1", "n2"):
        socks[n] = "%s/%s.sock" % (tmp, n)
        procs.append(subprocess.Popen([os.path.join(build, "dataplane/kvfence-node"), "--control",
                                       addr, "--node-id", n, "--local-socket", socks[n],
                                       "--port-file", "%s/%s.port" % (tmp, n), "--data-host",
                                       "127.0.0.1", "--data-port", "0", "--staging", staging],
                                      stdout=log, stderr=log))
        wait_file("%s/%s.port" % (tmp, n), 2)
    return addr, socks, procs


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page-bytes", type=int, default=16384)
    ap.add_argument("--staging", default="host", help="the nodes' --staging (host or cuda)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvf-bench-sgl-")
    addr, socks, procs = cluster(a.build_dir, tmp, a.staging)
    nbuf, npages = 2 * a.layers, 4 * a.pages
    shms, mgrs = [], {}
    boot = KVBootstrapServer("127.0.0.1", 0)
    try:
        for mode, node in (("prefill", "n1"), ("decode", "n2")):
            mine = [shared_memory.SharedMemory(name="kvf-bench-sgl-%d-%s-%d" %
                                               (os.getpid(), mode, b), create=True,
                                               size=npages * a.page_bytes)
                    for b in range(nbuf)]
            shms.extend(mine)
            args = KVArgs()
            args.engine_rank = 0
            args.kv_data_ptrs = [buffer_address(m.buf) for m in mine]
            args.kv_data_lens = [npages * a.page_bytes] * nbuf
            args.kv_item_lens = [a.page_bytes] * nbuf
            args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
            mgrs[mode] = KVManager(args, mode, SimpleNamespace(
                kvfence_control=addr, kvfence_node_id=node, kvfence_node_socket=socks[node],
                disaggregation_bootstrap_port=boot.port))
        chunk = -(-a.pages // a.chunks)
        pages = list(range(0, 2 * a.pages, 2))  # scattered: every other page

        def one(room, abort):
            recv = KVReceiver(mgrs["decode"], boot.address, room)
            recv.init(0)
            send = KVSender(mgrs["prefill"], boot.address, room, [0], 0)
            t0 = time.perf_counter()
            t_abort = None
            sent = 0
            metadata = False
            while True:
                rp, sp = recv.poll(), send.poll()
                if rp == KVPoll.WaitingForInput and not metadata:
                    recv.send_metadata(pages)
                    metadata = True
                if sp == KVPoll.WaitingForInput and sent == 0:
                    send.init(len(pages))
                if sp in (KVPoll.WaitingForInput, KVPoll.Transferring) and sent < len(pages) \
                        and t_abort is None:
                    send.send(pages[sent:sent + chunk])
                    sent += chunk
                    if abort:
                        t_abort = time.perf_counter()
                        recv.abort()
                if rp in (KVPoll.Success, KVPoll.Failed) and sp in (KVPoll.Success,
                                                                    KVPoll.Failed):
                    want = KVPoll.Failed if abort else KVPoll.Success
                    assert rp == sp == want, (room, rp, sp)
                    recv.clear()
                    send.clear()
                    return time.perf_counter() - (t_abort if abort else t0)
                time.sleep(0.001)

        ok = [one(1000 + i, False) for i in range(a.requests)]
        ab = [one(100000 + i, True) for i in range(a.requests)]
        mb = a.pages * nbuf * a.page_bytes / 1e6
        print("kvfence.sglang, %d requests of %d pages x %d buffers x %d B (%.1f MB) in %d chunks"
              % (a.requests, a.pages, nbuf, a.page_bytes, mb, a.chunks))
        print("  request, init -> both Success: p50 %.1f ms  p99 %.1f ms" %
              (pct(ok, 0.5) * 1e3, pct(ok, 0.99) * 1e3))
        print("  abort after chunk 1, abort() -> both Failed: p50 %.1f ms  p99 %.1f ms" %
              (pct(ab, 0.5) * 1e3, pct(ab, 0.99) * 1e3))
    finally:
        for m in mgrs.values():
            m.close()
        boot.close()
        for s in shms:
            s.close()
            s.unlink()
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
