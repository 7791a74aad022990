"""Which process a task runs, and whether it runs: the incarnation a
restarted worker is told apart by (keras_ps.cluster._network.incarnation),
and a paused task's stop, on real servers."""

import contextlib
import os
import subprocess
import sys

import pytest

import keras_ps
from keras_ps.cluster import _network
from keras_ps.cluster.local import wait_until_stopped

pytestmark = pytest.mark.timeout(180)


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
        cluster.pause("worker", 0)  # returns once the process is stopped
        try:
            assert _network.incarnation(address, 1) is None
        finally:
            cluster.resume("worker", 0)
        assert _network.incarnation(address, 10) == again

        # Nothing listens there any more.
        cluster.kill("worker", 0)
        assert _network.incarnation(address, 1) is None


@contextlib.contextmanager
def _busy_cores():
    """Every core busy (a loaded machine), so that a stopped task's threads
    wait for a core before the stop takes effect."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_pause_returns_once_the_task_answers_no_more():
    # SIGSTOP takes effect when each thread of the process next runs: with
    # every core busy, a probe sent the moment kill() returned was answered
    # 3-4 times in these 30 rounds on this project's 2-core machine. `pause`
    # waits until every thread is stopped, so a test (or the chaos
    # benchmark) that pauses a worker and then asks the coordinator
    # something sees it hung at once.
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster, \
            _busy_cores():
        address = cluster.spec["worker"][0]
        answered = []
        for attempt in range(30):
            assert _network.probe(address, 10), attempt
            cluster.pause("worker", 0)
            try:
                if _network.probe(address, 0.2):
                    answered.append(attempt)
            finally:
                cluster.resume("worker", 0)
        assert answered == []
        # A process that is gone counts as stopped: no wait, no error.
        cluster.kill("worker", 0)
        wait_until_stopped(cluster.pid("worker", 0), 1)
