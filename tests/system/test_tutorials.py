"""Smoke tests of tutorials/: each tutorial runs as a user runs it (a
subprocess that starts its own multi-process LocalCluster), with small step
counts, and must print the numbers the tutorial promises."""

import glob
import os
import re
import sys

import pytest

from _paths import REPO as ROOT  # noqa: E402
from _results import run_child
TUTORIALS = os.path.join(ROOT, "tutorials")


def run_tutorial(name, *args, timeout=150):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)  # a local cluster, not the caller's
    code, output = run_child(
        [sys.executable, os.path.join(TUTORIALS, name), *args], timeout,
        env=env, cwd=ROOT)
    assert code == 0, output[-6000:]
    return output


def number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text[-3000:]}"
    return float(match.group(1))


@pytest.mark.timeout(180)
def test_model_fit_tutorial(tmp_path):
    out = run_tutorial("model_fit.py", "--epochs", "3", "--steps_per_epoch",
                       "10", "--steps_per_execution", "5", "--backup_freq", "5",
                       "--workdir", str(tmp_path))
    # The embedding is split 4 + 4 rows over the two ps.
    assert "embedding shards: [((4, 16384), 'job:ps'), ((4, 16384), 'job:ps')]" in out
    # The Keras progress lines, one per epoch.
    assert [int(e) for e in re.findall(r"Epoch (\d)/3", out)] == [1, 2, 3]
    assert number(r"Training steps: (\d+)", out) == 30
    # The toy rule is learnt exactly, as in TF's tutorial.
    assert number(r"Final training accuracy: ([\d.]+)", out) >= 0.95
    assert number(r"Evaluation accuracy: ([\d.]+) on 200 examples", out) >= 0.95
    assert number(r"without a cluster: accuracy ([\d.]+)", out) >= 0.95
    # TensorBoard, ModelCheckpoint wrote their files; BackupAndRestore
    # cleaned its backup up after a finished run.
    assert glob.glob(str(tmp_path / "logs" / "train" / "events.*"))
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "model-01.keras", "model-02.keras", "model-03.keras"]
    assert not os.path.exists(tmp_path / "backup")


@pytest.mark.timeout(180)
def test_model_fit_tutorial_with_dynamic_shards(tmp_path):
    out = run_tutorial("model_fit.py", "--epochs", "3", "--input", "shards",
                       "--steps_per_execution", "2", "--workdir",
                       str(tmp_path))
    # The progress bar counts files (shards) out of the epoch's 8.
    assert [int(e) for e in re.findall(r"Epoch (\d)/3", out)] == [1, 2, 3]
    assert "Records trained per epoch: [1000, 1000, 1000] (8 files); 0 " \
        "trained twice" in out
    # 32 batches per epoch: 125 records per file in batches of 32 (4 each).
    assert number(r"Training steps: (\d+)", out) == 3 * 8 * 4
    assert number(r"Final training accuracy: ([\d.]+)", out) >= 0.95
    assert number(r"Evaluation accuracy: ([\d.]+) on 200 examples", out) >= 0.95


@pytest.mark.timeout(180)
def test_custom_training_loop_tutorial_and_restart(tmp_path):
    workdir = ["--workdir", str(tmp_path), "--steps_per_epoch", "5"]
    first = run_tutorial("custom_training_loop.py", "--epochs", "2", *workdir)
    assert "embedding shards: [((4, 16384), 'job:ps'), ((4, 16384), 'job:ps')]" in first
    assert "Restored" not in first
    assert re.findall(r"Finished epoch (\d)", first) == ["0", "1"]
    # 2 epochs x 5 steps + the "final loss" step.
    assert number(r"Training steps: (\d+)", first) == 11

    # Started again on a fresh cluster with the same workdir: it restores the
    # epoch-2 checkpoint (model, optimizer, epoch) and trains epochs 2 and 3.
    second = run_tutorial("custom_training_loop.py", "--epochs", "4", *workdir)
    assert re.search(r"Restored .*ckpt-2 at epoch 2", second)
    assert re.findall(r"Finished epoch (\d)", second) == ["2", "3"]
    assert number(r"Training steps: (\d+)", second) == 21
    # The tutorial's accuracy on its toy rule.
    assert number(r"Finished epoch 3, accuracy is ([\d.]+)", second) >= 0.95
    assert number(r"Inline evaluation accuracy: ([\d.]+)", second) >= 0.95
    exact = re.search(r"Exactly-once evaluation: accuracy ([\d.]+) on (\d+) "
                      r"examples \(of (\d+)\)", second)
    assert exact, second[-2000:]
    assert float(exact.group(1)) >= 0.95
    assert exact.group(2) == exact.group(3) == "160"


@pytest.mark.timeout(240)
def test_sidecar_evaluation_tutorial(tmp_path):
    out = run_tutorial("sidecar_evaluation.py", "--epochs", "3",
                       "--steps_per_epoch", "10", "--output_dir",
                       str(tmp_path), timeout=220)
    assert number(r"Training steps: (\d+)", out) == 30
    # One checkpoint per epoch; the evaluator (its own process) accounts for
    # each one: evaluated, or skipped with a log line when training outran
    # it. The final one is always evaluated.
    names = sorted(n[:-len(".json")] for n in os.listdir(tmp_path / "checkpoints")
                   if n.endswith(".json"))
    assert len(names) == 3
    evaluated = re.findall(r"evaluated checkpoint (ckpt-\d+) \(epoch (\d)", out)
    skipped = re.findall(r"skipped checkpoint (ckpt-\d+)", out)
    assert sorted([n for n, _ in evaluated] + skipped) == names
    assert evaluated[-1][0] == names[-1]
    # It exported the best model by accuracy (1-based epoch in the name),
    # which loads and scores without a cluster.
    exported = sorted(os.listdir(tmp_path / "export"))
    assert exported and set(exported) <= {
        f"best-{int(e) + 1:02d}.keras" for _, e in evaluated}
    assert number(r"reloaded without a cluster: accuracy ([\d.]+)", out) >= 0.85
    # Evaluation events sit beside training's for TensorBoard.
    assert glob.glob(str(tmp_path / "logs" / "validation" / "events.*"))
    assert glob.glob(str(tmp_path / "logs" / "train" / "events.*"))


@pytest.mark.timeout(180)
def test_streaming_ids_tutorial(tmp_path):
    capacity = 512
    out = run_tutorial("streaming_ids.py", "--epochs", "4", "--steps_per_epoch",
                       "20", "--steps_per_execution", "2", "--new_ids_per_hour",
                       "200", "--capacity", str(capacity), "--eval_batches", "4",
                       "--workdir", str(tmp_path))
    epochs = re.findall(r"epoch (\d): live rows (\d+), admissions (\d+), "
                        r"evictions (\d+), loss ([\d.]+)", out)
    assert [int(e[0]) for e in epochs] == [1, 2, 3, 4], out[-3000:]
    live, admitted, evicted = ([int(e[i]) for e in epochs] for i in (1, 2, 3))
    losses = [float(e[4]) for e in epochs]
    # The table stays within its capacity while more ids than it holds
    # arrive; the ids that faded were evicted. (How the hours line up with
    # the epochs depends on how the workers share the steps, so the counts
    # are checked over the run.)
    assert all(0 < n <= capacity for n in live), live
    assert sum(admitted) > capacity, admitted
    assert live[-1] == sum(admitted) - sum(evicted)  # the logs' running totals
    assert sum(evicted) > 0
    assert evicted[0] == 0, evicted  # nothing has faded in the first hour
    assert losses[-1] < losses[0], losses
    # Held-out clicks: ids with rows predict better than the next hour's
    # (half its ids never trained), and evaluation inserts nothing.
    last = number(r"Evaluation AUC/accuracy \(last hour\): ([\d.]+)", out)
    assert last > 0.7
    assert last > number(r"Evaluation AUC/accuracy \(next hour\): ([\d.]+)", out)
    assert re.search(r"live rows before evaluation (\d+), after \1\n", out), out
    # The export, loaded as plain Keras, predicts what the trained model does.
    assert (tmp_path / "streaming_ids.keras").is_file()
    assert number(r"exported model matches: max abs diff ([\d.e+-]+)", out) < 1e-5
