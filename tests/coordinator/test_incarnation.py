"""Which process a task runs: the incarnation a restarted worker is told
apart by (keras_ps.cluster._network.incarnation), on real servers."""

import glob
import time

import pytest

import keras_ps
from keras_ps.cluster import _network

pytestmark = pytest.mark.timeout(180)


def _wait_until_stopped(pid, timeout=60):
    """Waits until every thread of `pid` is stopped (SIGSTOP takes effect
    when each thread next runs, not when kill() returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(path) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that just ended
                continue
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} was not stopped in {timeout}s")


def test_a_task_restarted_on_its_address_has_another_incarnation():
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        address = cluster.spec["worker"][0]
        first = _network.incarnation(address, 10)
        assert first is not None
        assert _network.incarnation(address, 10) == first
        # The ps is another process: another incarnation.
        assert _network.incarnation(cluster.spec["ps"][0], 10) not in (None, first)

        cluster.kill("worker", 0)
        cluster.restart("worker", 0)
        assert _network.wait_until_answers(address, 60)
        again = _network.incarnation(address, 10)
        assert again is not None and again != first

        # A stopped process does not answer within the timeout.
        cluster.pause("worker", 0)
        try:
            _wait_until_stopped(cluster.pid("worker", 0))
            assert _network.incarnation(address, 1) is None
        finally:
            cluster.resume("worker", 0)
        assert _network.incarnation(address, 10) == again

        # Nothing listens there any more.
        cluster.kill("worker", 0)
        assert _network.incarnation(address, 1) is None
