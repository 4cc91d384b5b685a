"""How a room ended, asked after the fact.

The backends learn COMPLETED or ABORTED from WatchLeases room-state events.
A ReleaseWatcher that resubscribes (control-plane restart or failover)
replays the releases it missed but not the room states, so a lease can be
known RELEASED while its room's end is not. ended_state() asks the control
plane with the one engine call that says it: AbortRoom on the exact
generation. A lease is RELEASED only in an ended room, and AbortRoom of an
ended room changes nothing: FAILED_PRECONDITION for a COMPLETED room, the
room's token for an ABORTED one.
"""
from __future__ import annotations

from typing import Optional

from .. import errors
from ..client import ControlClient, RoomKey, RoomState

__all__ = ["ended_state"]


def ended_state(control: ControlClient, room: RoomKey) -> Optional[RoomState]:
    """How a room whose lease is RELEASED ended: COMPLETED, ABORTED, or
    UNSPECIFIED when it ended but cannot say how any more (its id has a newer
    generation, or its tombstone expired: treat it as failed, which is safe:
    the pages are released); None when the control plane cannot answer now
    (ask again later)."""
    try:
        r = control.abort_room(room, "kvfence backend: how did this released room end?")
    except errors.FailedPrecondition as e:
        # "room R:G is COMPLETED", or "generation G is not current".
        return RoomState.COMPLETED if "is COMPLETED" in e.details else RoomState.UNSPECIFIED
    except errors.NotFound:
        return RoomState.UNSPECIFIED
    except (errors.Unavailable, errors.DeadlineExceeded):
        return None
    return RoomState.ABORTED if r.state == RoomState.ABORTED else None
