"""The rendezvous of prefill and decode ranks: a small HTTP server (the
engine's bootstrap server) and its client.

It carries what kvfence does not: which node and pool a prefill rank is on,
and, per room and prefill rank, the decode side's metadata (its room key,
node, rank, pool, page indices, aux slot). It also carries aborts that
happen before a side knows the room's generation: a side that aborts before
it joined leaves a tombstone, and the peer's later metadata is refused (409),
so the peer aborts its own room by its exact key. Everything else about an
abort goes through kvfence (AbortRoom, RELEASED).

DESIGN. One ThreadingHTTPServer on loopback (or the given host), one thread
per connection; the whole state is two dicts under one lock, so a PUT of
metadata and a tombstone of the same room are ordered: either the metadata
is in before the tombstone (and the aborting side reads it back and aborts
by key) or it is refused. Entries are removed by DELETE (the prefill side's
clear()), except tombstones, which stay for the server's life (a few bytes
per aborted request; SGLang's bootstrap_room is random per request).

    PUT    /ranks/<rank>              {"node_id", "features", ...}
    GET    /ranks/<rank>              the same, or 404
    PUT    /rooms/<room>/<rank>/sink  the decode metadata; 409 {"aborted"} if tombstoned
    PUT    /rooms/<room>/<rank>/abort {"detail"}; answers the entry
    GET    /rooms/<room>/<rank>       {"sink": {...} | null, "aborted": str | null}
    DELETE /rooms/<room>/<rank>
"""
from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

__all__ = ["RendezvousServer", "Rendezvous", "RendezvousError"]

_TIMEOUT_S = 5.0


class RendezvousError(RuntimeError):
    pass


class RendezvousServer:
    """The server: RendezvousServer(host, port) serves at once (port 0: any;
    .port says which) until close()."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._ranks: Dict[str, Any] = {}
        self._rooms: Dict[Tuple[str, str], Dict[str, Any]] = {}
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:  # quiet
                pass

            def _reply(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"null")

            def do_GET(self) -> None:
                self._reply(*srv._handle("GET", self.path, None))

            def do_PUT(self) -> None:
                try:
                    body = self._body()
                except ValueError:
                    self._reply(400, {"error": "body: not JSON"})
                    return
                self._reply(*srv._handle("PUT", self.path, body))

            def do_DELETE(self) -> None:
                self._reply(*srv._handle("DELETE", self.path, None))

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvf-rendezvous",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return "%s:%d" % (self.host, self.port)

    def _handle(self, method: str, path: str, body: Any) -> Tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        with self._lock:
            if len(parts) == 2 and parts[0] == "ranks":
                if method == "PUT":
                    self._ranks[parts[1]] = body
                    return 200, {"ok": True}
                if method == "GET":
                    if parts[1] in self._ranks:
                        return 200, self._ranks[parts[1]]
                    return 404, {"error": "rank %s: not registered" % parts[1]}
            if len(parts) >= 3 and parts[0] == "rooms":
                key = (parts[1], parts[2])
                entry = self._rooms.get(key)
                if len(parts) == 3 and method == "GET":
                    return 200, entry or {"sink": None, "aborted": None}
                if len(parts) == 3 and method == "DELETE":
                    # A tombstone stays: the peer may post its metadata later
                    # (room ids are random per request, so it is not reused).
                    if entry is not None and entry["aborted"] is None:
                        del self._rooms[key]
                    return 200, {"ok": True}
                if len(parts) == 4 and method == "PUT":
                    entry = self._rooms.setdefault(key, {"sink": None, "aborted": None})
                    if parts[3] == "sink":
                        if entry["aborted"] is not None:
                            return 409, dict(entry)
                        entry["sink"] = body
                        return 200, dict(entry)
                    if parts[3] == "abort":
                        if entry["aborted"] is None:
                            entry["aborted"] = str((body or {}).get("detail") or "aborted")
                        return 200, dict(entry)
        return 404, {"error": "%s %s: no such resource" % (method, path)}

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


class Rendezvous:
    """A client of one RendezvousServer ("host:port")."""

    def __init__(self, address: str, timeout: float = _TIMEOUT_S) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError("bootstrap address %r: want host:port" % (address,))
        self.address = address
        self._host, self._port, self._timeout = host, int(port), timeout

    def _call(self, method: str, path: str, body: Any = None) -> Tuple[int, Any]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        except (OSError, http.client.HTTPException) as e:
            raise RendezvousError("bootstrap server %s: %s %s: %s" %
                                  (self.address, method, path, e)) from None
        finally:
            conn.close()

    def put_rank(self, rank: int, info: Dict[str, Any]) -> None:
        code, r = self._call("PUT", "/ranks/%d" % rank, info)
        if code != 200:
            raise RendezvousError("bootstrap server %s: PUT rank %d: %s" % (self.address, rank, r))

    def get_rank(self, rank: int) -> Optional[Dict[str, Any]]:
        code, r = self._call("GET", "/ranks/%d" % rank)
        return r if code == 200 else None

    def room(self, room: int, rank: int) -> Dict[str, Any]:
        return self._call("GET", "/rooms/%d/%d" % (room, rank))[1]

    def put_sink(self, room: int, rank: int, info: Dict[str, Any]) -> Optional[str]:
        """Posts the decode metadata; None, or the tombstone's detail when the
        prefill side aborted first (nothing was posted)."""
        code, r = self._call("PUT", "/rooms/%d/%d/sink" % (room, rank), info)
        if code == 409:
            return str(r.get("aborted"))
        if code != 200:
            raise RendezvousError("bootstrap server %s: PUT sink of room %d: %s" %
                                  (self.address, room, r))
        return None

    def abort(self, room: int, rank: int, detail: str) -> Dict[str, Any]:
        """Leaves a tombstone; the entry as it was (its "sink" may name the key
        to abort by)."""
        return self._call("PUT", "/rooms/%d/%d/abort" % (room, rank), {"detail": detail})[1]

    def delete(self, room: int, rank: int) -> None:
        self._call("DELETE", "/rooms/%d/%d" % (room, rank))
