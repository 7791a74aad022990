"""Which process a task runs, and whether it runs: the incarnation a
restarted worker is told apart by (keras_ps.cluster._network.incarnation),
a paused task's stop, and what answers at a new member's address, on real
servers."""

import contextlib
import os
import socket
import subprocess
import sys
import threading

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
def _listener(banner=None):
    """A TCP server on a free port: it says `banner` to each connection
    (a server of another protocol; sshd speaks first), or nothing at all
    (its kernel accepts connections; nobody reads them)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def serve():
            while True:
                try:
                    connection, _ = server.accept()
                except OSError:  # shut down at the end
                    return
                with connection:
                    connection.sendall(banner)

        thread = threading.Thread(target=serve, daemon=True)
        if banner is not None:
            thread.start()
        try:
            yield f"127.0.0.1:{server.getsockname()[1]}"
        finally:
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept()
    if banner is not None:
        thread.join(10)
        assert not thread.is_alive()


def test_a_new_members_address_is_looked_at_before_it_is_admitted():
    # (answers, why it is no worker task): a worker task is admitted, a ps
    # and a server of another protocol are refused; a port where nothing
    # answers (yet) is waited for, as a worker still starting.
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        assert _network.look_at_new_worker(
            cluster.spec["worker"][0], 10) == (True, None)
        answers, why = _network.look_at_new_worker(cluster.spec["ps"][0], 10)
        assert answers and why == ("it is the TensorFlow task /job:ps/"
                                   "replica:0/task:0, started as a ps task, "
                                   "not a worker")
    with _listener(b"SSH-2.0-OpenSSH_9.6\r\n") as sshd:
        assert _network.look_at_new_worker(sshd, 10) == (
            True, "it is not a gRPC server: it answered an HTTP/2 client "
                  "with b'SSH-2.0-O', the bytes of another protocol")
        assert not _network.probe(sshd, 10)
    with _listener() as silent:
        assert _network.look_at_new_worker(silent, 0.5) == (False, None)
    assert _network.look_at_new_worker(silent, 0.5) == (False, None)


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
