"""docs/quickstart.md's programs run as written: the ```c block compiled
against this build's libkvfence and run, the ```python block in its own
/usr/bin/python3 process, each against a real kvfence-control and two real
kvfence-node processes, with the environment `scripts/run.sh --keep` has the
reader export."""
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
DOC = os.path.join(REPO, "docs", "quickstart.md")


def block(lang):
    with open(DOC, encoding="utf-8") as f:
        found = re.findall(r"^```%s\n(.*?)^```$" % lang, f.read(), re.S | re.M)
    assert len(found) == 1, "docs/quickstart.md: want one ```%s block, found %d" % (lang,
                                                                                  len(found))
    return found[0]


def env_of(cluster):
    return dict(os.environ, KVFENCE_CONTROL=cluster.address,
                KVFENCE_N1_SOCKET=cluster.socket("n1"), KVFENCE_N2_SOCKET=cluster.socket("n2"))


def test_c_quickstart_runs_as_written(cluster, tmp_path):
    lib = os.environ.get("KVFENCE_LIBRARY")  # ctest sets it outside sanitizer builds
    if not lib:
        pytest.skip("KVFENCE_LIBRARY not set (a sanitizer build's library needs its runtime)")
    cc = shutil.which("cc")
    assert cc, "no C compiler (build-essential)"
    src = tmp_path / "quickstart.c"
    src.write_text(block("c"))
    exe = tmp_path / "quickstart"
    libdir = os.path.dirname(os.path.abspath(lib))
    # As the doc builds it (the compiler's default C dialect), warnings as errors.
    r = subprocess.run([cc, "-Wall", "-Werror", "-o", str(exe),
                        str(src), "-I", os.path.join(REPO, "clients", "c", "include"),
                        os.path.abspath(lib), "-Wl,-rpath," + libdir],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "the C quickstart does not compile:\n" + r.stderr
    r = subprocess.run([str(exe)], env=env_of(cluster), capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("C: every page freed on RELEASED"), r.stdout


def test_python_quickstart_runs_as_written(cluster, tmp_path):
    src = tmp_path / "quickstart.py"
    src.write_text(block("python"))
    r = subprocess.run([sys.executable, str(src)], env=env_of(cluster), capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("Python: every page freed on RELEASED"), r.stdout
