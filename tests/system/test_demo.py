"""The README's first command, `python -m keras_ps.demo`, run as a user runs
it: the test reads only what the user sees (the progress bar, the kill, the
evaluator's results and the summary) and the files the summary points to."""

import os
import re
import subprocess
import sys

import pytest

# Keras' progress bar colours its output; the test reads the text.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text[-3000:]}"
    return match.group(1)


@pytest.mark.timeout(200)
def test_demo_trains_survives_worker_kill_and_reports(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "keras_ps.demo", "--epochs", "2",
         "--steps_per_epoch", "100", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180)
    out = _ANSI.sub("", result.stdout)
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]

    assert "2 ps, 2 workers, 1 evaluator" in out
    assert re.search(r"sharded over the ps: \(1500, 16\) on ps:0, "
                     r"\(1500, 16\) on ps:1", out), out[-3000:]
    # Keras' progress bar, one per epoch, each run to the end.
    assert re.findall(r"Epoch (\d)/2", out) == ["1", "2"]
    assert len(re.findall(r"100/100 .*accuracy: [\d.]+ - loss: ", out)) == 2
    # Killed halfway (step 100 of 200), then restarted and re-admitted.
    assert "step 100: killed worker 1 (SIGKILL)" in out
    assert "restarted worker 1 on the same address" in out

    # The evaluator (its own process) evaluated checkpoints, the final one
    # (step 200) included, and exported the best model.
    evaluated = re.findall(
        r"evaluator: \[evaluator\] evaluated checkpoint ckpt-0*(\d+) "
        r"\(epoch \d, step \d+\): accuracy=([\d.e-]+)", out)
    assert evaluated and evaluated[-1][0] == "200", out[-3000:]
    assert os.path.exists(tmp_path / "best.keras")

    # The summary: every step ran, on both workers; worker 0 carried on
    # alone after the kill, so it ran at least the second half.
    summary = out.split("\nSummary\n", 1)[1]
    assert int(_number(r"steps: (\d+) in [\d.]+s \([\d.]+ steps/s", summary)) \
        == 200
    per_worker = {int(w): int(n) for w, n in re.findall(
        r"worker (\d): (\d+) steps", summary)}
    assert sum(per_worker.values()) >= 200
    # Worker 0 ran at least the second half alone; how many steps worker 1
    # got before the kill and after re-admission depends on the machine.
    assert per_worker[0] >= 100 and set(per_worker) == {0, 1}
    assert "killed at step 100" in summary
    # Worker 1 ends healthy, or, when training ended just as it came back,
    # says so in words (not only the state's name).
    assert re.search(r"worker 1: \d+ steps, (healthy|re-admitted, training "
                     r"ended before its next call) \(killed at step 100, "
                     r"restarted\)", summary), summary
    # Always answering 0 scores 0.75 on the rule; learning it scores ~1.
    accuracy = float(_number(
        r"final accuracy \(evaluator, held-out data\): ([\d.]+)", summary))
    assert accuracy >= 0.95
    assert accuracy == pytest.approx(float(evaluated[-1][1]), abs=1e-3)
    assert f"checkpoints: {tmp_path / 'checkpoints'}" in summary
    assert f"TensorBoard logs: {tmp_path / 'tensorboard'}" in summary
    assert os.listdir(tmp_path / "tensorboard" / "train")
    assert os.listdir(tmp_path / "tensorboard" / "validation")


def test_demo_refuses_a_used_output_dir(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "keras_ps.demo", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"--output_dir {tmp_path} is not empty; pass a new or empty " \
        "directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flag, value", [("--epochs", "0"),
                                         ("--batch", "-8")])
def test_demo_refuses_a_count_below_one(flag, value, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "keras_ps.demo", flag, value,
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"{flag} must be a positive integer. Received: {flag}={value}." \
        in result.stderr
    assert "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "out")  # refused before any work
