"""Fixtures of the chaos tests (tests/chaos/README.md).

The environment names the binaries (KVF_CONTROL_BIN, KVF_NODE_BIN; ctest and
run.sh set them) and the size of a run: KVF_CHAOS_CYCLES (kill -9 cycles of
the control plane, default 3), KVF_CHAOS_NODE_ROUNDS (kill -9 rounds per node
case, default 1). KVF_CHAOS_REPORT names a JSON file that gets the figures of
the run (run.sh prints them); without it they are only printed at the end.

Every process a test starts is killed at teardown, every mount unmounted and
every shm object unlinked, also when the test fails.
"""

import json
import os

import pytest

from kvf_harness import ControlProcess

FIGURES = {}


def env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise pytest.UsageError("%s must be an integer" % name)


def figure(key, value):
    """Records one figure of the run for the report."""
    FIGURES[key] = value


def _binary(var):
    path = os.environ.get(var)
    if not path:
        pytest.skip("%s is not set" % var)
    if not os.access(path, os.X_OK):
        pytest.fail("%s=%s is not an executable file" % (var, path))
    return path


@pytest.fixture(scope="session")
def control_bin():
    return _binary("KVF_CONTROL_BIN")


@pytest.fixture(scope="session")
def node_bin():
    return _binary("KVF_NODE_BIN")


@pytest.fixture
def servers(control_bin, tmp_path):
    """servers(data_dir, *args): starts a kvfence-control run (not waited
    for). Every run still alive at teardown is killed."""
    started = []

    def start(data_dir, *extra_args):
        p = ControlProcess(control_bin, tmp_path, data_dir, "run%d" % (len(started) + 1),
                           list(extra_args))
        started.append(p)
        return p.start()

    yield start
    for p in started:
        p.cleanup()


def pytest_sessionfinish(session, exitstatus):
    if not FIGURES:
        return
    path = os.environ.get("KVF_CHAOS_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(FIGURES, f, indent=2, sort_keys=True)


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.write_sep("=", "chaos figures")
        for k in sorted(FIGURES):
            terminalreporter.write_line("%s: %s" % (k, json.dumps(FIGURES[k], sort_keys=True)))
