"""A LocalCluster's tasks, forked from one process that has TF's server loaded.

Loading TF's server libraries costs a task 0.8 s of CPU before it serves (the
same in every task, and a LocalCluster starts, restarts and retries tasks
often). A `ForkServer` loads them once, in a process of its own (never in
the cluster's process, which may run TF's threads: a fork of it would not be
safe), then forks each task from it: the task runs
`python -m keras_ps.server` with its arguments, from memory already loaded.

The fork server is the tasks' parent. It reports each task's exit code to
the cluster's process, and exits when that process closes its pipe or dies:
its tasks, started with `--exit_with_parent`, then stop too.

`python -m keras_ps.server --fork_server` runs the fork server (`serve`; its
protocol: one JSON line per request on stdin, one per answer or task exit on
stdout).
"""

import ctypes
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

from keras_ps import _native
from keras_ps import _tf_adapter


class ForkServerError(RuntimeError):
    """The fork server could not start, or stopped while the cluster ran."""


class ForkedTask:
    """A task forked by a `ForkServer`, used as a `subprocess.Popen` is:
    `pid`, `poll`, `wait`, `send_signal`, `terminate`, `kill`. Its exit code
    (`returncode`) is negative for a signal, as Popen's."""

    def __init__(self, server, pid):
        self._server = server
        self.pid = pid

    @property
    def returncode(self):
        return self._server.exit_code(self.pid)

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        """The exit code, once the task exited.

        Raises:
            subprocess.TimeoutExpired: still running after `timeout` seconds.
        """
        code = self._server.wait_for_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"task pid {self.pid}", timeout)
        return code

    def send_signal(self, signum):
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # exited; its report is on its way
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


# The exit code given to a task whose fork server stopped before reporting
# it (its tasks then stop by themselves: their parent is gone).
EXIT_UNKNOWN = 255


class Reports:
    """What a forking process says on `stream`, one JSON object a line, read
    on a thread: answers to its requests (in order) and its children's exit
    codes (`{"exited": pid, "code": code}`, as `reap` sends them)."""

    def __init__(self, stream, name):
        self._changed = threading.Condition()
        self._exits = {}  # pid: exit code
        self._answers = []
        self.gone = False  # the stream ended: the process is gone
        self._reader = threading.Thread(target=self._read, args=(stream,),
                                        daemon=True, name=name)
        self._reader.start()

    def _read(self, stream):
        for line in stream:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                else:
                    # A new child may have the pid of one that exited.
                    self._exits.pop(message.get("pid"), None)
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self.gone = True
            self._changed.notify_all()

    def next_answer(self, timeout):
        """The next answer, or None once gone or after `timeout` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._answers or self.gone, timeout)
            return self._answers.pop(0) if self._answers else None

    def exit_code(self, pid, timeout=0):
        """The child's exit code; None while it runs (waiting up to
        `timeout` seconds, None for no limit, for it to exit)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self.gone,
                                   timeout)
            return self._exits.get(pid)

    def join(self, timeout):
        self._reader.join(timeout)


class ForkServer:
    """Starts the fork server and forks tasks from it.

    Args:
        env: the environment of the fork server, and so of every task.
        log_path: where the fork server's own output goes (TF's messages as
            it loads).
        timeout: seconds it has to load TF's server libraries.

    Raises:
        ForkServerError: it exited or did not load in time; the message
            names its log.
    """

    def __init__(self, env, log_path, timeout):
        self._log_path = log_path
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "keras_ps.server", "--fork_server"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=env)
        self._lock = threading.Lock()  # one request at a time
        self._reports = Reports(self._proc.stdout, "keras_ps-fork-server")
        self._next_answer(timeout, "load TF's server libraries")

    def _next_answer(self, timeout, doing):
        answer = self._reports.next_answer(timeout)
        if answer is not None:
            return answer
        if self._reports.gone:
            try:
                code = f"exited with code {self._proc.wait(5)}"
            except subprocess.TimeoutExpired:
                code = "closed its pipe"
        else:
            code = f"did not answer in {timeout:.0f}s"
        self._proc.kill()
        self._proc.wait()
        raise ForkServerError(
            f"the LocalCluster's fork server (the process its tasks are "
            f"forked from, pid {self._proc.pid}) {code} before it could "
            f"{doing}{_last_line(self._log_path)}; see {self._log_path}")

    def spawn(self, name, argv, log_path, timeout=60.0):
        """Forks task `name` ("ps:0") running `python -m keras_ps.server
        *argv`, its output appended to `log_path`; returns its `ForkedTask`.

        Raises:
            ForkServerError: the fork server is gone or did not answer.
        """
        request = json.dumps({"name": name, "argv": list(argv),
                              "log": log_path}) + "\n"
        with self._lock:
            try:
                self._proc.stdin.write(request.encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # it is gone: _next_answer says so
            answer = self._next_answer(timeout, "fork a task")
        if "error" in answer:
            raise ForkServerError(f"the LocalCluster's fork server could not "
                                  f"fork a task: {answer['error']}")
        return ForkedTask(self, answer["pid"])

    def exit_code(self, pid):
        """The task's exit code, or None while it runs."""
        code = self._reports.exit_code(pid)
        if code is None and self._reports.gone and not _alive(pid):
            return EXIT_UNKNOWN
        return code

    def wait_for_exit(self, pid, timeout=None):
        """The task's exit code, or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._reports.exit_code(pid, timeout)
        while True:
            code = self.exit_code(pid)
            if code is not None or (deadline is not None
                                    and time.monotonic() >= deadline):
                return code
            # The fork server is gone, and reports nothing more: its tasks
            # see their parent gone and end within a second.
            time.sleep(0.1)

    def close(self, timeout=10.0):
        """Ends the fork server (its tasks should be stopped first)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reports.join(timeout)


def _last_line(path):
    """' (its last words: ...)' from the end of a log, or ''."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f" (its last words: {lines[-1].strip()!r})" if lines else ""


def stat_state(path):
    """The state letter in a /proc stat file (`/proc/PID/stat`,
    `/proc/PID/task/TID/stat`), or None when it cannot be read (the process
    or thread is gone)."""
    try:
        with open(path) as f:
            # "pid (comm) state ...": comm may hold spaces and ")".
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid):
    state = stat_state(f"/proc/{pid}/stat")
    return state is not None and state not in "ZX"


# The fork server's side.

_ANSWERS_FD = None  # the fork server's pipe to the cluster's process


def _send(message):
    os.write(_ANSWERS_FD, (json.dumps(message) + "\n").encode())


def _name_process(name):
    """Names the process (`ps -o comm`, top) as its task: its command line
    stays the fork server's."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux
        pass


def redirect_stdio(output):
    """In a forked child: stdin from /dev/null, stdout and stderr to the
    file descriptor `output` (then closed)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(null)
    os.close(output)


def _run_task(run, argv, name, log, wakeup):
    """In the forked child: becomes the task, and never returns."""
    code = 1
    try:
        for fd in (*wakeup, _ANSWERS_FD):
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # The task keeps none of the fork server's pipes: the cluster's
        # process must see the answers end when the fork server does.
        redirect_stdio(log)
        random.seed()  # not the fork server's sequence, the same in each task
        _name_process(name)
        sys.argv = ["keras_ps.server", *argv]
        code = run(argv) or 0
    except SystemExit as e:  # argparse's errors
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def reap(send):
    """Reaps every child that exited, and `send`s each one's exit code
    (negative for a signal, as Popen's)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(run):
    """Runs the fork server (`python -m keras_ps.server --fork_server`):
    loads what every task loads before it serves, then forks a task per
    request, which calls `run(argv)` (keras_ps.server.main) and exits with
    its result. Never returns."""
    global _ANSWERS_FD
    # Answers go to a copy of stdout; stdout itself to the log (stderr), so
    # that nothing else printed is taken for an answer.
    _ANSWERS_FD = os.dup(1)
    os.dup2(2, 1)
    _tf_adapter.server_modules()
    try:
        loaded = _native.load_in_server()
    except ValueError as e:  # each task says it in its own log
        loaded = str(e)
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup[1], warn_on_full_buffer=False)
    _send({"ready": loaded})
    pending = b""
    while True:
        readable, _, _ = select.select([0, wakeup[0]], [], [])
        if wakeup[0] in readable:
            os.read(wakeup[0], 4096)
            reap(_send)
        if 0 not in readable:
            continue
        data = os.read(0, 65536)
        if not data:  # the cluster's process closed the pipe, or died
            os._exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            try:
                # Opened here: the log is there once the task is.
                log = os.open(request["log"],
                              os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as e:
                _send({"error": f"cannot open {request['log']}: {e.strerror}"})
                continue
            try:
                pid = os.fork()
            except OSError as e:
                os.close(log)
                _send({"error": f"fork failed: {e.strerror}"})
                continue
            if pid == 0:
                _run_task(run, request["argv"], request["name"], log, wakeup)
            os.close(log)
            _send({"pid": pid})
        reap(_send)

