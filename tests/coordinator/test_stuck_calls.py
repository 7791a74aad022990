"""Calls stuck on workers that answer: a read of a named pipe no one writes
blocks the worker's op for real (as a stalled network filesystem does) while
its process answers every probe."""

import os
import sys

import pytest

from _paths import TESTS
from _results import last_report
from _results import run_child

JOB = os.path.join(TESTS, "_stuck_job.py")
LINES_BEFORE_THE_PIPE = 40  # worker 1's lines before the pipe, in the job


def _run(mode, tmp_path, timeout, **env):
    pipe = str(tmp_path / "pipe")
    os.mkfifo(pipe)
    code, output = run_child(
        [sys.executable, JOB, mode, pipe], timeout,
        env={**os.environ, "KERAS_PS_HANG_TIMEOUT": "3", **env})
    assert code == 0, output[-6000:]
    return last_report(output, code)


@pytest.mark.timeout(260)
def test_a_call_stuck_on_a_worker_that_answers_goes_to_the_others(tmp_path):
    # Worker 1's dataset reads 40 lines, then blocks on the pipe. Its call
    # is given up once it has run the limit: its closures run on worker 0,
    # join returns, and worker 1 is re-admitted once the pipe is written.
    result = _run("iterator", tmp_path, 240, KERAS_PS_STUCK_TIMEOUT="20")
    steps, ran = result["steps"], result["ran"]
    assert sum(ran) == steps and ran[0] > 0
    assert result["few_at_join"] == LINES_BEFORE_THE_PIPE
    # Every closure ran; the only repeats are the steps of the given-up
    # call that ran before the read blocked (worker 1 read 40 lines and
    # finished `ran[1]` closures).
    assert result["total_at_join"] == steps + LINES_BEFORE_THE_PIPE - ran[1]
    assert result["state_while_stuck"] == "stuck"
    moves = result["moves"]
    assert moves[0].startswith("[worker:1] healthy -> stuck (ran ")
    assert "(limit 20s) on a worker that answers" in moves[0]
    assert "[worker:1] stuck -> recovering (answers)" in moves
    assert result["readmitted"] is True and result["ran_after"] > 0
    assert result["total"] == result["total_at_join"] + result["scheduled_after"]
    assert not any("[worker:0]" in m for m in moves)


@pytest.mark.timeout(260)
def test_a_function_stuck_wherever_it_runs_fails_the_job_naming_it(tmp_path):
    # The scheduled function reads the pipe itself: given up on one worker,
    # it gets stuck on the other. The job fails with an error that names the
    # function, the workers and the setting, instead of waiting forever.
    result = _run("function", tmp_path, 240, KERAS_PS_STUCK_TIMEOUT="10")
    assert result["error_type"] == "StuckCallError"
    assert result["is_deadline_exceeded"] is True
    message = result["message"]
    assert "A call of read_the_pipe was given up as stuck on workers [0, 1]" \
        in message
    assert "(limit 10s)" in message and "KERAS_PS_STUCK_TIMEOUT" in message
    assert result["fetched"] == "StuckCallError"
    assert sorted(m.split(" ->")[0] for m in result["moves"]) == [
        "[worker:0] healthy", "[worker:1] healthy"]


@pytest.mark.timeout(260)
def test_a_shard_whose_file_blocks_everywhere_fails_fit_naming_the_file(
        tmp_path):
    # Model.fit on a ShardedInput whose second file is the pipe: reading it
    # blocks on whichever worker takes it. fit fails with an error that
    # names the shard and its file, the thing the user has to fix.
    result = _run("shard", tmp_path, 240, KERAS_PS_STUCK_TIMEOUT="10")
    assert result["error_type"] == "StuckCallError"
    message = result["message"]
    pipe = str(tmp_path / "pipe")
    assert f"on shard 1 of 4 (file {pipe!r}) was given up as stuck on " \
        "workers [0, 1]" in message
    assert "Reading that shard most likely blocks on every worker" in message
    assert sorted(m.split(" ->")[0] for m in result["moves"]) == [
        "[worker:0] healthy", "[worker:1] healthy"]


@pytest.mark.timeout(260)
def test_calls_stuck_on_every_worker_fail_the_job_naming_them(tmp_path):
    # Every worker's dataset blocks on the pipe after its 40 lines, each in
    # a call of its own: once both are given up no worker is left, and a
    # stuck worker returns only if its call does. join raises, naming both.
    result = _run("everywhere", tmp_path, 240, KERAS_PS_STUCK_TIMEOUT="10")
    assert result["error_type"] == "StuckCallError"
    message = result["message"]
    assert message.startswith(
        "Every worker has a call given up as stuck, so none is left to train "
        "(worker 0: a call of step ran ")
    assert "; worker 1: a call of step ran " in message
    assert "(limit 10s) on a worker that answers" in message
    assert result["trained"] == 2 * LINES_BEFORE_THE_PIPE  # both read theirs
    assert result["states"] == ["stuck", "stuck"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_by_default_a_call_is_stuck_past_twenty_times_its_functions_calls(
        tmp_path):
    # No setting: worker 1's finished calls of the step take milliseconds,
    # so its stuck call is given up at the 120 s floor (over 2 minutes).
    result = _run("iterator", tmp_path, 380)
    assert result["total_at_join"] == \
        result["steps"] + LINES_BEFORE_THE_PIPE - result["ran"][1]
    assert "(limit 120s) on a worker that answers" in result["moves"][0]
    assert result["readmitted"] is True and result["ran_after"] > 0
