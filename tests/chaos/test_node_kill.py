"""kill -9 and SIGSTOP of a kvfence-node mid-transfer, with canary pages
(issue 14, chaos part 4; issue 12's release rule).

A real kvfence-control (short node ttl and heartbeat timeout) and two real
kvfence-node processes: n1 hosts the source pool, n2 the sink pool, both
POSIX shm objects of the test filled with canary patterns
(clients/python/examples/demo.py's Pool). One room moves PAGES pages from n1
to n2 in 2-page chunks on one pipelined SubmitChunks stream; the last chunk is
never sent, so the room cannot complete. After a random number of admitted
chunks one node (the victim) is killed with SIGKILL, or paused with SIGSTOP,
while the stream still submits.

The rule checked (docs/state-cores.md, "Pages on host H are released only on
a proof from H"): the survivor's lease is RELEASED only after the victim is
LOST and the survivor fenced it (logged before it reports); the victim's own
lease stays RELEASING with awaiting_host_proof (checked for HOLD_S past the
survivor's release: no timer releases it) until a proof from the victim's
host: for SIGKILL a restarted kvfence-node with the same node id and local
socket, which takes the host lock and witnesses the dead incarnation in its
Hello; for SIGSTOP the SIGCONT, after which the resumed node self-fences,
drains and sends its Witness. Canaries: no page outside the room's lease ever
changes (sink pool) and no source page changes at all; the sink pages are
re-armed as soon as the sink lease is RELEASED, and nothing writes them
afterwards (checked SETTLE_S after the last release).

KVF_CHAOS_NODE_ROUNDS rounds per kill case (default 1) and
KVF_CHAOS_PAUSED_ATTEMPTS per pause case (default 2), each on a fresh
cluster; every round and attempt must keep the rule.
"""

import os
import random
import signal
import statistics
import subprocess
import threading
import time

import pytest

import kvfence
from kvfence import ChunkRequest, LeaseState, NodeState, Participant, Role, RoomState
from demo import Pool, Stats

from conftest import env_int, figure

ROUNDS = env_int("KVF_CHAOS_NODE_ROUNDS", 1)
PAUSED_ATTEMPTS = env_int("KVF_CHAOS_PAUSED_ATTEMPTS", 2)
PAGE_SIZE = 65536
POOL_PAGES = 256
PAGES = 128  # source pages 0..127 -> sink pages SINK_FIRST..SINK_FIRST+127
SINK_FIRST = 64
CHUNK = 2
SETTLE_S = 1.5
HOLD_S = 1.5  # the victim's lease must stay RELEASING this long past the survivor's release
WAIT_S = 20.0
CONTROL_ARGS = ["--threads", "2", "--node-ttl-ms", "1500", "--heartbeat-timeout-ms", "2500",
                "--resend-ms", "50", "--metrics-listen", ""]
RESULTS = {}


def _tail(path, limit=3000):
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return "<no log>"


class Proc:
    def __init__(self, name, args, workdir):
        self.name = name
        self.log_path = os.path.join(str(workdir), name + ".log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait_lines(self, path, lines, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(path, "r", encoding="utf-8") as f:
                    parts = f.read().split("\n")
            except FileNotFoundError:
                parts = []
            if len(parts) > lines and all(p.strip() for p in parts[:lines]):
                return [p.strip() for p in parts[:lines]]
            if self.proc.poll() is not None:
                raise AssertionError("%s exited with %d:\n%s" % (
                    self.name, self.proc.returncode, _tail(self.log_path)))
            time.sleep(0.01)
        raise AssertionError("%s wrote no %s:\n%s" % (self.name, path, _tail(self.log_path)))

    def log(self):
        return _tail(self.log_path, 1 << 20)

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self):
        """SIGCONT + SIGTERM, SIGKILL after 10 s; the exit status."""
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Cluster:
    """kvfence-control, n1 and n2 with one canary pool each. close() stops
    every process and unlinks the pools, whatever state the test left."""

    def __init__(self, control_bin, node_bin, workdir):
        self.fault_file = str(workdir / "n1.faults")  # n1's --fault-file (off while absent)
        # n1's --test-local-hold-file: same-node copies wait while it exists
        self.hold_file = str(workdir / "n1.hold")
        self.workdir = workdir
        self.procs = {}
        self.retired = []  # processes replaced by restart()
        self.node_args = {}
        self.socks = {}
        self.pools = {}
        self.clients = []
        self.stats = Stats()
        port_file = str(workdir / "control.port")
        cp = self._start("control", [control_bin, "--listen", "127.0.0.1:0", "--port-file",
                                     port_file] + CONTROL_ARGS, workdir)
        (port,) = cp.wait_lines(port_file, 1)
        self.address = "127.0.0.1:%s" % port
        for nid in ("n1", "n2"):
            pf = str(workdir / (nid + ".port"))
            self.socks[nid] = str(workdir / (nid + ".sock"))
            self.node_args[nid] = ([node_bin, "--control", self.address, "--node-id", nid,
                                    "--local-socket", self.socks[nid], "--port-file", pf,
                                    "--data-host", "127.0.0.1", "--data-port", "0",
                                    "--drain-timeout-ms", "3000"]
                                   + (["--fault-file", self.fault_file, "--test-local-hold-file",
                                       self.hold_file] if nid == "n1" else []))
            self._start(nid, self.node_args[nid], workdir)
        for nid in ("n1", "n2"):
            self.procs[nid].wait_lines(str(workdir / (nid + ".port")), 2)
            self.pools[nid] = Pool(self.stats, "chaos-%s" % nid, self.node(nid), 0, PAGE_SIZE,
                                   POOL_PAGES)
        self.ctl = self.client(kvfence.ControlClient(self.address))
        self.admin = self.client(kvfence.AdminClient(self.address))

    def _start(self, name, args, workdir, log_name=None):
        self.procs[name] = Proc(log_name or name, args, workdir)
        return self.procs[name]

    def restart(self, nid):
        """A new kvfence-node process for `nid` (same node id, local socket
        and so host lock) once the old one is dead; waits for its port file."""
        old = self.procs[nid]
        assert old.proc.poll() is not None or old.proc.wait(timeout=10) is not None
        self.retired.append(old)
        pf = str(self.workdir / (nid + ".port"))
        os.unlink(pf)
        new = self._start(nid, self.node_args[nid], self.workdir, nid + "-restarted")
        new.wait_lines(pf, 2)
        return new

    def set_faults(self, text):
        """n1's fault file, written atomically (docs/node.md: fault injection)."""
        with open(self.fault_file + ".tmp", "w", encoding="ascii") as f:
            f.write(text)
        os.rename(self.fault_file + ".tmp", self.fault_file)

    def client(self, c):
        self.clients.append(c)
        return c

    def node(self, nid):
        return self.client(kvfence.NodeClient("unix:" + self.socks[nid]))

    def close(self):
        """Idempotent."""
        for c in self.clients:
            c.close()
        self.clients = []
        for name in ("n1", "n2", "control"):
            if name in self.procs:
                self.procs[name].stop()
        for p in self.retired:
            p.stop()
        for p in self.pools.values():
            p.close()
        self.pools = {}


@pytest.fixture
def cluster_factory(control_bin, node_bin, tmp_path):
    made = []

    def make(tag):
        d = tmp_path / tag
        d.mkdir()
        c = Cluster(control_bin, node_bin, d)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _pattern(room_id, j):
    unit = ("room %d page %d " % (room_id, j)).encode()
    return (unit * (PAGE_SIZE // len(unit) + 1))[:PAGE_SIZE]


def _sink_outside():
    return [pg for pg in range(POOL_PAGES) if not SINK_FIRST <= pg < SINK_FIRST + PAGES]


def _check_pages_after(cl, room_id, src, snk, rearmed, violations):
    """After the settle time: the released sink pages (re-armed with canaries
    at the release) unwritten, the sink's pages outside the lease and the
    source pool unchanged; appends what is wrong, with the load's problems, to
    `violations`. Returns the sink pages written after the release."""
    late = 0
    if "t" in rearmed:
        late = snk.check_canary(list(range(SINK_FIRST, SINK_FIRST + PAGES)),
                                "%.1f s after the sink lease was RELEASED (re-armed %s)" % (
                                    time.monotonic() - rearmed["t"], rearmed["when"]))
    if late:
        violations.append("%d sink pages written after the sink lease was RELEASED" % late)
    if snk.check_canary(_sink_outside(), "at the end"):
        violations.append("sink pages outside the lease changed")
    changed = [j for j in range(POOL_PAGES)
               if src.read(j) != (_pattern(room_id, j) if j < PAGES else src.canary(j))]
    if changed:
        violations.append("source pages changed: %s" % changed[:8])
    violations.extend(cl.stats.problems)
    return late


def _lease(info, nid):
    return [p.lease for p in info.participants if p.participant.node_id == nid][0]


def submit_until_hit(cl, rng, room, src, snk, sink_node, sink_rank):
    """Streams every chunk of the room from n1's source rank 0 to the sink on
    a thread; returns once 1 to 8 of them were admitted (the moment a test
    hits the node): the list of their answers, the thread, the stream and
    how many were admitted before the hit."""
    admitted = []
    hit_after = rng.randint(1, 8)
    hit = threading.Event()
    reqs = (ChunkRequest(room, seq, 0, src.pool_id, [(j, CHUNK)], sink_node, sink_rank,
                         snk.pool_id, [(SINK_FIRST + j, CHUNK)], last_chunk=False)
            for seq, j in enumerate(range(0, PAGES - CHUNK, CHUNK), start=1))
    stream = cl.node("n1").submit_chunks(reqs, window=16)

    def submit():
        try:
            for r in stream:
                admitted.append(r.ok)
                if len(admitted) == hit_after:
                    hit.set()
        except kvfence.KvfenceError:
            pass
        hit.set()

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    assert hit.wait(WAIT_S), "no chunk admitted"
    return admitted, submitter, stream, hit_after


def _run_round(cl, room_id, victim, sig, rng):
    """One transfer with `victim` hit by `sig` mid-way, then the proof from
    its host (SIGKILL: a restarted node; SIGSTOP: SIGCONT). Returns the
    figures and `violations`, the broken rules in the order seen (the round
    goes on after one, so that an early release shows what it lets happen)."""
    src, snk = cl.pools["n1"], cl.pools["n2"]
    survivor = "n2" if victim == "n1" else "n1"
    violations = []
    for j in range(PAGES):
        src.write(j, _pattern(room_id, j))
    a = cl.ctl.join_room(room_id, Participant("n1", 0, Role.SOURCE), src.pool_id, [(0, PAGES)],
                         expected_sources=1, expected_sinks=1, retry_s=5.0)
    b = cl.ctl.join_room(room_id, Participant("n2", 0, Role.SINK), snk.pool_id,
                         [(SINK_FIRST, PAGES)], expected_sources=1, expected_sinks=1,
                         retry_s=5.0)
    cl.admin.wait_room_state(a.room, RoomState.ACTIVE, WAIT_S)
    lease_of = {"n1": a.lease_id, "n2": b.lease_id}
    role = {a.lease_id: "source", b.lease_id: "sink"}
    victim_lease, survivor_lease = lease_of[victim], lease_of[survivor]
    incarnation0 = cl.admin.node(victim).incarnation

    # The release watcher takes the evidence at the instant each release arrives.
    proof = {}
    released = {lid: threading.Event() for lid in role}
    watch = cl.ctl.watch_leases(lease_ids=sorted(role))

    def follow():
        try:
            for ev in watch:
                if isinstance(ev, kvfence.LeaseReleased) and ev.lease.lease_id in role:
                    t = time.monotonic()
                    info = cl.admin.room(a.room)
                    proof[ev.lease.lease_id] = {
                        "t": t, "victim": cl.admin.node(victim),
                        "fenced": "fenced peer %s" % victim in cl.procs[survivor].log(),
                        "room_state": info.state, "other": _lease(info, victim if
                                                                  ev.lease.lease_id ==
                                                                  survivor_lease else survivor),
                    }
                    released[ev.lease.lease_id].set()
                    if len(proof) == len(role):
                        return
        except kvfence.KvfenceError:
            pass

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()

    if sig == signal.SIGSTOP:
        # Frames wait at the source (hold) until the victim is paused: a paused
        # sink gets them into its socket buffer, unread; a paused source holds
        # them and posts them when it resumes.
        cl.set_faults("hold=1\n")
        deadline = time.monotonic() + WAIT_S
        while "fault: config loaded" not in cl.procs["n1"].log():
            assert time.monotonic() < deadline, cl.procs["n1"].log()[-2000:]
            time.sleep(0.01)
    admitted, submitter, stream, hit_after = submit_until_hit(cl, rng, a.room, src, snk, "n2", 0)
    t_hit = time.monotonic()
    cl.procs[victim].kill(sig)
    if sig == signal.SIGSTOP:
        time.sleep(0.1)
        cl.set_faults("hold=0\n")  # a paused n1 reads it only when it resumes
        time.sleep(0.3)
    # Outside the lease nothing moves, at any time.
    snk.check_canary(_sink_outside(), "right after the %s of %s" % (sig.name, victim))

    rearmed = {}

    def rearm_sink_if_released(when):
        """Once the sink lease is RELEASED its pages are the engine's: re-arm
        them (once); nothing may write them afterwards."""
        if "t" in rearmed or not released[b.lease_id].is_set():
            return
        rearmed["landed"] = sum(1 for j in range(PAGES)
                                if snk.read(SINK_FIRST + j) == _pattern(room_id, j))
        for pg in range(SINK_FIRST, SINK_FIRST + PAGES):
            snk.write(pg, snk.canary(pg))
        rearmed["t"] = time.monotonic()
        rearmed["when"] = when

    # 1. The survivor's lease: released once the victim is LOST and fenced.
    if not released[survivor_lease].wait(WAIT_S + 10):
        stream.cancel()
        watch.cancel()
        raise AssertionError("%s lease %d not released: room %s\n%s" % (
            role[survivor_lease], survivor_lease, cl.admin.room(a.room),
            cl.procs[survivor].log()[-3000:]))
    p = proof[survivor_lease]
    t_lost = p["t"]
    what = "%s (survivor) lease %d" % (role[survivor_lease], survivor_lease)
    if p["victim"].state != NodeState.LOST:
        violations.append("%s released while %s is %s" % (what, victim, p["victim"].state))
    if not p["fenced"]:
        violations.append("%s released before %s fenced %s" % (what, survivor, victim))
    if p["room_state"] != RoomState.ABORTED:
        violations.append("%s released in a room %s" % (what, p["room_state"]))
    rearm_sink_if_released("at the survivor's release")
    stream.cancel()

    # 2. The victim's lease waits for its host: RELEASING, awaiting_host_proof,
    # counted in the stats, for HOLD_S; no timer releases it.
    what = "%s (victim) lease %d" % (role[victim_lease], victim_lease)
    polls = 0
    lease_pages = range(SINK_FIRST, SINK_FIRST + PAGES)
    stable = [snk.read(pg) for pg in lease_pages] if victim == "n2" else None
    while True:
        if released[victim_lease].is_set():
            violations.append("%s RELEASED at %+.3f s from the survivor's, %s still %s "
                              "(no proof from its host)" % (
                                  what, proof[victim_lease]["t"] - t_lost, victim,
                                  "paused" if sig == signal.SIGSTOP else "dead, not restarted"))
            break
        lv = _lease(cl.admin.room(a.room), victim)
        n_awaiting = cl.admin.stats().get("leases_awaiting_host_proof", 0)
        polls += 1
        if lv.state != LeaseState.RELEASING or not lv.awaiting_host_proof or n_awaiting != 1:
            violations.append("%s is %s awaiting_host_proof=%s (stats: %d awaiting) %.3f s past "
                              "the survivor's release" % (what, lv.state.name,
                                                          lv.awaiting_host_proof, n_awaiting,
                                                          time.monotonic() - t_lost))
            break
        if time.monotonic() - t_lost >= HOLD_S:
            break
        time.sleep(0.1)
    if victim == "n2":  # dead or paused: nothing may move its pages
        moved = [pg for pg, old in zip(lease_pages, stable) if snk.read(pg) != old]
        if moved:
            violations.append("sink pages %s changed while their node was %s" % (
                moved[:8], "paused" if sig == signal.SIGSTOP else "dead"))
    rearm_sink_if_released("while the victim waited")  # only after an early release

    # 3. The proof from the victim's host.
    landed_before_proof = (sum(1 for j in range(PAGES)
                               if snk.read(SINK_FIRST + j) == _pattern(room_id, j))
                           if victim == "n2" else None)  # a source victim's sink is re-armed
    t_proof = time.monotonic()
    if sig == signal.SIGKILL:
        cl.restart(victim)
        proof_log = "host lock %s.lock taken" % cl.socks[victim]
    else:
        cl.procs[victim].kill(signal.SIGCONT)
        proof_log = "witness: incarnation"
    if not released[victim_lease].wait(WAIT_S):
        violations.append("%s not released %.0f s after the proof: room %s" % (
            what, WAIT_S, cl.admin.room(a.room)))
    else:
        p = proof[victim_lease]
        if p["t"] < t_proof:
            pass  # reported above
        elif p["room_state"] != RoomState.ABORTED:
            violations.append("%s released in a room %s" % (what, p["room_state"]))
        if sig == signal.SIGKILL and p["t"] >= t_proof and not (
                p["victim"].incarnation > incarnation0):
            violations.append("%s released with %s at incarnation %d (was %d)" % (
                what, victim, p["victim"].incarnation, incarnation0))
    follower.join(5)
    watch.cancel()
    submitter.join(5)
    rearm_sink_if_released("after the proof")
    vlog = cl.procs[victim].log()
    proof_kind = ("witness" if "witness: incarnation" in vlog else "drained") \
        if sig == signal.SIGSTOP else "hello"
    # A paused source posts its held frames when it resumes (after the sink's
    # fence): they must not land.
    posted_on_resume = vlog.count("fault: release frame") if victim == "n1" else None
    if sig == signal.SIGKILL and proof_log not in vlog:
        violations.append("the restarted %s did not log %r" % (victim, proof_log))

    # 4. Nothing writes the released sink pages, nothing outside ever, no source page.
    time.sleep(SETTLE_S)
    late = _check_pages_after(cl, room_id, src, snk, rearmed, violations)
    t_victim = proof[victim_lease]["t"] if victim_lease in proof else None
    return {"admitted_before_hit": hit_after, "pages_landed": rearmed.get("landed"),
            "pages_landed_before_proof": landed_before_proof,
            "frames_posted_on_resume": posted_on_resume,
            "late_pages": late, "violations": violations, "hold_polls": polls,
            "proof": proof_kind,
            "survivor_released_s_after_hit": round(t_lost - t_hit, 3),
            # None when it was released without (before) the proof
            "victim_released_s_after_proof": (round(t_victim - t_proof, 3)
                                              if t_victim is not None and t_victim >= t_proof
                                              else None),
            "victim_waited_s": (round(t_victim - t_lost, 3) if t_victim is not None else None)}


def _run_same_host(cl, room_id, rng):
    """One same-node copy (source rank 0 and sink rank 1 both on n1, the local
    transport) with n1 paused while copies are held in flight
    (--test-local-hold-file), then the room aborted and the hold lifted while
    n1 is still stopped, so that the resumed node finds runnable copies at
    once. n1 is the room's only node: no peer can fence it, so nothing but a
    proof from n1 itself (Drained or Witness after SIGCONT) may release either
    lease; both stay RELEASING, awaiting_host_proof once n1 is LOST. The sink
    pages are re-armed at the sink lease's release and nothing may write them
    afterwards. Returns the figures and the violations, in the order seen."""
    src = cl.pools["n1"]
    snk = cl.pools["n1-sink"] = Pool(cl.stats, "chaos-n1-sink", cl.node("n1"), 1, PAGE_SIZE,
                                     POOL_PAGES)
    violations = []
    for j in range(PAGES):
        src.write(j, _pattern(room_id, j))
    a = cl.ctl.join_room(room_id, Participant("n1", 0, Role.SOURCE), src.pool_id, [(0, PAGES)],
                         expected_sources=1, expected_sinks=1, retry_s=5.0)
    b = cl.ctl.join_room(room_id, Participant("n1", 1, Role.SINK), snk.pool_id,
                         [(SINK_FIRST, PAGES)], expected_sources=1, expected_sinks=1,
                         retry_s=5.0)
    cl.admin.wait_room_state(a.room, RoomState.ACTIVE, WAIT_S)
    role = {a.lease_id: "source", b.lease_id: "sink"}

    def lease_by_id(info, lid):
        return [p.lease for p in info.participants if p.lease.lease_id == lid][0]

    released = {lid: threading.Event() for lid in role}
    t_release = {}
    watch = cl.ctl.watch_leases(lease_ids=sorted(role))

    def follow():
        try:
            for ev in watch:
                if isinstance(ev, kvfence.LeaseReleased) and ev.lease.lease_id in role:
                    t_release[ev.lease.lease_id] = time.monotonic()
                    released[ev.lease.lease_id].set()
                    if len(t_release) == len(role):
                        return
        except kvfence.KvfenceError:
            pass

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()

    # Hold the copies: every chunk is admitted and its copy queued, not run.
    with open(cl.hold_file, "w", encoding="ascii"):
        pass
    queued_file = cl.hold_file + ".queued"
    admitted, submitter, stream, hit_after = submit_until_hit(cl, rng, a.room, src, snk, "n1", 1)
    deadline = time.monotonic() + WAIT_S
    queued = 0
    while queued < 1:
        assert time.monotonic() < deadline, "no copy held:\n" + cl.procs["n1"].log()[-2000:]
        try:
            with open(queued_file, "r", encoding="ascii") as f:
                queued = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    t_stop = time.monotonic()
    cl.procs["n1"].kill(signal.SIGSTOP)
    stream.cancel()
    # Copies queued at the stop (the held count the node wrote last).
    with open(queued_file, "r", encoding="ascii") as f:
        queued = int(f.read().strip() or 0)
    os.unlink(cl.hold_file)  # a paused n1 sees it only when it resumes: its copies may run
    ab = cl.ctl.abort_room(a.room, "chaos: n1 paused mid-copy")
    lease_pages = range(SINK_FIRST, SINK_FIRST + PAGES)
    stable = [snk.read(pg) for pg in lease_pages]
    snk.check_canary(_sink_outside(), "right after the SIGSTOP of n1")

    rearmed = {}

    def rearm_sink_if_released(when):
        if "t" in rearmed or not released[b.lease_id].is_set():
            return
        rearmed["landed"] = sum(1 for j in range(PAGES)
                                if snk.read(SINK_FIRST + j) == _pattern(room_id, j))
        for pg in lease_pages:
            snk.write(pg, snk.canary(pg))
        rearmed["t"] = time.monotonic()
        rearmed["when"] = when

    # 1. While n1 is paused: no lease is released; once n1 is LOST both wait
    # for a proof from it (awaiting_host_proof, counted in the stats) for HOLD_S.
    t_lost = None
    polls = 0
    deadline = time.monotonic() + WAIT_S + 10
    while True:
        early = [lid for lid in role if released[lid].is_set()]
        if early:
            violations.append("%s lease RELEASED %.3f s after the SIGSTOP, n1 still paused (no "
                              "proof from its host)" % (
                                  role[early[0]], t_release[early[0]] - t_stop))
            break
        now = time.monotonic()
        if t_lost is None:
            if cl.admin.node("n1").state == NodeState.LOST:
                t_lost = now
            elif now > deadline:
                violations.append("n1 not LOST %.0f s after its SIGSTOP" % (now - t_stop))
                break
        else:
            info = cl.admin.room(a.room)
            n_awaiting = cl.admin.stats().get("leases_awaiting_host_proof", 0)
            polls += 1
            bad = [(role[lid], lease_by_id(info, lid)) for lid in role
                   if lease_by_id(info, lid).state != LeaseState.RELEASING
                   or not lease_by_id(info, lid).awaiting_host_proof]
            if bad or n_awaiting != 2:
                violations.append("with n1 LOST and paused: %s (stats: %d awaiting) %.3f s past "
                                  "LOST" % ("; ".join("%s lease %s awaiting_host_proof=%s" % (
                                      r, lv.state.name, lv.awaiting_host_proof)
                                      for r, lv in bad) or "leases held", n_awaiting,
                                      now - t_lost))
                break
            if now - t_lost >= HOLD_S:
                break
        time.sleep(0.1)
    moved = [pg for pg, old in zip(lease_pages, stable) if snk.read(pg) != old]
    if moved:
        violations.append("sink pages %s changed while n1 was paused" % moved[:8])
    rearm_sink_if_released("while n1 was paused")  # only after an early release

    # 2. The proof: SIGCONT; the resumed node drains or self-fences.
    t_proof = time.monotonic()
    cl.procs["n1"].kill(signal.SIGCONT)
    for lid in role:
        if not released[lid].wait(WAIT_S):
            violations.append("%s lease not released %.0f s after the SIGCONT: room %s" % (
                role[lid], WAIT_S, cl.admin.room(a.room)))
    follower.join(5)
    watch.cancel()
    submitter.join(5)
    rearm_sink_if_released("after the SIGCONT")
    if cl.admin.room(a.room).state != RoomState.ABORTED:
        violations.append("room %s after the proof" % cl.admin.room(a.room).state)
    nlog = cl.procs["n1"].log()
    proof_kind = "witness" if "witness: incarnation" in nlog else "drained"

    # 3. Nothing writes the released sink pages, nothing outside ever, no source page.
    time.sleep(SETTLE_S)
    late = _check_pages_after(cl, room_id, src, snk, rearmed, violations)
    t_last = max(t_release.values()) if len(t_release) == len(role) else None
    return {"admitted_before_hit": hit_after, "copies_held_at_stop": queued,
            "abort_state": ab.state.name, "pages_landed": rearmed.get("landed"),
            "late_pages": late, "violations": violations, "hold_polls": polls, "proof": proof_kind,
            "lost_s_after_stop": round(t_lost - t_stop, 3) if t_lost is not None else None,
            "victim_released_s_after_proof": (round(t_last - t_proof, 3)
                                              if t_last is not None and t_last >= t_proof
                                              else None),
            "victim_waited_s": (round(t_last - t_lost, 3)
                                if t_last is not None and t_lost is not None else None)}


def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _figures(key, runs, n_key, t0=None, load0=None):
    """The figures of one case; with t0 (its start, monotonic) and load0
    (os.getloadavg() then) also its wall time and the load around it."""
    RESULTS[key] = {
        n_key: len(runs),
        "rounds_with_violations": sum(1 for r in runs if r["violations"]),
        "late_pages": [r["late_pages"] for r in runs],
        "late_pages_total": sum(r["late_pages"] for r in runs),
        "pages_landed": [r["pages_landed"] for r in runs],
        "proof": sorted(set(r["proof"] for r in runs)),
        "victim_released_s_after_proof": _stats([r["victim_released_s_after_proof"]
                                                 for r in runs]),
        "victim_waited_s": _stats([r["victim_waited_s"] for r in runs]),
        "first_violations": [r["violations"][:2] for r in runs if r["violations"]][:2]}
    for k in ("pages_landed_before_proof", "copies_held_at_stop"):
        if any(k in r for r in runs):
            RESULTS[key][k] = [r.get(k) for r in runs]
    for k in ("survivor_released_s_after_hit", "lost_s_after_stop", "attempt_s"):
        if any(k in r for r in runs):
            RESULTS[key][k] = _stats([r.get(k) for r in runs])
    if t0 is not None:
        RESULTS[key]["wall_s"] = round(time.monotonic() - t0, 1)
        RESULTS[key]["loadavg_1m_start_end"] = [round(load0[0], 2),
                                                round(os.getloadavg()[0], 2)]
    figure("node_kill", RESULTS)


def _check(runs):
    bad = ["%s %d: %s" % ("attempt", i, "; ".join(r["violations"][:3]))
           for i, r in enumerate(runs) if r["violations"]]
    assert not bad, "%d of %d broke the rule:\n%s" % (len(bad), len(runs), "\n".join(bad))


@pytest.mark.parametrize("victim", ["n1", "n2"], ids=["source", "sink"])
def test_kill9_node_mid_transfer(cluster_factory, victim):
    """SIGKILL of the victim: the survivor's lease is released after LOST and
    the fence; the victim's waits (awaiting_host_proof) until a restarted
    node witnesses the dead incarnation (its Hello)."""
    rng = random.Random(0x5EED + (victim == "n2"))
    rounds = []
    for i in range(ROUNDS):
        cl = cluster_factory("%s-%d" % (victim, i))
        rounds.append(_run_round(cl, 1000 + i, victim, signal.SIGKILL, rng))
        cl.close()
    _figures("kill9_%s" % ("source" if victim == "n1" else "sink"), rounds, "rounds")
    _check(rounds)


@pytest.mark.parametrize("victim", ["n2", "n1"], ids=["sink", "source"])
def test_paused_node_lands_nothing_after_release(cluster_factory, victim):
    """SIGSTOP of the victim with frames in flight (a sink: in its socket
    buffer; a source: held in the process, posted when it resumes): it is
    LOST, the survivor fences it and its lease is released; the victim's lease
    stays RELEASING (awaiting_host_proof) while it is paused; SIGCONT: it
    lands or drops what it holds, self-fences, drains, and its proof releases
    its lease. Nothing lands in the sink pages after the sink lease's release.

    Before the rule (issue 12), both leases were released while the sink was
    paused, and the resumed sink wrote a buffered frame into the released
    pages in about 3 runs of 4 (its receiver raced its self-fence): hence
    several fresh clusters, each of which must keep the rule."""
    attempts = []
    t0, load0 = time.monotonic(), os.getloadavg()
    for i in range(PAUSED_ATTEMPTS):
        t = time.monotonic()
        cl = cluster_factory("paused-%s-%d" % (victim, i))
        attempts.append(_run_round(cl, 2000 + i, victim, signal.SIGSTOP,
                                   random.Random(12 + i + 100 * (victim == "n1"))))
        cl.close()
        attempts[-1]["attempt_s"] = round(time.monotonic() - t, 3)
    _figures("sigstop_%s" % ("source" if victim == "n1" else "sink"), attempts, "attempts", t0,
             load0)
    if victim == "n1":
        RESULTS["sigstop_source"]["frames_posted_on_resume"] = [r["frames_posted_on_resume"]
                                                                for r in attempts]
    _check(attempts)


def test_paused_node_same_host_copy(cluster_factory):
    """SIGSTOP of a node copying between two of its own pools (the local
    transport) with copies held in flight; the room is aborted and the hold
    lifted while it is paused. Its leases stay RELEASING (awaiting_host_proof
    once it is LOST: no peer of the room can fence its own memcpy workers)
    until the resumed node drains or self-fences and its Drained or Witness
    releases them; nothing lands in the sink pages after their release.

    Without the host-proof rule both leases are released as soon as the node
    is LOST, while it is paused, and the resumed node's copies can then write
    the released pages. Several fresh clusters, each must keep the rule."""
    attempts = []
    t0, load0 = time.monotonic(), os.getloadavg()
    for i in range(PAUSED_ATTEMPTS):
        t = time.monotonic()
        cl = cluster_factory("paused-local-%d" % i)
        attempts.append(_run_same_host(cl, 3000 + i, random.Random(300 + i)))
        cl.close()
        attempts[-1]["attempt_s"] = round(time.monotonic() - t, 3)
    _figures("sigstop_same_host_copy", attempts, "attempts", t0, load0)
    _check(attempts)
