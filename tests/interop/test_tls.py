"""TLS on kvfence-control's gRPC port (--tls-cert/--tls-key) and mutual TLS
(--tls-client-ca), seen from an independent client (python3-grpcio).

A throwaway PKI is made with /usr/bin/openssl once per module: a CA, a
server certificate for 127.0.0.1 (SAN IP:127.0.0.1 and DNS:localhost), client
certificates for each role (admin, an engine, nodes n1 and n2, one naming no
role), and a second, unrelated CA with its own client certificate. With
mutual TLS a caller is who its certificate says (docs/security.md): the
identity tests below are the forged-party cases of the release proof. Each test starts its own server (kvf_harness.ControlProcess,
metrics on an ephemeral port) and stops it with SIGTERM, expecting exit 0.
"""

import os
import subprocess
import time

import grpc
import pytest

from kvfence.v1 import control_pb2

from kvfence.v1 import node_pb2, types_pb2

from kvf_harness import RPC_TIMEOUT_S, ControlProcess, FakeNode, admin, control, join_request

from kvfstubs.grpc_health.v1 import health_pb2, health_pb2_grpc

OPENSSL = "/usr/bin/openssl"


# ---- the PKI ----------------------------------------------------------------------


def _openssl(*args, cwd):
    proc = subprocess.run(
        [OPENSSL] + list(args), cwd=str(cwd), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30,
    )
    assert proc.returncode == 0, "openssl %s:\n%s" % (" ".join(args), proc.stdout.decode(errors="replace"))


def _make_ca(d, name):
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", name + ".key", "-out", name + ".pem", "-days", "2", "-subj", "/CN=kvfence test " + name,
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )


def _make_leaf(d, name, ca, extensions):
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=kvfence test " + name,
        cwd=d,
    )
    with open(os.path.join(str(d), name + ".ext"), "w", encoding="ascii") as f:
        f.write(extensions)
    _openssl(
        "x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
        "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-sha256",
        "-extfile", name + ".ext",
        cwd=d,
    )


class Pki:
    def __init__(self, d):
        self.dir = d

    def path(self, name):
        return str(self.dir / name)

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_leaf(
        d, "server", "ca",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    client_ext = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"
    _make_leaf(d, "client", "ca", client_ext)
    _make_leaf(d, "other-client", "other-ca", client_ext + "subjectAltName=URI:spiffe://kvfence/admin\n")
    for name, uri in [("admin", "spiffe://kvfence/admin"), ("engine-7", "spiffe://kvfence/engine/engine-7"),
                      ("node-n1", "spiffe://kvfence/node/n1"), ("node-n2", "spiffe://kvfence/node/n2")]:
        _make_leaf(d, name, "ca", client_ext + "subjectAltName=URI:%s\n" % uri)
    return Pki(d)


# ---- servers and channels -------------------------------------------------------------


@pytest.fixture
def tls_server(control_bin, tmp_path, pki):
    """tls_server(mutual=False): a running kvfence-control with TLS; returns
    its address. Every server still running at teardown is stopped; a server
    that does not exit 0 on SIGTERM fails the test."""
    started = []

    def start(mutual=False):
        args = ["--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key")]
        if mutual:
            args += ["--tls-client-ca", pki.path("ca.pem")]
        name = "tls%d" % len(started)
        p = ControlProcess(control_bin, tmp_path, tmp_path / (name + "-data"), name, args)
        started.append(p)
        p.start()
        return p.wait_serving()

    yield start
    failures = []
    for p in started:
        try:
            rc = p.terminate()
        except AssertionError as e:
            failures.append(str(e))
            continue
        if rc != 0:
            failures.append("kvfence-control exited with %d after SIGTERM:\n%s" % (rc, p.stderr_tail()))
    for p in started:
        p.cleanup()
    assert not failures, "\n".join(failures)


@pytest.fixture
def channels():
    """channels(address, ...) -> a grpc.secure_channel (closed at teardown)."""
    opened = []

    def make(address, pki, ca="ca.pem", client=None, options=()):
        creds = grpc.ssl_channel_credentials(
            root_certificates=pki.read(ca),
            private_key=pki.read(client + ".key") if client else None,
            certificate_chain=pki.read(client + ".pem") if client else None,
        )
        ch = grpc.secure_channel(address, creds, options=list(options))
        opened.append(ch)
        return ch

    yield make
    for ch in opened:
        ch.close()


def _ping(ch):
    return admin(ch).Ping(control_pb2.PingRequest(), timeout=RPC_TIMEOUT_S)


def _assert_works(ch):
    grpc.channel_ready_future(ch).result(timeout=RPC_TIMEOUT_S)
    assert isinstance(_ping(ch), control_pb2.PingResponse)
    if health_pb2 is not None:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _assert_refused(ch):
    with pytest.raises(grpc.RpcError) as info:
        _ping(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, "%s: %s" % (
        info.value.code(),
        info.value.details(),
    )


# ---- server TLS -------------------------------------------------------------------


def test_tls_ping_and_health(tls_server, channels, pki):
    address = tls_server()
    _assert_works(channels(address, pki))


def test_tls_server_name_localhost(tls_server, channels, pki):
    """The DNS SAN works too; a name the certificate lacks is refused."""
    address = tls_server()
    _assert_works(channels(address, pki, options=[("grpc.ssl_target_name_override", "localhost")]))
    _assert_refused(
        channels(address, pki, options=[("grpc.ssl_target_name_override", "not-this-host.example")])
    )


def test_tls_insecure_channel_fails(tls_server, pki):
    address = tls_server()
    with grpc.insecure_channel(address) as ch:
        _assert_refused(ch)


def test_tls_other_ca_fails(tls_server, channels, pki):
    address = tls_server()
    _assert_refused(channels(address, pki, ca="other-ca.pem"))
    # The server is still fine for a good client afterwards.
    _assert_works(channels(address, pki))


def test_tls_node_session(tls_server, channels, pki):
    """A node attaches over TLS like over plaintext."""
    address = tls_server()
    ch = channels(address, pki)
    node = FakeNode(ch, "tls-node")
    try:
        welcome = node.recv("welcome")
        assert welcome.negotiated_version == 1
        info = admin(ch).GetNode(control_pb2.GetNodeRequest(node_id="tls-node"), timeout=RPC_TIMEOUT_S)
        assert info.node_id == "tls-node"
    finally:
        node.close()


# ---- mutual TLS -------------------------------------------------------------------


def test_mtls_client_without_cert_fails(tls_server, channels, pki):
    address = tls_server(mutual=True)
    _assert_refused(channels(address, pki))


def test_mtls_client_with_cert_works(tls_server, channels, pki):
    address = tls_server(mutual=True)
    _assert_works(channels(address, pki, client="admin"))


def test_mtls_client_cert_of_other_ca_fails(tls_server, channels, pki):
    """Even when it names the admin identity."""
    address = tls_server(mutual=True)
    _assert_refused(channels(address, pki, client="other-client"))
    _assert_works(channels(address, pki, client="admin"))


def test_mtls_insecure_channel_fails(tls_server, pki):
    address = tls_server(mutual=True)
    with grpc.insecure_channel(address) as ch:
        _assert_refused(ch)


# ---- mutual TLS: who may call what ----------------------------------------------


def _code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details() or ""


def _attach_refused(ch, node_id):
    """A Hello as node_id on `ch`: the stream must end PERMISSION_DENIED."""
    node = FakeNode(ch, node_id)
    try:
        with pytest.raises(AssertionError) as info:
            node.recv("welcome")
        err = node.call
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, "%s: %s" % (err.code(), err.details())
        return err.details()
    finally:
        node.close()


def test_mtls_admin_needs_admin_identity(tls_server, channels, pki):
    """Admin calls with an engine's, a node's or a nameless certificate are
    PERMISSION_DENIED, naming the method and the certificate; the admin's work."""
    address = tls_server(mutual=True)
    for client in ["engine-7", "node-n1", "client"]:
        ch = channels(address, pki, client=client)
        code, details = _code_of(
            lambda: admin(ch).FenceNode(control_pb2.FenceNodeRequest(node_id="n1"), timeout=RPC_TIMEOUT_S)
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED, (client, code, details)
        assert "/kvfence.v1.Admin/FenceNode" in details and "admin" in details, details
        code, details = _code_of(lambda: _ping(ch))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (client, code, details)
    _assert_works(channels(address, pki, client="admin"))


def test_mtls_control_needs_engine_identity(tls_server, channels, pki):
    """A node's certificate cannot join or abort rooms; an engine's can."""
    address = tls_server(mutual=True)
    n1 = FakeNode(channels(address, pki, client="node-n1"), "n1")
    try:
        n1.recv("welcome")
        node_ch = channels(address, pki, client="node-n1")
        code, details = _code_of(
            lambda: control(node_ch).JoinRoom(join_request(1, "n1", types_pb2.ROLE_SINK, 0), timeout=RPC_TIMEOUT_S)
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert "engine or admin" in details, details
        engine = channels(address, pki, client="engine-7")
        reply = control(engine).JoinRoom(
            join_request(1, "n1", types_pb2.ROLE_SINK, 0), timeout=RPC_TIMEOUT_S
        )
        assert reply.lease_id != 0
    finally:
        n1.close()


def test_mtls_forged_node_session_refused(tls_server, channels, pki):
    """Attach as n1 with n2's certificate or an engine's: refused before the
    Hello reaches the state (n1 stays unknown); n1's own certificate works."""
    address = tls_server(mutual=True)
    admin_ch = channels(address, pki, client="admin")
    for client in ["node-n2", "engine-7", "client"]:
        details = _attach_refused(channels(address, pki, client=client), "n1")
        assert "n1" in details or "node" in details, details
        code, _ = _code_of(
            lambda: admin(admin_ch).GetNode(control_pb2.GetNodeRequest(node_id="n1"), timeout=RPC_TIMEOUT_S)
        )
        assert code == grpc.StatusCode.NOT_FOUND, (client, code)
    n1 = FakeNode(channels(address, pki, client="node-n1"), "n1")
    try:
        assert n1.recv("welcome").negotiated_version == 1
    finally:
        n1.close()


def test_mtls_forged_drained_releases_nothing(tls_server, channels, pki):
    """The attack seen on the old code: n1 is attached and holds an aborted
    room's lease; a second party that knows n1's id and incarnation (Admin
    shows both) attaches as n1 to receive the AbortNotice and report Drained.
    With n2's certificate it cannot attach as n1, so the lease stays RELEASING
    until the real n1 drains."""
    address = tls_server(mutual=True)
    admin_ch = channels(address, pki, client="admin")
    engine = channels(address, pki, client="engine-7")
    n1 = FakeNode(channels(address, pki, client="node-n1"), "n1", incarnation=7)
    try:
        n1.recv("welcome")
        j = control(engine).JoinRoom(
            join_request(5, "n1", types_pb2.ROLE_SOURCE, 0, count=4), timeout=RPC_TIMEOUT_S
        )
        abort = control(engine).AbortRoom(control_pb2.AbortRoomRequest(room=j.room), timeout=RPC_TIMEOUT_S)
        notice = n1.recv("abort_notice")
        forger = FakeNode(channels(address, pki, client="node-n2"), "n1", incarnation=7)
        try:
            with pytest.raises(AssertionError):
                forger.recv("abort_notice", timeout=1.0)
            forger.send(drained=node_pb2.Drained(room=j.room, token=abort.token, notice_id=notice.notice_id))
        finally:
            forger.close()
        info = admin(admin_ch).GetRoom(control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=5)), timeout=RPC_TIMEOUT_S)
        assert info.state == types_pb2.ROOM_STATE_ABORTING, str(info)
        assert [p.lease.state for p in info.participants] == [types_pb2.LEASE_STATE_RELEASING], str(info)
        # The real node's Drained releases it.
        n1.send(drained=node_pb2.Drained(room=j.room, token=notice.token, notice_id=notice.notice_id))
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while True:
            info = admin(admin_ch).GetRoom(control_pb2.GetRoomRequest(room=types_pb2.RoomKey(room_id=5)), timeout=RPC_TIMEOUT_S)
            if info.state == types_pb2.ROOM_STATE_ABORTED:
                break
            assert time.monotonic() < deadline, str(info)
            time.sleep(0.02)
    finally:
        n1.close()


def _node_attached(admin_ch, node_id):
    try:
        info = admin(admin_ch).GetNode(control_pb2.GetNodeRequest(node_id=node_id), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        return False
    return info.state == types_pb2.NODE_STATE_ATTACHED


def test_mtls_real_node_attaches_as_its_certificate(tls_server, channels, pki, node_bin, tmp_path):
    """kvfence-node over mutual TLS (--control-tls-*): attaches as n1 with
    n1's certificate; with n2's certificate it is refused and never attaches."""
    address = tls_server(mutual=True)
    admin_ch = channels(address, pki, client="admin")
    procs = []

    def start(node_id, cert):
        log = open(str(tmp_path / ("%s-%s.log" % (node_id, cert))), "wb")
        p = subprocess.Popen(
            [node_bin, "--control", address, "--node-id", node_id,
             "--local-socket", str(tmp_path / ("%s-%s.sock" % (node_id, cert))), "--rdma", "off",
             "--control-tls-ca", pki.path("ca.pem"), "--control-tls-cert", pki.path(cert + ".pem"),
             "--control-tls-key", pki.path(cert + ".key")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        procs.append((p, log))
        return p

    try:
        start("n1", "node-n2")
        time.sleep(1.5)  # several reconnect attempts
        assert not _node_attached(admin_ch, "n1")
        start("n1", "node-n1")
        deadline = time.monotonic() + 10
        while not _node_attached(admin_ch, "n1"):
            assert time.monotonic() < deadline, "n1 did not attach over mutual TLS"
            time.sleep(0.05)
        with open(str(tmp_path / "n1-node-n2.log"), "rb") as f:
            assert b"is not the node the client certificate names" in f.read()
    finally:
        for p, log in procs:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()


def test_kvfence_insecure_metric(control_bin, tmp_path, pki):
    """kvfence_insecure is 1 without mutual TLS and 0 with it."""
    import urllib.request

    values = {}
    for name, args in [("plain", []),
                       ("mtls", ["--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
                                 "--tls-client-ca", pki.path("ca.pem")])]:
        mport = tmp_path / (name + ".mport")
        p = ControlProcess(control_bin, tmp_path, tmp_path / (name + "-data"), name,
                           args + ["--metrics-port-file", str(mport)])
        p.start()
        try:
            p.wait_serving()
            port = int(mport.read_text().split()[0])
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=RPC_TIMEOUT_S) as r:
                text = r.read().decode()
            values[name] = [l for l in text.splitlines() if l.startswith("kvfence_insecure ")]
        finally:
            assert p.terminate() == 0, p.stderr_tail()
            p.cleanup()
    assert values == {"plain": ["kvfence_insecure 1"], "mtls": ["kvfence_insecure 0"]}, values
