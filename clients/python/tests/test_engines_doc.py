"""docs/engines.md's quickstart programs run as written: each ```python
block of the file, in its own /usr/bin/python3 process, against a real
kvfence-control and two real kvfence-node processes, with the environment
that `scripts/run.sh --keep` tells the reader to export."""
import os
import re
import subprocess
import sys

import pytest

# As the quickstart's `scripts/run.sh --keep` (its nodes run --staging host): the engines'
# multi-buffer pools are read through the staging copy towards another node.
pytestmark = pytest.mark.node_args("--staging", "host")

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "docs",
                   "engines.md")


def blocks():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_doc_has_both_programs():
    b = blocks()
    assert len(b) == 2, "docs/engines.md: want the SGLang and the vLLM program, found %d" % len(b)
    assert "kvfence.sglang" in b[0] and "kvfence.vllm" in b[1]


@pytest.mark.parametrize("which,expect", [(0, "SGLang: every page freed on RELEASED"),
                                          (1, "vLLM: request r1 loaded on decode")])
def test_quickstart_runs_as_written(cluster, tmp_path, which, expect):
    env = dict(os.environ, KVFENCE_CONTROL=cluster.address,
               KVFENCE_N1_SOCKET=cluster.socket("n1"), KVFENCE_N2_SOCKET=cluster.socket("n2"))
    # The engines are not installed: the packages' own copies of the base
    # classes are used, as the doc says (no tests/standins on the path).
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if "standins" not in p)
    src = tmp_path / ("quickstart%d.py" % which)
    src.write_text(blocks()[which])
    r = subprocess.run([sys.executable, str(src)], env=env, capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout
    if which == 0:
        assert "room 101: ('Success', 'Success')" in r.stdout, r.stdout
        assert "room 102 aborted after one chunk: ('Failed', 'Failed')" in r.stdout, r.stdout
