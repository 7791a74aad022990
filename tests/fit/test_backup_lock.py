"""BackupAndRestore locks its backup_dir while fit runs: a job SIGKILLed in
fit leaves the directory free at once for the job started again; the same
callback locks it again in a later fit; a fit that raises gives it back;
two callbacks of one process on one directory exclude each other. On the
shared real cluster; the holder killed is a real job in its own process
(the refusal of a second job is a case of tests/api/test_bad_inputs.py)."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest

import keras_ps
from keras_ps.backups import _job_lock
from keras_ps.errors import BackupDirInUseError

from _backups import holding_job

X = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
Y = (X.sum(1, keepdims=True) > 0).astype("float32")


def _model(strategy):
    # The layers of tests/_fit_job.py's model: a backup of either restores
    # into the other.
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.Adam(0.02), "binary_crossentropy",
                      steps_per_execution=2)
    return model


def _holder(directory):
    with open(os.path.join(directory, _job_lock.FILE_NAME)) as f:
        text = f.read()
    return json.loads(text) if text else None


class _SeesItsLock(keras.callbacks.Callback):
    """At each batch end: the lock file names this process, and another
    holder of this process is refused, naming it."""

    def __init__(self, directory):
        super().__init__()
        self.directory, self.batches = directory, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        assert _holder(self.directory)["pid"] == os.getpid()
        with pytest.raises(BackupDirInUseError) as refused:
            _job_lock.JobLock(self.directory, "BackupAndRestore").acquire()
        assert "(this process: a BackupAndRestore" in str(refused.value)


def _is_free(directory):
    lock = _job_lock.JobLock(directory, "BackupAndRestore")
    lock.acquire()
    lock.release()
    return True


@pytest.mark.timeout(240)
def test_a_sigkilled_holder_leaves_the_backup_dir_free_at_once(
        cluster, strategy, tmp_path):
    directory = str(tmp_path / "backup")
    with holding_job(cluster.spec, directory) as holder:
        assert _holder(directory)["pid"] == holder.pid
        before = _model(strategy)
        with pytest.raises(BackupDirInUseError):
            before.fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=4,
                       verbose=0, callbacks=[
                           keras_ps.callbacks.BackupAndRestore(directory)])
        os.kill(holder.pid, signal.SIGKILL)
        assert holder.wait(30) == -signal.SIGKILL
    # The job started again takes the lock at once: no waiting, no stale
    # lock to clear, though the file still names the killed job.
    assert _holder(directory)["pid"] == holder.pid
    model = _model(strategy)
    probe = _SeesItsLock(directory)
    model.fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[keras_ps.callbacks.BackupAndRestore(
                  directory, save_freq=2, delete_checkpoint=False), probe])
    assert probe.batches == 2  # steps_per_execution=2
    assert _holder(directory) is None  # given back: no holder named
    assert _is_free(directory)


@pytest.mark.timeout(120)
def test_a_later_fit_with_the_same_callback_locks_it_again(strategy, tmp_path):
    directory = str(tmp_path / "backup")
    model = _model(strategy)
    backup = keras_ps.callbacks.BackupAndRestore(directory, save_freq=2,
                                                 delete_checkpoint=False)
    for epochs in (1, 2):
        probe = _SeesItsLock(directory)
        model.fit(X, Y, batch_size=8, epochs=epochs, steps_per_epoch=4,
                  verbose=0, callbacks=[backup, probe])
        assert probe.batches == 2
        assert _is_free(directory)
    # The second fit resumed from the first one's backup.
    assert int(model.optimizer.iterations.numpy()) == 8


class _Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("a callback failed")


@pytest.mark.timeout(120)
def test_a_fit_that_raises_gives_the_lock_back(strategy, tmp_path):
    directory = str(tmp_path / "backup")
    backup = keras_ps.callbacks.BackupAndRestore(directory)
    with pytest.raises(RuntimeError, match="a callback failed"):
        _model(strategy).fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=4,
                             verbose=0, callbacks=[backup, _Fails()])
    assert _is_free(directory)
    # Another callback of this process on the directory trains.
    model = _model(strategy)
    model.fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[keras_ps.callbacks.BackupAndRestore(directory)])
    assert int(model.optimizer.iterations.numpy()) == 4


class _NoStep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        raise AssertionError("a step was scheduled")


@pytest.mark.timeout(120)
def test_two_callbacks_of_one_fit_on_one_dir_are_refused(strategy, tmp_path):
    directory = str(tmp_path / "backup")
    first = keras_ps.callbacks.BackupAndRestore(directory)
    second = keras_ps.callbacks.BackupAndRestore(directory)
    with pytest.raises(BackupDirInUseError) as refused:
        _model(strategy).fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=4,
                             verbose=0, callbacks=[_NoStep(), first, second])
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert "(this process: a BackupAndRestore" in message
    # Both gave the directory back when fit raised.
    assert _is_free(directory)


# A process of another machine's job, as a network file system shows it: it
# holds the lock, and the lock file names a host that is not this one.
_FOREIGN_HOLDER = r"""
import fcntl, json, os, signal, sys
f = open(sys.argv[1], "a+")
fcntl.flock(f.fileno(), fcntl.LOCK_EX)
f.seek(0); f.truncate()
json.dump({"pid": os.getpid(), "host": "a-lost-machine"}, f); f.flush()
print("held", flush=True)
signal.pause()
"""


def _foreign_holder(directory):
    holder = subprocess.Popen(
        [sys.executable, "-c", _FOREIGN_HOLDER,
         os.path.join(directory, _job_lock.FILE_NAME)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages, self.changed = [], threading.Condition()

    def emit(self, record):
        with self.changed:
            self.messages.append(record.getMessage())
            self.changed.notify_all()


@pytest.mark.timeout(120)
def test_a_holder_on_another_host_is_waited_for(tmp_path, monkeypatch):
    """The chief started again on another machine after its own was lost
    meets the lost machine's lock (a network file system keeps it for a
    while): it waits, says so, and takes the lock once it is let go."""
    monkeypatch.setenv("KERAS_PS_BACKUP_LOCK_WAIT", "90")
    holder = _foreign_holder(str(tmp_path))
    records = _Records()
    _job_lock.logger.addHandler(records)
    lock, outcome = _job_lock.JobLock(str(tmp_path), "BackupAndRestore"), []
    taker = threading.Thread(
        target=lambda: outcome.append(lock.acquire() or "taken"), daemon=True)
    try:
        taker.start()
        with records.changed:
            assert records.changed.wait_for(lambda: any(
                "waiting up to 90 s" in m for m in records.messages), 60)
        warning = next(m for m in records.messages if "waiting up to" in m)
        assert f"pid {holder.pid} on host a-lost-machine" in warning
        assert not outcome  # still waiting
        holder.kill()
        holder.wait()
        taker.join(60)
        assert outcome == ["taken"] and lock.held
        with open(lock.path) as f:
            assert json.load(f)["pid"] == os.getpid()
    finally:
        _job_lock.logger.removeHandler(records)
        holder.kill()
        holder.wait()
        lock.release()


@pytest.mark.timeout(120)
def test_a_holder_on_another_host_past_the_wait_is_named(tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("KERAS_PS_BACKUP_LOCK_WAIT", "1")
    holder = _foreign_holder(str(tmp_path))
    try:
        with pytest.raises(BackupDirInUseError) as refused:
            _job_lock.JobLock(str(tmp_path), "BackupAndRestore").acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host a-lost-machine" in message
        assert "(waited 1 s for it, KERAS_PS_BACKUP_LOCK_WAIT)" in message
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
