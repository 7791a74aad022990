"""Test jobs forked from a process that imported TensorFlow and Keras once.

A job script (tests/_fit_job.py, ...) spends 2.5 s of CPU importing TF and
Keras before its first line runs, and a suite runs about a hundred. Each
test process starts one zygote (`python tests/_zygote.py FD`) that imports
them once, creates no TF context (TF's threads and state would not survive
a fork), and forks a job per request. The job is a process of its own: its
own pid, session and process group (signals and `killpg` reach it and what
it starts, as `start_new_session=True` does), the environment, directory and
arguments asked for, its output on the pipe it was given. It runs the script
as `python script args` does, from the zygote's top level: its exceptions,
`sys.exit`, atexit handlers and interpreter shutdown are Python's own.

`run(command, timeout, env, cwd)` is what `_results.run_child` uses for
`[sys.executable, "script.py", ...]`; `start(command, env, cwd, stdin)` what
`_results.start_child` uses, for a job the test signals or talks to while
it runs.
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from keras_ps.cluster import _forks

_MAX_REQUEST = 1 << 20


# The test process' side.

class Zygote:
    """One zygote and the jobs it forked (thread-safe)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._reports = _forks.Reports(ours.makefile("rb"), "test-zygote")

    @property
    def gone(self):
        return self._reports.gone

    def spawn(self, argv, env, cwd, output_fd, input_fd=None):
        """Forks a job running `python *argv`, its stdout and stderr on
        `output_fd`, its stdin from `input_fd` (or /dev/null); returns its
        pid."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        fds = [output_fd] + ([] if input_fd is None else [input_fd])
        with self._lock:
            socket.send_fds(self._sock, [request], fds)
            answer = self._reports.next_answer(120)
        if answer is None:
            raise RuntimeError("the test zygote is gone")
        return answer["pid"]

    def wait(self, pid, timeout):
        """The job's exit code, or None after `timeout` seconds."""
        return self._reports.exit_code(pid, timeout)


_zygote = None
_zygote_lock = threading.Lock()


def _the_zygote():
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.gone:
            _zygote = Zygote()
        return _zygote


def run(command, timeout, env=None, cwd=None):
    """(exit code, output) of `command` ([sys.executable, script, ...]),
    forked from the zygote; on a timeout, asks it for its threads' stacks
    (SIGUSR1), kills its process group and fails with its output."""
    job = start(command, env, cwd)
    chunks = []  # bytes as they come: a timeout shows what was written
    reader = threading.Thread(target=_read_all,
                              args=(job.stdout.buffer, chunks), daemon=True)
    reader.start()
    try:
        code = job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.send_signal(signal.SIGUSR1)
        _wait_quietly(job, 5)
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_quietly(job, 30)
        reader.join(30)
        output = b"".join(chunks).decode(errors="replace")
        raise AssertionError(
            f"{command[1:]} timed out after {timeout} s:\n{output[-12000:]}"
        ) from None
    reader.join()  # until every holder of the pipe closed it, as Popen's
    return code, b"".join(chunks).decode(errors="replace")


def _wait_quietly(job, timeout):
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


class Job:
    """A job forked from the zygote, used as a `subprocess.Popen` started
    with `stdout=PIPE, stderr=STDOUT, text=True` (and `stdin=PIPE`) is:
    `pid`, `stdout`, `stdin`, `poll`, `wait`, `send_signal`, `terminate`,
    `kill`, `returncode` (negative for a signal). Its exit code comes from
    the zygote, its parent."""

    def __init__(self, zygote, args, pid, stdout, stdin):
        self._zygote = zygote
        self.args, self.pid, self.stdout, self.stdin = args, pid, stdout, stdin
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
        if self.returncode is None and self._zygote.gone:
            raise AssertionError(f"{self.args[1:]}: the zygote it was forked "
                                 "from ended, and with it the exit code")
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # exited since; the zygote reports its code

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def start(command, env=None, cwd=None, stdin=False):
    """`command` ([sys.executable, script, ...]) forked from the zygote, as
    a `Job`: its output (stdout and stderr) readable as text from
    `job.stdout`, its stdin writable (line-buffered) from `job.stdin` with
    `stdin`."""
    zygote = _the_zygote()
    read_end, write_end = os.pipe()
    in_read, in_write = os.pipe() if stdin else (None, None)
    try:
        pid = zygote.spawn(command[1:], dict(os.environ if env is None
                                             else env), cwd, write_end,
                           in_read)
    except BaseException:
        for fd in (read_end, in_write):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (write_end, in_read):
            if fd is not None:
                os.close(fd)
    return Job(zygote, command, pid,
               os.fdopen(read_end, "r", encoding="utf-8", errors="replace"),
               None if in_write is None else
               os.fdopen(in_write, "w", buffering=1, encoding="utf-8"))


def _read_all(f, chunks):
    with f:
        for chunk in iter(lambda: f.read1(65536), b""):
            chunks.append(chunk)


# The zygote's side.

def _serve(sock):
    """Forks a job per request; returns (in the child only) its request."""
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)

    def send(message):
        sock.sendall((json.dumps(message) + "\n").encode())

    while True:
        readable, _, _ = select.select([sock, wakeup_r], [], [])
        if wakeup_r in readable:
            os.read(wakeup_r, 4096)
            _forks.reap(send)
        if sock not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 2)
        if not data:  # the test process is gone
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wakeup_r, wakeup_w):
                os.close(fd)
            sock.close()
            return json.loads(data), fds
        for fd in fds:
            os.close(fd)
        send({"pid": pid})
        _forks.reap(send)


def _become_job(request, fds):
    """In the forked child: the process `python argv...` would be, its
    output on fds[0] and its stdin from fds[1] if given."""
    import random

    os.setsid()
    _forks.redirect_stdio(fds[0])
    if len(fds) > 1:
        os.dup2(fds[1], 0)
        os.close(fds[1])
    # The zygote's keras_ps (for `_forks.reap`) is not the job's: the job
    # imports its own, which sets its defaults in the job's environment.
    for name in [n for n in sys.modules
                 if n == "keras_ps" or n.startswith("keras_ps.")]:
        del sys.modules[name]
    os.environ.clear()
    os.environ.update(request["env"])
    if request["cwd"]:
        os.chdir(request["cwd"])
    random.seed()  # each job its own sequence (ports, names), not the zygote's
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    return script


if __name__ == "__main__":
    import runpy

    # What every job imports first (creating no TF context).
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    _script = _become_job(*_serve(socket.socket(fileno=int(sys.argv[1]))))
    runpy.run_path(_script, run_name="__main__")
