"""Build hook of the kvfence Python package (pyproject.toml holds the metadata).

Generates the gRPC stubs (kvfence._proto.v1) from the protos while the
package is built, with build_stubs.py: from $KVFENCE_API_DIR, else the
repository's api/ two directories up. It uses protoc and grpc_python_plugin
when both are on PATH (protobuf-compiler, protobuf-compiler-grpc), else the
grpc_tools module (python3-grpc-tools).
"""
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    """build_py that first writes kvfence/_proto into the build directory."""

    def run(self):
        api_dir = os.environ.get("KVFENCE_API_DIR") or os.path.join(HERE, "..", "..", "api")
        if not os.path.isfile(os.path.join(api_dir, "kvfence", "v1", "types.proto")):
            sys.exit("kvfence: the protos are not in %s (set KVFENCE_API_DIR to the repository's "
                     "api/ directory)" % api_dir)
        sys.path.insert(0, HERE)
        import build_stubs  # noqa: E402 (this directory, not an installed module)

        protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
        if protoc and plugin:
            args = [protoc, plugin]
        else:
            args = ["grpc_tools", "-"]
        out = os.path.join(self.build_lib)
        if build_stubs.main(["build_stubs.py"] + args + [api_dir, out]) != 0:
            sys.exit("kvfence: generating the gRPC stubs failed")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
