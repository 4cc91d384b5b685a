#!/usr/bin/python3
"""A stand-in vLLM engine process (prefill: kv_producer, or decode:
kv_consumer) with kvfence.vllm's connector loaded out of tree.

It does what vLLM's V1 engine does with a KV connector (vllm-project/vllm at
commit 003df29: the scheduler's connector calls and the model runner's), in
our words and in one process (one scheduler, one worker, as with one GPU):
the factory loads "KvfenceConnector" from kv_connector_module_path
"kvfence.vllm" twice (roles SCHEDULER and WORKER); the worker registers the KV
cache, one tensor per layer shaped (2, num_blocks, block_bytes), each layer
allocated on its own (its own POSIX shm object, or with --memory fake-device
a kvfence.FakeDeviceBuffer, "GPU" memory the node opens by its fake CUDA IPC
handle); each step runs build_connector_meta ->
bind_connector_metadata -> start_load_kv -> wait_for_save -> get_finished ->
get_block_ids_with_load_errors -> clear_connector_metadata ->
update_connector_output. Blocks of a request whose request_finished said
delay_free=True are freed when get_finished reports the id; others at once.

Checks, as in sglang_engine.py: every free of blocks that had a lease happens
with that lease RELEASED, no block freed twice, free blocks keep the
canary, and a loaded request's blocks hold the prefill pattern (every layer,
K and V).

Commands (JSON lines): {"op": "request", "req": id, "blocks": n, "params":
{...}, "timeout_s": t}; {"op": "abort", "req": id}; {"op": "status"};
{"op": "quit"}. A prefill request is computed and finished at once; the reply
carries request_finished's (delay_free, kv_transfer_params).
"""
import argparse
import enum
import json
import os
import sys
import threading
import time
import traceback
from multiprocessing import shared_memory
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvfence  # noqa: E402
from kvfence import FakeDeviceBuffer, LeaseState  # noqa: E402
from kvfence.enginekit import buffer_address  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

STEP_S = 0.002
BLOCK_TOKENS = 16


class RequestStatus(enum.Enum):
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_ABORTED = 4


class ShmTensor:
    """What the connector reads of a torch.Tensor: data_ptr(), nbytes, shape."""

    def __init__(self, ptr, shape, nbytes):
        self._ptr, self.shape, self.nbytes = ptr, shape, nbytes

    def data_ptr(self):
        return self._ptr


class Blocks:
    def __init__(self, ids):
        self._ids = ids

    def get_block_ids(self):
        return (list(self._ids),)


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


def pattern(room, i, b, n):
    v = (room * 5 + i * 17 + b * 41) & 0xFF
    return bytes(((v + k) & 0xFF for k in range(256))) * (n // 256)


def canary(seed, page, b, n):
    v = (seed * 13 + page * 7 + b * 5 + 0x3C) & 0xFF
    return bytes(((v ^ k) & 0xFF for k in range(256))) * (n // 256)


class Engine:
    def __init__(self, a):
        self.a = a
        self.seed = 3 if a.role == "kv_producer" else 4
        self.layers, self.nblocks, self.item = a.layers, a.blocks, a.block_bytes
        self.nbuf = 2 * self.layers
        layer_bytes = 2 * self.nblocks * self.item
        self.owned, self.mem, ptrs = [], [], []
        for l in range(self.layers):
            if a.memory == "fake-device":
                m = FakeDeviceBuffer("%s%d-%s-%d" % (a.fake_prefix, os.getpid(), a.role[3:], l),
                                     layer_bytes)
                self.mem.append(m.mem)
                ptrs.append(m.ptr)
            else:
                m = shared_memory.SharedMemory(name="kvf-vllm-%d-%s-%d" % (os.getpid(), a.role,
                                                                           l),
                                               create=True, size=layer_bytes)
                self.mem.append(m.buf)
                ptrs.append(buffer_address(m.buf))
            self.owned.append(m)
        for b in range(self.nbuf):
            for p in range(self.nblocks):
                self._put(b, p, canary(self.seed, p, b, self.item))
        extra = {"control": a.control, "node_id": a.node_id, "node_socket": a.socket,
                 "rendezvous": a.rendezvous, "abort_unclaimed_after_s": a.abort_unclaimed}
        cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector="KvfenceConnector", kv_connector_module_path="kvfence.vllm",
            kv_role=a.role, kv_connector_extra_config=extra, engine_id="e-%s" % a.role))
        self.sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER)
        caches = {"model.layers.%d.self_attn" % l: ShmTensor(ptrs[l],
                                                             (2, self.nblocks, self.item),
                                                             layer_bytes)
                  for l in range(self.layers)}
        self.worker.register_kv_caches(caches)
        if a.drop_room_states:
            # As after the watcher resubscribed: releases replayed, room states not.
            self.worker.watcher._on_room_state = lambda ev: None
        self.admin = kvfence.AdminClient(a.control)
        self.free_blocks = list(range(self.nblocks))
        self.used = set()
        self.reqs = {}
        self.violations = []
        self.lock = threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    # layer l's K is buffer 2l, its V 2l+1 (the order kv_cache_buffers uses)
    def _put(self, b, p, data):
        off = ((b % 2) * self.nblocks + p) * self.item
        self.mem[b // 2][off:off + self.item] = data

    def _get(self, b, p):
        off = ((b % 2) * self.nblocks + p) * self.item
        return bytes(self.mem[b // 2][off:off + self.item])

    def alloc(self, n):
        got, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        if len(got) < n:
            raise MemoryError("out of blocks")
        self.used.update(got)
        return got

    def free(self, r):
        if r["lease"]:
            s = lease_state(self.admin, r["key"], r["lease"])
            if s != LeaseState.RELEASED:
                self.violations.append("%s: blocks freed while lease %d is %s" %
                                       (r["req"], r["lease"], getattr(s, "name", s)))
        for p in r["ids"]:
            if p not in self.used:
                self.violations.append("%s: block %d freed twice" % (r["req"], p))
                continue
            self.used.discard(p)
            for b in range(self.nbuf):
                self._put(b, p, canary(self.seed, p, b, self.item))
            self.free_blocks.append(p)
        r["freed"] += 1

    def canaries(self):
        return ["block %d buffer %d" % (p, b) for p in self.free_blocks for b in range(self.nbuf)
                if self._get(b, p) != canary(self.seed, p, b, self.item)]

    def _finish(self, r, status):
        req = r["obj"]
        req.status = status
        delay, params = self.sched.request_finished(req, list(r["ids"]))
        r["delay"] = delay
        r["state"] = "finished"
        if not delay:
            self.free(r)
        return delay, params

    def request(self, req, blocks, params=None, timeout_s=0):
        params = dict(params or {})
        obj = SimpleNamespace(request_id=req, num_tokens=blocks * BLOCK_TOKENS,
                              kv_transfer_params=params, status=RequestStatus.RUNNING)
        r = {"req": req, "obj": obj, "ids": [], "room": int(params.get("kvfence_room") or 0),
             "lease": 0, "key": None, "freed": 0, "delay": None, "state": "new", "outcome": None,
             "verified": None, "t0": time.monotonic(), "timeout_s": timeout_s}
        self.reqs[req] = r
        if self.a.role == "kv_producer":
            r["ids"] = self.alloc(blocks)
            room_hint = int(params.get("kvfence_room") or 0)
            delay, out = self._finish(r, RequestStatus.FINISHED_STOPPED)
            if out:
                r["room"] = int(out["kvfence_room"])
            # "Computed" before it finished (written now that the room id is
            # known; the worker grants it only at the next step, under this lock).
            for i, p in enumerate(r["ids"] if delay else ()):
                for b in range(self.nbuf):
                    self._put(b, p, pattern(r["room"] or room_hint, i, b, self.item))
            return {"delay": delay, "params": out}
        n, load_async = self.sched.get_num_new_matched_tokens(obj, 0)
        r["ids"] = self.alloc(blocks)
        r["state"] = "waiting" if load_async else "running"
        obj.status = RequestStatus.WAITING_FOR_REMOTE_KVS if load_async else obj.status
        self.sched.update_state_after_alloc(obj, Blocks(r["ids"]), n or 0)
        return {"matched": n, "async": load_async}

    def _step(self):
        meta = self.sched.build_connector_meta(None)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        for r in self.reqs.values():
            if not r["freed"]:
                r["lease"] = self.worker.lease_of(r["req"]) or r["lease"]
                r["key"] = self.worker.room_of(r["req"]) or r["key"]
        sending, recving = self.worker.get_finished(set())
        errs = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(SimpleNamespace(finished_sending=sending,
                                                           finished_recving=recving))
        for rid in recving or ():
            r = self.reqs[rid]
            if r["state"] != "waiting":
                self.violations.append("%s: done_recving in state %s" % (rid, r["state"]))
                continue
            if set(r["ids"]) & errs:
                r["outcome"] = "load_error"  # vLLM recomputes these blocks
            else:
                r["outcome"] = "loaded"
                r["verified"] = self._verify(r)
            r["state"] = "running"
            delay, _ = self._finish(r, RequestStatus.FINISHED_STOPPED)  # decoded, done
            if delay:
                self.violations.append("%s: delay_free after its load ended" % rid)
        for rid in sending or ():
            r = self.reqs[rid]
            if not r["delay"] or r["freed"]:
                self.violations.append("%s: done_sending without a delayed free" % rid)
                continue
            r["outcome"] = r["outcome"] or ("sent" if self.a.role == "kv_producer"
                                            else "aborted")
            self.free(r)
        now = time.monotonic()
        for r in self.reqs.values():
            if (r["state"] == "waiting" and r["timeout_s"] and now - r["t0"] > r["timeout_s"]):
                self._finish(r, RequestStatus.FINISHED_ABORTED)  # the scheduler gives up

    def _verify(self, r):
        for i, p in enumerate(r["ids"]):
            for b in range(self.nbuf):
                if self._get(b, p) != pattern(r["room"], i, b, self.item):
                    return "block %d (index %d) buffer %d differs" % (p, i, b)
        return "ok"

    def _loop(self):
        while not self.stop:
            with self.lock:
                try:
                    self._step()
                except Exception:
                    self.violations.append(traceback.format_exc())
            time.sleep(STEP_S)

    def command(self, c):
        op = c.pop("op")
        if op == "quit":
            self.close()
            return {"ok": True}
        with self.lock:
            if op == "request":
                return self.request(**c)
            if op == "abort":
                r = self.reqs[c["req"]]
                if r["state"] == "finished":
                    return {"ok": True, "already": True}
                delay, _ = self._finish(r, RequestStatus.FINISHED_ABORTED)
                return {"ok": True, "delay": delay}
            if op == "status":
                keys = ("state", "outcome", "verified", "freed", "delay", "room", "lease")
                return {"requests": {k: {x: r[x] for x in keys} for k, r in self.reqs.items()},
                        "violations": list(self.violations), "canaries": self.canaries(),
                        "used": sorted(self.used),
                        "pool": {"id": self.worker.memory.pool_id,
                                 "page_size": self.worker.memory.pool.page_size,
                                 "buffers": self.worker.memory.buffers}}
        return {"error": "unknown op %r" % op}

    def close(self):
        self.stop = True
        self.thread.join(timeout=5)
        self.worker.shutdown()
        self.sched.shutdown()
        self.admin.close()
        for m in self.owned:
            m.close()
            if not isinstance(m, FakeDeviceBuffer):
                m.unlink()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["kv_producer", "kv_consumer"], required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--rendezvous", default=None, help="producer: host:port to serve")
    ap.add_argument("--abort-unclaimed", type=float, default=None)
    ap.add_argument("--drop-room-states", action="store_true")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--block-bytes", type=int, default=1024)
    ap.add_argument("--memory", choices=["shm", "fake-device"], default="shm",
                    help="each layer's tensor: its own shm object, or a FakeDeviceBuffer (the "
                    "node needs --test-fake-device-pools PREFIX)")
    ap.add_argument("--fake-prefix", default="/kvf-pyfdev-", help="FakeDeviceBuffer names' prefix")
    a = ap.parse_args()
    eng = Engine(a)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        quit_ = c.get("op") == "quit"
        try:
            rep = eng.command(c)
        except Exception as e:
            rep = {"error": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()}
        print(json.dumps(rep), flush=True)
        if quit_:
            return 0
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
