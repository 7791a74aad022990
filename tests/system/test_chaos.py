"""Model.fit under repeated SIGKILL/restart and SIGSTOP/SIGCONT of workers
(benchmarks/chaos.py): training finishes, every planned step ran (only the
at-least-once slack more), the result matches an undisturbed run."""

import os
import sys

import pytest

from _paths import REPO
from _results import last_report
from _results import run_child

CHAOS = os.path.join(REPO, "benchmarks", "chaos.py")
MAX_PACK, PER_EXECUTION = 16, 2


def _run(kills, stops, timeout):
    code, output = run_child(
        [sys.executable, CHAOS, "--kills", str(kills), "--stops", str(stops)],
        timeout, env={**os.environ, "KERAS_PS_HANG_TIMEOUT": "3"})
    assert code == 0, output[-6000:]
    return last_report(output)


def _check(report, kills, stops):
    disturbed, undisturbed = report["disturbed"], report["undisturbed"]
    assert disturbed["chaos_error"] is None
    assert [e["kind"] for e in disturbed["events"]].count("kill") == kills
    assert [e["kind"] for e in disturbed["events"]].count("stop") == stops
    for event in disturbed["events"]:
        # Noticed, worked around, and the worker came back and ran steps.
        assert {"failed_after_s", "others_running_after_s",
                "running_again_after_s"} <= set(event), event
    planned = disturbed["planned_steps"]
    # At-least-once: a lost packed execution may have run before it was
    # retried; nothing is lost.
    slack = report["failures"] * MAX_PACK * PER_EXECUTION
    assert planned <= disturbed["iterations"] <= planned + slack
    assert undisturbed["iterations"] == undisturbed["planned_steps"]
    assert disturbed["states"] == ["healthy"] * 3
    assert undisturbed["final_accuracy"] > 0.95
    assert abs(disturbed["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.02


@pytest.mark.timeout(420)
def test_chaos_short():
    _check(_run(kills=1, stops=1, timeout=400), kills=1, stops=1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_chaos_long():
    _check(_run(kills=8, stops=3, timeout=1150), kills=8, stops=3)
