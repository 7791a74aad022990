"""BackupAndRestore(save_before_preemption=True): SIGTERM during fit writes a
backup at the next step boundary, then takes its course; the job started
again resumes at that step. The signals are real: sent by this process to
the job's, or by the job to itself."""

import json
import logging
import os
import signal
import sys
import threading

import keras
import numpy as np
import psutil
import pytest

import keras_ps
from keras_ps.coordinator.values import RemoteValueStatus
from keras_ps.training._fit_epochs import SHORT_LEAD_PER_WORKER
from _backups import read_backup_state
from _paths import TESTS
from _pid_namespace import pid_1_prefix
from _results import last_report
from _results import run_child
from _results import start_child

JOB = os.path.join(TESTS, "_fit_job.py")
# tests/_fit_job.py preempt: 2 epochs of 100 steps, 2 steps an execution.
EPOCHS, STEPS = 2, 100


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
                PYTHONFAULTHANDLER="1")


def _args(cluster, backup_dir, mode):
    spec = json.dumps({k: list(v) for k, v in cluster.spec.items()})
    return [sys.executable, JOB, "preempt", spec, backup_dir, mode]


def _again(cluster, backup_dir):
    code, output = run_child(_args(cluster, backup_dir, "-"), 200,
                             env=_env())
    assert code == 0, output[-3000:]
    return last_report(output)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("as_pid_1", [False, True], ids=["process", "pid_1"])
def test_sigterm_mid_epoch_backs_up_then_ends_and_the_job_resumes_there(
        cluster, tmp_path, as_pid_1):
    # save_freq=False: the only backup is the one SIGTERM asks for. As the
    # first process of a PID namespace (a container's command), the kernel
    # drops a signal that has no handler: fit then exits with status 143
    # itself, instead of training on until the container's SIGKILL.
    prefix = []
    if as_pid_1:
        prefix, why_not = pid_1_prefix()
        if prefix is None:
            pytest.skip(why_not)
    backup_dir = str(tmp_path / "backup")
    job = start_child(prefix + _args(cluster, backup_dir, "mid"), env=_env())
    output = []
    try:
        for line in job.stdout:
            output.append(line)
            if line.startswith("WAITING FOR SIGTERM"):  # after batch 19
                target = psutil.Process(job.pid)
                if as_pid_1:  # unshare's one child: the job
                    [target] = target.children()
                target.send_signal(signal.SIGTERM)
                break
        output.append(job.stdout.read())
        job.wait(120)
    finally:
        if job.poll() is None:
            job.kill()
    output = "".join(output)
    # The process ended by the signal (or, as PID 1, with its status), as
    # without the callback, but after a backup at the next step boundary:
    # the execution of steps 20-21.
    assert job.returncode == (128 + signal.SIGTERM if as_pid_1
                              else -signal.SIGTERM), output[-3000:]
    assert "written; passing the signal on" in output, output[-3000:]
    state = read_backup_state(backup_dir)
    assert (state["epoch"], state["step"]) == (0, 22), state

    result = _again(cluster, backup_dir)
    assert result["resumed"] == [0, state["step"]]
    assert result["epochs"] == [0, 1]
    # Every planned step ran once more; at-least-once allows one packed
    # execution (2 steps) per worker to run twice.
    assert result["planned"] <= result["iterations"] <= result["planned"] + 4
    assert not os.path.exists(backup_dir)


@pytest.mark.timeout(300)
def test_sigterm_after_the_last_step_keeps_a_backup_of_the_finished_training(
        cluster, tmp_path):
    # SIGTERM after the last epoch's end: training is done, but the process
    # still ends by the signal, before its caller could use the model. The
    # backup of the end is written and kept, so the job started again finds
    # training done instead of starting over.
    backup_dir = str(tmp_path / "backup")
    code, output = run_child(_args(cluster, backup_dir, "at_end"), 200,
                             env=_env())
    assert code == -signal.SIGTERM, output[-3000:]
    assert "training ended after SIGTERM" in output, output[-3000:]
    state = read_backup_state(backup_dir)
    assert (state["epoch"], state["step"]) == (EPOCHS, 0), state

    result = _again(cluster, backup_dir)
    assert result["resumed"] == [EPOCHS, 0]
    assert result["epochs"] == []
    assert result["planned"] <= result["iterations"] <= result["planned"] + 4
    assert not os.path.exists(backup_dir)


# -- in this process: SIGTERM handed to a handler of the program's ---------------
def _model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=2)
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(512, 4)).astype("float32"),
            rng.normal(size=(512, 1)).astype("float32"))


class _Program:
    """A program's own SIGTERM handler, installed for the test."""

    def __init__(self):
        self.calls = 0

    def __call__(self, signum, frame):
        self.calls += 1

    def __enter__(self):
        self.before = signal.signal(signal.SIGTERM, self)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.before)


class _SigtermAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch, then_raise=False):
        super().__init__()
        self.at, self.then_raise = (epoch, batch), then_raise

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
            if self.then_raise:
                raise RuntimeError("the program's own error")


class _Lead(keras.callbacks.Callback):
    """The most executions still running or waiting at a batch end."""

    def __init__(self, short_lead):
        super().__init__()
        self.short_lead = short_lead
        self.remotes, self.most = [], 0

    def on_train_batch_end(self, batch, logs=None):
        self.remotes.append(logs.remote_value)
        self.most = max(self.most, sum(
            r.status is RemoteValueStatus.PENDING for r in self.remotes))


@pytest.mark.timeout(240)
def test_fit_keeps_a_short_lead_for_a_callback_that_acts_on_signals(strategy):
    # Without it fit schedules an epoch's executions at once, and a batch
    # end (where a notice is acted on) comes before they run: a SIGTERM
    # would wait for the rest of the epoch. With it (BackupAndRestore's
    # save_before_preemption), fit stays at most 16 executions per worker
    # ahead (fewer when they are slow).
    x, y = _data()
    leads = {}
    for short in (False, True):
        lead = _Lead(short)
        _model(strategy).fit(x, y, batch_size=1, epochs=1, steps_per_epoch=512,
                             callbacks=[lead], verbose=0)
        leads[short] = lead.most
    most = SHORT_LEAD_PER_WORKER[1] * 2  # 2 workers
    assert leads[True] <= most, leads
    assert leads[False] > 2 * most, leads


@pytest.mark.timeout(240)
def test_sigterm_goes_to_the_programs_handler_after_the_backup(strategy,
                                                              tmp_path):
    # The program handles SIGTERM itself and goes on: fit writes the backup
    # at the next boundary, hands the signal over once, and trains to the
    # end; the program's handler is in place again after fit.
    x, y = _data()
    model = _model(strategy)
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path / "backup"), save_freq="epoch",
        save_before_preemption=True, delete_checkpoint=False)
    written = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state = read_backup_state(backup.backup_dir)
            if state and state not in written:
                written.append(state)

    with _Program() as program:
        history = model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=8,
                            callbacks=[_SigtermAt(0, 3), backup, Seen()],
                            verbose=0)
        assert signal.getsignal(signal.SIGTERM) is program
    assert program.calls == 1
    # The first backup is the notice's, at the step boundary after the
    # signal (the batch that sent it), before the epoch's own backup.
    assert [(s["epoch"], s["step"]) for s in written][:1] == [(0, 4)]
    assert history.epoch == [0, 1]
    assert int(model.optimizer.iterations.numpy()) == 16


@pytest.mark.timeout(240)
def test_sigterm_then_an_error_in_fit_hands_the_signal_over_after_it(
        strategy, tmp_path, caplog):
    # fit ends by the program's error before the next step boundary: the
    # handler is given back and the signal delivered as fit raises, with
    # the error in the log (a process the signal ends prints no traceback).
    caplog.set_level(logging.WARNING)
    x, y = _data()
    model = _model(strategy)
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path / "backup"), save_before_preemption=True)
    with _Program() as program:
        with pytest.raises(RuntimeError, match="the program's own error"):
            model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=8,
                      callbacks=[backup, _SigtermAt(0, 3, then_raise=True)],
                      verbose=0)
        assert signal.getsignal(signal.SIGTERM) is program
    # Nothing fit scheduled runs after it raised.
    assert keras_ps.ClusterCoordinator(strategy).is_idle()
    assert program.calls == 1
    assert ("fit ended by RuntimeError(\"the program's own error\") after "
            "SIGTERM; passing the signal on") in caplog.text, caplog.text


@pytest.mark.timeout(240)
def test_save_before_preemption_refuses_fit_outside_the_main_thread(
        strategy, tmp_path):
    x, y = _data()
    model = _model(strategy)
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path / "backup"), save_before_preemption=True)
    before = signal.getsignal(signal.SIGTERM)
    errors = []

    def fit():
        try:
            model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=2,
                      callbacks=[backup], verbose=0)
        except ValueError as error:
            errors.append(str(error))

    thread = threading.Thread(target=fit, name="trainer")
    thread.start()
    thread.join(200)
    assert len(errors) == 1 and "main thread" in errors[0], errors
    assert "'trainer'" in errors[0] and "Fix:" in errors[0]
    assert signal.getsignal(signal.SIGTERM) is before


def test_save_before_preemption_refuses_a_model_outside_keras_ps(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = _data()
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path / "backup"), save_before_preemption=True)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="keras_ps.ParameterServerStrategy"):
        model.fit(x, y, epochs=1, callbacks=[backup], verbose=0)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.timeout(240)
def test_sigterm_in_a_sharded_fit_backs_up_the_epochs_ledger(strategy,
                                                            tmp_path):
    # With a ShardedInput a batch end is a shard done: the notice's backup
    # holds the shards done so far, and a new fit resumes after them.
    x, y = _data()
    data = keras_ps.ShardedInput((x, y), batch_size=32, records_per_shard=64,
                                 seed=0)  # 8 shards
    backup_dir = str(tmp_path / "backup")
    backup = keras_ps.callbacks.BackupAndRestore(
        backup_dir, save_freq=False, save_before_preemption=True,
        delete_checkpoint=False)
    written = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state = read_backup_state(backup_dir)
            if state and state not in written:
                written.append(state)

    with _Program() as program:
        _model(strategy).fit(data, epochs=1, verbose=0,
                             callbacks=[_SigtermAt(0, 2), backup, Seen()])
    assert program.calls == 1
    assert (written[0]["epoch"], written[0]["step"]) == (0, 3), written
    assert written[0]["extra"], written  # the shard ledger
    again = keras_ps.callbacks.BackupAndRestore(backup_dir)
    history = _model(strategy).fit(data, epochs=1, verbose=0, callbacks=[again])
    assert again.resume_position() == (0, 3)
    assert history.history["shards_done"] == [8.0]
