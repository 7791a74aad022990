"""Workers cut off from a ps by the network while the coordinator reaches
it, for real (tests/_cut_off_job.py: firewall rules reject the worker
processes' packets to ps 0's port, every other path left working), and the
policy alone (keras_ps/coordinator/cut_off.py) on a fake clock.

Before: a cut-off worker was re-admitted several times a second for as long
as the cut lasted, without a warning, and with every worker cut off the
job retried for good."""

import logging
import os
import sys

import pytest

from _kills import run_cutting_job
from _paths import TESTS
from _results import last_report
from keras_ps.coordinator import cut_off
from keras_ps.errors import NoWorkersAvailableError

HOLD_S = 4  # how long worker 1 stays cut off in the custom loop
DROP_HOLD_S = 45  # the same, its packets dropped


@pytest.fixture(scope="module")
def job():
    code, output = run_cutting_job(
        [sys.executable, os.path.join(TESTS, "_cut_off_job.py"), str(HOLD_S)],
        300, KERAS_PS_CUT_OFF_TIMEOUT="3")
    assert code == 0, output[-4000:]
    return last_report(output, code)


@pytest.mark.timeout(360)
def test_a_worker_cut_off_from_a_ps_waits_longer_each_round_and_comes_back(
        job):
    worker = job["workers"][1]
    # Re-admitted at once, then after 0.5, 1 and 2 s: at most 5 times in
    # the 4 s of the cut (before: about 30), and it ran nothing meanwhile.
    assert 1 <= job["readmitted_while_cut"] <= 5, job
    assert job["ran_while_cut"] == 0, job
    # Healed: it runs calls again and is healthy.
    assert job["ran_after_heal"] >= 20 and job["state"] == "healthy", job
    told = [w for w in job["warnings"] if w.startswith("[worker:1]")]
    assert told[0].startswith(
        f"[worker:1] {worker} fails its calls on a connection "
        "(UnavailableError: "), told
    assert "(it names ps 0)" in told[0] and \
        "most likely cut off from a ps by the network" in told[0], told
    assert told[1].startswith(f"[worker:1] {worker} runs calls again, "), told
    # Its failed steps never reached the ps it was cut off from: each step
    # was applied there once. On the other ps, a failed call's steps may
    # have applied their update before the call failed (TF orders a step's
    # updates per variable only), then ran again elsewhere: at least once,
    # at most once more per closure of a failed call.
    assert job["devices"][0].startswith("/job:ps/replica:0/task:0"), job
    assert job["on_ps0"] == job["scheduled"], job
    assert job["scheduled"] <= job["on_ps1"] <= \
        job["scheduled"] + job["failed_calls"] * job["max_pack"], job


# Run apart (-m slow): about 70 s, most of it the cut held. The suite keeps
# a vanished machine's connections given up (coordinator/
# test_vanished_machines.py) and the rejected cut above.
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_worker_whose_packets_to_a_ps_are_dropped_is_cut_off_once_given_up():
    # Dropped without an answer, the worker's calls to ps 0 wait on their
    # connection until KERAS_PS_PEER_TIMEOUT (5 s here) ends it, then fail
    # as a rejected cut's (before: until the stuck-call watchdog, 120 s).
    code, output = run_cutting_job(
        [sys.executable, os.path.join(TESTS, "_cut_off_job.py"),
         str(DROP_HOLD_S), "drop"], 360, KERAS_PS_PEER_TIMEOUT="5")
    assert code == 0, output[-4000:]
    job = last_report(output, code)
    worker = job["workers"][1]
    told = [w for w in job["warnings"] if w.startswith("[worker:1]")]
    assert told and told[0].startswith(
        f"[worker:1] {worker} fails its calls on a connection "), told
    assert "most likely cut off from a ps by the network" in told[0], told
    assert told[-1].startswith(f"[worker:1] {worker} runs calls again, "), \
        told
    # Rounds 0, 0.5, 1, 2, 4, 8, 16 s apart at most in the cut's 45 s.
    assert 1 <= job["readmitted_while_cut"] <= 8, job
    assert job["ran_after_heal"] >= 20 and job["state"] == "healthy", job
    for on_ps in (job["on_ps0"], job["on_ps1"]):
        assert job["scheduled"] <= on_ps <= \
            job["scheduled"] + job["failed_calls"] * job["max_pack"], job


@pytest.mark.timeout(360)
def test_every_worker_cut_off_ends_fit_with_an_error_naming_the_cause(job):
    fit = job["fit"]
    assert fit["raised"] == "NoWorkersAvailableError", fit
    # KERAS_PS_CUT_OFF_TIMEOUT=3: the error comes once both have been cut
    # off 3 s (their rounds 0.5-2 s apart), never retried for good.
    assert 3 <= fit["seconds"] < 60, fit
    message = fit["message"]
    for text in [f"worker 0 ({job['workers'][0]}): ",
                 f"worker 1 ({job['workers'][1]}): ", "(it names ps 0)",
                 "cut off from a ps by the network",
                 "KERAS_PS_CUT_OFF_TIMEOUT"]:
        assert text in message, message


# -- the policy alone --------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _error(text="failed to connect to all addresses"):
    import tensorflow as tf
    return tf.errors.UnavailableError(None, None, (
        "Graph execution error:\n\nDetected at node x defined at (most "
        "recent call last):\n<stack traces unavailable>\n2 root error(s) "
        f"found.\n  (0) UNAVAILABLE:  {text}\nAdditional GRPC error "
        "information from remote target /job:ps/replica:0/task:1/device:"
        "CPU:0 while calling /tensorflow.eager.EagerService/Enqueue:"))


def test_the_wait_before_a_readmission_doubles_from_the_second_round():
    waits = [cut_off.wait_before_readmission(r) for r in range(1, 10)]
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_the_gist_is_the_status_line_and_the_ps_it_names():
    assert cut_off.gist(_error()) == (
        "(0) UNAVAILABLE:  failed to connect to all addresses "
        "(it names ps 1)")
    assert cut_off.gist(ValueError("")) == ""


def test_a_round_counts_until_a_call_runs_and_warns_once(caplog):
    clock = _Clock()
    cut = cut_off.CutOffWorkers(lambda: [0, 1], 60, clock)
    with caplog.at_level(logging.WARNING, "keras_ps.coordinator.cut_off"):
        for rounds in range(1, 5):
            assert cut.put_out(1, "w1:1", _error()) is None
            assert cut.wait(1) == cut_off.wait_before_readmission(rounds)
        assert cut.wait(0) == 0.0
        clock.now += 7
        cut.ran(1)
    assert cut.wait(1) == 0.0
    assert [r.getMessage()[:45] for r in caplog.records] == [
        "[worker:1] w1:1 fails its calls on a connecti",
        "[worker:1] w1:1 runs calls again, 7s after it"]


def test_the_job_fails_only_when_every_worker_is_cut_off_for_the_timeout():
    clock = _Clock()
    members = [0, 1]
    cut = cut_off.CutOffWorkers(lambda: members, 10, clock)
    for _ in range(3):
        assert cut.put_out(0, "w0:1", _error()) is None
    clock.now += 30  # worker 1 is not cut off: no error
    assert cut.put_out(0, "w0:1", _error()) is None
    assert cut.put_out(1, "w1:1", _error()) is None  # its first round
    assert cut.put_out(1, "w1:1", _error()) is None  # cut 0 s
    clock.now += 9
    assert cut.put_out(1, "w1:1", _error()) is None
    clock.now += 1
    fatal = cut.put_out(1, "w1:1", _error())
    assert isinstance(fatal, NoWorkersAvailableError)
    assert "worker 0 (w0:1): (0) UNAVAILABLE:" in fatal.message
    assert "worker 1 (w1:1): (0) UNAVAILABLE:" in fatal.message
    assert "for 10s" in fatal.message
    # A worker that left counts no more; one that ran ends its rounds.
    members = [1]
    assert cut.put_out(1, "w1:1", _error()) is not None
    cut.ran(1)
    assert cut.put_out(1, "w1:1", _error()) is None


def test_a_timeout_of_0_waits_for_good():
    clock = _Clock()
    cut = cut_off.CutOffWorkers(lambda: [0], 0, clock)
    for _ in range(20):
        clock.now += 30
        assert cut.put_out(0, "w0:1", _error()) is None
