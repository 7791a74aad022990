"""Real failures under a running loop: SIGKILL of worker and ps processes,
SIGSTOP of a worker (hung, not dead)."""

import os
import sys

import numpy as np
import pytest

from _kills import can_reset_connections
from _paths import TESTS
from _results import last_report
from _results import run_child

JOB = os.path.join(TESTS, "_fault_job.py")


def run_job(mode, timeout, **env):
    code, output = run_child([sys.executable, JOB, mode], timeout,
                             env={**os.environ, **env})
    assert code == 0, output[-6000:]
    return last_report(output)


@pytest.mark.timeout(240)
def test_worker_killed_mid_loop():
    result = run_job("worker_kill", timeout=220)
    # join() returned; every closure ran at least once (at-least-once: a
    # killed worker's in-flight batch may have partly run before it died).
    assert result["total"] >= result["steps"]
    # At most one packed batch (16 closures) per worker is re-run.
    assert result["total"] <= result["steps"] + 16 * 3
    assert sum(result["per_worker"]) == result["steps"]
    assert result["states"][1] == "failed"
    assert result["per_worker"][0] > 0 and result["per_worker"][2] > 0
    # Restarted on the same address, the worker is re-admitted: its dataset
    # is rebuilt (a 4th dataset_fn call, for worker 1) and it runs closures.
    assert result["readmitted"] is True
    assert result["states_after"] == ["healthy"] * 3
    assert sorted(result["built_on"][:3]) == [0, 1, 2]
    assert result["built_on"][3:] == [1]
    assert result["after_restart"] > 0
    assert result["total_after"] >= result["total"] + 300


@pytest.mark.timeout(150)
def test_worker_restarted_at_once_is_readmitted_not_blamed_on_the_user():
    # A restart policy brings a killed worker back before any call to it
    # fails: it answers every probe, a call fails on the connection, and its
    # retry fails on the eager context the worker lost (InvalidArgumentError
    # "Primary device is not remote"), an error that names no connection.
    result = run_job("worker_restart", timeout=130)
    assert result["error"] is None, result["error"]
    assert result["readmitted"] is True
    # Every closure ran once (the 20 before the kill, 100 after it): a
    # call that fails on a restarted worker has not run its step.
    assert result["total"] == 120.0
    assert sum(result["ran_after"]) == 100 and result["ran_after"][1] > 0
    assert result["built_on"] == [0, 1, 1]  # worker 1's dataset made again
    assert result["states"] == ["healthy", "healthy"]


@pytest.mark.timeout(120)
def test_ps_killed_raises_within_10s():
    result = run_job("ps_kill", timeout=100)
    assert result["error"] == "ParameterServerUnavailableError"
    assert result["seconds"] < 10
    assert "Restart the job" in result["message"]


@pytest.mark.timeout(120)
def test_ps_restarted_at_once_raises_within_10s():
    # A restart policy (Docker's, Kubernetes') can bring a killed ps back on
    # its address before any closure fails: it answers every probe, but the
    # variables it held are gone and it knows nothing of this job.
    result = run_job("ps_restart", timeout=100)
    assert result["error"] == "ParameterServerUnavailableError"
    assert result["seconds"] < 10
    assert "Restart the job" in result["message"]


@pytest.mark.timeout(180)
def test_custom_loop_recovers_a_killed_ps_from_its_checkpoint():
    # The ps is SIGKILLed mid-loop and started again on its address; the
    # loop catches the error, recovers the ps in place, restores its
    # checkpoint (total = 20) and goes on with the same coordinator,
    # workers and iterators: both workers take steps again, and the step
    # traced before the loss is not traced again (its trace is fed the
    # variable made again).
    result = run_job("ps_recover", timeout=160)
    assert result["seen"] < 10
    assert result["lost"] == [0]
    assert result["variables"] == 1
    assert result["restored"] == 20.0
    assert result["total"] == 20.0 + result["scheduled"], result
    assert result["states"] == ["healthy", "healthy"], result
    assert result["traced"] == [1, 1], result


@pytest.mark.timeout(240)
def test_state_a_restarted_worker_lost_is_raised_at_once_with_the_fix():
    # Closures read a variable the user placed on their worker; a restarted
    # worker lost it. Its marker is readable after the re-admission, so the
    # failure of its first call is the function's own: raised at the first
    # time, with a note on what a re-admission rebuilds, never retried in a
    # loop of re-admissions.
    result = run_job("worker_state_lost", timeout=220)
    assert result["error"] == "InvalidArgumentError", result
    assert result["is_keras_ps"] is False
    assert result["readmissions"] == 1, result
    note = " ".join(result["notes"])
    assert "worker 1's first call since it was re-admitted" in note, result
    assert "strategy.scope()" in note


@pytest.mark.timeout(240)
def test_worker_stopped_does_not_hang_training():
    # SIGSTOP: the process is alive, its port accepts TCP, its call never
    # returns. The watchdog gives the call up after the hang timeout.
    result = run_job("worker_stop", timeout=220, KERAS_PS_HANG_TIMEOUT="3")
    assert result["state_while_stopped"] == "hung"
    # Eager ops of new kinds ran on the coordinator while the worker was
    # stopped (TF's default wraps each in a function registered on every
    # task, which waited for the stopped one with the GIL held).
    expected = [float(np.log(np.exp(np.arange(i * 3, i * 3 + 3.0)).sum()))
                for i in range(2)]
    assert np.allclose(result["new_ops_while_stopped"], expected), result
    # join() returned while the worker was still stopped; the given-up call
    # may also have run once the worker continued (at-least-once: at most one
    # packed batch of 16).
    assert result["steps"] <= result["total"] <= result["steps"] + 16
    # After SIGCONT the same process is re-admitted and runs closures again.
    assert result["readmitted"] is True
    assert result["after_resume"] > 0


@pytest.mark.timeout(240)
def test_function_traced_while_a_worker_is_stopped_freezes_no_other_thread():
    # TF registers a newly traced function on every worker and waits for the
    # stopped one. That wait used to hold the GIL, freezing every thread of
    # the coordinator's process, so the thread that would continue the
    # worker never ran. Now it runs while the trace waits, and continues the
    # worker before the outside process that saves a frozen run does.
    # The hang watchdog gives the stopped worker's call up while its trace
    # waits: its closures run on the other worker, and it is not run after.
    result = run_job("trace_while_stopped", timeout=220,
                     KERAS_PS_HANG_TIMEOUT="3")
    assert result["trace_waited"] is True, result
    assert result["outside_continued"] is False, result
    assert result["resumed_before_join"] is True, result
    assert result["ticks_while_trace_waits"] > 0, result
    assert result["values"] == [6.0] * 5
    assert result["runs"] == 5.0  # each once: the call given up did not run
    # The worker works on: both take closures after it.
    assert result["states"] == ["healthy", "healthy"]
    assert all(n > 0 for n in result["ran_after"]), result


@pytest.mark.timeout(240)
def test_a_trace_waiting_for_an_idle_stopped_worker_does_not_hold_training():
    # A worker stops while idle, during another's trace of a new pack size:
    # the trace waits for it (TF registers functions on every worker), and
    # no call of the stopped worker ages to show it. It is set aside, the
    # waiting call is given up, and the third worker runs its closures with
    # the size traced: join returns while the worker is still stopped
    # (before, it waited until a process outside continued it, 90 s).
    result = run_job("trace_waits_for_an_idle_stopped_worker", timeout=220,
                     KERAS_PS_HANG_TIMEOUT="3")
    assert result["outside_continued"] is False, result
    assert result["joined_after"] < 60, result
    stopped, tracing = result["stopped"], result["tracing"]
    assert len(tracing) == 1 and stopped != tracing[0], result
    assert result["states_at_join"][stopped] == "hung", result
    assert result["states_at_join"][tracing[0]] == "hung", result
    # Each closure ran once (the call given up in its trace did not run),
    # and after SIGCONT every worker is back and the next closures run.
    assert result["runs_at_join"] == 9.0 and all(result["done"]), result
    assert result["back"] == [True, True, True] and result["runs"] == 39.0


@pytest.mark.timeout(240)
def test_closure_of_a_killed_worker_is_cancelled_after_another_error():
    # As TF's coordinator: a long closure's worker is SIGKILLed while another
    # closure fails; join() raises that error, the long closure's fetch()
    # raises CancelledError (it is not run again: total holds only the six
    # steps scheduled after), and the coordinator works on.
    result = run_job("preempted_while_cancelling", timeout=220)
    assert result["join_raised"] == "InvalidArgumentError", result
    assert result["long_fetch"] == "CancelledError", result
    # Each of the six later steps adds 1 to a total the long one never
    # touched (they run on two workers: in any order).
    assert result["after"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], result
    assert result["total"] == 6.0, result


@pytest.mark.timeout(240)
def test_an_iterator_reads_again_after_a_connection_reset_mid_read():
    # The worker's connection to the ps is aborted (ss -K) while its step
    # reads a 3 s element: the step fails with UnavailableError on a worker
    # that answers, the ps holding its variables, and is retried on it. TF
    # cancelled the read, which ended the iterator for good: the retry
    # failed with End of sequence and the loop ended with "ran out of data"
    # (what ended a fit after a ps recovery in the Docker test). Now the
    # worker's datasets are made again before the retry.
    if not can_reset_connections():
        pytest.skip("this machine does not let `ss -K` abort a connection")
    result = run_job("connection_reset_mid_read", timeout=220)
    assert result["reset"] >= 1, result
    assert result["failed"] == [
        "[worker:0] closure failed with UnavailableError; worker answers, "
        "dead ps [] -> retry"], result
    assert len(result["made_again"]) == 1, result
    # The retried step and the two after each read an element, and each
    # added 1; the failed attempt's update, 2 s into the call, never
    # reached the ps.
    assert result["reset_at"] < 2.0, result
    assert (result["first"], result["after"]) == (1.0, [1.0, 1.0]), result
    assert result["total"] == 4.0, result
    assert result["states"] == ["healthy"], result


@pytest.mark.timeout(240)
def test_a_marker_read_cut_by_a_reset_connection_keeps_the_ps():
    # Whether a ps still holds the job's variables is a read of a marker
    # variable on it. That read, in flight (the ps SIGSTOPped meanwhile),
    # has its connection aborted (ss -K): the ps lost nothing, and a read
    # on the next connection says so. Before, the one failed read counted
    # the ps as restarted, and a loop without a backup ended with
    # ParameterServerUnavailableError ("the model's variables there are
    # lost"; a fit with one recovered it from its backup, rolled back).
    if not can_reset_connections():
        pytest.skip("this machine does not let `ss -K` abort a connection")
    result = run_job("marker_read_reset", timeout=220)
    assert result["reset"] == 1, result
    assert result["holds"] is True, result
    assert result["lost"] == {}, result
    assert result["total"] == 1.0, result  # and steps run on


@pytest.mark.timeout(240)
def test_iterators_read_again_after_a_ps_lost_mid_read():
    # A step fails on a SIGKILLed ps while its iterator read is under way, so
    # TF cancels that read (which ends the iterator for good). After
    # recover_parameter_servers() and a restore, the next steps read their
    # iterator again (started over) instead of failing with End of sequence.
    result = run_job("ps_loss_mid_read", timeout=220)
    assert result["failed"] == "ParameterServerUnavailableError", result
    assert result["after"] == [1.0, 1.0], result
    assert result["total"] == 3.0, result  # restored 1, then two steps
