"""ReleaseWatcher: the one place an engine learns that its pages are free.

A background WatchLeases subscription that calls `on_released(lease)`
exactly once per released lease, from its own thread, deduplicated by
lease_id across resubscriptions (the server replays past releases on every
subscription), and that forgets what it delivered once no replay can bring
it back.

DESIGN

Threads. One watcher thread owns the stream and the resubscription loop,
adds to the dedup window and runs the callbacks; a short-lived check thread
(below) forgets from the window. Any thread may call start(),
stop(), is_released(), wait(); they touch the window only under `_cv`.
The callback runs outside `_cv`, so it may call is_released()/wait() of its
own watcher (not stop()).

Why it keeps up (measured: bench/README.md, "Python release watcher").
Two things, each worth a factor under GIL contention:
  - the watcher opens its own channel (its own HTTP/2 connection) to the
    control plane, with the ControlClient's target, credentials and
    options; the engine's unary calls do not share it. On the engine's
    channel, with 16 engine threads calling, the stream fell seconds behind;
  - every WatchLeases stream of a ControlClient runs on grpcio's
    single-threaded stream path (client.py, _WATCH_CHANNEL_OPTIONS): the
    watcher thread itself polls the call's completion queue with the GIL
    released, one GIL acquisition per release, where grpcio's default path
    hands each message from the channel's spin thread to the consumer
    through a condition variable (two contended acquisitions).
A ControlClient made on a channel passed in has no target to copy: its
watcher uses that channel as it is (own_channel=False behaves the same).
backend="libkvfence" goes one step further (_libkvfence.py): the C
library's thread receives and queues without the GIL, and the watcher
thread wakes once per batch, not once per message.

The dedup window (the memory bound). The server replays, on every
(re)subscription, each matching lease that is RELEASED and whose room it
still keeps as a tombstone (a room's tombstone timer starts when its last
lease is released and runs `--tombstone-ttl-ms`, default 600 s). So a
delivered lease can come back only while the server would still replay it,
and that is all dedup has to cover. The window keeps lease ids (not Lease
objects) grouped by room, in the order of their room's latest release
delivered here. A room older than `remember_s` (default 600 s, the default
tombstone TTL) is not just dropped: once per remember_s, after a delivery,
a helper thread (kvfence-release-check) opens one more WatchLeases stream
with the watcher's own filter and reads its replay up to `synced` (lease
ids only, no Lease objects) while the live stream goes on; every old room
none of whose leases came back, and that got no delivery meanwhile, is
forgotten: no later replay can bring it back (a tombstone that expired
never returns). Rooms that came back are kept for another round. A check
that fails forgets nothing. The cost is one resubscription's replay per
remember_s, on the server and in the helper thread: with remember_s equal
to the TTL, about one more message per release, parsed without building
Lease objects (and one more thread wanting the GIL while it runs). So the bound is the
server's: the ids of releases whose rooms the server still keeps, plus up
to two remember_s of newer ones, about (releases per second) x (TTL + 2 x
remember_s) x 180 bytes (tracemalloc: 177 B per id, two leases a room),
whatever the engine's age; and no lease is ever delivered twice, however
long a room's last lease waits (a lost node's lease waiting for its host's
proof keeps the room, and its replay, alive). The one case it cannot cover is a server
that forgets a release and makes it again (a failover to a standby that
had not replicated it): a watcher that kept everything would dedup that.

Lease objects are kept only for the last `keep_leases` releases (wait() of
a lease released a moment ago, as an engine that checks is_released() after
recording a grant does), and for leases a wait() is blocked on.
"""
from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import grpc

from . import _convert, _libkvfence, errors
from ._proto.v1 import control_pb2
from .client import (DEFAULT_TIMEOUT_S, ControlClient, Lease, LeaseReleased, LeaseWatch, RoomKey,
                     RoomStateChanged, WatchEvent, WatchSynced, _event_from)

__all__ = ["ReleaseWatcher", "DEFAULT_REMEMBER_S", "DEFAULT_KEEP_LEASES"]

log = logging.getLogger("kvfence")

#: Seconds a delivered lease id is kept for dedup after its room's last
#: release seen here, and the period of the checks with the server that
#: forget older ones: the control plane's default --tombstone-ttl-ms (600 s).
DEFAULT_REMEMBER_S = 600.0
#: Lease objects kept for wait() after their release.
DEFAULT_KEEP_LEASES = 4096
_MAX_CALLBACK_ERRORS = 100
_CODES: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


class _DedupWindow:
    """Delivered lease ids by room, ordered by the room's latest delivery
    (or check that kept it), oldest first; a room is forgotten only by
    forget(), after a check. Not thread safe (the watcher's _cv)."""

    def __init__(self, remember_s: float) -> None:
        self.remember_s = remember_s
        self._rooms: "collections.OrderedDict[RoomKey, Tuple[float, List[int]]]" = \
            collections.OrderedDict()
        self._room_of: Dict[int, RoomKey] = {}

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._room_of

    def __len__(self) -> int:
        return len(self._room_of)

    @property
    def rooms(self) -> int:
        return len(self._rooms)

    def add(self, lease: Lease, now: float) -> None:
        entry = self._rooms.pop(lease.room, None)
        ids = entry[1] if entry is not None else []
        ids.append(lease.lease_id)
        self._rooms[lease.room] = (now, ids)  # now the newest room
        self._room_of[lease.lease_id] = lease.room

    def old_rooms(self, now: float) -> List[Tuple[RoomKey, float, List[int]]]:
        """The rooms whose latest delivery is older than remember_s, oldest
        first, each with that delivery's time (left in the window)."""
        out: List[Tuple[RoomKey, float, List[int]]] = []
        horizon = now - self.remember_s
        for room, (t, ids) in self._rooms.items():
            if t > horizon:
                break
            out.append((room, t, list(ids)))
        return out

    def delivered_at(self, room: RoomKey) -> Optional[float]:
        t_ids = self._rooms.get(room)
        return t_ids[0] if t_ids is not None else None

    def touch(self, room: RoomKey, now: float) -> None:
        """A room kept after a check: the newest again."""
        t_ids = self._rooms.pop(room, None)
        if t_ids is not None:
            self._rooms[room] = (now, t_ids[1])

    def forget(self, room: RoomKey) -> int:
        """Removes one room; how many lease ids went."""
        t_ids = self._rooms.pop(room, None)
        if t_ids is None:
            return 0
        for lid in t_ids[1]:
            del self._room_of[lid]
        return len(t_ids[1])


class ReleaseWatcher:
    """A background WatchLeases subscription that calls `on_released(lease)`
    exactly once per released lease (deduplicated by lease_id across
    resubscriptions), from its own thread. This is where an engine frees pages.

        with ctl.release_watcher(allocator.free_lease, node_id="n2") as w:
            ...            # started, and synced: no release can be missed
            w.wait(lease_id, 5.0)

    start() returns once the server sent `synced`, so a lease granted after
    start() cannot be released unseen. On UNAVAILABLE (control plane restart
    or failover) the watcher resubscribes with backoff; the replay plus the
    lease_id dedup make that lossless while the room is kept as a tombstone.

    remember_s: the least time a delivered lease id stays in the dedup window
    after its room's last release seen here, and the period of the checks
    that forget what the server would no longer replay (module docstring).
    keep_leases: how many recent Lease objects wait() can still return.
    own_channel: read the stream on a channel of its own (the default; see
    the module docstring), closed by stop().
    backend: "grpc" (grpcio, the default) or "libkvfence": the C library's
    queued watch through ctypes (_libkvfence.py; $KVFENCE_LIBRARY; plaintext
    only): its own thread receives without the GIL, and this watcher's
    thread wakes once per batch of events.
    """

    def __init__(self, control: ControlClient, on_released: Callable[[Lease], None], *,
                 node_id: str = "", ranks: Iterable[int] = (),
                 on_room_state: Optional[Callable[[RoomStateChanged], None]] = None,
                 backoff: Tuple[float, float] = (0.05, 2.0),
                 remember_s: float = DEFAULT_REMEMBER_S,
                 keep_leases: int = DEFAULT_KEEP_LEASES, own_channel: bool = True,
                 backend: str = "grpc") -> None:
        if remember_s <= 0:
            raise ValueError("remember_s: must be > 0, got %r" % (remember_s,))
        if keep_leases < 0:
            raise ValueError("keep_leases: must be >= 0, got %r" % (keep_leases,))
        self._control = control
        # The client whose stream this watcher reads: its own (closed by
        # stop()) unless the control client's channel was passed in.
        self._own: Optional[ControlClient] = None  # made by start()
        self._own_channel = own_channel
        if backend not in ("grpc", "libkvfence"):
            raise ValueError("backend: 'grpc' or 'libkvfence', got %r" % (backend,))
        self._backend = backend
        self._queued: Optional[_libkvfence.QueuedWatch] = None  # made by start()
        self._on_released = on_released
        self._on_room_state = on_room_state
        self._node_id = node_id
        self._ranks = list(ranks)
        self._backoff = backoff
        self._cv = threading.Condition()
        # Under _cv: the dedup window, recent Lease objects, waiters.
        self._window = _DedupWindow(remember_s)
        self._keep_leases = keep_leases
        self._recent: "collections.OrderedDict[int, Lease]" = collections.OrderedDict()
        self._waiting: Dict[int, int] = {}  # lease_id -> wait() calls blocked on it
        self._held: Dict[int, Lease] = {}  # released leases a wait() is blocked on
        self._synced = False
        self._syncs = 0
        self._stopping = False
        self._watch: Optional[LeaseWatch] = None
        self._thread: Optional[threading.Thread] = None
        self.last_error: Optional[BaseException] = None
        # The latest callback exceptions (at most _MAX_CALLBACK_ERRORS).
        self.callback_errors: List[BaseException] = []
        self.delivered = 0  # leases handed to on_released (each once)
        self.forgotten = 0  # lease ids dropped from the window after a check
        self.verifications = 0  # checks the server answered (a replay up to synced)
        self._next_verify = time.monotonic() + remember_s  # under _cv
        self._verify_call: Optional[Any] = None  # the check's stream, under _cv
        self._checking = False  # a check thread runs, under _cv

    # ---- control ----------------------------------------------------------------

    def start(self, timeout: float = DEFAULT_TIMEOUT_S) -> "ReleaseWatcher":
        """Starts the thread and waits for the first `synced`."""
        control = self._control
        if self._backend == "libkvfence":
            lib = _libkvfence.load()
            if lib is None or control.target is None or control._channel_args is None or \
                    control._channel_args[0] is not None:
                raise ValueError("backend='libkvfence': needs libkvfence with kvf_watch_queue "
                                 "($KVFENCE_LIBRARY) and a plaintext ControlClient with a target")
            self._queued = _libkvfence.QueuedWatch(lib, control.target, self._node_id,
                                                   self._ranks,
                                                   self._on_room_state is not None)
        if self._own_channel and control._channel_args is not None and \
                control.target is not None:
            credentials, options = control._channel_args
            self._own = ControlClient(control.target, credentials=credentials, options=options,
                                      timeout=control.timeout)
        self._thread = threading.Thread(target=self._run, name="kvfence-release-watcher",
                                        daemon=True)
        self._thread.start()
        with self._cv:
            synced = self._cv.wait_for(lambda: self._synced, timeout)
        if not synced:
            self.stop()
            raise errors.DeadlineExceeded(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "WatchLeases not synced within %.3g s (last error: %s)" %
                (timeout, self.last_error), "Control.WatchLeases")
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            w = self._watch
            check = self._verify_call
            self._cv.notify_all()
        if w is not None:
            w.cancel()
        if check is not None:
            check.cancel()
        if self._queued is not None:
            self._queued.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
            if not self._thread.is_alive():
                if self._own is not None:
                    self._own.close()
                    self._own = None
                if self._queued is not None:
                    self._queued.close()
                    self._queued = None

    # ---- queries ----------------------------------------------------------------

    def is_released(self, lease_id: int) -> bool:
        """True when the lease's release was delivered and is still in the
        dedup window (until a check found the server would not replay it)."""
        with self._cv:
            return lease_id in self._window

    @property
    def remembered(self) -> int:
        """Lease ids in the dedup window now (the memory bound's measure)."""
        with self._cv:
            return len(self._window)

    @property
    def syncs(self) -> int:
        """`synced` events seen: 1 after start(), one more per resubscription."""
        with self._cv:
            return self._syncs

    def wait(self, lease_id: int, timeout: float) -> Lease:
        """Waits for the release of `lease_id` (after its callback ran) and
        returns the lease. DeadlineExceeded after `timeout`: the pages are
        then still not free. A lease whose release was delivered longer ago
        than the last `keep_leases` releases: NotFound (its Lease is gone;
        is_released() still answers while it is kept). A lease forgotten is
        indistinguishable from one not released: wait for a lease from
        before it could be released, not long after."""
        with self._cv:
            self._waiting[lease_id] = self._waiting.get(lease_id, 0) + 1
            try:
                ok = self._cv.wait_for(
                    lambda: lease_id in self._recent or lease_id in self._held or
                    lease_id in self._window, timeout)
                lease = self._recent.get(lease_id) or self._held.get(lease_id)
            finally:
                n = self._waiting.pop(lease_id) - 1
                if n:
                    self._waiting[lease_id] = n
                else:
                    self._held.pop(lease_id, None)
            if lease is not None:
                return lease
            if ok:
                raise errors.NotFound(
                    grpc.StatusCode.NOT_FOUND,
                    "lease %d was released and delivered earlier; its Lease is no longer kept "
                    "(keep_leases=%d)" % (lease_id, self._keep_leases), "Control.WatchLeases")
            raise errors.DeadlineExceeded(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "lease %d not released within %.3g s; its pages are not free" %
                (lease_id, timeout), "Control.WatchLeases")

    # ---- the watcher thread ---------------------------------------------------------

    def _run(self) -> None:
        if self._queued is not None:
            self._run_queued(self._queued)
            return
        delay = self._backoff[0]
        while True:
            with self._cv:
                if self._stopping:
                    return
                watch = (self._own or self._control).watch_leases(
                    node_id=self._node_id, ranks=self._ranks,
                    include_room_states=self._on_room_state is not None)
                self._watch = watch
            try:
                for ev in watch:
                    delay = self._backoff[0]
                    self._handle(ev)
            except errors.KvfenceError as e:
                self.last_error = e
                log.info("WatchLeases ended (%s); resubscribing in %.2f s", e, delay)
            with self._cv:
                if self._stopping:
                    return
                self._cv.wait(delay)
            delay = min(delay * 2, self._backoff[1])

    def _handle(self, ev: WatchEvent) -> None:
        if isinstance(ev, LeaseReleased):
            self._deliver(ev.lease)
        elif isinstance(ev, WatchSynced):
            with self._cv:
                self._synced = True
                self._syncs += 1
                self._cv.notify_all()
        elif isinstance(ev, RoomStateChanged) and self._on_room_state:
            try:
                self._on_room_state(ev)
            except Exception as e:  # a callback's bug must not stop the watch
                log.exception("on_room_state callback failed")
                self._callback_failed(e)

    def _run_queued(self, q: "_libkvfence.QueuedWatch") -> None:
        """The libkvfence backend: the library's thread receives and
        resubscribes; this thread wakes once per batch."""
        while q.wait():
            for kind, data in q.drain():
                if kind == _libkvfence.DISCONNECTED:
                    code = struct.unpack_from("=I", data)[0] if len(data) >= 4 else 14
                    self.last_error = errors.make_error(
                        _CODES.get(code, grpc.StatusCode.UNKNOWN),
                        data[4:].decode(errors="replace"), "Control.WatchLeases")
                    log.info("WatchLeases ended (%s); libkvfence resubscribes", self.last_error)
                    continue
                ev = _event_from(control_pb2.LeaseEvent.FromString(data))
                if ev is not None:
                    self._handle(ev)
            with self._cv:
                if self._stopping:
                    return

    def _deliver(self, lease: Lease) -> None:
        with self._cv:
            if lease.lease_id in self._window:
                return  # a replay after resubscription: already handled
        try:
            self._on_released(lease)
        except Exception as e:
            log.exception("on_released callback failed for lease %d", lease.lease_id)
            self._callback_failed(e)
        with self._cv:
            now = time.monotonic()
            self._window.add(lease, now)
            self.delivered += 1
            if self._keep_leases:
                self._recent[lease.lease_id] = lease
                while len(self._recent) > self._keep_leases:
                    self._recent.popitem(last=False)
            if lease.lease_id in self._waiting:
                self._held[lease.lease_id] = lease
            self._cv.notify_all()
            due = now >= self._next_verify and not self._checking and not self._stopping
            if due:
                self._checking = True
                self._next_verify = now + self._window.remember_s
                old = self._window.old_rooms(now)
        if due and old:
            threading.Thread(target=self._verify, args=(old,), name="kvfence-release-check",
                             daemon=True).start()
        elif due:
            with self._cv:
                self._checking = False

    def _verify(self, old: List[Tuple[RoomKey, float, List[int]]]) -> None:
        """Its own thread: one replay of this watcher's filter, read up to
        `synced` (ids only); then every old room none of whose leases came
        back, and that got no delivery meanwhile, is forgotten. Nothing is
        forgotten when the replay fails."""
        client = self._own or self._control
        req = _convert.watch_leases_request(self._node_id, self._ranks, (), False)
        replayed = set()
        synced = False
        with self._cv:
            if self._stopping:
                self._checking = False
                return
            call = self._verify_call = client._stub.WatchLeases(req)
        try:
            for m in call:
                which = m.WhichOneof("event")
                if which == "released":
                    replayed.add(m.released.lease_id)
                elif which == "synced":
                    synced = True
                    break
        except grpc.RpcError as e:
            if not self._stopping:
                log.info("dedup window: the check's replay failed (%s); nothing forgotten",
                         e.code())
        finally:
            call.cancel()
        with self._cv:
            self._verify_call = None
            self._checking = False
            if not synced:
                return
            now = time.monotonic()
            for room, t, ids in old:
                if self._window.delivered_at(room) != t:
                    continue  # a later release of the room came: it is young again
                if any(lid in replayed for lid in ids):
                    self._window.touch(room, now)  # still kept by the server
                else:
                    self.forgotten += self._window.forget(room)
            self.verifications += 1

    def _callback_failed(self, e: BaseException) -> None:
        self.callback_errors.append(e)
        del self.callback_errors[:-_MAX_CALLBACK_ERRORS]

    def __enter__(self) -> "ReleaseWatcher":
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
