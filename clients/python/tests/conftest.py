"""Fixtures of the Python client tests: a real kvfence-control and two real
kvfence-node processes (n1, n2) per test, with one POSIX shm pool per node.

KVF_CONTROL_BIN and KVF_NODE_BIN name the binaries (ctest sets them);
PYTHONPATH holds clients/python and the build directory with kvfence/_proto.
Teardown stops every process with SIGTERM and fails the test unless each
exits 0; the shm objects are unlinked.
"""
import os
import signal
import subprocess
import time
from multiprocessing import shared_memory

import pytest

import kvfence

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
PAGE_SIZE = 4096
PAGE_COUNT = 64
FAKE_DEVICE_PREFIX = "/kvf-pyfdev-"


def _log_tail(path, limit=3000):
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return "<no log>"


def _binary(var):
    path = os.environ.get(var)
    if not path:
        pytest.skip("%s is not set" % var)
    if not os.access(path, os.X_OK):
        pytest.fail("%s=%s is not an executable file" % (var, path))
    return path


class Proc:
    """A child process with its log; `ready` reads its port file."""

    def __init__(self, name, args, workdir):
        self.name = name
        self.log_path = os.path.join(str(workdir), name + ".log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_file(self, path, lines):
        """The first `lines` lines of `path` once complete (written by rename or
        ending with a newline)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with open(path, "r", encoding="utf-8") as f:
                    text = f.read()
            except FileNotFoundError:
                text = ""
            parts = text.split("\n")
            if len(parts) > lines and all(p.strip() for p in parts[:lines]):
                return [p.strip() for p in parts[:lines]]
            if self.proc.poll() is not None:
                pytest.fail("%s exited with %d before writing %s:\n%s" %
                            (self.name, self.proc.returncode, path, _log_tail(self.log_path)))
            time.sleep(0.01)
        pytest.fail("%s wrote no %s within %.0f s:\n%s" %
                    (self.name, path, START_TIMEOUT_S, _log_tail(self.log_path)))

    def stop(self):
        """SIGTERM; the exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # in case a test left it stopped
            except ProcessLookupError:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._log.close()
                return None
        self._log.close()
        return self.proc.returncode


class ShmPool:
    """A POSIX shm object of PAGE_COUNT pages, filled with a canary pattern."""

    def __init__(self, tag, seed):
        self.shm = shared_memory.SharedMemory(
            name="kvf-py-%d-%s-%d" % (os.getpid(), tag, time.monotonic_ns() % 1000000),
            create=True, size=PAGE_SIZE * PAGE_COUNT)
        self.page_size = PAGE_SIZE
        self.page_count = PAGE_COUNT
        self.seed = seed
        self.buf = self.shm.buf
        self.buf[:] = canary(seed, 0, PAGE_COUNT)
        self.pool_id = 0

    @property
    def name(self):
        return "/" + self.shm.name  # the shm_open name the node needs

    def page(self, i):
        return bytes(self.buf[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])

    def close(self):
        self.buf = None
        self.shm.close()
        self.shm.unlink()


def canary(seed, first, count):
    """Bytes of pages [first, first+count) of a pool filled with `seed`."""
    out = bytearray()
    for pg in range(first, first + count):
        b = (pg * 31 + seed) & 0xFF
        out += bytes(((b + i * 7) & 0xFF for i in range(256))) * (PAGE_SIZE // 256)
    return bytes(out)


class Cluster:
    def __init__(self, control, address, nodes, pools, workdir):
        self.control_proc = control
        self.address = address
        self.nodes = nodes  # node_id -> (Proc, socket path)
        self.pools = pools  # node_id -> ShmPool
        self.workdir = workdir
        self._clients = []

    def socket(self, node_id):
        return self.nodes[node_id][1]

    def node_pid(self, node_id):
        return self.nodes[node_id][0].proc.pid

    def control(self, **kw):
        c = kvfence.ControlClient(self.address, **kw)
        self._clients.append(c)
        return c

    def admin(self):
        c = kvfence.AdminClient(self.address)
        self._clients.append(c)
        return c

    def node(self, node_id):
        c = kvfence.NodeClient("unix:" + self.socket(node_id))
        self._clients.append(c)
        return c

    def set_faults(self, node_id, text, timeout=10.0):
        """Writes the node's fault file (docs/node.md, "Fault injection")
        atomically and waits until the node logged that it loaded it."""
        proc = self.nodes[node_id][0]
        log = lambda: open(proc.log_path, "rb").read().count(b"fault: config loaded")
        before = log()
        path = os.path.join(str(self.workdir), node_id + ".faults")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.rename(path + ".tmp", path)
        deadline = time.monotonic() + timeout
        while log() <= before:
            if time.monotonic() > deadline:
                pytest.fail("%s did not load its fault file %r:\n%s" %
                            (node_id, text, _log_tail(proc.log_path)))
            time.sleep(0.005)

    def close_clients(self):
        for c in self._clients:
            c.close()
        self._clients = []


def pytest_configure(config):
    config.addinivalue_line("markers", "control_args(*args): more kvfence-control arguments "
                            "for the test's cluster")
    config.addinivalue_line("markers", "node_args(*args): more kvfence-node arguments for "
                            "both nodes of the test's cluster")


@pytest.fixture
def cluster(tmp_path, request):
    """kvfence-control + kvfence-node n1 and n2, each node with a registered
    shm pool (seed 1 on n1, seed 0xa5 on n2). A test marked
    @pytest.mark.control_args("--flag", "value") adds control plane arguments,
    @pytest.mark.node_args(...) node arguments (both nodes)."""
    marker = request.node.get_closest_marker("control_args")
    extra = [str(a) for a in marker.args] if marker else []
    nmarker = request.node.get_closest_marker("node_args")
    node_extra = [str(a) for a in nmarker.args] if nmarker else []
    control_bin = _binary("KVF_CONTROL_BIN")
    node_bin = _binary("KVF_NODE_BIN")
    procs = []
    pools = {}
    cl = None
    failures = []
    try:
        port_file = str(tmp_path / "control.port")
        cp = Proc("control", [control_bin, "--listen", "127.0.0.1:0", "--port-file", port_file,
                              "--metrics-listen", "127.0.0.1:0", "--threads", "2",
                              "--resend-ms", "50", "--node-ttl-ms", "3000"] + extra, tmp_path)
        procs.append(cp)
        (port,) = cp.wait_file(port_file, 1)
        address = "127.0.0.1:%s" % port
        nodes = {}
        for nid in ("n1", "n2"):
            sock = str(tmp_path / (nid + ".sock"))
            pf = str(tmp_path / (nid + ".port"))
            p = Proc(nid, [node_bin, "--control", address, "--node-id", nid, "--local-socket",
                           sock, "--port-file", pf, "--data-host", "127.0.0.1", "--data-port", "0",
                           "--drain-timeout-ms", "3000",
                           # FakeDeviceBuffer objects named under it are fake device
                           # pools (test_pools.py); ShmPool names are not.
                           "--test-fake-device-pools", FAKE_DEVICE_PREFIX,
                           # No faults while the file is absent (Cluster.set_faults).
                           "--fault-file", str(tmp_path / (nid + ".faults"))] + node_extra,
                     tmp_path)
            procs.append(p)
            nodes[nid] = (p, sock)
        for nid, (p, sock) in nodes.items():
            _, written_sock = p.wait_file(str(tmp_path / (nid + ".port")), 2)
            assert written_sock == sock
        for nid, seed in (("n1", 1), ("n2", 0xA5)):
            pools[nid] = ShmPool(nid, seed)
        cl = Cluster(cp, address, nodes, pools, tmp_path)
        for nid, pool in pools.items():
            with kvfence.NodeClient("unix:" + cl.socket(nid)) as nc:
                pool.pool_id = nc.register_pool_shm(pool.name, PAGE_SIZE, PAGE_COUNT).pool_id
        yield cl
    finally:
        if cl is not None:
            cl.close_clients()
        for p in reversed(procs):  # nodes first, then the control plane
            rc = p.stop()
            if rc != 0:
                failures.append("%s exited with %s on SIGTERM:\n%s" %
                                (p.name, rc, _log_tail(p.log_path)))
        for pool in pools.values():
            pool.close()
    if failures:
        pytest.fail("\n".join(failures))
