"""A task's machine that vanishes without a reset (a preempted VM, a deleted
pod), for real (tests/_vanish_job.py: every packet to or from worker 1's
port dropped, its process SIGKILLed), and the socket options that bound it
(keras_ps/cluster/_dead_peers.py) on real loopback connections.

Before: the connections to the vanished worker stayed open for about 15
minutes of retransmissions; a function traced meanwhile waited on its
registration there, and `fit` waited with it (in the job below, for good:
it timed out)."""

import os
import socket
import subprocess
import sys

import portpicker
import pytest

from _kills import Vanish
from _kills import can_cut_network
from _kills import heal_every_cut
from _kills import run_cutting_job
from _paths import TESTS
from _results import last_report
from keras_ps.cluster import _dead_peers

PER_EXECUTION = 2  # tests/_fit_job.py's steps_per_execution


@pytest.fixture(scope="module")
def job():
    code, output = run_cutting_job(
        [sys.executable, os.path.join(TESTS, "_vanish_job.py")], 240,
        KERAS_PS_PEER_TIMEOUT="5", KERAS_PS_HANG_TIMEOUT="3")
    assert code == 0, output[-4000:]
    return last_report(output, code)


@pytest.mark.timeout(300)
def test_fit_goes_on_when_a_workers_machine_vanishes_for_good(job):
    fit = job["fit"]
    assert fit["vanished"], fit
    # Every planned step ran on the worker left; a step of the lost worker
    # whose outcome was lost ran again (at least once, as any worker loss).
    assert fit["planned"] <= fit["iterations"] <= \
        fit["planned"] + 2 * PER_EXECUTION, fit
    assert any("given up after 5s without an answer from the peer's host "
               "(KERAS_PS_PEER_TIMEOUT)" in m for m in job["told"]), job


@pytest.mark.timeout(300)
def test_a_function_traced_while_a_machine_is_gone_runs_on_the_others(job):
    loop = job["loop"]
    # Each closure ran once, on worker 0; the vanished worker is out.
    assert loop["values"] == [2.0 * i for i in range(8)], loop
    assert loop["total"] == sum(range(8)), loop
    assert loop["states"][0] == "healthy", loop
    assert loop["states"][1] in ("failed", "hung"), loop


def test_healing_a_dead_jobs_rules_keeps_a_live_ones():
    # Tests that cut run side by side: one's cleanup once removed the
    # rules another's job was still testing with.
    why = can_cut_network()
    if why:
        pytest.skip(f"cannot drop a port's packets on this machine: {why}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid, port = int(dead.stdout), portpicker.pick_unused_port()
    live = Vanish(port)
    try:
        rule = ["OUTPUT", "-p", "tcp", "--dport", str(port), "-m", "comment",
                "--comment", f"keras_ps_test_cut_{dead_pid}", "-j", "DROP"]
        subprocess.run(["iptables", "-I", *rule], check=True)
        assert heal_every_cut() >= 1  # (a dead job of a test beside too)
        listed = subprocess.run(["iptables", "-S", "OUTPUT"], check=True,
                                capture_output=True, text=True).stdout
        assert f"keras_ps_test_cut_{dead_pid}" not in listed
        assert listed.count(f"keras_ps_test_cut_{os.getpid()}") == 2
    finally:
        live.heal()


# -- the socket options, on loopback connections -----------------------------


def _options(sock):
    return dict(
        keepalive=sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        user_timeout_ms=sock.getsockopt(socket.IPPROTO_TCP,
                                        socket.TCP_USER_TIMEOUT),
        idle=sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        interval=sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        probes=sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))


@pytest.fixture
def connections():
    """Two listening sockets and a connection to each: (watched server,
    its client, its accepted end), (other server, client, accepted)."""
    made = []
    for _ in range(2):
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        made.append((server, client, accepted))
    yield made
    for trio in made:
        for sock in trio:
            sock.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                    reason="needs /proc/self/fd (Linux)")
def test_connections_to_or_from_a_tasks_port_get_the_bound_once(connections):
    (server, client, accepted), (_, other_client, other_accepted) = connections
    seen, skipped = set(), set()
    port = server.getsockname()[1]
    assert _dead_peers.configure(12, seen, {port}, False, skipped) == 2
    for sock in (client, accepted):  # to the port, and accepted on it
        assert _options(sock) == dict(keepalive=1, user_timeout_ms=12000,
                                      idle=6, interval=1, probes=5)
    for sock in (other_client, other_accepted):
        assert _options(sock)["keepalive"] == 0
        assert _options(sock)["user_timeout_ms"] == 0
    # Set once: a second look finds nothing new; a closed socket is
    # forgotten.
    assert _dead_peers.configure(12, seen, {port}, False, skipped) == 0
    inode = os.fstat(client.fileno()).st_ino
    assert inode in seen
    client.close()
    _dead_peers.configure(12, seen, {port}, False, skipped)
    assert inode not in seen
    # The other connection's port becomes a task's (a worker joined): once
    # the sockets passed over are looked at again, it is set too.
    other_port = other_accepted.getsockname()[1]
    assert _dead_peers.configure(12, seen, {port, other_port}, False,
                                 skipped) == 0
    skipped.clear()
    assert _dead_peers.configure(12, seen, {port, other_port}, False,
                                 skipped) == 2
    assert _options(other_client)["user_timeout_ms"] == 12000


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                    reason="needs /proc/self/fd (Linux)")
def test_a_tasks_server_process_sets_every_connection(connections):
    # This process may hold others (the session's cluster's): at least 4.
    assert _dead_peers.configure(7, set(), set(), True) >= 4
    for trio in connections:
        for sock in trio[1:]:
            assert _options(sock)["user_timeout_ms"] == 7000


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                    reason="needs /proc/self/fd (Linux)")
def test_a_socket_not_connected_yet_is_looked_at_again():
    sock = socket.socket()
    try:
        seen = set()
        _dead_peers.configure(5, seen, set(), True)
        assert os.fstat(sock.fileno()).st_ino not in seen
        assert _options(sock)["user_timeout_ms"] == 0
    finally:
        sock.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                    reason="needs /proc/self/fd (Linux)")
def test_a_descriptor_reused_since_it_was_listed_is_left_alone(connections):
    # Listed as one socket, the number now another's: nothing set, and the
    # duplicate made to look is closed.
    client = connections[0][1]
    before = len(os.listdir("/proc/self/fd"))
    assert _dead_peers._set_options(client.fileno(), -1, 9, set(), True) \
        is False
    assert len(os.listdir("/proc/self/fd")) == before
    assert _options(client)["user_timeout_ms"] == 0


@pytest.mark.parametrize("value, wanted", [
    ("0.5", "must be 0 (off) or at least 1 second"),
    ("-1", "must be at least 0"), ("soon", "must be a number")])
def test_a_bad_peer_timeout_names_the_variable(monkeypatch, value, wanted):
    monkeypatch.setenv("KERAS_PS_PEER_TIMEOUT", value)
    with pytest.raises(ValueError, match="KERAS_PS_PEER_TIMEOUT") as raised:
        _dead_peers.timeout_from_env()
    assert wanted in str(raised.value) and repr(value) in str(raised.value)


def test_the_default_and_off(monkeypatch):
    monkeypatch.delenv("KERAS_PS_PEER_TIMEOUT", raising=False)
    assert _dead_peers.timeout_from_env() == 30.0
    monkeypatch.setenv("KERAS_PS_PEER_TIMEOUT", "0")
    assert _dead_peers.timeout_from_env() == 0.0
    assert _dead_peers.watch(["localhost:1"]) == 0.0  # off: nothing watched


@pytest.mark.parametrize("timeout, before, after", [
    (30, None, "grpc.min_reconnect_backoff_ms=5000"),
    (5, "grpc.keepalive_time_ms=60000",
     "grpc.keepalive_time_ms=60000,grpc.min_reconnect_backoff_ms=2000"),
    (600, None, "grpc.min_reconnect_backoff_ms=20000"),
    (30, "grpc.min_reconnect_backoff_ms=9000",  # the user's, kept
     "grpc.min_reconnect_backoff_ms=9000"),
    (0, None, None)])
def test_grpc_gives_a_connection_attempt_a_sixth_of_the_peer_timeout(
        monkeypatch, timeout, before, after):
    if before is None:
        monkeypatch.delenv("TF_GRPC_DEFAULT_OPTIONS", raising=False)
    else:
        monkeypatch.setenv("TF_GRPC_DEFAULT_OPTIONS", before)
    _dead_peers.bound_connect_attempts(timeout)
    assert os.environ.get("TF_GRPC_DEFAULT_OPTIONS") == after
