"""Engine stand-in processes for the backend tests (tests/standins/): start
one, send it JSON commands, wait for its requests to end."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STANDINS = os.path.join(HERE, "standins")
START_TIMEOUT_S = 15.0


class EngineProc:
    def __init__(self, script, args, workdir, name):
        self.name = name
        self.log_path = os.path.join(str(workdir), name + ".log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([STANDINS] + env.get("PYTHONPATH", "").split(os.pathsep))
        self.proc = subprocess.Popen([sys.executable, os.path.join(STANDINS, script)] + args,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True, bufsize=1)
        self.ready = self._read(START_TIMEOUT_S)
        self.pid = self.proc.pid

    def _read(self, timeout):
        import select
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("%s: no reply within %.0f s; log:\n%s" %
                                     (self.name, timeout, self.log()))
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    raise AssertionError("%s exited (%s); log:\n%s" %
                                         (self.name, self.proc.poll(), self.log()))
                return json.loads(line)

    def log(self):
        try:
            with open(self.log_path, "r", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def call(self, op, timeout=10.0, **kw):
        kw["op"] = op
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        rep = self._read(timeout)
        if "error" in rep:
            raise AssertionError("%s: %s failed: %s\n%s" % (self.name, op, rep["error"],
                                                           rep.get("trace", "")))
        return rep

    def status(self):
        return self.call("status")

    def wait(self, pred, timeout=10.0, what="condition"):
        """Polls status() until pred(status) is true; the status."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError("%s: %s not reached in %.0f s: %s\nlog:\n%s" %
                                     (self.name, what, timeout, json.dumps(st, indent=1),
                                      self.log()))
            time.sleep(0.02)

    def wait_outcome(self, room, timeout=10.0):
        st = self.wait(lambda s: (s["requests"].get(str(room)) or {}).get("outcome"), timeout,
                       "an outcome of room %d" % room)
        return st["requests"][str(room)]

    def kill(self, sig=signal.SIGKILL):
        os.kill(self.proc.pid, sig)

    def close(self):
        """quit (or kill when it does not answer); unlinks shm a killed one left."""
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=10.0)
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        for p in glob.glob("/dev/shm/kvf-*-%d-*" % self.proc.pid):
            try:
                os.unlink(p)
            except OSError:
                pass
        self._log.close()
        return self.proc.returncode
