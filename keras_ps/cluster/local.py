"""Local clusters for tests and demos: servers in this process, or one real
process per task on this machine's loopback (`LocalCluster`).

TensorFlow is imported only by `create_in_process_cluster`; each task of a
`LocalCluster` runs `python -m keras_ps.server`'s code in a process forked
from one that loaded TF's server once (keras_ps.cluster._forks).
"""

import collections.abc
import glob
import json
import logging
import math
import numbers
import os
import signal
import subprocess
import tempfile
import time

import portpicker

from keras_ps import _native
from keras_ps._base_errors import ClusterConfigError
from keras_ps.cluster import _forks
from keras_ps.cluster import _network
from keras_ps.cluster.spec import resolver_from_spec

logger = logging.getLogger(__name__)


def _local_spec(num_workers, num_ps):
    def pick():
        return f"localhost:{portpicker.pick_unused_port()}"

    return {
        "worker": [pick() for _ in range(num_workers)],
        "ps": [pick() for _ in range(num_ps)],
    }


_IN_PROCESS_SERVERS = []

_START_ATTEMPTS = 3

# Seconds the fork server has to load TF's server libraries (about 1 s of
# CPU), or to fork a task: not `start_timeout`, which is the task's to
# answer once it runs; a limit for a machine too loaded to do either.
_FORK_SERVER_TIMEOUT = 120.0


class _AddressTaken(RuntimeError):
    """A task of a LocalCluster found its port taken as it started."""


def create_in_process_cluster(num_workers, num_ps):
    """Starts ps and worker servers inside this process (as TF's tutorial does).

    Returns:
        A cluster resolver for the new cluster. The servers live until the
        process exits.
    """
    import tensorflow as tf  # only here: LocalCluster's parent needs no TF

    spec = _local_spec(num_workers, num_ps)
    cluster = tf.train.ClusterSpec(spec)
    config = tf.compat.v1.ConfigProto()
    # Every server in this process shares the cores: without enough inter-op
    # threads, a worker's blocking ops starve each other and calls hang.
    config.inter_op_parallelism_threads = num_workers + 1
    for job, tasks in spec.items():
        for i in range(len(tasks)):
            _IN_PROCESS_SERVERS.append(
                tf.distribute.Server(
                    cluster, job_name=job, task_index=i, protocol="grpc",
                    config=config, start=True,
                )
            )
    return resolver_from_spec(spec)


def wait_for_port(address, timeout, process=None):
    """Waits until the task's gRPC server at `address` answers; False on
    timeout, or at once when `process` has exited."""
    return _network.wait_until_answers(address, timeout, process)


def wait_until_stopped(pid, timeout=60.0):
    """Waits until every thread of process `pid` is stopped (SIGSTOP), or
    the process is gone. Without /proc (not Linux) it returns at once.

    Raises:
        TimeoutError: a thread still runs after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        states = [state for state in map(
            _forks.stat_state, glob.glob(f"/proc/{pid}/task/*/stat"))
            if state is not None]  # None: a thread that just ended
        # t: stopped under a debugger; Z, X: the process is gone.
        if all(state in "tTZX" for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"process {pid} still runs {timeout:.0f}s after SIGSTOP "
                f"(its threads' states: {''.join(sorted(set(states)))})")
        time.sleep(0.002)


def _check_arguments(num_workers, num_ps, log_dir, env, start_timeout):
    """Refuses LocalCluster arguments of the wrong type before any task
    starts (they failed deep inside, or in the tasks, with bare errors).

    Raises:
        TypeError: an argument of the wrong type, named with the fix.
        ClusterConfigError: a start_timeout of 0 or less, or not finite.
    """
    for name, job, value in (("num_workers", "worker", num_workers),
                             ("num_ps", "ps", num_ps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            example = (f" ({name}={int(value)})" if isinstance(value, str)
                       and value.strip().isdigit() else "")
            raise TypeError(
                f"LocalCluster's {name} must be an integer, the number of "
                f"{job} tasks. Received: {name}={value!r} of type "
                f"{type(value).__name__}. Pass an integer, 1 or more"
                f"{example}.")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            f"LocalCluster's log_dir must be a path. Received: log_dir="
            f"{log_dir!r} of type {type(log_dir).__name__}. Pass the path of "
            "a directory (created if missing), or None for a temporary one.")
    if env is not None and not isinstance(env, collections.abc.Mapping):
        raise TypeError(
            f"LocalCluster's env must be a dict of environment variables. "
            f"Received: env={env!r} of type {type(env).__name__}. Pass e.g. "
            "env={'KERAS_PS_NATIVE': '0'}, or None.")
    for key, value in (env or {}).items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise TypeError(
                "LocalCluster's env maps names to values, both strings (as "
                f"os.environ). Received: env[{key!r}]={value!r} "
                f"({type(key).__name__}: {type(value).__name__}). Pass "
                f"env={{{str(key)!r}: {str(value)!r}}}.")
    if (isinstance(start_timeout, bool)
            or not isinstance(start_timeout, numbers.Real)
            or not 0 < start_timeout < math.inf):
        error = (ClusterConfigError if isinstance(start_timeout, numbers.Real)
                 and not isinstance(start_timeout, bool) else TypeError)
        raise error(
            "LocalCluster's start_timeout is the seconds each task has to "
            f"answer on its port. Received: start_timeout={start_timeout!r}. "
            "Pass a positive number of seconds (the default is 60).")


class LocalCluster:
    """A ps/worker cluster of real processes on this machine's loopback.

    Each task runs `python -m keras_ps.server`'s code in its own process, on
    a free port: a fork of one process that loaded TF's server libraries
    once (a task serves without spending 0.8 s of CPU to load them; the
    tasks get the environment of the cluster's start; `ps` shows each with
    the command line of the process they are forked from, `pid(job,
    index)` tells which is which, and `ps -o comm` names them). A task can be
    stopped (SIGTERM), killed (SIGKILL), paused (SIGSTOP), resumed and
    restarted on the same address. When another process takes
    a picked port before its task binds it, the cluster starts again on new
    ports (up to 3 starts).

    Args:
        num_workers: number of worker tasks.
        num_ps: number of parameter-server tasks.
        log_dir: where each task's output goes (`ps-0.log`, ...; TF's
            messages as it loads in `fork-server.log`), created if missing
            (a temporary folder if None).
        env: extra environment variables for every task.
        start_timeout: seconds each task has to answer on its port.
        intra_op_threads: threads one op of a task may split its work over
            (`python -m keras_ps.server --intra_op_threads`). None (the
            default) shares this machine's cores between the tasks:
            `max(1, cores // tasks)`. Every task of a LocalCluster runs on
            this one machine, and TF's default (one thread per core in each
            process) makes each task hand every sizeable op to as many
            threads as the machine has cores, all competing for the same
            cores: on 2 cores with 4 tasks, the busier ps of a LazyAdam
            `fit` used 7.4-9.8 ms of CPU per step, 5.6-6.9 ms with one
            thread (benchmarks/RESULTS.md). 0 keeps TF's default.

    Raises:
        TypeError: an argument of the wrong type (before any task starts).
        ClusterConfigError: a count below 1, or another value it cannot
            use (before any task starts).
        RuntimeError: a task exited or did not answer in time.

    Example:
    ```python
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
    ```
    """

    def __init__(self, num_workers=2, num_ps=1, log_dir=None, env=None,
                 start_timeout=60.0, intra_op_threads=None):
        _check_arguments(num_workers, num_ps, log_dir, env, start_timeout)
        if num_workers < 1 or num_ps < 1:
            raise ClusterConfigError(
                "A LocalCluster needs at least one worker and one ps. "
                f"Received: num_workers={num_workers}, num_ps={num_ps}. "
                "Pass counts of 1 or more.")
        if intra_op_threads is None:
            intra_op_threads = max(
                1, (os.cpu_count() or 1) // (num_workers + num_ps))
        elif (not isinstance(intra_op_threads, int)
              or isinstance(intra_op_threads, bool) or intra_op_threads < 0):
            raise ClusterConfigError(
                f"intra_op_threads={intra_op_threads!r} is not a number of "
                "threads. Pass None to share this machine's cores between "
                "the tasks, 0 for TF's default (one per core in every task), "
                "or a count of 1 or more.")
        self.intra_op_threads = intra_op_threads
        if log_dir is not None and os.path.exists(log_dir) and \
                not os.path.isdir(log_dir):
            raise ClusterConfigError(
                f"log_dir={log_dir!r} exists and is not a directory. Pass a "
                "directory for the tasks' logs (it is created if missing), "
                "or None for a temporary one.")
        self.spec = _local_spec(num_workers, num_ps)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="keras_ps_cluster_")
        os.makedirs(self.log_dir, exist_ok=True)
        self._env = dict(env or {})
        self._start_timeout = start_timeout
        self._procs = {}
        self._forks = None  # started with the first task
        _native.check_direct_io()  # before any task reads it
        if _native.enabled():
            # Built here, once, before the tasks start and load it: a first
            # build takes longer than a task's start-up.
            try:
                _native.build()
            except _native.NativeBuildError:
                pass  # each task's log says why; the coordinator warns once
        try:
            self._start(num_workers, num_ps)
        except BaseException:
            self.shutdown()  # no task outlives a cluster that did not start
            raise

    def _start(self, num_workers, num_ps):
        # A port picked free can be taken before its task binds it: by
        # another process's listener, or as the local port of a connection
        # (the picked ports are in the range the kernel gives those). No
        # task has run a step yet, so the whole cluster starts again on new
        # ports; the task's log keeps each attempt.
        for attempt in range(1, _START_ATTEMPTS + 1):
            for job in ("ps", "worker"):
                for i in range(len(self.spec[job])):
                    self._launch(job, i)
            try:
                for job in ("ps", "worker"):
                    for i in range(len(self.spec[job])):
                        self._wait_ready(job, i)
                return
            except _AddressTaken as e:
                self._stop_tasks()
                if attempt == _START_ATTEMPTS:
                    raise RuntimeError(
                        f"{e} in each of {_START_ATTEMPTS} starts, with new "
                        "ports each time. Something on this machine takes "
                        "the free ports as they are picked: stop it, or "
                        f"start the tasks yourself on ports it leaves alone; "
                        f"see {self.log_dir} for the tasks' logs.") from None
                logger.warning("[cluster] %s; starting the cluster again on "
                               "new ports", e)
                self._procs = {}
                self.spec = _local_spec(num_workers, num_ps)

    @property
    def resolver(self):
        """A cluster resolver for this cluster (the coordinator is this process)."""
        return resolver_from_spec(self.spec)

    def address(self, job, index):
        return self.spec[job][index]

    def pid(self, job, index):
        return self._procs[(job, index)].pid

    def _task_env(self):
        env = dict(os.environ)
        env.update(self._env)
        env.pop("TF_CONFIG", None)
        env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "2")
        return env

    def _launch(self, job, index):
        if self._forks is None:
            self._forks = _forks.ForkServer(
                self._task_env(), os.path.join(self.log_dir, "fork-server.log"),
                _FORK_SERVER_TIMEOUT)
        self._procs[(job, index)] = self._forks.spawn(
            f"{job}:{index}",
            ["--cluster_spec", json.dumps(self.spec),
             "--job_name", job, "--task_index", str(index),
             "--intra_op_threads", str(self.intra_op_threads),
             # Tasks end with this process, even when it is SIGKILLed.
             "--exit_with_parent"],
            os.path.join(self.log_dir, f"{job}-{index}.log"),
            _FORK_SERVER_TIMEOUT)
        logger.info("[cluster] started %s:%d at %s (pid %d)", job, index,
                    self.spec[job][index], self._procs[(job, index)].pid)

    def _wait_ready(self, job, index):
        proc = self._procs[(job, index)]
        if not wait_for_port(self.spec[job][index], self._start_timeout, proc):
            code = proc.poll()
            if code == _network.EXIT_ADDRESS_TAKEN:
                raise _AddressTaken(
                    f"another process took the port of {job}:{index} "
                    f"({self.spec[job][index]}) before the task bound it")
            raise RuntimeError(
                f"Task {job}:{index} " + (
                    f"exited with code {code} before it answered"
                    + self._error_line(job, index)
                    if code is not None else
                    f"did not start within {self._start_timeout}s")
                + f"; see {self.log_dir}/{job}-{index}.log")

    def _error_line(self, job, index):
        """The one-line error the task's server printed last, if any."""
        prefix = _network.SERVER_ERROR_PREFIX
        with open(os.path.join(self.log_dir, f"{job}-{index}.log"),
                  errors="replace") as f:
            errors = [line.strip()[len(prefix):] for line in f
                      if line.startswith(prefix)]
        return f" ({errors[-1]})" if errors else ""

    def kill(self, job, index):
        """SIGKILLs a task (as a preemption would) and reaps it."""
        proc = self._procs[(job, index)]
        proc.kill()
        proc.wait()
        logger.info("[cluster] killed %s:%d", job, index)

    def stop(self, job, index, timeout=10.0):
        """SIGTERMs a task and waits for it to exit; returns its exit code."""
        proc = self._procs[(job, index)]
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def pause(self, job, index, timeout=60.0):
        """SIGSTOPs a task (as a hung host would) and returns once every
        thread of its process is stopped: a signal takes effect when each
        thread next runs, and until then the task may still answer (a probe
        right after kill() was answered 46 times in 300 on 2 busy cores)."""
        proc = self._procs[(job, index)]
        proc.send_signal(signal.SIGSTOP)
        wait_until_stopped(proc.pid, timeout)

    def resume(self, job, index):
        self._procs[(job, index)].send_signal(signal.SIGCONT)

    def restart(self, job, index):
        """Starts a stopped or killed task again on the same address.

        Raises:
            RuntimeError: the task did not start within `start_timeout`
                seconds, or another process held its port all that time.
        """
        proc = self._procs[(job, index)]
        if proc.poll() is None:
            self.kill(job, index)
        # The server binds with SO_REUSEADDR, so the killed process' socket
        # in TIME_WAIT does not block the same port. Another process may
        # hold it for a while (a connection given it as its local port):
        # the address is the cluster's, so the task tries it again.
        deadline = time.monotonic() + self._start_timeout
        while True:
            self._launch(job, index)
            try:
                return self._wait_ready(job, index)
            except _AddressTaken as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"{e}, and held it for {self._start_timeout}s; see "
                        f"{self.log_dir}/{job}-{index}.log") from None
                logger.warning("[cluster] %s; trying again", e)
                time.sleep(0.5)

    def _stop_tasks(self):
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            proc.wait()

    def shutdown(self):
        self._stop_tasks()
        if self._forks is not None:
            self._forks.close()
            self._forks = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
