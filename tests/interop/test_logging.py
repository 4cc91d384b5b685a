"""The log of both daemons (docs/logging.md): one JSON schema on stderr and a
--log-level that comes from the command line, the environment or the config
file, like every other setting.

Each test starts its own real processes on 127.0.0.1 and stops them with
SIGTERM; every wait has a deadline.
"""

import json
import os
import signal
import subprocess
import time

from kvf_harness import ControlProcess

LEVELS = ("debug", "info", "warn", "error")
WAIT_S = 15.0


def parse_log(text):
    """Every stderr line as a dict; fails on a line that is not a JSON object
    in the schema (ts, level, proc, msg first, in that order)."""
    records = []
    for line in text.splitlines():
        rec = json.loads(line)
        assert isinstance(rec, dict), line
        keys = list(rec)
        assert keys[:4] == ["ts", "level", "proc", "msg"], line
        assert set(keys) <= {"ts", "level", "proc", "msg", "room", "node", "incarnation"}, line
        assert rec["level"] in LEVELS, line
        assert len(rec["ts"]) == 24 and rec["ts"].endswith("Z"), line
        records.append(rec)
    return records


def run_control(control_bin, tmp_path, name, args=(), env_extra=None):
    """Starts kvfence-control, waits until it serves, stops it with SIGTERM;
    returns its stderr parsed."""
    p = ControlProcess(control_bin, tmp_path, tmp_path / (name + "-data"), name, args)
    if env_extra:
        saved = dict(os.environ)
        os.environ.update(env_extra)
        try:
            p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    else:
        p.start()
    try:
        p.wait_serving()
    finally:
        rc = p.terminate()
    assert rc == 0, p.stderr_tail()
    return parse_log(p.stderr_text())


def test_control_lines_follow_the_schema(control_bin, tmp_path):
    recs = run_control(control_bin, tmp_path, "default")
    assert recs, "no log lines"
    assert all(r["proc"] == "kvfence-control" for r in recs)
    levels = {r["level"] for r in recs}
    assert "info" in levels and "debug" not in levels
    assert any("serving on 127.0.0.1:0" in r["msg"] for r in recs if r["level"] == "info")


def test_control_log_level_from_the_command_line(control_bin, tmp_path):
    recs = run_control(control_bin, tmp_path, "warn", ["--log-level", "warn"])
    assert recs, "the warnings (no mutual TLS) are missing"
    assert {r["level"] for r in recs} <= {"warn", "error"}
    assert any(r["msg"].startswith("INSECURE") for r in recs)


def test_control_log_level_from_the_config_file_and_environment(control_bin, tmp_path):
    conf = tmp_path / "control.conf"
    conf.write_text("# quiet\nlog-level = error\n")
    recs = run_control(control_bin, tmp_path, "conf", ["--config", str(conf)])
    assert recs == []  # nothing went wrong, and warnings are below error
    recs = run_control(control_bin, tmp_path, "env", env_extra={"KVF_CONTROL_LOG_LEVEL": "error"})
    assert recs == []
    # The command line wins over the environment.
    recs = run_control(control_bin, tmp_path, "both", ["--log-level", "info"],
                       env_extra={"KVF_CONTROL_LOG_LEVEL": "error"})
    assert any(r["level"] == "info" for r in recs)


def test_a_bad_log_level_stops_both_daemons(control_bin, node_bin, tmp_path):
    for binary, args in [(control_bin, ["--listen", "127.0.0.1:0"]),
                         (node_bin, ["--control", "127.0.0.1:1", "--rdma", "off",
                                     "--local-socket", str(tmp_path / "n.sock")])]:
        r = subprocess.run([binary] + args + ["--log-level", "loud"], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=WAIT_S)
        assert r.returncode == 2, r.stderr
        assert b"--log-level: 'loud' is not debug, info, warn or error" in r.stderr
    r = subprocess.run([node_bin, "--help"], capture_output=True, timeout=WAIT_S)
    assert r.returncode == 0 and b"--log-level" in r.stdout


def _run_node(node_bin, address, tmp_path, name, args=()):
    """Starts kvfence-node against `address`, waits for its port file (written
    after the control plane welcomed it), stops it with SIGTERM; returns its
    stderr parsed."""
    port_file = tmp_path / (name + ".port")
    err_path = tmp_path / (name + ".stderr")
    with open(str(err_path), "wb") as err:
        p = subprocess.Popen(
            [node_bin, "--control", address, "--node-id", name,
             "--local-socket", str(tmp_path / (name + ".sock")), "--port-file", str(port_file),
             "--data-host", "127.0.0.1", "--data-port", "0", "--rdma", "off",
             "--drain-timeout-ms", "2000"] + list(args),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + WAIT_S
        while not (port_file.exists() and port_file.read_text().endswith("\n")):
            assert p.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, "no port file:\n" + err_path.read_text()
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    assert rc == 0, err_path.read_text()
    return parse_log(err_path.read_text())


def test_node_lines_follow_the_schema_and_the_level(control_bin, node_bin, tmp_path):
    control = ControlProcess(control_bin, tmp_path, tmp_path / "data", "control",
                             ["--log-level", "error"])
    control.start()
    try:
        address = control.wait_serving()
        recs = _run_node(node_bin, address, tmp_path, "n1")
        assert recs and all(r["proc"] == "kvfence-node" for r in recs)
        assert any(r["level"] == "info" for r in recs)
        recs = _run_node(node_bin, address, tmp_path, "n2", ["--log-level", "warn"])
        assert all(r["level"] in ("warn", "error") for r in recs)
    finally:
        assert control.terminate() == 0, control.stderr_tail()
