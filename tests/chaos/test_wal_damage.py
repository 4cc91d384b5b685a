"""The WAL damage matrix (issue 14, chaos part 2).

One data directory is made once per run (a snapshot, then a log segment of
about 25 records, every join acknowledged and mapped to the last seq on disk
when its reply came, then a few records nobody was answered for). Each case
copies it, damages the copy one way, and starts kvfence-control on it:

  damage                               expected
  one flipped byte, a middle record     refuses: file, offset, seq
  one flipped byte, the last record     torn tail: cut, serves every ack
  the last record truncated             torn tail: cut, serves every ack
  a middle segment deleted              refuses: the missing seq / segment
  the last segment deleted              refuses: the sealed segment
  a record removed (a seq gap)          refuses: file, offset, seq
  a byte flipped in the snapshot        refuses: the snapshot file

Where it refuses, `--repair-wal` must back up what it changes, cut the log,
say how many records it dropped, and the next start must serve every change
acknowledged before the damage.

The log is one segment (a snapshot rolls to a new one and the server rolls at
64 MiB otherwise): the segment cases split it the way the server rolls
(kvf_store.split_segment: a header per segment, a seal naming the successor),
and an undamaged split must start and serve everything first.
"""

import os
import shutil

import pytest

from conftest import figure
from kvf_harness import ControlProcess, FakeNode
from kvf_store import (
    QUIET_TIMERS,
    REC_HDR,
    assert_acked,
    join,
    last_seq,
    records,
    records_raw,
    repair,
    segments,
    snapshots,
    split_segment,
    wait_refused_start,
)

ARGS = QUIET_TIMERS + ["--snapshot-every", 40]
JOINS = 60
CUT_MESSAGE = "of torn or corrupt tail"
RESULTS = {}


@pytest.fixture(scope="module")
def base_log(control_bin, tmp_path_factory):
    """(data dir, {room_id: (generation, lease_id)}, {room_id: seq on disk at
    its reply}). The directory is never started on again: cases copy it."""
    work = tmp_path_factory.mktemp("walbase")
    data = work / "data"
    srv = ControlProcess(control_bin, work, data, "base", ARGS).start()
    try:
        srv.wait_serving()
        ch = srv.channel()
        node = FakeNode(ch, "n1")
        node.recv("welcome")
        acked, ack_seq = {}, {}
        for room_id in range(1, JOINS + 1):
            j = join(ch, room_id)
            acked[room_id] = (j.room.generation, j.lease_id)
            ack_seq[room_id] = last_seq(data)  # the reply follows the record's sync
        # Records nobody was answered for: joins whose replies "were lost"
        # (the client gave up), then the session's end.
        for room_id in range(JOINS + 1, JOINS + 4):
            join(ch, room_id)
        node.close()
        assert srv.terminate() == 0, srv.stderr_tail()
    finally:
        srv.cleanup()
    assert snapshots(data) and len(segments(data)) == 1, sorted(os.listdir(data))
    recs = records(data / segments(data)[0])
    assert len(recs) >= 20, recs
    assert recs[-1][1] > max(ack_seq.values()), "the last record holds an acknowledged change"
    return data, acked, ack_seq


class Case:
    def __init__(self, control_bin, base, tmp_path, name):
        self.bin = control_bin
        self.base_dir, self.acked, self.ack_seq = base
        self.data = tmp_path / name
        shutil.copytree(self.base_dir, self.data)
        self.name = name
        self.tmp = tmp_path
        self.runs = []
        self.seg = self.data / segments(self.data)[0]
        self.recs = records(self.seg)

    def start(self):
        p = ControlProcess(self.bin, self.tmp, self.data, "%s-%d" % (self.name, len(self.runs)),
                           ARGS)
        self.runs.append(p)
        return p.start()

    def cleanup(self):
        for p in self.runs:
            p.cleanup()

    def short(self, msg):
        return msg.replace(str(self.data), "DIR")[:300]

    def before(self, seq):
        """The acknowledged joins whose record is before `seq`."""
        return {k: v for k, v in self.acked.items() if self.ack_seq[k] < seq}

    def expect_serves_all(self, cut=True):
        srv = self.start()
        srv.wait_serving()
        assert_acked(srv.channel(), self.acked)
        cuts = [m for m in srv.log_messages() if CUT_MESSAGE in m]
        if cut:
            assert cuts, srv.stderr_tail()
        assert srv.terminate() == 0, srv.stderr_tail()
        RESULTS[self.name] = {"start": "serves", "acked_checked": len(self.acked),
                              "lost": 0, "log": self.short(cuts[0]) if cuts else ""}

    def expect_refused(self, names):
        """The start fails and its error names every string of `names`;
        returns the error text."""
        srv = self.start()
        wait_refused_start(srv)
        text = srv.stderr_text()
        for n in names:
            assert n in text, "%r not in:\n%s" % (n, srv.stderr_tail())
        errors = srv.log_errors() or [text.strip().splitlines()[-1]]
        RESULTS[self.name] = {"start": "refused", "error": self.short(errors[-1])}
        return text

    def expect_repair(self, first_lost, dropped=None, says=None):
        """--repair-wal backs up, cuts, reports; the next start serves every
        change acknowledged before seq `first_lost`. `dropped`: the count it
        must report; `says`: a phrase its report must hold."""
        before = set(os.listdir(self.data))
        r = repair(self.bin, self.data)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        if dropped is not None:
            assert "dropped %d records" % dropped in out, out
        else:
            assert "dropped" in out, out
        if says is not None:
            assert says in out, out
        backups = [d for d in os.listdir(self.data) if d.startswith("repair-")]
        assert len(backups) == 1, sorted(os.listdir(self.data))
        saved = os.listdir(self.data / backups[0])
        assert saved, "empty backup %s" % backups[0]
        srv = self.start()
        srv.wait_serving()
        survivors = self.before(first_lost)
        assert_acked(srv.channel(), survivors)
        assert srv.terminate() == 0, srv.stderr_tail()
        said = [ln for ln in out.splitlines() if "dropped" in ln]
        RESULTS[self.name].update({
            "repair": "rc 0", "repair_says": self.short(said[0]) if said else "",
            "backup_files": len(saved), "acked_kept": len(survivors),
            "acked_dropped": len(self.acked) - len(survivors),
            "files_changed": sorted(before ^ set(os.listdir(self.data)))})


@pytest.fixture
def case(request, control_bin, base_log, tmp_path):
    c = Case(control_bin, base_log, tmp_path, request.node.name[len("test_"):])
    yield c
    c.cleanup()


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


# ---- the matrix ---------------------------------------------------------------------


def test_flip_middle_record(case):
    i = len(case.recs) // 2
    off, seq, length = case.recs[i]
    _flip(case.seg, off + REC_HDR + length // 2)
    case.expect_refused([case.seg.name, "offset %d" % off, "seq %d" % seq, "--repair-wal"])
    case.expect_repair(seq, dropped=len(case.recs) - i)


def test_flip_last_record_is_a_torn_tail(case):
    off, seq, length = case.recs[-1]
    _flip(case.seg, off + REC_HDR + length // 2)
    case.expect_serves_all()


def test_truncated_last_record_is_a_torn_tail(case):
    off, seq, length = case.recs[-1]
    os.truncate(case.seg, off + REC_HDR + length // 2)
    case.expect_serves_all()


def test_split_log_intact(case):
    """The control case of the segment cases: the split log is accepted."""
    first = case.recs[0][1]
    split_segment(case.data, [first + 8, first + 16])
    case.expect_serves_all(cut=False)


def test_deleted_middle_segment(case):
    first = case.recs[0][1]
    names = split_segment(case.data, [first + 8, first + 16])
    os.unlink(case.data / names[1])
    case.expect_refused(["refusing to start", "--repair-wal"])
    text = case.runs[-1].stderr_text()
    assert names[1] in text or "seq %d" % (first + 8) in text, case.runs[-1].stderr_tail()
    # The deleted segment's 8 records and every later one: the count is known.
    case.expect_repair(first + 8, dropped=len([r for r in case.recs if r[1] >= first + 8]))


def test_deleted_last_segment(case):
    first = case.recs[0][1]
    names = split_segment(case.data, [first + 12])
    os.unlink(case.data / names[1])
    case.expect_refused([names[0], "seal", "--repair-wal"])
    # Nothing on disk says how many records the deleted file held.
    case.expect_repair(first + 12, says="dropped at least 0 records: a deleted file held every "
                                        "record from seq %d on" % (first + 12))


def test_seq_gap_record_removed(case):
    i = len(case.recs) // 2
    raw_recs = records_raw(case.seg)
    off, seq, length, rec = raw_recs[i]
    raw = case.seg.read_bytes()
    case.seg.write_bytes(raw[:off] + raw[off + len(rec):])
    nxt = raw_recs[i + 1]
    # The record after the hole sits where the removed one was, with seq + 1.
    case.expect_refused([case.seg.name, "offset %d" % off, "expected %d, found %d" % (seq, nxt[1]),
                         "--repair-wal"])
    case.expect_repair(seq, dropped=len(case.recs) - i - 1)


def test_damaged_snapshot(case):
    snap = case.data / snapshots(case.data)[-1]
    size = snap.stat().st_size
    assert size > 64, size
    _flip(snap, 32 + (size - 32) // 2)
    case.expect_refused([snap.name])
    r = repair(case.bin, case.data)
    out = (r.stdout + r.stderr).strip()
    RESULTS[case.name].update({"repair": "rc %d" % r.returncode,
                               "repair_says": case.short(out.splitlines()[-1]) if out else ""})
    # A snapshot is the only copy of what it covers (the log before it was
    # deleted): repair cannot cut its way past it and must not pretend to.
    assert r.returncode != 0, out
    assert snap.name in out, out
    assert snap.read_bytes() != b"" and snap.exists()


def teardown_module(module):
    figure("wal_damage", RESULTS)

