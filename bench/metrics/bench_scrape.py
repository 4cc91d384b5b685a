#!/usr/bin/env python3
"""Scrape cost of kvfence-node's /metrics (docs/metrics.md, "Cost").

    bench/metrics/bench_scrape.py [BUILD_DIR, default build] [GETs, default 300]

Starts a kvfence-control (memory only) and one kvfence-node on 127.0.0.1 with
--metrics-listen 127.0.0.1:0, GETs the node's /metrics that many times one
after the other (each a new HTTP/1.1 connection, as Prometheus's first scrape)
and prints the body size and the median / p90 time of a GET. Both daemons get
SIGTERM at the end. Everything lives in a temporary directory.
"""
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def wait_port(path):
    for _ in range(300):
        try:
            with open(path) as f:
                v = f.readline().strip()
            if v:
                return int(v)
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    sys.exit(f"no {path}")


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    w = tempfile.mkdtemp(prefix="kvf-scrape-")
    procs = []
    try:
        cp = subprocess.Popen([f"{build}/controlplane/kvfence-control", "--listen", "127.0.0.1:0",
                               "--port-file", f"{w}/cp.port", "--metrics-listen", ""],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(cp)
        port = wait_port(f"{w}/cp.port")
        node = subprocess.Popen([f"{build}/dataplane/kvfence-node", "--control",
                                 f"127.0.0.1:{port}", "--node-id", "scrape-1", "--local-socket",
                                 f"{w}/n.sock", "--port-file", f"{w}/n.port", "--metrics-listen",
                                 "127.0.0.1:0", "--metrics-port-file", f"{w}/n.mport"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(node)
        mport = wait_port(f"{w}/n.mport")
        wait_port(f"{w}/n.port")
        times, body = [], b""
        for _ in range(n):
            t = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
                body = r.read()
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"node /metrics: {len(body)} bytes, {body.count(10)} lines; GET median "
              f"{statistics.median(times) * 1e3:.2f} ms, p90 {times[int(0.9 * n)] * 1e3:.2f} ms "
              f"({n} GETs)")
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=20)
        shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    main()
