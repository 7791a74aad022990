"""Connecting to a cluster whose tasks are (re)starting, per-worker datasets
made while a worker is down, and clusters one after another in one process.
Each runs in its own coordinator process (tests/_cluster_job.py)."""

import os
import re
import sys

import pytest

from _paths import TESTS
from _results import last_report
from _results import run_child

JOB = os.path.join(TESTS, "_cluster_job.py")


def run_job(mode, timeout):
    code, output = run_child([sys.executable, JOB, mode], timeout,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert code == 0, output[-6000:]
    return last_report(output)


@pytest.mark.timeout(200)
def test_strategy_waits_for_a_starting_worker_and_names_one_that_never_answers():
    result = run_job("connect", timeout=180)
    unreachable = result["unreachable"]
    assert unreachable["type"] == "ClusterUnreachableError"
    assert "worker:1" in unreachable["message"]
    assert "KERAS_PS_CONNECT_TIMEOUT" in unreachable["message"]
    assert unreachable["seconds"] >= 2
    # Before that, one warning (shown without any logging set up) named the
    # task and its address, and how long until the wait ends.
    [(level, message)] = result["still_waiting"]
    assert level == "WARNING", message
    assert "worker:1 (localhost:" in message and "worker:0" not in message
    assert re.search(r"giving up in \d s \(KERAS_PS_CONNECT_TIMEOUT=2\)",
                     message), message
    # The strategy was built while worker 0 was down: it waited, the worker
    # came back, and the steps ran.
    assert result["waited"] is True
    assert result["total"] == 10


@pytest.mark.timeout(200)
def test_per_worker_dataset_made_while_a_worker_is_down():
    result = run_job("dataset_while_down", timeout=180)
    assert result["state_after_create"] == "failed"
    assert result["readmitted"] is True
    # Every step read 1.0 + 2.0; the returning worker ran steps too.
    assert result["total"] >= 300 * 3.0
    assert result["per_worker"][1] > 0


@pytest.mark.timeout(200)
def test_element_spec_waits_for_a_worker_to_return():
    result = run_job("dataset_no_worker", timeout=180)
    # With the only worker down, the wait ends at the timeout, named.
    assert "KERAS_PS_CONNECT_TIMEOUT" in result["timed_out"]["message"]
    assert result["timed_out"]["seconds"] >= 2
    # Once it is back, the dataset is made on it and its structure read.
    assert result["spec"] == [[3], "float32"]


@pytest.mark.timeout(200)
def test_clusters_one_after_another_in_one_process():
    result = run_job("second_cluster", timeout=180)
    assert result["runs"] == [40.0] * 4
    for use in ("coordinator", "predict"):
        assert "connection was replaced" in result["refused"][use], result


@pytest.mark.timeout(200)
def test_a_variable_made_before_the_strategy_is_named_and_the_next_step_runs():
    # TF's workers fail such a step with "/job:localhost/... unknown device".
    result = run_job("made_before", timeout=180)
    for name, needle in (("variable", "reads variable 'early:0'"),
                         ("model", "reads variable 'sequential/dense/")):
        message = result["refused"][name]
        assert message is not None, f"the {name} made before was not refused"
        for text in (needle, "created before the keras_ps strategy connected",
                     "/job:localhost/", "Create it after"):
            assert text in message, (text, message)
    assert result["late"] == 2.0
