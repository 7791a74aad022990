"""A backup that cannot be written, on the shared real cluster: its volume
(a small tmpfs mounted for the test) is filled up for real, so the ps'
writes fail with ENOSPC. The user gets `keras_ps.errors.BackupWriteError`
naming the directory, the reason and the fix; nothing of the failed backup
is published or left on the volume; the backup before it restores bit for
bit, and backups go on once there is room.

Mounting needs root on Linux (CI runs so); elsewhere the tests skip and say
why."""

import contextlib
import errno
import json
import logging
import os
import subprocess
import types

import numpy as np
import pytest

import keras
import keras_ps
from callbacks import BackupAndRestore

pytestmark = pytest.mark.timeout(300)

ROWS, DIM, IDS, BATCH = 4000, 16, 4, 32
VOLUME = "2M"  # a full backup of the model below is ~0.8 MB


@contextlib.contextmanager
def small_volume(path):
    os.makedirs(path)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={VOLUME}", "tmpfs", path],
        capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip("needs a small tmpfs volume, mounted as root: "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def fill(volume):
    """Writes a file until `volume` is full; returns its path."""
    path = os.path.join(volume, "filler")
    with open(path, "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 65536)
    assert full.value.errno == errno.ENOSPC
    return path


def build(strategy):
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((IDS,), dtype="int32"),
            keras.layers.Embedding(ROWS, DIM),
            keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(keras_ps.optimizers.LazyAdam(0.01), "mse")
    return model


def data(seed, steps):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, ROWS, (steps * BATCH, IDS)).astype("int32"),
            rng.normal(size=(steps * BATCH, 1)).astype("float32"))


def train(model, seed, steps=3):
    x, y = data(seed, steps)
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps,
              verbose=0)


def values(model):
    return [np.array(v.numpy()) for v in
            model.weights + model.optimizer.variables]


def check_message(error, directory, still):
    message = str(error)
    assert isinstance(error, OSError)
    assert f"written to {directory!r}"[:-1] in message, message
    assert "No space left on device" in message, message
    assert "Nothing of it was published" in message, message
    assert still in message, message
    assert "Fix: free space" in message, message


@pytest.mark.parametrize("background", [False, True])
def test_a_full_volume_fails_the_backup_clearly_and_the_one_before_restores(
        strategy, tmp_path, background):
    with small_volume(str(tmp_path / "volume")) as volume:
        directory = os.path.join(volume, "backups")
        model = build(strategy)
        train(model, 0)
        writer = keras_ps.IncrementalBackup(
            model, directory, min_table_bytes=0,
            background_deltas=background)
        first = writer.save()
        assert first.kind == "full"
        kept = values(model)
        listing = sorted(os.listdir(directory))

        train(model, 1)
        filler = fill(volume)
        with pytest.raises(keras_ps.errors.BackupWriteError) as raised:
            writer.save()
            # In the background the delta fails in its thread; the next
            # save says so.
            writer.save()
        check_message(raised.value, directory,
                      f"full backup {first.id}" if not background
                      else "the backups published before it restore")
        # The failed delta's files are gone; the manifest is the first's.
        assert sorted(os.listdir(directory)) == listing

        os.remove(filler)
        assert writer.restore().id == first.id
        for restored, expected in zip(values(model), kept):
            assert restored.tobytes() == expected.tobytes()
        train(model, 2)
        writer.wait()
        assert writer.save().kind == "delta"
        writer.wait()


@pytest.mark.parametrize("incremental", [False, True])
def test_a_full_volume_ends_fit_with_the_error_and_keeps_the_last_backup(
        strategy, tmp_path, incremental):
    with small_volume(str(tmp_path / "volume")) as volume:
        backup_dir = os.path.join(volume, "backups")
        state_path = None

        class FillAfterTheFirstBackup(keras.callbacks.Callback):
            filler = None

            def on_train_batch_end(self, batch, logs=None):
                nonlocal state_path
                states = [name for name in os.listdir(backup_dir)
                          if name.endswith(".json")] if os.path.isdir(
                              backup_dir) else []
                if states and self.filler is None:
                    state_path = os.path.join(backup_dir, states[0])
                    self.filler = fill(volume)

        model = build(strategy)
        x, y = data(3, 12)
        filling = FillAfterTheFirstBackup()
        backup = BackupAndRestore(backup_dir, save_freq=4,
                                  incremental=incremental)
        with pytest.raises(keras_ps.errors.BackupWriteError) as raised:
            model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=12,
                      callbacks=[backup, filling], verbose=0)
        assert filling.filler is not None, "no backup was written before"
        check_message(raised.value, backup_dir,
                      "backup 1 (epoch 0, step 4)" if not incremental
                      else "full backup 1")
        with open(state_path) as f:
            state = json.load(f)
        assert (state["serial"], state["step"]) == (1, 4)
        # Only the first backup's files: no half-written second one.
        names = set(os.listdir(backup_dir))
        assert not any(name.startswith(("backup-2", ".")) for name in names)
        if incremental:
            folders = os.listdir(os.path.join(backup_dir, "incremental"))
            assert sorted(f for f in folders if "-0" in f) == ["full-000001"]


def test_a_write_failing_on_a_connection_is_made_again_while_every_ps_holds(
        strategy, caplog):
    # The policy on the shared real cluster (its marker reads are real; the
    # write raises TF's own UnavailableError): made again with a warning,
    # at most 3 writes; any other error, and the third failure, raised.
    # fit/test_ps_recovery.py::test_a_backup_whose_connection_drops_is_written_again
    # (-m slow) drops a backup's connection for real.
    import tensorflow as tf
    from keras_ps.callbacks import _backup_modes

    model = types.SimpleNamespace(distribute_strategy=strategy)
    calls = []

    def write(errors):
        calls.append(1)
        if len(calls) <= errors:
            raise tf.errors.UnavailableError(
                None, None, "recvmsg:Connection reset by peer\nmore")
        return "written"

    with caplog.at_level(logging.WARNING, "keras_ps.callbacks._backup_modes"):
        assert _backup_modes.written_again_on_dropped_connections(
            model, lambda: write(2), "backup 7") == "written"
    assert len(calls) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"[chief] backup 7 failed on a connection (UnavailableError: "
        f"recvmsg:Connection reset by peer), every ps holding its "
        f"variables; writing it again ({n} of 3)" for n in (2, 3)]
    calls.clear()
    with pytest.raises(tf.errors.UnavailableError):
        _backup_modes.written_again_on_dropped_connections(
            model, lambda: write(3), "backup 8")
    assert len(calls) == 3

    def disk_full():
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    calls.clear()
    with pytest.raises(OSError):
        _backup_modes.written_again_on_dropped_connections(
            model, disk_full, "backup 9")
    assert len(calls) == 1
