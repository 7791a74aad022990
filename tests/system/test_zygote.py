"""The test harness' zygote (tests/_zygote.py): a job forked from it is the
process `python script args` would be, as far as the tests can tell."""

import os
import signal
import subprocess
import sys

import pytest

from _results import run_child
from _results import start_child

_SCRIPT = """
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # as _results does
mode = sys.argv[1]
print("pid", os.getpid(), "leads its group", os.getpgid(0) == os.getpid(),
      "session", os.getsid(0) == os.getpid(), flush=True)
if mode == "exit":
    sys.exit(3)
if mode == "raise":
    raise ValueError("raised by the job")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang":
    time.sleep(600)
print("parent", os.getppid(), flush=True)
print("keras_ps imported before", "keras_ps" in sys.modules, flush=True)
import keras_ps
print("GRPC_FAIL_FAST", os.environ.get("GRPC_FAIL_FAST"), flush=True)
print("env", os.environ.get("ZYGOTE_TEST"), "cwd", os.getcwd(),
      "argv", sys.argv[1:], "path0", sys.path[0], flush=True)
"""


@pytest.mark.timeout(120)
def test_a_forked_job_is_the_process_python_would_start(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, ZYGOTE_TEST="set")
    env.pop("GRPC_FAIL_FAST", None)  # set by keras_ps' import, in the job
    code, output = run_child([sys.executable, str(script), "env", "x"], 60,
                             env=env, cwd=str(tmp_path / ".."))
    assert code == 0, output
    assert "leads its group True session True" in output
    # Forked from the zygote, not started by this process.
    assert f"parent {os.getpid()}\n" not in output and "parent " in output
    # Its keras_ps is its own, imported under its environment.
    assert "keras_ps imported before False" in output
    assert "GRPC_FAIL_FAST use_caller" in output
    assert (f"env set cwd {tmp_path.parent} argv ['env', 'x'] "
            f"path0 {tmp_path}") in output
    assert run_child([sys.executable, str(script), "exit"], 60,
                     env=env)[0] == 3
    code, output = run_child([sys.executable, str(script), "raise"], 60,
                             env=env)
    assert code == 1 and "ValueError: raised by the job" in output
    assert run_child([sys.executable, str(script), "kill"], 60,
                     env=env)[0] == -signal.SIGKILL
    # A job past its time: its stacks (SIGUSR1), then killed with its group.
    with pytest.raises(AssertionError, match=r"(?s)timed out after 3 s.*"
                       r"Current thread.*in <module>"):
        run_child([sys.executable, str(script), "hang"], 3, env=env,
                  cwd=os.path.dirname(os.path.dirname(__file__)))


_TALKING_SCRIPT = """
import sys, time
print("READY", flush=True)
line = sys.stdin.readline()
print("GOT", line.strip(), flush=True)
if line.strip() == "wait":
    time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_started_job_reads_its_stdin_and_ends_by_the_signal_sent(tmp_path):
    # As subprocess.Popen with stdout=PIPE, stderr=STDOUT, stdin=PIPE: the
    # test talks to the job, signals it and reads its exit code.
    script = tmp_path / "talk.py"
    script.write_text(_TALKING_SCRIPT)
    job = start_child([sys.executable, str(script)], stdin=True)
    try:
        assert job.stdout.readline() == "READY\n"
        assert job.poll() is None
        job.stdin.write("wait\n")
        assert job.stdout.readline() == "GOT wait\n"
        with pytest.raises(subprocess.TimeoutExpired):
            job.wait(0.5)
        job.send_signal(signal.SIGTERM)
        assert job.wait(60) == -signal.SIGTERM == job.poll()
        assert job.stdout.read() == ""
    finally:
        job.kill()
    # A job that ends by itself, its stdin closed.
    job = start_child([sys.executable, str(script)], stdin=True)
    job.stdin.close()
    assert job.wait(60) == 0
    assert job.stdout.read() == "READY\nGOT \n"
