"""Exceptions of the kvfence client: every failed call raises a KvfenceError
that carries the gRPC status code and the server's message.

    try:
        ctl.extend_lease(room, lease_id, [(8, 4)])
    except kvfence.Aborted as e:       # the room is aborting: the pages come back later
        print(e.code, e.details)       # grpc.StatusCode.ABORTED, "room 7:3: ABORTING ..."

The subclass follows the status code (status_class()); codes without their own
class raise KvfenceError itself. DeadlineExceeded is also a TimeoutError and
Unavailable also a ConnectionError, so generic handlers catch them.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Type

import grpc

__all__ = [
    "KvfenceError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "Unavailable",
    "DeadlineExceeded",
    "Unimplemented",
    "Cancelled",
    "Internal",
    "status_class",
    "from_rpc_error",
]

ERROR_DETAIL_KEY = "kvfence-error-bin"


class KvfenceError(Exception):
    """A kvfence call failed.

    code:    the grpc.StatusCode of the reply
    details: the server's status message (names the field, room or page at fault)
    method:  the RPC, e.g. "Control.JoinRoom" ("" when raised by the client itself)
    detail:  the decoded kvfence.v1.ErrorDetail from the trailing metadata key
             `kvfence-error-bin` when the server sent one, else None
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, code: grpc.StatusCode, details: str = "", method: str = "",
                 detail: Optional[Any] = None) -> None:
        self.code = code
        self.details = details or ""
        self.method = method
        self.detail = detail
        where = (method + ": ") if method else ""
        super().__init__("%s%s: %s" % (where, code.name, self.details))

    @property
    def reason(self) -> str:
        """ErrorDetail.reason (e.g. "PAGE_CONFLICT") when the server sent one, else ""."""
        return getattr(self.detail, "reason", "") or ""


class InvalidArgument(KvfenceError):
    """INVALID_ARGUMENT: a malformed field; the message names it."""


class NotFound(KvfenceError):
    """NOT_FOUND: unknown room, lease, node or pool."""


class AlreadyExists(KvfenceError):
    """ALREADY_EXISTS: a second, different create of a unique thing."""


class ResourceExhausted(KvfenceError):
    """RESOURCE_EXHAUSTED: a list longer than a limit, or out of memory."""


class FailedPrecondition(KvfenceError):
    """FAILED_PRECONDITION: wrong state (pages of another room, stale
    generation or token, missing capability)."""


class Aborted(KvfenceError):
    """ABORTED: the room is aborting or aborted."""


class Unavailable(KvfenceError, ConnectionError):
    """UNAVAILABLE: server down, shutting down or recovering, or the node does
    not know the room yet; retry with backoff."""


class DeadlineExceeded(KvfenceError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline (or a client-side wait such as
    wait_released) passed."""


class Unimplemented(KvfenceError):
    """UNIMPLEMENTED: the server does not serve this call (yet)."""


class Cancelled(KvfenceError):
    """CANCELLED: the call was cancelled."""


class Internal(KvfenceError):
    """INTERNAL: the server failed (mapping, registration, ...)."""


_BY_CODE: Dict[grpc.StatusCode, Type[KvfenceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
}

for _code, _cls in _BY_CODE.items():
    _cls.code = _code


def status_class(code: grpc.StatusCode) -> Type[KvfenceError]:
    """The exception class raised for `code` (KvfenceError when it has none)."""
    return _BY_CODE.get(code, KvfenceError)


def make_error(code: grpc.StatusCode, details: str = "", method: str = "",
               detail: Optional[Any] = None) -> KvfenceError:
    """An exception of the class that matches `code`."""
    return status_class(code)(code, details, method, detail)


def _error_detail(err: grpc.RpcError) -> Optional[Any]:
    trailing = getattr(err, "trailing_metadata", None)
    if trailing is None:
        return None
    try:
        md = trailing() or ()
    except Exception:  # pragma: no cover - a call object without metadata
        return None
    for key, value in md:
        if key == ERROR_DETAIL_KEY and isinstance(value, bytes):
            try:
                from ._proto.v1 import types_pb2

                d = types_pb2.ErrorDetail()
                d.ParseFromString(value)
                return d
            except Exception:
                return None
    return None


def from_rpc_error(err: grpc.RpcError, method: str = "") -> KvfenceError:
    """The KvfenceError for a grpc.RpcError raised by a call or a stream."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return make_error(code or grpc.StatusCode.UNKNOWN, details or "", method, _error_detail(err))
