#!/usr/bin/python3
"""bench_release.py: how late a Python engine learns that a lease is
RELEASED when its process is busy, against the C client in the same run.

It starts a real kvfence-control and two real kvfence-node processes (n1,
n2) on 127.0.0.1, one POSIX shm pool per node, and then, in this one Python
process:

  - `--engines` (16) engine threads, each in a loop: join a room (source on
    n1, sink on n2, its own pages), some Python work (`--work-ms`), AbortRoom
    (timestamped just before the call), more Python work; a page slot is
    reused only once its two leases were released;
  - `--cpu-threads` (2) threads that only burn CPU in Python;
  - one kvfence.ReleaseWatcher (every lease) whose callback timestamps each
    release: the Python figure.

Beside it runs c_release_watch (bench/python/c_release_watch.c: libkvfence's
kvf_watch_leases on its own C thread, the same filter), which timestamps the
same releases: the C figure. Both clocks are CLOCK_MONOTONIC, so for every
lease: latency = receipt - abort call. The first `--warmup` seconds are left
out. Prints one JSON object (p50/p90/p99/max per client, their ratio) and a
line for bench/README.md.

    PYTHONPATH=clients/python:build/clients/python /usr/bin/python3 \\
        bench/python/bench_release.py --build build [--duration 20]

The watcher implementation measured is whatever `kvfence` PYTHONPATH gives
(the benchmark only uses the public API), so the same script measures the
old and the new client. Exits 1 when a call fails or a release is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from typing import Dict, List, Optional

import grpc

import kvfence
from kvfence import Participant, Role

PAGE_SIZE = 4096
PAGES_PER_ROOM = 4
SLOTS = 4  # page slots per engine: a slot waits for its two leases' release


class Daemon:
    """A child process with its log file; ready() reads its port file."""

    def __init__(self, name: str, args: List[str], workdir: str) -> None:
        self.name = name
        self.log_path = os.path.join(workdir, name + ".log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_file(self, path: str, lines: int, timeout: float = 15.0) -> List[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(path, encoding="utf-8") as f:
                    parts = f.read().split("\n")
            except FileNotFoundError:
                parts = []
            if len(parts) > lines and all(p.strip() for p in parts[:lines]):
                return [p.strip() for p in parts[:lines]]
            if self.proc.poll() is not None:
                raise SystemExit("%s exited (%d); log %s" % (self.name, self.proc.returncode,
                                                            self.log_path))
            time.sleep(0.01)
        raise SystemExit("%s wrote no %s; log %s" % (self.name, path, self.log_path))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.returncode != 0:
            print("%s exited with %d; log %s" % (self.name, self.proc.returncode, self.log_path),
                  file=sys.stderr)


def pct(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(xs: List[float]) -> Dict[str, float]:
    return {"n": len(xs), "p50_ms": round(pct(xs, 0.50), 2), "p90_ms": round(pct(xs, 0.90), 2),
            "p99_ms": round(pct(xs, 0.99), 2), "max_ms": round(max(xs) if xs else 0.0, 2)}


def burn(ms: float) -> None:
    """Python work holding the GIL (as an engine's scheduler does)."""
    end = time.perf_counter() + ms / 1000.0
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="the CMake build directory")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds left out at the start")
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--work-ms", type=float, default=1.0,
                    help="Python work of an engine before and after each abort")
    ap.add_argument("--plain-channel", action="store_true",
                    help="give the client a channel made with grpcio's defaults")
    ap.add_argument("--shared-watch-channel", action="store_true",
                    help="the watcher reads on the engines' channel (own_channel=False)")
    ap.add_argument("--backend", default="grpc", choices=("grpc", "libkvfence"),
                    help="ReleaseWatcher backend (libkvfence: set KVFENCE_LIBRARY)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this process (seconds; Python's default 0.005)")
    ap.add_argument("--keep", action="store_true", help="keep the daemons' logs")
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)

    control_bin = os.path.join(a.build, "controlplane", "kvfence-control")
    node_bin = os.path.join(a.build, "dataplane", "kvfence-node")
    cwatch_bin = os.path.join(a.build, "bench", "python", "c_release_watch")
    for b in (control_bin, node_bin, cwatch_bin):
        if not os.access(b, os.X_OK):
            raise SystemExit("%s: not built (ninja -C %s)" % (b, a.build))

    workdir = tempfile.mkdtemp(prefix="kvf-bench-py-")
    daemons: List[Daemon] = []
    pools: Dict[str, shared_memory.SharedMemory] = {}
    page_count = a.engines * SLOTS * PAGES_PER_ROOM
    cwatch: Optional[subprocess.Popen] = None
    ok = False
    try:
        port_file = os.path.join(workdir, "control.port")
        cp = Daemon("control", [control_bin, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                "--metrics-listen", "127.0.0.1:0", "--threads", "2"], workdir)
        daemons.append(cp)
        (port,) = cp.wait_file(port_file, 1)
        address = "127.0.0.1:%s" % port
        for nid in ("n1", "n2"):
            sock = os.path.join(workdir, nid + ".sock")
            d = Daemon(nid, [node_bin, "--control", address, "--node-id", nid, "--local-socket",
                             sock, "--port-file", os.path.join(workdir, nid + ".port"),
                             "--data-host", "127.0.0.1", "--data-port", "0"], workdir)
            daemons.append(d)
        pool_ids: Dict[str, int] = {}
        for d in daemons[1:]:
            d.wait_file(os.path.join(workdir, d.name + ".port"), 2)
            shm = shared_memory.SharedMemory(name="kvf-bench-py-%d-%s" % (os.getpid(), d.name),
                                             create=True, size=PAGE_SIZE * page_count)
            pools[d.name] = shm
            with kvfence.NodeClient("unix:" + os.path.join(workdir, d.name + ".sock")) as nc:
                pool_ids[d.name] = nc.register_pool_shm(shm.name, PAGE_SIZE, page_count).pool_id

        c_out = open(os.path.join(workdir, "c_watch.out"), "w+b")
        cwatch = subprocess.Popen([cwatch_bin, address, ""], stdin=subprocess.PIPE,
                                  stdout=c_out, stderr=open(os.path.join(workdir, "c_watch.log"),
                                                            "wb"))
        # --plain-channel: a channel made here (grpcio's default stream path),
        # as an engine that passes its own channel gets.
        ctl = kvfence.ControlClient(channel=grpc.insecure_channel(address)) if a.plain_channel \
            else kvfence.ControlClient(address)
        py_seen: Dict[int, int] = {}

        def on_released(lease: kvfence.Lease) -> None:
            py_seen[lease.lease_id] = time.monotonic_ns()

        kw = {"own_channel": False} if a.shared_watch_channel else {}
        if a.backend != "grpc":
            kw["backend"] = a.backend
        watcher = ctl.release_watcher(on_released, **kw).start(10.0)
        deadline = time.monotonic() + 10
        while b"synced" not in open(c_out.name, "rb").read():
            if time.monotonic() > deadline or cwatch.poll() is not None:
                raise SystemExit("c_release_watch did not sync")
            time.sleep(0.01)

        stop = threading.Event()
        abort_at: Dict[int, int] = {}  # lease_id -> monotonic ns just before AbortRoom
        errors: List[str] = []
        rooms = [0]

        def engine(i: int) -> None:
            slots: List[List[int]] = [[] for _ in range(SLOTS)]
            n = 0
            try:
                while not stop.is_set():
                    s = n % SLOTS
                    n += 1
                    for lid in slots[s]:
                        watcher.wait(lid, 30.0)
                    first = (i * SLOTS + s) * PAGES_PER_ROOM
                    room_id = (i + 1) * 1000000 + n
                    ja = ctl.join_room(room_id, Participant("n1", 0, Role.SOURCE), pool_ids["n1"],
                                       [(first, PAGES_PER_ROOM)], retry_s=5.0)
                    jb = ctl.join_room(room_id, Participant("n2", 0, Role.SINK), pool_ids["n2"],
                                       [(first, PAGES_PER_ROOM)], retry_s=5.0)
                    burn(a.work_ms)
                    t = time.monotonic_ns()
                    ctl.abort_room(ja.room, "bench")
                    abort_at[ja.lease_id] = abort_at[jb.lease_id] = t
                    slots[s] = [ja.lease_id, jb.lease_id]
                    rooms[0] += 1
                    burn(a.work_ms)
            except Exception as e:  # report, and stop the run
                errors.append("engine %d: %r" % (i, e))
                stop.set()

        def cpu_hog() -> None:
            x = 0
            while not stop.is_set():
                for i in range(1000):
                    x += i * i

        threads = [threading.Thread(target=engine, args=(i,), daemon=True)
                   for i in range(a.engines)]
        threads += [threading.Thread(target=cpu_hog, daemon=True) for _ in range(a.cpu_threads)]
        t0 = time.monotonic_ns()
        for t in threads:
            t.start()
        stop.wait(a.duration)
        stop.set()
        for t in threads:
            t.join(60)
        if errors:
            raise SystemExit("; ".join(errors))
        # Let the last releases arrive.
        want = set(abort_at)
        deadline = time.monotonic() + 30
        while not want <= set(py_seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        watcher.stop()
        cwatch.stdin.close()
        if cwatch.wait(10) != 0:
            raise SystemExit("c_release_watch exited with %d" % cwatch.returncode)
        c_seen: Dict[int, int] = {}
        with open(c_out.name, encoding="utf-8") as f:
            for line in f:
                p = line.split()
                if p and p[0] == "released":
                    c_seen[int(p[1])] = int(p[2])
        missing_py = sorted(want - set(py_seen))
        missing_c = sorted(want - set(c_seen))
        if missing_py or missing_c:
            raise SystemExit("releases missing: python %s, C %s" %
                             (missing_py[:10], missing_c[:10]))
        start = t0 + int(a.warmup * 1e9)
        py_ms = [(py_seen[l] - t) / 1e6 for l, t in abort_at.items() if t >= start]
        c_ms = [(c_seen[l] - t) / 1e6 for l, t in abort_at.items() if t >= start]
        py, c = summary(py_ms), summary(c_ms)
        out = {"python": py, "c": c, "rooms": rooms[0], "engines": a.engines,
               "cpu_threads": a.cpu_threads, "work_ms": a.work_ms, "duration_s": a.duration,
               "watcher": type(watcher).__module__ + "." + type(watcher).__name__,
               "backend": a.backend, "switch_interval_s": sys.getswitchinterval(),
               "plain_channel": a.plain_channel, "shared_watch_channel": a.shared_watch_channel,
               "p99_ratio": round(py["p99_ms"] / c["p99_ms"], 2) if c["p99_ms"] else None,
               "p50_ratio": round(py["p50_ms"] / c["p50_ms"], 2) if c["p50_ms"] else None}
        print(json.dumps(out))
        print("| %s | %d | %.1f / %.1f | %.1f / %.1f | %.2f |" %
              (time.strftime("%Y-%m-%d"), py["n"], py["p50_ms"], py["p99_ms"], c["p50_ms"],
               c["p99_ms"], out["p99_ratio"] or 0))
        ctl.close()
        ok = True
        return 0
    finally:
        if cwatch is not None and cwatch.poll() is None:
            cwatch.kill()
            cwatch.wait()
        for d in reversed(daemons):
            d.stop()
        for shm in pools.values():
            shm.close()
            shm.unlink()
        if ok and not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print("logs in %s" % workdir, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
