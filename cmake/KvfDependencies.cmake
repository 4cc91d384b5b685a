# KvfDependencies: the one list of what kvfence needs, each with the Debian 12
# package that provides it (scripts/install-deps.sh installs the same list).
# Every entry is required: a missing one stops the configure here, naming the
# package. The only optional part is CUDA (top-level CMakeLists.txt), which
# says in the configure output whether it is on and why.
include_guard(GLOBAL)

find_package(PkgConfig QUIET)
if(NOT PKG_CONFIG_FOUND)
  kvf_missing("program 'pkg-config'" pkg-config)
endif()
find_package(Threads REQUIRED)

# Libraries (DESIGN: gRPC core C API, protobuf-c, ZeroMQ, verbs, metrics HTTP).
kvf_require_pkg(GRPC grpc libgrpc-dev)
kvf_require_pkg(PROTOBUFC libprotobuf-c libprotobuf-c-dev)
kvf_require_pkg(ZMQ libzmq libzmq3-dev)
# libcrypto: the data port's handshake (HMAC-SHA256, RAND_bytes, CRYPTO_memcmp) and the
# per-incarnation X25519 peer keys (dataplane/peer/peer_keys.c).
kvf_require_pkg(CRYPTO libcrypto libssl-dev)
kvf_require_pkg(IBVERBS libibverbs libibverbs-dev)
kvf_require_pkg(MHD libmicrohttpd libmicrohttpd-dev)
kvf_require_pkg(CMOCKA cmocka libcmocka-dev)

# Code generators.
kvf_require_program(KVF_PROTOC protoc protobuf-compiler)
kvf_require_program(KVF_PROTOC_C protoc-c protobuf-c-compiler)
kvf_require_program(KVF_GRPC_PY_PLUGIN grpc_python_plugin protobuf-compiler-grpc)

# Protos that are not ours: health and reflection (grpc-proto), and the
# descriptor proto that reflection indexes (libprotobuf-dev).
set(KVF_GRPC_PROTO_DIR /usr/share/grpc-proto CACHE PATH "Where grpc-proto installed its .proto files")
set(KVF_PROTOBUF_PROTO_DIR /usr/include CACHE PATH
    "Where google/protobuf/descriptor.proto is installed")
foreach(proto grpc/health/v1/health.proto grpc/reflection/v1alpha/reflection.proto
        grpc/reflection/v1/reflection.proto)
  kvf_require_file(${KVF_GRPC_PROTO_DIR}/${proto} grpc-proto)
endforeach()
kvf_require_file(${KVF_PROTOBUF_PROTO_DIR}/google/protobuf/descriptor.proto libprotobuf-dev)

# The Python client, the interop and crash tests: Debian's python3 and grpcio.
set(KVF_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with grpcio, protobuf and pytest (Debian's)")
kvf_require_file(${KVF_PYTHON} python3)
kvf_require_python_module(${KVF_PYTHON} grpc python3-grpcio)
kvf_require_python_module(${KVF_PYTHON} google.protobuf python3-protobuf)
kvf_require_python_module(${KVF_PYTHON} pytest python3-pytest)
# tests/monitoring reads the alert rules and their promtool tests; the Python
# client's install test makes a venv and pip-installs into it, offline.
kvf_require_python_module(${KVF_PYTHON} yaml python3-yaml)
kvf_require_python_module(${KVF_PYTHON} ensurepip python3-venv)
kvf_require_python_module(${KVF_PYTHON} setuptools python3-setuptools)
kvf_require_python_module(${KVF_PYTHON} wheel python3-wheel)

# Tests that make throwaway certificates (TLS), and the deployment checks
# (helm and kubectl come from an npm package and are unzipped; normal build
# only: a sanitizer build's binaries load libasan, which no image ships).
kvf_require_program(KVF_OPENSSL openssl openssl)
# The Promela model of the release proof (tests/model).
kvf_require_program(KVF_SPIN spin spin)
# promtool checks both daemons' /metrics and the shipped alert rules.
kvf_require_program(KVF_PROMTOOL promtool prometheus)
if(NOT KVF_SANITIZE)
  kvf_require_program(KVF_NODE_EXE node nodejs)
  kvf_require_program(KVF_NPM_EXE npm npm)
  kvf_require_program(KVF_UNZIP unzip unzip)
endif()
