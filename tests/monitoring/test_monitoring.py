#!/usr/bin/env python3
"""The monitoring files (deploy/monitoring/) against promtool and the daemons.

    test_monitoring.py rules   REPO
        promtool check rules and promtool test rules on kvfence-rules.yaml,
        every alert of the file fires in at least one test case, and the
        chart's copy (deploy/helm/kvfence/files/) is identical.
    test_monitoring.py live    REPO KVFENCE_CONTROL KVFENCE_NODE
        starts a kvfence-control (with a data dir: the WAL families too) and a
        kvfence-node on 127.0.0.1, each with --metrics-listen 127.0.0.1:0,
        makes two calls (so the RPC families have series), scrapes both
        /metrics and checks: `promtool check metrics` accepts each
        (exit 0); the node exports every family docs/metrics.md promises, both
        export kvfence_build_info and process_*; every metric an expression of
        the dashboard or of the rules names is a series one of them exports.

Fails with a message when promtool is missing (the configure requires it).
The daemons die with this process (PR_SET_PDEATHSIG) and are stopped with
SIGTERM at the end, where each must exit 0; everything lives in a temporary
directory.
"""
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import yaml

WAIT_S = 15

NODE_FAMILIES = [
    "kvfence_node_bytes_total",
    "kvfence_node_frames_total",
    "kvfence_node_ops_in_flight",
    "kvfence_node_chunk_latency_seconds",
    "kvfence_node_chunks_total",
    "kvfence_node_frames_refused_total",
    "kvfence_node_frames_late_total",
    "kvfence_node_peers_fenced_total",
    "kvfence_node_self_fences_total",
    "kvfence_node_pools",
    "kvfence_node_rooms",
    "kvfence_node_session_connected",
]
EVERY_DAEMON = [
    "kvfence_build_info",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
]
# Words of PromQL that look like metric names.
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def promtool():
    p = shutil.which("promtool")
    if not p:  # the configure requires it (cmake/KvfDependencies.cmake)
        print("promtool not found (Debian package prometheus, scripts/install-deps.sh)")
        sys.exit(1)
    return p


def metric_names(expr):
    """The metric names an expression selects (functions, label matchers,
    grouping labels, durations and strings left out)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)         # strings
    e = re.sub(r"\{[^}]*\}", "", e)                        # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                       # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if rest.startswith("("):
            continue                                       # a function
        if word.lower() in PROMQL_WORDS or re.fullmatch(r"\d.*", word):
            continue
        names.add(word)
    return names


def rule_file_exprs(path):
    doc = yaml.safe_load(open(path))
    return [(r.get("alert") or r.get("record"), r["expr"])
            for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs(path):
    d = json.load(open(path))
    out = []

    def walk(panels):
        for p in panels:
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            targets = p.get("targets") or []
            if not targets:
                fail(f"dashboard panel '{p.get('title')}' has no query")
            for t in targets:
                if not t.get("expr"):
                    fail(f"dashboard panel '{p.get('title')}' has a target without expr")
                out.append((p.get("title"), t["expr"]))
    walk(d["panels"])
    for v in d.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        m = re.match(r"label_values\(([^,)]+)", q or "")
        if m:
            out.append((f"variable {v['name']}", m.group(1)))
    return out


# ---- rules ------------------------------------------------------------------------

def check_rules(repo):
    tool = promtool()
    mon = os.path.join(repo, "deploy", "monitoring")
    rules = os.path.join(mon, "kvfence-rules.yaml")
    tests = os.path.join(mon, "kvfence-rules.test.yaml")
    for args in (["check", "rules", rules], ["test", "rules", tests]):
        r = subprocess.run([tool, *args], cwd=mon, capture_output=True, text=True)
        print(f"== promtool {' '.join(args[:2])}: exit {r.returncode}")
        if r.returncode != 0:
            fail(f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}")
    alerts = {name for name, _ in rule_file_exprs(rules)}
    fired = set()
    for tc in yaml.safe_load(open(tests))["tests"]:
        for a in tc.get("alert_rule_test", []):
            if a.get("exp_alerts"):
                fired.add(a["alertname"])
    missing = sorted(alerts - fired)
    if missing:
        fail(f"alerts no test case fires: {missing}")
    print(f"rules: {len(alerts)} alerts, each fired by a promtool test case")
    copy = os.path.join(repo, "deploy", "helm", "kvfence", "files", "kvfence-rules.yaml")
    if open(copy, "rb").read() != open(rules, "rb").read():
        fail(f"{copy} differs from {rules}: copy the rules into the chart")
    print("rules: the chart's copy is identical")


# ---- live daemons ---------------------------------------------------------------------

def pdeathsig():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def wait_file(path, proc, what):
    end = time.time() + WAIT_S
    while time.time() < end:
        if proc.poll() is not None:
            fail(f"{what} exited early ({proc.returncode}); its log: {proc.log_path}\n"
                 + open(proc.log_path).read()[-3000:])
        try:
            with open(path) as f:
                first = f.readline().strip()
            if first:
                return int(first)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    fail(f"{what}: no {path} after {WAIT_S}s")


def start(argv, log_path):
    log = open(log_path, "w")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pdeathsig)
    p.log_path = log_path
    return p


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        if r.status != 200:
            fail(f"GET /metrics on {port}: {r.status}")
        return r.read().decode()


def series_names(text):
    names, families = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0))
    return names, families


def check_live(repo, control_bin, node_bin):
    tool = promtool()
    work = tempfile.mkdtemp(prefix="kvf-monitoring-")
    procs = []
    try:
        cp = start([control_bin, "--listen", "127.0.0.1:0", "--port-file", f"{work}/cp.port",
                    "--data-dir", f"{work}/data", "--metrics-listen", "127.0.0.1:0",
                    "--metrics-port-file", f"{work}/cp.mport"], f"{work}/control.log")
        procs.append(cp)
        cport = wait_file(f"{work}/cp.port", cp, "kvfence-control")
        cmport = wait_file(f"{work}/cp.mport", cp, "kvfence-control")
        node = start([node_bin, "--control", f"127.0.0.1:{cport}", "--node-id", "mon-1",
                      "--local-socket", f"{work}/node.sock", "--port-file", f"{work}/node.port",
                      "--data-host", "127.0.0.1", "--data-port", "0",
                      "--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                      f"{work}/node.mport"], f"{work}/node.log")
        procs.append(node)
        nmport = wait_file(f"{work}/node.mport", node, "kvfence-node")
        wait_file(f"{work}/node.port", node, "kvfence-node (welcomed)")
        # Two finished calls, so that the RPC families have series too: one
        # served (Admin.Ping, an empty request) and one unknown method.
        with grpc.insecure_channel(f"127.0.0.1:{cport}") as ch:
            ch.unary_unary("/kvfence.v1.Admin/Ping")(b"", timeout=5)
            try:
                ch.unary_unary("/kvfence.v1.Admin/NoSuchMethod")(b"", timeout=5)
                fail("an unknown method answered OK")
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    fail(f"unknown method: {e.code()}")

        texts = {"kvfence-control": scrape(cmport), "kvfence-node": scrape(nmport)}
        exported = set()
        for who, text in texts.items():
            path = os.path.join(work, f"{who}.metrics")
            with open(path, "w") as f:
                f.write(text)
            with open(path) as f:
                r = subprocess.run([tool, "check", "metrics"], stdin=f, capture_output=True,
                                   text=True)
            print(f"== promtool check metrics < {who} /metrics: exit {r.returncode}")
            if r.returncode != 0:
                fail(f"promtool check metrics on {who}'s /metrics (exit {r.returncode}):\n"
                     f"{r.stdout}{r.stderr}")
            names, families = series_names(text)
            exported |= names
            for fam in EVERY_DAEMON:
                if fam not in families:
                    fail(f"{who} does not export {fam}")
            if who == "kvfence-control":
                for fam in ("kvfence_rpc_requests_total", "kvfence_rpc_latency_seconds",
                            "kvfence_wal_fsync_latency_seconds", "kvfence_rooms"):
                    if fam not in families:
                        fail(f"kvfence-control does not export {fam}")
            if who == "kvfence-node":
                for fam in NODE_FAMILIES:
                    if fam not in families:
                        fail(f"kvfence-node does not export {fam}")
        checked = 0
        sources = [("dashboard", os.path.join(repo, "deploy/monitoring/kvfence-dashboard.json"),
                    dashboard_exprs),
                   ("rules", os.path.join(repo, "deploy/monitoring/kvfence-rules.yaml"),
                    rule_file_exprs)]
        for what, path, reader in sources:
            for where, expr in reader(path):
                names = metric_names(expr)
                if not names:
                    fail(f"{what} '{where}': no metric in {expr!r}")
                for n in sorted(names):
                    checked += 1
                    if n not in exported:
                        fail(f"{what} '{where}': {n} is exported by neither daemon ({expr})")
        print(f"live: both /metrics pass promtool; {checked} metric names of the dashboard and "
              f"the rules are exported")
        # Both daemons stop cleanly on SIGTERM (the node first: its session ends).
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                fail(f"{p.args[0]} did not exit within 20 s of SIGTERM")
            if rc != 0:
                fail(f"{p.args[0]} exited {rc} on SIGTERM; its log:\n"
                     + open(p.log_path).read()[-3000:])
        print("live: both daemons exited 0 on SIGTERM")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "rules":
        check_rules(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "live":
        check_live(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
