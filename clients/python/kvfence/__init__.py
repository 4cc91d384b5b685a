"""kvfence: the Python client of kvfence (KV-cache page ownership for
disaggregated LLM serving), on grpcio.

    import kvfence
    with kvfence.ControlClient("127.0.0.1:7070") as ctl:
        j = ctl.join_room(room_id, kvfence.Participant("n2", 0, kvfence.Role.SINK),
                          pool_id, pages=kv_indices)  # a PageSet, smallest form
        ...
        ctl.wait_released(j.lease_id, timeout=30)   # only now are the pages free

The gRPC stubs (kvfence._proto.v1) are generated at build time from api/ by
clients/python/build_stubs.py into the build directory; put that directory on
PYTHONPATH after the source directory (see clients/python/README.md).
"""
# The generated stubs live in the build tree under <gen>/kvfence/_proto: let
# this package span every `kvfence` directory on sys.path.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)  # type: ignore[name-defined]

from .errors import (Aborted, AlreadyExists, Cancelled, DeadlineExceeded,  # noqa: E402
                     FailedPrecondition, Internal, InvalidArgument, KvfenceError, NotFound,
                     ResourceExhausted, Unavailable, Unimplemented, status_class)

try:
    from .client import (DEFAULT_FEATURES, DEFAULT_TIMEOUT_S, AbortReason,  # noqa: E402
                         AbortResult, AdminClient, ControlClient, JoinResult, Lease, LeaseMode,
                         LeaseReleased, LeaseState, LeaseWatch, NodeClient, NodeInfo, NodeState,
                         PageRange, Participant, Pool, PoolKind, ReleaseWatcher, Role, RoomInfo,
                         RoomKey, RoomState, RoomStateChanged, Token, WatchEvent, WatchSynced,
                         ranges_from_pages, LifetimeState, NodeRoomState, ChunkDone, TransportKind,
                         AuxReceived, TransferDone, NodeEvent, NodeWatch, ChunkRequest,
                         ChunkResult, ChunkStream, PageSet, PageSetForm)
except ImportError as e:  # pragma: no cover - stubs not generated or not on PYTHONPATH
    if "_proto" not in str(e):
        raise
    raise ImportError(
        "kvfence: generated stubs not found (kvfence._proto); build the `python_client` "
        "target and put its output directory on PYTHONPATH (clients/python/README.md)") from e

__version__ = "0.1.0"

__all__ = [
    "KvfenceError", "InvalidArgument", "NotFound", "AlreadyExists", "ResourceExhausted",
    "FailedPrecondition", "Aborted", "Unavailable", "DeadlineExceeded", "Unimplemented",
    "Cancelled", "Internal", "status_class",
    "ControlClient", "NodeClient", "AdminClient", "LeaseWatch", "ReleaseWatcher",
    "Role", "RoomState", "LeaseState", "LeaseMode", "AbortReason", "NodeState", "PoolKind",
    "RoomKey", "PageRange", "Participant", "Token", "Lease", "JoinResult", "AbortResult", "Pool",
    "LeaseReleased", "RoomStateChanged", "WatchSynced", "WatchEvent", "NodeInfo", "RoomInfo",
    "ranges_from_pages", "DEFAULT_FEATURES", "DEFAULT_TIMEOUT_S",
    "LifetimeState", "NodeRoomState", "ChunkDone", "TransportKind", "AuxReceived", "TransferDone",
    "NodeEvent",
    "NodeWatch", "ChunkRequest", "ChunkResult", "ChunkStream", "PageSet", "PageSetForm",
]
