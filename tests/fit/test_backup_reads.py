"""A backup written as a Keras weights file that cannot be read (truncated
on disk here), on the shared real cluster: with Keras 3's
`double_checkpoint=True` the backup before it is restored, with a warning
naming the file; without it, `fit` raises `BackupCorruptError` naming the
file and the fix. A damaged state file (backup_state.json) is the same
error, but for incremental backups, whose manifest holds what it held:
the newest of them is restored."""

import glob
import json
import logging
import os

import keras
import numpy as np
import pytest

import keras_ps
from callbacks import BackupAndRestore

pytestmark = pytest.mark.timeout(240)

STEPS = 4


def _model(strategy):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return model


def _fit(model, backup, epochs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 8, 4)).astype("float32")
    y = rng.normal(size=(STEPS * 8, 1)).astype("float32")
    return model.fit(x, y, batch_size=8, epochs=epochs, steps_per_epoch=STEPS,
                     callbacks=[backup], verbose=0)


def _state(directory):
    with open(os.path.join(directory, "backup_state.json")) as f:
        return json.load(f)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("double", [True, False])
def test_a_weights_backup_keeps_the_one_before_with_double_checkpoint(
        strategy, tmp_path, double):
    directory = str(tmp_path / "backup")
    backup = BackupAndRestore(directory, incremental=False,
                              delete_checkpoint=False,
                              double_checkpoint=double)
    _fit(_model(strategy), backup, epochs=3)
    state = _state(directory)
    files = sorted(os.path.basename(p) for p in
                   glob.glob(os.path.join(directory, "*.weights.h5")))
    if double:
        assert files == ["backup-2.weights.h5", "backup-3.weights.h5"]
        assert state["previous"]["weights"] == "backup-2.weights.h5"
    else:
        assert files == ["backup-3.weights.h5"]
        assert "previous" not in state


def test_an_unreadable_newest_backup_restores_the_one_before(
        strategy, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    directory = str(tmp_path / "backup")
    _fit(_model(strategy), BackupAndRestore(
        directory, incremental=False, delete_checkpoint=False,
        double_checkpoint=True), epochs=2)
    newest = os.path.join(directory, _state(directory)["weights"])
    _truncate(newest)
    # A Keras 3 user's arguments, by name.
    again = BackupAndRestore(directory, save_freq="epoch",
                             double_checkpoint=True, delete_checkpoint=True)
    model = _model(strategy)
    history = _fit(model, again, epochs=3)
    # The backup before is the one after epoch 0: epochs 1 and 2 run again.
    assert history.epoch == [1, 2]
    assert int(model.optimizer.iterations.numpy()) == 3 * STEPS
    assert f"backup file {newest} cannot be read" in caplog.text, caplog.text
    assert "restoring the backup before it: backup 1 (epoch 1, step 0)" in \
        caplog.text


def test_an_unreadable_backup_without_one_before_names_the_file_and_fix(
        strategy, tmp_path):
    directory = str(tmp_path / "backup")
    _fit(_model(strategy), BackupAndRestore(
        directory, incremental=False, delete_checkpoint=False), epochs=1)
    newest = os.path.join(directory, _state(directory)["weights"])
    _truncate(newest)
    with pytest.raises(keras_ps.errors.BackupCorruptError) as raised:
        _fit(_model(strategy), BackupAndRestore(directory), epochs=2)
    message = str(raised.value)
    assert repr(newest) in message and "double_checkpoint=True" in message
    assert "delete the backup directory" in message



def _damage(path, how):
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write({"empty": "", "half": text[:len(text) // 2],
                 "list": "[]"}[how])


@pytest.mark.parametrize("how", ["empty", "half", "list"])
def test_a_damaged_state_file_names_it_and_the_fix(strategy, tmp_path, how):
    directory = str(tmp_path / "backup")
    _fit(_model(strategy), BackupAndRestore(
        directory, incremental=False, delete_checkpoint=False), epochs=1)
    path = os.path.join(directory, "backup_state.json")
    _damage(path, how)
    with pytest.raises(keras_ps.errors.BackupCorruptError) as raised:
        _fit(_model(strategy), BackupAndRestore(directory), epochs=2)
    message = str(raised.value)
    assert f"Backup state file {path!r} cannot be read" in message
    assert "['backup-1.weights.h5']" in message, message
    assert "put back a copy of the file" in message
    assert f"delete the backup directory {directory!r}" in message


@pytest.mark.parametrize("how", ["empty", "half", "list"])
def test_a_damaged_state_file_of_incremental_backups_restores_the_newest(
        strategy, tmp_path, caplog, how):
    caplog.set_level(logging.WARNING)
    directory = str(tmp_path / "backup")
    _fit(_model(strategy), BackupAndRestore(
        directory, incremental=True, delete_checkpoint=False), epochs=2)
    path = os.path.join(directory, "backup_state.json")
    _damage(path, how)
    model = _model(strategy)
    history = _fit(model, BackupAndRestore(
        directory, incremental=True, delete_checkpoint=False), epochs=3)
    # The manifest's newest backup is the one after epoch 1.
    assert history.epoch == [2]
    assert int(model.optimizer.iterations.numpy()) == 3 * STEPS
    assert f"backup state file {path} cannot be read" in caplog.text
    assert "restoring the newest incremental backup" in caplog.text
    assert _state(directory)["epoch"] == 3  # written whole again
