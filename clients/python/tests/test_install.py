"""`pip install clients/python` as an engine developer does it: into a venv
made with --system-site-packages over Debian's grpcio and protobuf, offline,
the stubs generated while the package is built; then the installed package
(not the source tree) talks to a real kvfence-control."""
import os
import shutil
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)                      # clients/python
REPO = os.path.dirname(os.path.dirname(PKG))     # the repository


def _clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the tests' own path: source + build tree
    env["PIP_NO_INDEX"] = "1"     # offline: nothing from any index
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_pip_install_into_a_venv_and_use_it(tmp_path, cluster):
    # A copy of what a clone has (the package and the protos), so the build's
    # own files (build/, *.egg-info) never land in the source tree.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    shutil.copytree(PKG, src / "clients" / "python", ignore=ignore)
    shutil.copytree(os.path.join(REPO, "api"), src / "api", ignore=ignore)
    venv = tmp_path / "venv"
    env = _clean_env()
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, env=env)
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-build-isolation",
                        str(src / "clients" / "python")], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True)
    assert r.returncode == 0, "pip install failed:\n" + r.stdout + r.stderr

    script = textwrap.dedent("""
        import os, sys, kvfence
        import kvfence.enginekit, kvfence.sglang, kvfence.vllm  # the engine backends
        from kvfence._proto.v1 import control_pb2
        d = os.path.dirname(kvfence.__file__)
        assert d.startswith(sys.prefix), d       # the venv's copy, not the source tree
        assert os.path.isfile(os.path.join(d, "py.typed"))
        assert os.path.isfile(os.path.join(d, "_proto", "v1", "control_pb2.pyi"))
        with kvfence.AdminClient(sys.argv[1]) as admin:
            admin.ping()
        print("ok", kvfence.__version__)
        """)
    r = subprocess.run([py, "-c", script, cluster.address], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok 0.1.0"
