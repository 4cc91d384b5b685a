#!/usr/bin/python3
"""A stand-in SGLang engine process (prefill or decode) on kvfence.sglang.

It does what SGLang's disaggregation scheduler does with a transfer backend
(sgl-project/sglang at commit 0094505d: the prefill bootstrap queue and
inflight queue, the decode prealloc and transfer queues), in our words and
reduced to what the backend sees: it fills a KVArgs with the addresses of its
KV buffers (2 per layer, K and V, each allocated on its own: a POSIX shm
object per buffer, or with --memory fake-device a kvfence.FakeDeviceBuffer per
buffer, "GPU" memory that the node opens by its (fake) CUDA IPC handle; with
--memory one-shm all of them in one object, as before multi-buffer pools; V
buffers may have another page size, --v-item-len) and of two aux buffers (one
slot per request), builds the KVManager, then per request a
KVSender or KVReceiver, polls every request once per step (2 ms), sends
chunked prefill one chunk per step, and frees a request's pages after
Success or Failed. Nothing else frees pages.

What a test checks, it records: every free() is checked (each page
allocated, hence freed exactly once; the request's lease RELEASED at the
control plane at that moment, read with Admin.ListLeases); freed pages are
filled with this engine's canary again, so a write after the release shows
in `canaries`; a decode Success is checked byte for byte against the pattern
the prefill engine wrote (every buffer, and the aux slot).

Driven by JSON lines on stdin, one reply line per command on stdout:
  {"op": "request", "room": R, "pages": n, "chunk": c, "abort_at": ...,
   "hold_after": k, "timeout_s": t, "bootstrap": "host:port"}
      abort_at: "bootstrapping" | "waiting" | "transfer" (prefill: after its
      first chunk) | "success" (abort() after Success) | null
  {"op": "abort", "room": R}      {"op": "resume", "room": R}
  {"op": "status"}  -> {"requests": {R: {...}}, "violations": [...], "canaries": [...]}
  {"op": "quit"}
"""
import argparse
import functools
import json
import os
import sys
import threading
import time
import traceback
from multiprocessing import shared_memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the stand-in `sglang` package

import kvfence  # noqa: E402
from kvfence import LeaseState  # noqa: E402
from kvfence import FakeDeviceBuffer  # noqa: E402
from kvfence.enginekit import buffer_address  # noqa: E402
from kvfence.sglang import KVBootstrapServer, KVManager, KVPoll, KVReceiver, KVSender  # noqa
from sglang.srt.disaggregation.base.conn import KVArgs  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402

STEP_S = 0.002


def lease_state(admin, key, lease_id):
    """The lease's state at the control plane, from its exact room-generation
    (GetRoom), else from the room id's lease list. A generation that a newer
    one replaced may be gone from both; one is replaced only once it ended,
    and these tests lose no node (no lease waits for its host's proof), so
    its leases count as RELEASED then."""
    try:
        for p in admin.room(key).participants:
            if p.lease is not None and p.lease.lease_id == lease_id:
                return p.lease.state
    except kvfence.NotFound:
        pass
    for l in admin.leases(room_id=key.room_id):
        if l.lease_id == lease_id:
            return l.state
    if admin.room(key.room_id).room.generation > key.generation:
        return LeaseState.RELEASED
    return None


@functools.lru_cache(maxsize=1024)
def _fill(v, xor, n):
    return bytes((((v ^ k) if xor else (v + k)) & 0xFF for k in range(256))) * (n // 256)


def pattern(room, i, b, n):
    """The KV bytes of token page i, buffer b, of room `room` (prefill writes, decode checks)."""
    return _fill((room * 7 + i * 13 + b * 29) & 0xFF, False, n)


def canary(seed, page, b, n):
    return _fill((seed * 11 + page * 31 + b * 3 + 0x5A) & 0xFF, True, n)


class Engine:
    """One TP rank: its KV and aux buffers, its KVManager, its scheduler loop."""

    def __init__(self, a, rank=0, boot=None):
        self.a = a
        self.rank = rank
        self.mode = a.mode
        self.seed = 1 if a.mode == "prefill" else 2
        self.nbuf = 2 * a.layers
        # Bytes a page of buffer b: K buffers (even) item_len, V buffers (odd)
        # v_item_len.
        self.items = [a.item_len if b % 2 == 0 else (a.v_item_len or a.item_len)
                      for b in range(self.nbuf)]
        self.pages = a.pages
        tag = "kvf-sgl-%d-%s-%d" % (os.getpid(), a.mode, rank)
        self.owned = []  # what close() frees
        self.kv = []     # per buffer: a writable memoryview of its pages
        ptrs = []
        if a.memory == "one-shm":
            one = shared_memory.SharedMemory(name=tag + "-kv", create=True,
                                             size=self.pages * sum(self.items))
            self.owned.append(one)
            at = 0
            for b in range(self.nbuf):
                self.kv.append(one.buf[at:at + self.pages * self.items[b]])
                ptrs.append(buffer_address(one.buf) + at)
                at += self.pages * self.items[b]
        for b in range(self.nbuf if a.memory != "one-shm" else 0):
            size = self.pages * self.items[b]
            if a.memory == "fake-device":
                dev = FakeDeviceBuffer("%s%d-%s-%d-%d" % (a.fake_prefix, os.getpid(), a.mode,
                                                          rank, b), size)
                self.owned.append(dev)
                self.kv.append(dev.mem)
                ptrs.append(dev.ptr)
            else:
                shm = shared_memory.SharedMemory(name="%s-kv%d" % (tag, b), create=True,
                                                 size=size)
                self.owned.append(shm)
                self.kv.append(shm.buf)
                ptrs.append(buffer_address(shm.buf))
        self.aux_item = 256
        self.aux_slots = 16
        self.aux = shared_memory.SharedMemory(name=tag + "-aux", create=True,
                                              size=2 * self.aux_slots * self.aux_item)
        # Every buffer's canary image (free pages hold it; checked in canaries()).
        self.images = [b"".join(canary(self.seed, p, b, self.items[b]) for p in range(self.pages))
                       for b in range(self.nbuf)]
        for b in range(self.nbuf):
            self.kv[b][:] = self.images[b]
        for b in range(2):
            for s in range(self.aux_slots):
                self._put_aux(b, s, canary(self.seed, s, 100 + b, self.aux_item))
        abase = buffer_address(self.aux.buf)
        args = KVArgs()
        args.engine_rank = rank
        args.kv_data_ptrs = ptrs
        args.kv_data_lens = [self.pages * i for i in self.items]
        args.kv_item_lens = list(self.items)
        args.aux_data_ptrs = [abase + b * self.aux_slots * self.aux_item for b in range(2)]
        args.aux_data_lens = [self.aux_slots * self.aux_item] * 2
        args.aux_item_lens = [self.aux_item] * 2
        args.page_size = 1
        args.gpu_id = 0
        args.ib_device = None
        self.boot, self.owns_boot = boot, False
        server_args = argparse.Namespace(tp_size=a.tp,
            kvfence_control=a.control, kvfence_node_id=a.node_id, kvfence_node_socket=a.socket,
            kvfence_features=None if a.features is None else [f for f in a.features.split(",")
                                                               if f],
            disaggregation_bootstrap_port=None)
        if a.mode == "prefill":
            if self.boot is None:
                self.boot, self.owns_boot = KVBootstrapServer("127.0.0.1", 0), True
            server_args.disaggregation_bootstrap_port = self.boot.port
        mode = DisaggregationMode.PREFILL if a.mode == "prefill" else DisaggregationMode.DECODE
        self.mgr = KVManager(args, mode, server_args)
        if a.old_join:
            # A peer whose kvfence client predates QUIESCE_V1: it registered
            # at the bootstrap server as usual but joins rooms without it.
            self.mgr.features = ()
        self.admin = kvfence.AdminClient(a.control)
        # --scatter: every other page first, as a long-running engine's free
        # list is (a request's pages are then as many runs as pages).
        self.free_pages = (list(range(0, self.pages, 2)) + list(range(1, self.pages, 2))
                           if a.scatter else list(range(self.pages)))
        self.used = set()
        self.free_slots = list(range(self.aux_slots))
        self.reqs = {}
        self.violations = []
        self.lock = threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    # ---- memory -------------------------------------------------------------------

    def _put(self, b, p, data):
        n = self.items[b]
        self.kv[b][p * n:(p + 1) * n] = data

    def _get(self, b, p):
        n = self.items[b]
        return bytes(self.kv[b][p * n:(p + 1) * n])

    def _put_aux(self, b, s, data):
        off = (b * self.aux_slots + s) * self.aux_item
        self.aux.buf[off:off + self.aux_item] = data

    def _get_aux(self, b, s):
        off = (b * self.aux_slots + s) * self.aux_item
        return bytes(self.aux.buf[off:off + self.aux_item])

    def alloc(self, n):
        if n > len(self.free_pages):
            raise MemoryError("out of pages")
        got, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self.used.update(got)
        return got

    def free(self, r):
        """The scheduler frees a finished request: checked, then re-canaried."""
        obj = r["obj"]
        if obj.lease_id:
            st = lease_state(self.admin, obj.room, obj.lease_id)
            if st != LeaseState.RELEASED:
                self.violations.append("room %d: pages freed while lease %d is %s" %
                                       (r["room"], obj.lease_id, getattr(st, "name", st)))
        for p in r["pages"] or []:
            if p not in self.used:
                self.violations.append("room %d: page %d freed twice" % (r["room"], p))
                continue
            self.used.discard(p)
            for b in range(self.nbuf):
                self._put(b, p, canary(self.seed, p, b, self.items[b]))
            self.free_pages.append(p)
        if r["slot"] is not None:
            for b in range(2):
                self._put_aux(b, r["slot"], canary(self.seed, r["slot"], 100 + b, self.aux_item))
            self.free_slots.append(r["slot"])
        r["freed"] += 1

    def canaries(self):
        bad = []
        # Nothing allocated: each buffer whole against its image (fast); else page by page.
        pages = [] if not self.used and all(self.kv[b] == self.images[b]
                                            for b in range(self.nbuf)) else self.free_pages
        for p in pages:
            for b in range(self.nbuf):
                if self._get(b, p) != canary(self.seed, p, b, self.items[b]):
                    bad.append("page %d buffer %d" % (p, b))
        for s in self.free_slots:
            for b in range(2):
                if self._get_aux(b, s) != canary(self.seed, s, 100 + b, self.aux_item):
                    bad.append("aux slot %d buffer %d" % (s, b))
        return bad

    # ---- requests -----------------------------------------------------------------

    def request(self, room, pages, chunk=0, abort_at=None, hold_after=0, timeout_s=0,
                bootstrap=None, aux=True):
        boot = bootstrap or (self.boot.address if self.boot else None)
        r = {"room": room, "n": pages, "chunk": chunk or pages, "abort_at": abort_at,
             "hold_after": hold_after, "timeout_s": timeout_s, "pages": None, "slot": None,
             "sent": 0, "chunks": 0, "aborted": False, "outcome": None, "failure": None,
             "freed": 0, "verified": None, "t0": time.monotonic(), "seen": [], "aux": aux}
        if self.mode == "prefill":
            r["obj"] = KVSender(self.mgr, boot, room, [0], 0)
        else:
            r["obj"] = KVReceiver(self.mgr, boot, room)
            if abort_at != "bootstrapping":
                r["obj"].init(0)
        self.reqs[room] = r
        return {"ok": True}

    def _abort(self, r):
        if not r["aborted"]:
            r["aborted"] = True
            r["obj"].abort()

    def _step(self, r):
        obj = r["obj"]
        p = obj.poll()
        if not r["seen"] or r["seen"][-1] != p.name:
            r["seen"].append(p.name)
        if r["outcome"] is not None:
            return
        if p in (KVPoll.Success, KVPoll.Failed):
            r["outcome"] = p.name
            if p == KVPoll.Failed:
                try:
                    obj.failure_exception()
                except Exception as e:  # the reason, as SGLang would log it
                    r["failure"] = str(e)
            elif self.mode == "decode":
                r["verified"] = self._verify(r)
            if p == KVPoll.Success and r["abort_at"] == "success":
                obj.abort()
                r["after_abort"] = obj.poll().name
            m = obj.get_transfer_metric() if self.mode == "prefill" else None
            if m is not None:
                r["metric"] = [m.latency_s, m.transferred_bytes]
            self.free(r)
            obj.clear()
            return
        at = r["abort_at"]
        if r["timeout_s"] and time.monotonic() - r["t0"] > r["timeout_s"]:
            self._abort(r)  # the scheduler's waiting timeout: an abort, never a free
        if p == KVPoll.Bootstrapping and at == "bootstrapping":
            self._abort(r)
            return
        if p == KVPoll.WaitingForInput and r["pages"] is None and not r["aborted"]:
            if at == "waiting":
                self._abort(r)
                return
            r["pages"] = self.alloc(r["n"])
            r["slot"] = self.free_slots.pop(0)
            if self.mode == "prefill":
                for i, pg in enumerate(r["pages"]):
                    for b in range(self.nbuf):
                        self._put(b, pg, pattern(r["room"], i, b, self.items[b]))
                for b in range(2):
                    self._put_aux(b, r["slot"], pattern(r["room"], 1000 + b, 0, self.aux_item))
                obj.init(r["n"], r["slot"] if r["aux"] else None)
            else:
                obj.send_metadata(r["pages"], r["slot"])
            return
        if self.mode == "prefill" and r["pages"] is not None and not r["aborted"]:
            if r["sent"] < r["n"] and not (r["hold_after"] and r["chunks"] >= r["hold_after"]):
                c = r["pages"][r["sent"]:r["sent"] + r["chunk"]]
                obj.send(c)
                r["sent"] += len(c)
                r["chunks"] += 1
                if at == "transfer" and r["chunks"] == 1:
                    self._abort(r)

    def _verify(self, r):
        for i, pg in enumerate(r["pages"]):
            for b in range(self.nbuf):
                if self._get(b, pg) != pattern(r["room"], i, b, self.items[b]):
                    return "page %d (token %d) buffer %d differs" % (pg, i, b)
        for b in range(2):
            want = (pattern(r["room"], 1000 + b, 0, self.aux_item) if r["aux"] else
                    canary(self.seed, r["slot"], 100 + b, self.aux_item))  # none was sent
            if self._get_aux(b, r["slot"]) != want:
                return "aux slot %d buffer %d differs" % (r["slot"], b)
        return "ok"

    def _loop(self):
        while not self.stop:
            with self.lock:
                for r in list(self.reqs.values()):
                    try:
                        self._step(r)
                    except Exception:
                        self.violations.append("room %d: %s" % (r["room"], traceback.format_exc()))
                        r["outcome"] = r["outcome"] or "error"
            time.sleep(STEP_S)

    def command(self, c):
        op = c.pop("op")
        with self.lock:
            if op == "request":
                return self.request(**c)
            if op == "abort":
                self._abort(self.reqs[c["room"]])
                return {"ok": True}
            if op == "resume":
                self.reqs[c["room"]]["hold_after"] = 0
                return {"ok": True}
            if op == "status":
                out = {}
                for room, r in self.reqs.items():
                    out[str(room)] = {k: r[k] for k in ("outcome", "failure", "freed", "verified",
                                                        "seen", "chunks", "aborted")}
                    out[str(room)]["poll"] = r["obj"].poll().name
                    out[str(room)]["lease_id"] = r["obj"].lease_id
                    out[str(room)]["after_abort"] = r.get("after_abort")
                    out[str(room)]["metric"] = r.get("metric")
                return {"requests": out, "violations": list(self.violations),
                        "canaries": self.canaries(), "free": len(self.free_pages),
                        "used": sorted(self.used),
                        "pool": {"id": self.mgr.memory.pool_id,
                                 "kind": self.mgr.memory.pool.kind.name,
                                 "page_size": self.mgr.memory.pool.page_size,
                                 "page_count": self.mgr.memory.pool.page_count}}
        if op == "quit":
            self.close()
            return {"ok": True}
        return {"error": "unknown op %r" % op}

    def close(self):
        self.stop = True
        self.thread.join(timeout=5)
        try:  # an engine that shuts down gives its pool back (the node logs its copies)
            self.mgr.node.unregister_pool(self.mgr.memory.pool_id, timeout=5)
        except kvfence.KvfenceError as e:
            print("unregister_pool: %s" % e, file=sys.stderr)
        self.mgr.close()
        self.admin.close()
        if self.owns_boot:
            self.boot.close()
        for v in self.kv:
            v.release()
        for m in self.owned:
            if isinstance(m, FakeDeviceBuffer):
                m.close()
            else:
                m.close()
                m.unlink()
        self.aux.close()
        self.aux.unlink()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["prefill", "decode"], required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--item-len", type=int, default=1024)
    ap.add_argument("--v-item-len", type=int, default=0, help="V buffers' page size (0: item-len)")
    ap.add_argument("--memory", choices=["shm", "fake-device", "one-shm"], default="shm",
                    help="shm: one shm object per KV buffer; fake-device: one FakeDeviceBuffer "
                    "per KV buffer (the node needs --test-fake-device-pools PREFIX); one-shm: "
                    "every KV buffer in one shm object")
    ap.add_argument("--scatter", action="store_true", help="allocate every other page first")
    ap.add_argument("--fake-prefix", default="/kvf-pyfdev-", help="FakeDeviceBuffer names' prefix")
    ap.add_argument("--features", default=None, help="comma separated; '' for none")
    ap.add_argument("--old-join", action="store_true", help="join rooms without QUIESCE_V1")
    ap.add_argument("--tp", type=int, default=1, help="TP ranks in this process")
    a = ap.parse_args()
    ranks = [Engine(a, 0)]
    for r in range(1, a.tp):  # TP ranks share the prefill's bootstrap server
        ranks.append(Engine(a, r, ranks[0].boot))
    boot = ranks[0].boot
    print(json.dumps({"ready": True, "bootstrap": boot.address if boot else None,
                      "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        quit_ = c.get("op") == "quit"
        try:
            # Every command goes to every rank, as SGLang's schedulers act per
            # request on all TP ranks; status: rank 0's, and all with --tp > 1.
            reps = [eng.command(dict(c)) for eng in reversed(ranks)][::-1]
            rep = reps[0]
            if a.tp > 1 and c.get("op") == "status":
                rep = dict(rep, ranks=reps)
        except Exception as e:
            rep = {"error": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()}
        print(json.dumps(rep), flush=True)
        if quit_:
            return 0
    for eng in reversed(ranks):
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
