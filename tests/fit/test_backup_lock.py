"""BackupAndRestore locks its backup_dir while fit runs: a job SIGKILLed in
fit leaves the directory free at once for the job started again; the same
callback locks it again in a later fit; a fit that raises gives it back;
two callbacks of one process on one directory exclude each other; its
incremental backups are written under its lock. A custom loop's
IncrementalBackup locks its directory from its first operation until
close(): a second one is refused before it writes anything, and a SIGKILLed
or closed holder leaves the directory free at once. On the shared real
cluster; the holders are real jobs in their own processes (the refusal of
a second job is a case of tests/api/test_bad_inputs.py)."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import keras_ps
from keras_ps.backups import _job_lock
from keras_ps.errors import BackupDirInUseError

from _backups import holding_job
from _polling import wait_until

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


def _built_model(strategy):
    """_model with its optimizer built, as an IncrementalBackup needs."""
    model = _model(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    return model


def _holder(directory):
    with open(os.path.join(directory, _job_lock.FILE_NAME)) as f:
        text = f.read()
    return json.loads(text) if text else None


def _files(directory):
    """{path under `directory`: (size, mtime in ns, bytes)} of its files."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            stat = os.stat(path)
            found[os.path.relpath(path, directory)] = (
                stat.st_size, stat.st_mtime_ns, data)
    return found


class _SeesItsLock(keras.callbacks.Callback):
    """At each batch end: the lock file names this process, and another
    holder of this process (a callback's lock, a custom loop's
    IncrementalBackup) is refused, naming it."""

    def __init__(self, directory):
        super().__init__()
        self.directory, self.batches = directory, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        assert _holder(self.directory)["pid"] == os.getpid()
        with pytest.raises(BackupDirInUseError) as refused:
            _job_lock.JobLock(self.directory, "BackupAndRestore").acquire()
        assert "(this process: a BackupAndRestore" in str(refused.value)
        with pytest.raises(BackupDirInUseError) as refused:
            keras_ps.IncrementalBackup(self.model, self.directory).check()
        assert "(this process: a BackupAndRestore" in str(refused.value)
        assert f"Received: directory={self.directory!r}" in str(
            refused.value)


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
        # A custom loop's IncrementalBackup waits for it the same way.
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        with pytest.raises(BackupDirInUseError) as refused:
            keras_ps.IncrementalBackup(model, str(tmp_path)).check()
        message = str(refused.value)
        assert f"directory {str(tmp_path)!r} is in use" in message
        assert "(waited 1 s for it, KERAS_PS_BACKUP_LOCK_WAIT)" in message
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(120)
def test_fit_writes_incremental_backups_under_the_callbacks_lock(strategy,
                                                                 tmp_path):
    # The callback's own IncrementalBackup (in backup_dir/incremental) is
    # not refused by the callback's lock, and takes none of its own.
    directory = str(tmp_path / "backup")
    model = _model(strategy)
    probe = _SeesItsLock(directory)
    model.fit(X, Y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[keras_ps.callbacks.BackupAndRestore(
                  directory, save_freq=2, incremental=True,
                  delete_checkpoint=False), probe])
    assert probe.batches == 2
    incremental = os.path.join(directory, "incremental")
    assert sorted(os.listdir(incremental))[-1] == "manifest.json"
    assert not os.path.exists(os.path.join(incremental, _job_lock.FILE_NAME))
    assert _is_free(directory)


@pytest.mark.timeout(300)
def test_a_second_incremental_backup_is_refused_until_the_holder_dies(
        cluster, strategy, tmp_path, monkeypatch):
    # A holder on this host is alive: refused at once, however long a
    # holder on another host would be waited for.
    monkeypatch.setenv("KERAS_PS_BACKUP_LOCK_WAIT", "600")
    directory = str(tmp_path / "backup")
    second = keras_ps.IncrementalBackup(_built_model(strategy), directory)
    with holding_job(cluster.spec, directory, "hold_incremental") as holder:
        assert _holder(directory)["pid"] == holder.pid
        assert _holder(directory)["by"] == "IncrementalBackup"
        before = _files(directory)
        assert "manifest.json" in before
        for operation in (second.save, second.save_full, second.save_delta,
                          second.restore, second.check):
            started = time.monotonic()
            with pytest.raises(BackupDirInUseError) as refused:
                operation()
            assert time.monotonic() - started < 60, operation
            message = str(refused.value)
            assert (f"directory {directory!r} is in use by another training "
                    "job") in message
            assert (f"pid {holder.pid} on host {socket.gethostname()} "
                    "(IncrementalBackup)") in message
            assert ("Fix: give this job a different directory, or stop the "
                    "other job first") in message
        # The holder's backup, its manifest and its lock file as they were.
        assert _files(directory) == before
        assert holder.poll() is None, holder.output()[-3000:]
        os.kill(holder.pid, signal.SIGKILL)
        assert holder.wait(30) == -signal.SIGKILL
    # The refused object takes the lock at its next operation, at once
    # (the file still names the killed job), and restores its backup.
    assert _holder(directory)["pid"] == holder.pid
    with second:
        entry = second.restore()
        assert (entry.kind, entry.metadata) == ("full", {"step": 0})
        assert _holder(directory)["pid"] == os.getpid()
        assert second.save(metadata={"step": 1}).kind == "delta"
    assert _holder(directory) is None  # closed: no holder named
    assert _is_free(directory)


@pytest.mark.timeout(300)
def test_a_closed_incremental_backup_lets_the_next_job_in(cluster, strategy,
                                                         tmp_path):
    # The holder's process goes on running after close().
    directory = str(tmp_path / "backup")
    with holding_job(cluster.spec, directory, "hold_incremental") as holder:
        holder.stdin.write("\n")
        holder.stdin.flush()
        wait_until(lambda: "CLOSED\n" in holder.output().splitlines(True)
                   or holder.poll() is not None, 120, "the holder's close()")
        assert holder.poll() is None, holder.output()[-3000:]
        assert _holder(directory) is None
        with keras_ps.IncrementalBackup(_built_model(strategy),
                                        directory) as backup:
            entry = backup.restore()
            assert (entry.kind, entry.metadata) == ("delta", {"step": 1})
        holder.stdin.close()
        assert holder.wait(60) == 0, holder.output()[-3000:]


@pytest.mark.timeout(120)
def test_an_incremental_backup_on_one_directory_per_process_at_a_time(
        strategy, tmp_path):
    directory = str(tmp_path)
    first = keras_ps.IncrementalBackup(_built_model(strategy), directory)
    assert not os.path.exists(os.path.join(directory, _job_lock.FILE_NAME))
    first.check()  # the first operation takes the lock
    assert _holder(directory)["pid"] == os.getpid()
    second = keras_ps.IncrementalBackup(_built_model(strategy), directory)
    with pytest.raises(BackupDirInUseError) as refused:
        second.save_full()
    assert ("(this process: an IncrementalBackup on the same directory, not "
            "closed yet)") in str(refused.value)
    assert os.listdir(directory) == [_job_lock.FILE_NAME]
    first.close()
    assert _holder(directory) is None
    assert second.save_full().kind == "full"
    with pytest.raises(BackupDirInUseError):
        first.check()  # a closed one takes it again at its next operation
    second.close()
    first.check()
    assert _holder(directory)["pid"] == os.getpid()
    first.close()
    assert _is_free(directory)
