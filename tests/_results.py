"""How a test's child process reports: one `RESULT {json}` line per report."""

import faulthandler
import json
import os
import signal
import subprocess
import sys

PREFIX = "RESULT "

# A child that imports this prints every thread's stack on SIGUSR1: a test
# whose child timed out sends it before the kill, so the hang is seen.
faulthandler.register(signal.SIGUSR1, all_threads=True)


def say(**values):
    """Prints one report (in the child process)."""
    print(PREFIX + json.dumps(values), flush=True)


def reports(output):
    """Every report in a child's output, in order."""
    return [json.loads(line[len(PREFIX):]) for line in output.splitlines()
            if line.startswith(PREFIX)]


def last_report(output, code=None):
    """The child's last report; fails with its output (and its exit code,
    when given: a negative one is the signal that ended it) when there is
    none."""
    found = reports(output)
    exited = "" if code is None else f" (the child exited with {code})"
    # A crash's stacks (faulthandler, every thread) take several thousand.
    assert found, (f"no {PREFIX.strip()} line in the output{exited}:\n"
                   f"{output[-12000:]}")
    return found[-1]


def _is_script(command):
    """Whether `command` is `[sys.executable, "script.py", ...]`, which the
    test zygote can fork."""
    return (command[0] == sys.executable and len(command) > 1
            and command[1].endswith(".py"))


def run_child(command, timeout, **popen_kwargs):
    """Runs `command` in its own process group; returns (exit code, output).
    On a timeout it asks the child for its threads' stacks (SIGUSR1), kills
    the group (the child's servers with it) and fails with that output.

    A Python script (`[sys.executable, "job.py", ...]`, with `env` and `cwd`
    at most) is forked from a process that imported TF and Keras once
    (tests/_zygote.py): the same process otherwise, 2.5 s of CPU sooner."""
    if _is_script(command) and set(popen_kwargs) <= {"env", "cwd"}:
        import _zygote

        return _zygote.run(command, timeout, **popen_kwargs)
    job = subprocess.Popen(command, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, **popen_kwargs)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.send_signal(signal.SIGUSR1)
        try:
            job.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(
            f"{command[1:]} timed out after {timeout} s:\n{output[-12000:]}")
    return job.returncode, output


def start_child(command, env=None, cwd=None, stdin=False, fresh=False):
    """Starts `command` as `subprocess.Popen(command, stdout=PIPE,
    stderr=STDOUT, text=True, env=env, cwd=cwd)` would (with `stdin=PIPE`
    if `stdin`), for a test that signals it or reads it as it runs. A Python
    script is forked from the zygote, as in `run_child`, unless `fresh`
    (a new interpreter, as Popen starts it); the job has a session of its
    own either way."""
    if _is_script(command) and not fresh:
        import _zygote

        return _zygote.start(command, env=env, cwd=cwd, stdin=stdin)
    return subprocess.Popen(
        command, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1 if stdin else -1, env=env, cwd=cwd, start_new_session=True)
