"""ctypes binding of libkvfence's queued lease watch (kvfence.h,
kvf_watch_queue_*), for ReleaseWatcher(backend="libkvfence").

The library's own thread receives the WatchLeases stream, resubscribes
with backoff and queues every event as the LeaseEvent bytes the server
sent, without the GIL; this module's reader blocks in poll(2) on the
queue's eventfd (GIL released) and takes the whole batch in one call that
keeps the GIL (ctypes.PyDLL: no release and re-acquire around a call that
only copies memory). So a burst of releases costs the Python thread one GIL
acquisition, where grpcio costs one per message.

The library is found by $KVFENCE_LIBRARY (a path to libkvfence.so) or
ctypes.util.find_library("kvfence"); load() is None when neither gives one
with the queued watch. Plaintext only: libkvfence takes TLS as file paths,
grpc.ChannelCredentials carry bytes.

DESIGN: one QueuedWatch belongs to one reader thread (wait() and drain());
wake() and close() may be called from another thread (close() after the
reader has returned).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
from typing import Iterable, List, Optional, Tuple

# enum kvf_lease_event_kind
RELEASED, ROOM_STATE, SYNCED, DISCONNECTED = 1, 2, 3, 4

_ENOBUFS = 105


class _Status(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("message", ctypes.c_char * 256)]


class _Filter(ctypes.Structure):
    _fields_ = [("node_id", ctypes.c_char_p), ("ranks", ctypes.POINTER(ctypes.c_uint32)),
                ("n_ranks", ctypes.c_size_t), ("lease_ids", ctypes.POINTER(ctypes.c_uint64)),
                ("n_lease_ids", ctypes.c_size_t), ("include_room_states", ctypes.c_bool)]


class _Lib:
    """The two views of one libkvfence: `calls` releases the GIL around each
    call (create, stop: they may block), `quick` keeps it (drain)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls = ctypes.CDLL(path)
        self.quick = ctypes.PyDLL(path)
        vp, st = ctypes.c_void_p, ctypes.POINTER(_Status)
        c = self.calls
        c.kvf_client_create.argtypes = [ctypes.c_char_p, vp, ctypes.POINTER(vp), st]
        c.kvf_client_create.restype = ctypes.c_int
        c.kvf_client_destroy.argtypes = [vp]
        c.kvf_client_destroy.restype = None
        c.kvf_watch_queue_start.argtypes = [vp, ctypes.POINTER(_Filter), ctypes.POINTER(vp), st]
        c.kvf_watch_queue_start.restype = ctypes.c_int
        c.kvf_watch_queue_fd.argtypes = [vp]
        c.kvf_watch_queue_fd.restype = ctypes.c_int
        c.kvf_watch_queue_stop.argtypes = [vp]
        c.kvf_watch_queue_stop.restype = None
        q = self.quick
        q.kvf_watch_queue_drain.argtypes = [vp, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.POINTER(ctypes.c_size_t)]
        q.kvf_watch_queue_drain.restype = ctypes.c_int


_loaded: Optional[_Lib] = None
_tried = False


def load() -> Optional[_Lib]:
    """libkvfence with the queued watch, or None."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    path = os.environ.get("KVFENCE_LIBRARY") or ctypes.util.find_library("kvfence")
    if not path:
        return None
    try:
        lib = _Lib(path)
    except (OSError, AttributeError):  # not loadable, or too old (no kvf_watch_queue_*)
        return None
    _loaded = lib
    return lib


class QueuedWatch:
    """One kvf_client and one kvf_watch_queue on it."""

    def __init__(self, lib: _Lib, target: str, node_id: str, ranks: Iterable[int],
                 include_room_states: bool) -> None:
        self._lib = lib
        self._client = ctypes.c_void_p()
        self._queue = ctypes.c_void_p()
        st = _Status()
        if lib.calls.kvf_client_create(target.encode(), None, ctypes.byref(self._client),
                                       ctypes.byref(st)):
            raise OSError("libkvfence: kvf_client_create(%s): %s" %
                          (target, st.message.decode(errors="replace")))
        rank_list = list(ranks)
        self._ranks = (ctypes.c_uint32 * max(1, len(rank_list)))(*rank_list)
        f = _Filter(node_id.encode() if node_id else None,
                    self._ranks if rank_list else None, len(rank_list), None, 0,
                    include_room_states)
        if lib.calls.kvf_watch_queue_start(self._client, ctypes.byref(f),
                                           ctypes.byref(self._queue), ctypes.byref(st)):
            lib.calls.kvf_client_destroy(self._client)
            raise OSError("libkvfence: kvf_watch_queue_start: %s" %
                          st.message.decode(errors="replace"))
        self._fd = lib.calls.kvf_watch_queue_fd(self._queue)
        self._wake_r, self._wake_w = os.pipe()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._cap = 1 << 20
        self._buf = ctypes.create_string_buffer(self._cap)
        self._len = ctypes.c_size_t()

    def wait(self) -> bool:
        """Blocks (GIL released) until events may be queued (True) or wake()
        was called (False)."""
        while True:
            for fd, _ in self._poll.poll():
                if fd == self._wake_r:
                    return False
            return True

    def drain(self) -> List[Tuple[int, bytes]]:
        """Every queued event: (kind, bytes) in order; DISCONNECTED's bytes are
        a uint32 status code and the message."""
        while True:
            rc = self._lib.quick.kvf_watch_queue_drain(self._queue, self._buf, self._cap,
                                                       ctypes.byref(self._len))
            if rc == -_ENOBUFS:  # one record larger than the buffer: grow it
                self._cap = max(self._cap * 2, self._len.value)
                self._buf = ctypes.create_string_buffer(self._cap)
                continue
            if rc != 0:
                raise OSError(-rc, "kvf_watch_queue_drain")
            break
        data = ctypes.string_at(self._buf, self._len.value)
        out = []
        off = 0
        while off < len(data):
            kind, n = struct.unpack_from("=II", data, off)
            off += 8
            out.append((kind, data[off:off + n]))
            off += n
        return out

    def wake(self) -> None:
        """Makes wait() return False (any thread)."""
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Stops the watch (joins the library's thread) and frees everything;
        the reader must have returned."""
        self._lib.calls.kvf_watch_queue_stop(self._queue)
        self._lib.calls.kvf_client_destroy(self._client)
        os.close(self._wake_r)
        os.close(self._wake_w)
