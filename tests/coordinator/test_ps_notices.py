"""A ps' preemption notice, for real: `python -m keras_ps.server` ps tasks of
a LocalCluster get SIGTERM while a coordinator's PsNoticeWatch asks them,
and serve on until released, until their grace is over, until a second
signal or until no coordinator watches; one never asked stops at once
(tests/_notice_job.py). Model.fit's use of it: tests/fit/test_ps_recovery.py."""

import os
import sys

import pytest

from _paths import TESTS
from _results import last_report
from _results import run_child


def _job(mode, tmp_path, output_too=False):
    code, output = run_child(
        [sys.executable, os.path.join(TESTS, "_notice_job.py"), mode,
         str(tmp_path)], 200,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1"))
    assert code == 0, output[-4000:]
    return (last_report(output), output) if output_too else \
        last_report(output)


@pytest.mark.timeout(240)
def test_a_noticed_ps_stops_at_its_grace_a_second_signal_or_when_unwatched(
        tmp_path):
    result = _job("ways_to_stop", tmp_path)
    assert result["started"] is True
    # Each SIGTERM of a watched ps was heard by the coordinator (the job
    # waits for that), and the ps served on until one of these, which its
    # stop line names.
    lines = result["lines"]
    assert "ps:0 stopping 3 s after SIGTERM, not released" in lines["grace"]
    assert "ps:1 stopping on a second signal" in lines["second_signal"]
    assert "ps:2 stopping on SIGTERM, no coordinator watching any more" in \
        lines["unwatched_while_noticed"]
    # A ps no coordinator asked stops on SIGTERM at once, as it always did.
    assert "ps:0 stopping on signal" in lines["never_watched"]


@pytest.mark.timeout(240)
def test_a_custom_loop_backs_up_on_a_notice_and_loses_no_step(tmp_path):
    # ps 0 gets SIGTERM mid-loop and is started again once it exits; the
    # loop writes a checkpoint at the next step, releases the ps, recovers
    # it and restores the checkpoint: every step is counted once on both ps.
    result = _job("custom_loop", tmp_path)
    assert result["recovered"] == 1
    assert result["saved_at"] == result["notice_at"]
    assert result["values"] == [result["steps"]] * 2, result


@pytest.mark.timeout(240)
def test_a_ps_without_the_kernels_is_not_watched_and_stops_at_once(tmp_path):
    result, output = _job("no_kernels", tmp_path, output_too=True)
    assert result["started"] is False
    assert "the ps' preemption notices are not watched" in output
    assert "start every ps with `python -m keras_ps.server`" in output
    assert "ps:0 stopping on signal" in result["line"]
