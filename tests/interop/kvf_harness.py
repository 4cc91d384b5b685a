"""Helpers of the durability tests: a kvfence-control process that can be
stopped, killed and restarted on one data directory, and a fake node that
speaks NodeSession.Attach.

Nothing here starts anything by itself; test_durability.py owns the lifetimes
(its fixture kills whatever a failed test left running).
"""

import json
import os
import queue
import signal
import subprocess
import threading
import time

import grpc

from kvfence.v1 import control_pb2, control_pb2_grpc, node_pb2, node_pb2_grpc, types_pb2

RPC_TIMEOUT_S = 5.0
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
CAPS = types_pb2.CapabilitySet(protocol_min=1, protocol_max=1, features=["QUIESCE_V1"])


def read_port(path):
    """(port, complete) from a port file; port is None while absent or partial."""
    try:
        with open(path, "r", encoding="ascii") as f:
            text = f.read()
    except (FileNotFoundError, UnicodeDecodeError):
        return None, False
    stripped = text.strip()
    if not stripped.isdigit() or not 0 < int(stripped) < 65536:
        return None, False
    return int(stripped), text.endswith("\n")


class ControlProcess:
    """One run of kvfence-control on 127.0.0.1:0 with --data-dir.

    stdout and stderr go to separate files under `workdir`, one pair per run
    (`name`), so each restart's log can be read on its own.
    """

    def __init__(self, binary, workdir, data_dir, name, extra_args=()):
        self.binary = binary
        self.data_dir = str(data_dir)
        self.port_file = os.path.join(str(workdir), name + ".port")
        self.stderr_path = os.path.join(str(workdir), name + ".stderr")
        self.stdout_path = os.path.join(str(workdir), name + ".stdout")
        self.args = [
            binary,
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            self.port_file,
            "--data-dir",
            self.data_dir,
        ] + [str(a) for a in extra_args]
        self.proc = None
        self.address = None
        self._channels = []

    # ---- lifetime ---------------------------------------------------------

    def start(self):
        """Starts the process; does not wait for it (see wait_serving)."""
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        # The metrics HTTP server defaults to the fixed port 9464: pick one
        # instead, so parallel runs do not clash (and log no error). Set
        # through the environment, which a binary without metrics ignores.
        env = dict(os.environ, KVF_CONTROL_METRICS_LISTEN="127.0.0.1:0")
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env
            )
        return self

    def wait_serving(self, timeout=START_TIMEOUT_S):
        """Waits for the port file; returns the address. Raises AssertionError
        (with the log) if the process exits first or the time runs out."""
        deadline = time.monotonic() + timeout
        previous = None
        while time.monotonic() < deadline:
            seen, complete = read_port(self.port_file)
            if seen is not None and (complete or seen == previous):
                self.address = "127.0.0.1:%d" % seen
                return self.address
            previous = seen
            if self.proc.poll() is not None:
                raise AssertionError(
                    "kvfence-control exited with %d before writing its port:\n%s"
                    % (self.proc.returncode, self.stderr_tail())
                )
            time.sleep(0.02)
        raise AssertionError(
            "kvfence-control wrote no port within %.0f s:\n%s" % (timeout, self.stderr_tail())
        )

    def wait_exit(self, timeout):
        """The exit status, or None if it is still running after `timeout`."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM and wait; returns the exit status (killed and -9 if it hangs)."""
        self.close_channels()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            rc = self.wait_exit(timeout)
            if rc is None:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(
                    "kvfence-control did not exit within %.0f s of SIGTERM (killed):\n%s"
                    % (timeout, self.stderr_tail())
                )
        return self.proc.returncode

    def kill9(self, close_channels=True):
        """SIGKILL, like a power cut for the process (not for the page cache).
        close_channels=False leaves the channels to clients still calling
        (they see UNAVAILABLE); close_channels() them once they are done."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if close_channels:
            self.close_channels()

    def cleanup(self):
        """Kills the process if it still runs (teardown of a failed test)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close_channels()

    # ---- clients ----------------------------------------------------------

    def channel(self):
        """A new channel to the server, ready to use; closed with the process."""
        assert self.address is not None, "wait_serving() first"
        ch = grpc.insecure_channel(self.address)
        self._channels.append(ch)
        grpc.channel_ready_future(ch).result(timeout=RPC_TIMEOUT_S)
        return ch

    def close_channels(self):
        for ch in self._channels:
            ch.close()
        self._channels = []

    # ---- logs -------------------------------------------------------------

    def stderr_text(self):
        try:
            with open(self.stderr_path, "r", encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stderr_tail(self, limit=4000):
        return self.stderr_text()[-limit:] or "<empty stderr>"

    def log_records(self):
        """Every log line on stderr as a dict (JSON lines; any other line as
        {"level": "?", "msg": line})."""
        out = []
        for line in self.stderr_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            out.append(rec if isinstance(rec, dict) else {"level": "?", "msg": line})
        return out

    def log_messages(self):
        """The `msg` of every log line on stderr."""
        return [str(r.get("msg", "")) for r in self.log_records()]

    def log_errors(self):
        """The `msg` of every log line of level "error"."""
        return [str(r.get("msg", "")) for r in self.log_records() if r.get("level") == "error"]


class FakeNode:
    """A node session over NodeSession.Attach: Hello first, then whatever the
    test sends. Messages from the control plane are collected by a reader
    thread; a stream error ends up in the same queue."""

    def __init__(self, channel, node_id, incarnation=1, page_count=1 << 20, auto_drain=False):
        """auto_drain: answer every AbortNotice with Drained at once (a node
        with nothing in flight), from the reader thread."""
        self.node_id = node_id
        self.incarnation = incarnation
        self.auto_drain = auto_drain
        self._requests = queue.Queue()
        self._received = queue.Queue()
        self._requests.put(
            node_pb2.NodeMessage(
                hello=node_pb2.Hello(
                    node_id=node_id,
                    incarnation=incarnation,
                    capabilities=CAPS,
                    pools=[types_pb2.Pool(pool_id=1, page_size=4096, page_count=page_count)],
                )
            )
        )
        self.call = node_pb2_grpc.NodeSessionStub(channel).Attach(self._outgoing())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _outgoing(self):
        while True:
            msg = self._requests.get()
            if msg is None:
                return
            yield msg

    def _read(self):
        try:
            for msg in self.call:
                if msg.WhichOneof("msg") == "room_update":
                    # As a real node does once it applied the update: the
                    # control plane tells the room's other nodes this node's
                    # members only after it (node.proto RoomUpdateAck).
                    u = msg.room_update
                    self.send(
                        room_update_ack=node_pb2.RoomUpdateAck(room=u.room, version=u.version)
                    )
                if self.auto_drain and msg.WhichOneof("msg") == "abort_notice":
                    n = msg.abort_notice
                    self.send(
                        drained=node_pb2.Drained(room=n.room, token=n.token, notice_id=n.notice_id)
                    )
                self._received.put(msg)
        except grpc.RpcError as e:
            self._received.put(e)
        self._received.put(None)

    def send(self, **fields):
        self._requests.put(node_pb2.NodeMessage(**fields))

    def recv(self, kind, timeout=RPC_TIMEOUT_S):
        """The next message of `kind` (a NodeMessage oneof name, e.g.
        "abort_notice"); others are skipped. Raises AssertionError on timeout
        or when the stream ends."""
        deadline = time.monotonic() + timeout
        skipped = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    "%s: no %s within %.1f s (got %s)" % (self.node_id, kind, timeout, skipped)
                )
            try:
                msg = self._received.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None or isinstance(msg, grpc.RpcError):
                raise AssertionError(
                    "%s: stream ended while waiting for %s: %r" % (self.node_id, kind, msg)
                )
            which = msg.WhichOneof("msg")
            if which == kind:
                return getattr(msg, which)
            skipped.append(which)

    def close(self):
        """Ends the session at once (cancel), as a node process exit would."""
        self._requests.put(None)
        self.call.cancel()
        self._reader.join(timeout=RPC_TIMEOUT_S)


def join_request(room_id, node_id, role, first, count=1, expected_sources=1, expected_sinks=1):
    return control_pb2.JoinRoomRequest(
        room_id=room_id,
        expected_sources=expected_sources,
        expected_sinks=expected_sinks,
        participant=types_pb2.Participant(node_id=node_id, rank=0, role=role),
        engine_capabilities=CAPS,
        pool_id=1,
        ranges=[types_pb2.PageRange(first=first, count=count)],
    )


def control(channel):
    return control_pb2_grpc.ControlStub(channel)


def admin(channel):
    return control_pb2_grpc.AdminStub(channel)


def token_of(msg):
    """An AbortToken as a comparable tuple."""
    return (msg.hi, msg.lo)
