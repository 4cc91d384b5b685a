"""cli_json_ref.py: the reference for the kvfence CLI's -o json (test_cli.c).

Usage: cli_json_ref.py TARGET CALL [ARG] < the CLI's JSON document

Makes the same Admin call as the CLI through Python's grpcio, prints the
reply with protobuf's own JSON printer (google.protobuf.json_format, the
canonical proto3 mapping that grpcurl prints too), and compares it with the
CLI's document read from stdin, both parsed by the json module. Fields that
time moves between the two calls (ages, last message, notice re-sends) are
dropped from both. Exit 0 when they are equal, 1 with both printed if not.
PYTHONPATH must hold the generated stubs (tests/interop builds them).
"""
import json
import sys

import grpc
from google.protobuf import json_format

from kvfence.v1 import control_pb2, control_pb2_grpc, types_pb2

MOVING = {"ageMs", "stateAgeMs", "lastSeenMs", "uptimeMs", "noticeAttempts",
          "noticesPending", "noticesSent", "noticesResent"}


def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if k not in MOVING}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v


def main():
    target, what = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else None
    admin = control_pb2_grpc.AdminStub(grpc.insecure_channel(target))
    big = 1000  # one page: the CLI merges its pages into one reply
    if what == "room":
        reply = admin.GetRoom(control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=int(arg))))
    elif what == "rooms":
        reply = admin.ListRooms(control_pb2.ListRoomsRequest(page_size=big))
    elif what == "node":
        reply = admin.GetNode(control_pb2.GetNodeRequest(node_id=arg))
    elif what == "nodes":
        reply = admin.ListNodes(control_pb2.ListNodesRequest(page_size=big))
    elif what == "leases":
        reply = admin.ListLeases(control_pb2.ListLeasesRequest(page_size=big))
    elif what == "stats":
        reply = admin.GetStats(control_pb2.GetStatsRequest())
    else:
        sys.exit("unknown call " + what)
    ref = strip(json_format.MessageToDict(reply))
    cli = strip(json.load(sys.stdin))
    if ref != cli:
        print("protobuf:", json.dumps(ref, sort_keys=True))
        print("kvfence: ", json.dumps(cli, sort_keys=True))
        sys.exit(1)


main()
