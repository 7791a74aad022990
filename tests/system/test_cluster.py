import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import portpicker
import psutil
import pytest

from keras_ps import cluster as cluster_lib
from keras_ps.errors import ClusterConfigError

from _pid_namespace import pid_1_prefix
from _polling import wait_until

pytestmark = pytest.mark.timeout(120)

GOOD = {"cluster": {"ps": ["localhost:2001"], "worker": ["localhost:2002"]},
        "task": {"type": "worker", "index": 0}}


@pytest.mark.parametrize("raw, needle", [
    ("", "TF_CONFIG is not set"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"cluster": GOOD["cluster"]}), "no task section"),
    (json.dumps({**GOOD, "task": {"type": "trainer", "index": 0}}), "'trainer'"),
    (json.dumps({**GOOD, "task": {"type": "worker", "index": 3}}),
     "worker:3, but the cluster lists 1"),
    (json.dumps({**GOOD, "task": {"type": "worker", "index": "x"}}), "index='x'"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "no cluster section"),
    (json.dumps({**GOOD, "cluster": {"ps": ["localhost:1"], "worker": ["localhost:1"]}}),
     "used by both ps:0 and worker:0"),
    (json.dumps({**GOOD, "cluster": {"ps": "localhost:1", "worker": ["localhost:2"]}}),
     "must list its task addresses"),
    (json.dumps({**GOOD, "cluster": {"ps": ["nohost"], "worker": ["localhost:2"]}}),
     "'nohost'"),
    (json.dumps({**GOOD, "cluster": {"ps": ["h:99999"], "worker": ["localhost:2"]}}),
     "'h:99999'"),
])
def test_bad_tf_config(raw, needle):
    with pytest.raises(ClusterConfigError) as info:
        cluster_lib.parse_tf_config(raw)
    assert needle in str(info.value)


def test_good_tf_config_and_evaluator_without_cluster():
    cluster, task_type, index = cluster_lib.parse_tf_config(json.dumps(GOOD))
    assert (task_type, index) == ("worker", 0) and cluster["ps"] == ["localhost:2001"]
    assert cluster_lib.parse_tf_config(
        json.dumps({"task": {"type": "evaluator", "index": 0}}),
        require_cluster=False) == ({}, "evaluator", 0)


def _server(env_tf_config=None, args=(), timeout=60):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    if env_tf_config is not None:
        env["TF_CONFIG"] = env_tf_config
    return subprocess.run([sys.executable, "-m", "keras_ps.server", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("tf_config, needle", [
    ("{oops", "not valid JSON"),
    (json.dumps({**GOOD, "task": {"type": "gpu", "index": 0}}), "'gpu'"),
    (json.dumps({**GOOD, "task": {"type": "ps", "index": 5}}), "ps:5"),
    (json.dumps({**GOOD, "task": {"type": "chief", "index": 0},
                 "cluster": {**GOOD["cluster"], "chief": ["localhost:2003"]}}),
     "runs ps and worker tasks"),
])
def test_server_cli_one_line_errors(tf_config, needle):
    result = _server(tf_config)
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.startswith("keras_ps.server")]
    assert len(lines) == 1 and needle in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def _hold(port=0):
    """A socket listening on `port` (0: a free one) of every address."""
    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    busy.bind(("", port))
    busy.listen()
    return busy


def test_server_cli_port_in_use():
    with _hold() as busy:
        port = busy.getsockname()[1]
        spec = {"ps": [f"localhost:{port}"], "worker": ["localhost:1"]}
        result = _server(args=["--cluster_spec", json.dumps(spec),
                               "--job_name", "ps", "--task_index", "0"])
    assert result.returncode == 3  # the code a launcher retries on
    assert "already in use" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT],
                         ids=["sigterm", "sigint"])
@pytest.mark.parametrize("as_pid_1", [False, True], ids=["process", "pid_1"])
def test_a_server_stopped_by_a_signal_ends_by_it(signum, as_pid_1):
    # Not exit 0: a task stopped by a signal has not finished its work, and
    # restart policies that start again only what failed (Docker's
    # on-failure, a TFJob's ExitCode policy) must bring it back. As the
    # first process of a PID namespace (a container's command), where the
    # kernel drops the signal raised again, it exits with the same status.
    prefix = []
    if as_pid_1:
        prefix, why_not = pid_1_prefix()
        if prefix is None:
            pytest.skip(why_not)
    port = portpicker.pick_unused_port()
    spec = {"ps": [f"localhost:{port}"], "worker": [f"localhost:{portpicker.pick_unused_port()}"]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen(
        prefix + [sys.executable, "-m", "keras_ps.server", "--cluster_spec",
                  json.dumps(spec), "--job_name", "ps", "--task_index", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cluster_lib.wait_for_port(f"localhost:{port}", 60, proc)
        target = psutil.Process(proc.pid)
        if as_pid_1:  # unshare's one child: the server
            [target] = target.children()
        target.send_signal(signum)
        code = proc.wait(timeout=20)
        out = proc.stdout.read()
        assert code == (128 + signum if as_pid_1 else -signum), (
            code, out, proc.stderr.read()[-2000:])
        assert "ps:0 stopping on signal" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_local_cluster_kill_and_restart(tmp_path):
    # A log_dir that does not exist yet is created.
    log_dir = tmp_path / "logs" / "cluster"
    with cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                  log_dir=str(log_dir)) as local:
        assert sorted(p.name for p in log_dir.iterdir()) == [
            "fork-server.log", "ps-0.log", "worker-0.log"]
        address = local.address("worker", 0)
        old = local.pid("worker", 0)
        # Forked from one process, each task is named as itself.
        with open(f"/proc/{old}/comm") as f:
            assert f.read().strip() == "worker:0"
        local.kill("worker", 0)
        assert not cluster_lib.wait_for_port(address, 0.5)
        local.restart("worker", 0)
        assert local.pid("worker", 0) != old
        assert cluster_lib.wait_for_port(address, 5)


def _holders_of_files_in(directory):
    """Pids of the processes with a file of `directory` open."""
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}")
                     for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        if any(link.startswith(directory + os.sep) for link in links):
            holders.add(int(pid))
    return holders


def test_local_cluster_that_fails_to_start_stops_its_tasks(tmp_path,
                                                          monkeypatch):
    # No task is seen to answer in time (a forked task may well answer
    # within a millisecond, so the check is made to say it did not): the
    # start fails while the tasks it launched are running, and it must not
    # leave them running (each writes its log in log_dir, which it holds
    # open), nor the process they are forked from.
    from keras_ps.cluster import local
    monkeypatch.setattr(local, "wait_for_port", lambda *args: False)
    log_dir = str(tmp_path / "logs")
    with pytest.raises(RuntimeError, match="did not start within 0.001s"):
        cluster_lib.LocalCluster(num_workers=1, num_ps=1, log_dir=log_dir,
                                 start_timeout=0.001)
    assert sorted(os.listdir(log_dir)) == [
        "fork-server.log", "ps-0.log", "worker-0.log"]
    assert _holders_of_files_in(log_dir) == set()


@contextlib.contextmanager
def _ps_port_taken(monkeypatch, starts):
    """Holds a port and makes LocalCluster's port picks give it to ps:0 in
    its first `starts` starts (a 1-worker, 1-ps cluster picks the worker's
    port, then the ps'), free ports otherwise. Yields the held port."""
    from keras_ps.cluster import local
    real, calls = local.portpicker.pick_unused_port, []
    with _hold() as busy:
        taken = busy.getsockname()[1]

        def pick():
            calls.append(None)
            second_of_a_start = len(calls) % 2 == 0
            if second_of_a_start and len(calls) <= 2 * starts:
                return taken
            return real()
        monkeypatch.setattr(local.portpicker, "pick_unused_port", pick)
        yield taken


def test_local_cluster_starts_again_when_a_picked_port_is_taken(
        tmp_path, monkeypatch):
    log_dir = str(tmp_path / "logs")
    with _ps_port_taken(monkeypatch, starts=1) as taken:
        with cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                      log_dir=log_dir) as local:
            assert local.address("ps", 0) != f"localhost:{taken}"
            assert cluster_lib.wait_for_port(local.address("ps", 0), 5)
            assert cluster_lib.wait_for_port(local.address("worker", 0), 5)
            with open(os.path.join(log_dir, "ps-0.log")) as f:
                log = f.read()
            assert f"(localhost:{taken}) is already in use" in log, log
    assert _holders_of_files_in(log_dir) == set()


def test_local_cluster_gives_up_when_every_start_finds_a_port_taken(
        tmp_path, monkeypatch):
    log_dir = str(tmp_path / "logs")
    with _ps_port_taken(monkeypatch, starts=3) as taken:
        with pytest.raises(RuntimeError) as raised:
            cluster_lib.LocalCluster(num_workers=1, num_ps=1, log_dir=log_dir)
    message = str(raised.value)
    assert f"took the port of ps:0 (localhost:{taken})" in message, message
    assert "in each of 3 starts" in message and log_dir in message, message
    assert _holders_of_files_in(log_dir) == set()


def test_local_cluster_restart_waits_for_its_port_to_be_free(tmp_path):
    # A killed task's port, held by another process when it restarts: the
    # task exits at once, and restart() starts it again until it binds the
    # port (the cluster's other tasks know it by that address).
    log_dir = str(tmp_path / "logs")
    log = os.path.join(log_dir, "worker-0.log")
    with cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                  log_dir=log_dir) as local:
        address = local.address("worker", 0)
        local.kill("worker", 0)
        busy = _hold(int(address.rsplit(":", 1)[1]))

        def refused():
            with open(log) as f:
                return "already in use" in f.read()

        def free_once_refused():
            wait_until(refused, 60, "the restarted task's refusal")
            busy.close()
        releaser = threading.Thread(target=free_once_refused)
        releaser.start()
        try:
            local.restart("worker", 0)
        finally:
            releaser.join()
            busy.close()
        assert refused() and cluster_lib.wait_for_port(address, 5)


def test_local_cluster_restart_gives_up_on_a_port_held_for_long(tmp_path):
    log_dir = str(tmp_path / "logs")
    with cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                  log_dir=log_dir) as local:
        address = local.address("worker", 0)
        local.kill("worker", 0)
        local._start_timeout = 2.0  # started: now only the restart's limit
        with _hold(int(address.rsplit(":", 1)[1])):
            with pytest.raises(RuntimeError) as raised:
                local.restart("worker", 0)
    message = str(raised.value)
    assert f"took the port of worker:0 ({address})" in message, message
    assert "held it for 2.0s" in message and "worker-0.log" in message


def _serving_line(log_dir, job):
    # The task prints it just after its port starts answering.
    def line():
        with open(os.path.join(log_dir, f"{job}-0.log")) as f:
            return next((l for l in f if "serving at" in l), None)
    return wait_until(line, 30, f"{job}-0.log's 'serving at' line")


def test_local_cluster_shares_the_cores_between_its_tasks(tmp_path):
    # Every task of a LocalCluster is on this machine: by default each may
    # split an op over its share of the cores, not over all of them.
    shared = max(1, (os.cpu_count() or 1) // 2)
    with cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                  log_dir=str(tmp_path / "shared")) as local:
        assert local.intra_op_threads == shared
        for job in ("ps", "worker"):
            line = _serving_line(local.log_dir, job)
            assert f"{shared} intra-op" in line, line
    # 0: TF's default, one thread per core in every task.
    with cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                  log_dir=str(tmp_path / "default"),
                                  intra_op_threads=0) as local:
        for job in ("ps", "worker"):
            line = _serving_line(local.log_dir, job)
            assert "intra-op: one per core" in line, line


_OWNER = """
import sys
from keras_ps import cluster as cluster_lib
local = cluster_lib.LocalCluster(num_workers=1, num_ps=1, log_dir=sys.argv[1])
print(local.pid("ps", 0), local.pid("worker", 0), flush=True)
sys.stdin.read()  # until the test kills this process
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has ended all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_local_cluster_tasks_end_when_its_process_is_sigkilled(tmp_path):
    """A coordinator killed with SIGKILL runs no cleanup: its LocalCluster's
    tasks notice their parent is gone and stop, instead of holding their
    ports and memory until someone kills them by hand."""
    from tests._polling import wait_until

    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = owner.stdout.readline()
        assert line, "the cluster's process printed no pids"
        pids = [int(p) for p in line.split()]
        assert all(_alive(p) for p in pids)
        owner.kill()
        owner.wait()
        wait_until(lambda: not any(_alive(p) for p in pids), 15,
                   "the tasks of a SIGKILLed LocalCluster's process to stop")
    finally:
        try:  # whatever of the group is left, if the test failed
            os.killpg(owner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    logs = "".join(open(tmp_path / name).read() for name in ("ps-0.log", "worker-0.log"))
    assert "because the process that started it" in logs, logs


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_local_cluster_whose_fork_server_is_killed_says_so(tmp_path):
    # The tasks are forked from one process: SIGKILLed, its tasks stop
    # (their parent is gone), waiting on them does not hang, and a restart
    # says the process is gone and names its log, instead of hanging.
    local = cluster_lib.LocalCluster(num_workers=1, num_ps=1,
                                     log_dir=str(tmp_path))
    try:
        pids = [local.pid(job, 0) for job in ("ps", "worker")]
        fork_server = _parent(pids[0])
        assert _parent(pids[1]) == fork_server != os.getpid()
        os.kill(fork_server, signal.SIGKILL)
        wait_until(lambda: not any(_alive(p) for p in pids), 15,
                   "the tasks of a killed fork server to stop")
        with pytest.raises(RuntimeError, match=r"fork server .*pid "
                           rf"{fork_server}\) (exited|closed).*"
                           r"fork-server\.log"):
            local.restart("ps", 0)
    finally:
        local.shutdown()
    assert not _alive(fork_server)
