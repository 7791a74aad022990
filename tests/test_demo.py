"""The README's first command, run short: it must train, survive the kill and
print its summary."""

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_demo_runs_and_survives_worker_kill():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-m", "keras_ps.demo", "--steps", "300"],
                            capture_output=True, text=True, env=env, timeout=220)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "killed worker 2" in out
    assert "worker 2:" in out and "failed" in out.split("worker 2:")[1].splitlines()[0]
    accuracy = float(out.split("accuracy of the last 50 steps ")[1].split()[0])
    assert accuracy > 0.9
