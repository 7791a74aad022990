"""Sidecar evaluation: SidecarCheckpoint, SidecarEvaluator, the export callback
and the `python -m keras_ps.evaluator` task.

Unit tests run plain Keras in this process (the evaluator needs no cluster);
the end-to-end test trains on a real LocalCluster in one process and
evaluates in another.
"""

import glob
import json
import logging
import os
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from _paths import REPO
from _polling import wait_until
from _results import reports
from _results import run_child
from keras_ps import evaluator as evaluator_cli
from keras_ps.sidecar import evaluator as evaluation
from keras_ps.sidecar import format as fmt

pytestmark = pytest.mark.timeout(120)

JOB = os.path.join(REPO, "tests", "_sidecar_job.py")


# -- helpers ----------------------------------------------------------------------------
def _model(width=4, extra_layer=False):
    layers = [keras.Input((3,)), keras.layers.Dense(width, activation="relu")]
    if extra_layer:
        layers.append(keras.layers.Dense(width))
    layers.append(keras.layers.Dense(1))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
    return model


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, x.sum(1, keepdims=True)


def _train(checkpoint_dir, epochs, width=4, **kwargs):
    """Plain Keras fit writing one SidecarCheckpoint per epoch; returns names."""
    keras.utils.set_random_seed(0)
    model = _model(width)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[
        keras_ps.callbacks.SidecarCheckpoint(checkpoint_dir, **kwargs)])
    return fmt.list_checkpoints(checkpoint_dir)


def _events(log_dir):
    """{tag: [(step, value), ...]} from the event files under log_dir/validation."""
    found = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "validation", "events.*"))):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor))))
    return found


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_checkpoint_restored(self, checkpoint):
        self.calls.append(("restored", checkpoint.name))

    def on_test_begin(self, logs=None):
        self.calls.append(("begin", None))

    def on_test_end(self, logs=None):
        self.calls.append(("end", dict(logs)))


# -- the training side -----------------------------------------------------------------
def test_checkpoint_writes_step_epoch_and_final(tmp_path):
    names = _train(tmp_path, epochs=3)
    manifests = [fmt.read_checkpoint(str(tmp_path), n) for n in names]
    assert [(c.epoch, c.step, c.final) for c in manifests] == [
        (0, 4, False), (1, 8, False), (2, 12, True)]
    assert all(os.path.exists(c.path) for c in manifests)
    # Nothing temporary is left behind.
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    # max_to_keep deletes the oldest; early stop marks the last one final.
    keep = tmp_path / "keep"
    assert _train(keep, epochs=4, max_to_keep=2) == [
        fmt.checkpoint_name(12), fmt.checkpoint_name(16)]
    stopped = tmp_path / "stopped"
    names = _train(stopped, epochs=2, total_epochs=10)
    assert fmt.read_checkpoint(str(stopped), names[-1]).final
    assert not fmt.read_checkpoint(str(stopped), names[0]).final


def test_callback_arguments_are_checked():
    with pytest.raises(ValueError, match="checkpoint directory"):
        keras_ps.callbacks.SidecarCheckpoint("")
    with pytest.raises(ValueError, match="max_to_keep"):
        keras_ps.callbacks.SidecarCheckpoint("d", max_to_keep=0)
    with pytest.raises(ValueError, match="export_filepath must end"):
        keras_ps.callbacks.SidecarEvaluatorModelExport("best.h5")
    with pytest.raises(ValueError, match="mode must be"):
        keras_ps.callbacks.SidecarEvaluatorModelExport("b.keras", mode="auto")


# -- the evaluator ------------------------------------------------------------------------
def test_evaluates_newest_once_skips_older_and_writes_events(tmp_path, caplog):
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    names = _train(ckpt, epochs=3)
    recorder = _Recorder()
    export = keras_ps.callbacks.SidecarEvaluatorModelExport(
        str(tmp_path / "best-{epoch:02d}-{step}.keras"), monitor="mae")
    sidecar = keras_ps.SidecarEvaluator(
        _model(), _data(seed=1), ckpt, callbacks=[recorder, export],
        poll_interval=0.05, log_dir=logs, timeout=30)
    with caplog.at_level(logging.INFO, logger="keras_ps"):
        made = sidecar.start()
    # Training outran the evaluator: only the newest (final) one is evaluated.
    assert [e.checkpoint.name for e in made] == [names[-1]]
    assert made[0].checkpoint.final and made[0].checkpoint.step == 12
    assert [n for n, _ in sidecar.skipped] == names[:2]
    for name in names[:2]:
        assert f"skipped checkpoint {name}" in caplog.text
    assert [c[0] for c in recorder.calls] == ["restored", "begin", "end"]
    assert recorder.calls[2][1]["loss"] == pytest.approx(made[0].metrics["loss"])
    assert sidecar.model.optimizer.iterations.numpy() == 12
    events = _events(logs)
    assert events["evaluation_loss_vs_iterations"] == [
        (12, pytest.approx(made[0].metrics["loss"], rel=1e-6))]
    assert events["epoch_mae"] == [
        (2, pytest.approx(made[0].metrics["mae"], rel=1e-6))]
    # The export holds the checkpoint's weights and predicts like it.
    exported = keras.saving.load_model(str(tmp_path / "best-03-12.keras"),
                                        compile=False)
    x, _ = _data(seed=2)
    np.testing.assert_allclose(exported.predict(x, verbose=0),
                               sidecar.model.predict(x, verbose=0), rtol=1e-6)
    assert export.exported == [str(tmp_path / "best-03-12.keras")]


def test_checkpoint_deleted_between_list_and_read_is_skipped(
        tmp_path, monkeypatch, caplog):
    ckpt = str(tmp_path)
    names = _train(ckpt, epochs=3)
    real_list = fmt.list_checkpoints
    deleted = []

    def list_then_delete(directory):
        listed = real_list(directory)
        if not deleted:
            # Training's max_to_keep removes the two newest right after the
            # evaluator listed them: one loses its weights, one its manifest.
            os.remove(os.path.join(directory, listed[-1] + fmt.WEIGHTS_SUFFIX))
            os.remove(os.path.join(directory, listed[-2] + fmt.MANIFEST_SUFFIX))
            deleted.extend(listed[-2:])
        return listed

    monkeypatch.setattr(fmt, "list_checkpoints", list_then_delete)
    sidecar = keras_ps.SidecarEvaluator(_model(), _data(), ckpt,
                                        max_evaluations=1, poll_interval=0.05,
                                        timeout=30)
    with caplog.at_level(logging.INFO, logger="keras_ps"):
        made = sidecar.start()
    assert [e.checkpoint.name for e in made] == [names[0]]
    assert sidecar.skipped == [(names[2], "deleted while being read"),
                               (names[1], "deleted while being read")]
    assert f"skipped checkpoint {names[2]}: deleted while being read" in \
        caplog.text


def test_final_mark_after_evaluation_stops_without_reevaluating(tmp_path):
    ckpt = str(tmp_path)
    (name,) = _train(ckpt, epochs=1)
    # As if training were still going: the checkpoint is not final yet.
    fmt.write_manifest(ckpt, name, 0, 4, False)

    class _TrainingEnds(keras.callbacks.Callback):
        # Training's on_train_end marks the already-evaluated checkpoint final.
        def on_test_end(self, logs=None):
            c = fmt.read_checkpoint(ckpt, name)
            fmt.write_manifest(ckpt, name, c.epoch, c.step, True)

    sidecar = keras_ps.SidecarEvaluator(_model(), _data(), ckpt,
                                        callbacks=[_TrainingEnds()],
                                        poll_interval=0.05, timeout=30)
    made = sidecar.start()
    assert [e.checkpoint.name for e in made] == [name]
    assert sidecar.evaluations == made


def test_no_checkpoint_times_out_with_periodic_log(tmp_path, monkeypatch,
                                                   caplog):
    monkeypatch.setattr(evaluation, "_WAIT_LOG_INTERVAL", 0.1)
    missing = str(tmp_path / "never")
    sidecar = keras_ps.SidecarEvaluator(_model(), _data(), missing,
                                        poll_interval=0.05, timeout=0.6)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="keras_ps"):
        with pytest.raises(evaluation.SidecarTimeoutError) as info:
            sidecar.start()
    assert 0.6 <= time.monotonic() - start < 20
    message = str(info.value)
    assert "No new checkpoint" in message and missing in message
    assert "SidecarCheckpoint" in message and "timeout=0.6" in message
    assert isinstance(info.value, TimeoutError)
    assert caplog.text.count("waiting for a checkpoint in") >= 2


def test_missing_checkpoint_dir_warns_and_evaluates_once_it_appears(
        tmp_path, monkeypatch, caplog):
    """A checkpoint_dir that does not exist is named in a WARNING at the
    first look, then every _MISSING_DIR_WARN_INTERVAL seconds (not at every
    poll); the evaluator keeps waiting and evaluates once training creates
    the directory."""
    monkeypatch.setattr(evaluation, "_MISSING_DIR_WARN_INTERVAL", 0.3)
    missing = str(tmp_path / "not_yet")
    sidecar = keras_ps.SidecarEvaluator(_model(), _data(), missing,
                                        poll_interval=0.02, timeout=60)
    polls = []
    listed = sidecar._list_checkpoints
    monkeypatch.setattr(sidecar, "_list_checkpoints",
                        lambda: polls.append(1) or listed())
    made = []

    def warnings():
        return [r for r in caplog.records if r.levelno == logging.WARNING
                and "does not exist" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="keras_ps"):
        thread = threading.Thread(target=lambda: made.extend(sidecar.start()))
        start = time.monotonic()
        thread.start()
        wait_until(lambda: len(warnings()) >= 3, 30, "three warnings")
        elapsed, count, looks = time.monotonic() - start, len(warnings()), \
            len(polls)
        _train(missing, epochs=1)  # a final checkpoint: the evaluator stops
        thread.join(60)
    assert not thread.is_alive()
    assert [e.checkpoint.name for e in made] == fmt.list_checkpoints(missing)
    first = warnings()[0].getMessage()
    assert f"checkpoint_dir {missing!r} does not exist" in first, first
    assert "no checkpoint has appeared there yet" in first, first
    assert "check that training writes to this path" in first, first
    # One at the first look, then one per interval at most: not every poll.
    assert count <= 1 + elapsed / 0.3 and looks > count, (count, looks)


def test_checkpoint_of_another_model_names_the_weight(tmp_path):
    ckpt = str(tmp_path)
    _train(ckpt, epochs=1, width=4)
    wider = keras_ps.SidecarEvaluator(_model(width=5), _data(), ckpt,
                                      poll_interval=0.05, timeout=30)
    with pytest.raises(evaluation.CheckpointMismatchError,
                       match=r"weight 'layers/dense/vars/0' has shape \(3, 4\) "
                             r"in the checkpoint but \(3, 5\) in the model"):
        wider.start()
    deeper = keras_ps.SidecarEvaluator(_model(extra_layer=True), _data(), ckpt,
                                       poll_interval=0.05, timeout=30)
    with pytest.raises(evaluation.CheckpointMismatchError,
                       match=r"'layers/dense_1/vars/0' has shape \(4, 1\) in "
                             r"the checkpoint but \(4, 4\)"):
        deeper.start()
    assert deeper.evaluations == []


def test_evaluator_arguments_are_checked(tmp_path):
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    unbuilt.compile(loss="mse")
    with pytest.raises(ValueError, match="not built"):
        keras_ps.SidecarEvaluator(unbuilt, [], str(tmp_path))
    keras_ps.SidecarEvaluator(unbuilt, _data(), str(tmp_path))
    assert unbuilt.built  # built from the first batch of data, as TF's does
    uncompiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="not compiled"):
        keras_ps.SidecarEvaluator(uncompiled, _data(), str(tmp_path))
    with pytest.raises(ValueError, match="max_evaluations"):
        keras_ps.SidecarEvaluator(_model(), _data(), str(tmp_path),
                                  max_evaluations=0)


def test_export_needs_a_logged_metric(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _train(ckpt, epochs=1)
    export = keras_ps.callbacks.SidecarEvaluatorModelExport(
        str(tmp_path / "best.keras"), monitor="val_accuracy", mode="max")
    sidecar = keras_ps.SidecarEvaluator(_model(), _data(), ckpt,
                                        callbacks=[export], poll_interval=0.05,
                                        timeout=30)
    with pytest.raises(ValueError, match="monitor='val_accuracy'"):
        sidecar.start()


# -- the task's command line ------------------------------------------------------------
def test_cli_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    model_fn = f"{JOB}:evaluator_model"
    base = ["--checkpoint_dir", str(tmp_path)]
    assert evaluator_cli.main(["--model_fn", "no_colon"] + base) == 2
    assert evaluator_cli.main(["--model_fn", "no_such_module_x:f"] + base) == 2
    assert evaluator_cli.main(["--model_fn", f"{JOB}:nope"] + base) == 2
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1"]},
         "task": {"type": "worker", "index": 0}}))
    assert evaluator_cli.main(["--model_fn", model_fn] + base) == 2
    monkeypatch.setenv("TF_CONFIG", "{not json")
    assert evaluator_cli.main(["--model_fn", model_fn] + base) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 5 and all(
        line.startswith("keras_ps.evaluator: error: ") for line in lines), lines
    assert "task type 'worker'" in lines[3]
    # An evaluator task with no checkpoint: timeout, one line, exit 1.
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"task": {"type": "evaluator", "index": 0}}))
    assert evaluator_cli.main(["--model_fn", model_fn, "--timeout", "0.3",
                               "--poll_interval", "0.05"] + base) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No new checkpoint" in err[0]


# -- end to end: training process + evaluator process ---------------------------------
@pytest.mark.timeout(420)
def test_training_and_evaluator_processes(tmp_path):
    epochs = 4
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    export = str(tmp_path / "export" / "best-{epoch:02d}.keras")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3",
               TF_CONFIG=json.dumps({
                   "cluster": {"worker": ["localhost:1"],
                               "evaluator": ["localhost:2"]},
                   "task": {"type": "evaluator", "index": 0}}))
    evaluator = subprocess.Popen(
        [sys.executable, "-m", "keras_ps.evaluator", "--model_fn",
         f"{JOB}:evaluator_model", "--checkpoint_dir", ckpt, "--log_dir", logs,
         "--export_filepath", export, "--monitor", "loss", "--mode", "min",
         "--poll_interval", "0.2", "--timeout", "300"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    train_env = {k: v for k, v in env.items() if k != "TF_CONFIG"}
    try:
        code, trained = run_child(
            [sys.executable, JOB, "train", ckpt, logs, str(epochs)], 360,
            cwd=REPO, env=train_env)
        assert code == 0, trained[-3000:]
        out, _ = evaluator.communicate(timeout=120)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.communicate()
    assert evaluator.returncode == 0, out[-3000:]
    result = reports(trained)[0]
    assert result["embedding_shards"] == 2          # trained sharded
    assert result["iterations"] == epochs * 10

    names = fmt.list_checkpoints(ckpt)
    checkpoints = [fmt.read_checkpoint(ckpt, n) for n in names]
    assert [c.epoch for c in checkpoints] == list(range(epochs))
    assert [c.final for c in checkpoints] == [False] * (epochs - 1) + [True]
    summary = json.loads(next(line.split(" done ", 1)[1]
                              for line in out.splitlines()
                              if line.startswith("keras_ps.evaluator: done ")))
    # Each checkpoint evaluated once, or skipped with a log line; the final
    # one evaluated. (The training job paces itself on the evaluator, so
    # normally nothing is skipped.)
    evaluated, skipped = summary["evaluated"], summary["skipped"]
    assert len(evaluated) == len(set(evaluated))
    assert sorted(evaluated + skipped) == names
    assert evaluated[-1] == names[-1]
    for name in skipped:
        assert f"skipped checkpoint {name}" in out
    if "PACE timeout" not in trained:
        assert evaluated == names

    # Event files: one value per evaluated checkpoint, at its training step.
    events = _events(logs)
    by_name = {c.name: c for c in checkpoints}
    losses = events["evaluation_loss_vs_iterations"]
    assert [s for s, _ in losses] == [by_name[n].step for n in evaluated]
    assert [s for s, _ in events["epoch_accuracy"]] == [
        by_name[n].epoch for n in evaluated]
    for name, (_, loss) in zip(evaluated, losses):
        assert f"evaluated checkpoint {name}" in out
        assert f"loss={loss:.6g}" in out

    # The best model by loss was exported at each improvement.
    improved, best = [], None
    for name, (_, loss) in zip(evaluated, losses):
        if best is None or loss < best:
            improved.append(by_name[name].epoch + 1)
            best = loss
    exported = sorted(os.listdir(tmp_path / "export"))
    assert exported == [f"best-{e:02d}.keras" for e in improved]
    sys.path.insert(0, os.path.join(REPO, "tests"))
    try:
        import _sidecar_job
    finally:
        sys.path.pop(0)
    model = keras.saving.load_model(
        str(tmp_path / "export" / exported[-1]), compile=False)
    x, y = _sidecar_job.data(seed=9, n=512)
    predictions = model.predict(x, verbose=0)
    assert predictions.shape == (512, 1)
    loss = keras.losses.binary_crossentropy(y, predictions).numpy().mean()
    assert loss == pytest.approx(best, rel=1e-4)
