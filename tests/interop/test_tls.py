"""TLS on kvfence-control's gRPC port (--tls-cert/--tls-key) and mutual TLS
(--tls-client-ca), seen from an independent client (python3-grpcio).

A throwaway PKI is made with /usr/bin/openssl once per module: a CA, a
server certificate for 127.0.0.1 (SAN IP:127.0.0.1 and DNS:localhost), a
client certificate, and a second, unrelated CA with its own client
certificate. Each test starts its own server (kvf_harness.ControlProcess,
metrics on an ephemeral port) and stops it with SIGTERM, expecting exit 0.
"""

import os
import subprocess

import grpc
import pytest

from kvfence.v1 import control_pb2

from kvf_harness import RPC_TIMEOUT_S, ControlProcess, FakeNode, admin

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
    _make_leaf(d, "other-client", "other-ca", client_ext)
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
    _assert_works(channels(address, pki, client="client"))


def test_mtls_client_cert_of_other_ca_fails(tls_server, channels, pki):
    address = tls_server(mutual=True)
    _assert_refused(channels(address, pki, client="other-client"))
    _assert_works(channels(address, pki, client="client"))


def test_mtls_insecure_channel_fails(tls_server, pki):
    address = tls_server(mutual=True)
    with grpc.insecure_channel(address) as ch:
        _assert_refused(ch)
