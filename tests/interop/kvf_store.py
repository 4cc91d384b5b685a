"""Helpers of the tests that look at kvfence-control's data directory: the
write-ahead log's on-disk format (controlplane/store/wal.c), damage to it,
`--repair-wal`, refused starts and a small tmpfs for a full disk.

Used by tests/interop/test_store_integrity.py and tests/chaos/. Nothing here
starts a server; the callers own every process (kvf_harness.ControlProcess).

Formats (little-endian; wal.c's opening comment is the reference):
  segment  wal-<first seq, 16 hex>.log: a 24-byte header ("KVFW", u32
           version, u64 first seq, u32 0, u32 CRC-32C of the 20 bytes
           before it), records back to back, then, once the next segment is
           durable, a seal.
  record   u32 payload length, u32 CRC-32C over (u64 seq, payload), u64 seq,
           payload.
  seal     a record header with length 0x80000000, the CRC-32C of the u64
           seq, and the next segment's first seq.
"""

import contextlib
import os
import struct
import subprocess

import grpc

from kvfence.v1 import control_pb2, types_pb2

from kvf_harness import RPC_TIMEOUT_S, admin, control, join_request

# Timers pushed far out: nothing changes state (or is logged) on its own.
QUIET_TIMERS = [
    "--node-ttl-ms", 600000,
    "--join-timeout-ms", 600000,
    "--drain-deadline-ms", 600000,
    "--resend-ms", 5000,
]
SEG_HDR = 24
REC_HDR = 16
SEAL_LEN = 0x80000000
# The exit status of kvfence-control when its log cannot be written.
EXIT_STORE_FAILED = 3


# ---- CRC-32C (Castagnoli, reflected 0x82F63B78), as controlplane/store/crc32c.c ----

def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


# ---- the data directory --------------------------------------------------------


def files(data_dir, prefix, suffix):
    return sorted(f for f in os.listdir(data_dir) if f.startswith(prefix) and f.endswith(suffix))


def segments(data_dir):
    return files(data_dir, "wal-", ".log")


def snapshots(data_dir):
    return files(data_dir, "snapshot-", ".snap")


def seg_name(first_seq):
    return "wal-%016x.log" % first_seq


def wal_bytes(data_dir):
    return sum(os.path.getsize(os.path.join(data_dir, f)) for f in segments(data_dir))


def records(path):
    """[(offset, seq, payload length)] of every record of a segment, up to the
    first seal or the first header that does not fit."""
    return [(off, seq, length) for off, seq, length, _ in records_raw(path)]


def records_raw(path):
    """[(offset, seq, payload length, bytes of the whole record)]."""
    with open(path, "rb") as f:
        raw = f.read()
    out = []
    off = SEG_HDR
    while off + REC_HDR <= len(raw):
        length, _crc, seq = struct.unpack_from("<IIQ", raw, off)
        if length & SEAL_LEN:  # a seal: the segment ends here
            break
        out.append((off, seq, length, raw[off:off + REC_HDR + length]))
        off += REC_HDR + length
    return out


def last_seq(data_dir):
    """The seq of the last whole record of the newest segment (0 if none)."""
    segs = segments(data_dir)
    if not segs:
        return 0
    recs = records(os.path.join(str(data_dir), segs[-1]))
    return recs[-1][1] if recs else int(segs[-1][4:20], 16) - 1


def seg_header(first_seq, version=2):
    head = b"KVFW" + struct.pack("<IQI", version, first_seq, 0)
    return head + struct.pack("<I", crc32c(head))


def seal(next_seq):
    return struct.pack("<IIQ", SEAL_LEN, crc32c(struct.pack("<Q", next_seq)), next_seq)


def split_segment(data_dir, cuts):
    """Rewrites the single log segment of `data_dir` as several, the way the
    server rolls at its size limit: a new segment starts at every seq in
    `cuts`, and every segment but the last ends with a seal naming its
    successor. Returns the new segment names in order."""
    segs = segments(data_dir)
    assert len(segs) == 1, segs
    path = os.path.join(str(data_dir), segs[0])
    with open(path, "rb") as f:
        version = struct.unpack_from("<I", f.read(8), 4)[0]
    recs = records_raw(path)
    assert recs, "empty segment"
    starts = [recs[0][1]] + sorted(cuts)
    assert all(recs[0][1] < c <= recs[-1][1] for c in cuts), (cuts, recs[0][1], recs[-1][1])
    names = []
    for i, first in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else None
        body = b"".join(r[3] for r in recs if r[1] >= first and (end is None or r[1] < end))
        tail = seal(end) if end is not None else b""
        name = seg_name(first)
        tmp = os.path.join(str(data_dir), name + ".split")
        with open(tmp, "wb") as f:
            f.write(seg_header(first, version) + body + tail)
        names.append(name)
    os.unlink(path)
    for name in names:
        os.rename(os.path.join(str(data_dir), name + ".split"), os.path.join(str(data_dir), name))
    return names


# ---- calls -------------------------------------------------------------------------


def serve(servers, data_dir, *extra_args):
    """A server from the `servers` factory, waited for until it serves."""
    p = servers(data_dir, *extra_args)
    p.wait_serving()
    return p


def join(ch, room_id, node_id="n1", first=None, features=None):
    rq = join_request(room_id, node_id, types_pb2.ROLE_SOURCE,
                      first=room_id if first is None else first)
    if features is not None:
        rq.engine_capabilities.features[:] = features
    return control(ch).JoinRoom(rq, timeout=4 * RPC_TIMEOUT_S)


def get_room(ch, room_id, generation=0):
    return admin(ch).GetRoom(
        control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=room_id, generation=generation)),
        timeout=RPC_TIMEOUT_S,
    )


def refusal(fn):
    """(status code, details) of calling fn(); (OK, "") when it succeeds."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def assert_acked(ch, acked):
    """Every acknowledged join ({room_id: (generation, lease_id)}) is there
    with the lease id it was given."""
    for room_id, (generation, lease_id) in sorted(acked.items()):
        info = get_room(ch, room_id)
        got = (info.room.generation, [p.lease.lease_id for p in info.participants])
        assert got == (generation, [lease_id]), "room %d: acknowledged %r, found %r" % (
            room_id, (generation, [lease_id]), got)


# ---- starts that must fail, and the repair -------------------------------------------


def wait_refused_start(srv, timeout=10.0):
    """The server exits non-zero without ever writing its port file."""
    rc = srv.wait_exit(timeout)
    assert rc is not None, "kvfence-control still runs %.0f s after start" % timeout
    assert rc != 0, srv.stderr_tail()
    assert not os.path.exists(srv.port_file), "port file written by a server that did not start"
    return rc


def repair(control_bin, data_dir):
    return subprocess.run(
        [control_bin, "--data-dir", str(data_dir), "--repair-wal"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
    )


# ---- a full disk ----------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(mnt, size="4m"):
    """Mounts a tmpfs of `size` at `mnt` (created) and unmounts it on the way
    out, also when the body fails. Yields the mount point, or a string saying
    why it cannot be mounted (not root, mount refused): the caller skips."""
    if os.geteuid() != 0:
        yield "mounting a tmpfs needs root (euid %d)" % os.geteuid()
        return
    os.makedirs(str(mnt), exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s,mode=0700" % size, "tmpfs",
                        str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        yield "cannot mount a tmpfs: %s" % r.stderr.strip()
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path):
    """Writes `path` until the file system is full."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
