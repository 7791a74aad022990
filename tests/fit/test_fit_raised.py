"""A `fit` or `evaluate` that raises (a callback's error, Ctrl-C) leaves
nothing running: what it scheduled and had not run is cancelled, and the
next call starts on an idle cluster. On the shared real cluster."""

import gc
import signal

import keras
import numpy as np
import pytest

import keras_ps
from keras_ps.coordinator.values import RemoteValueStatus

pytestmark = pytest.mark.timeout(240)

# Batch 1: an epoch of 512 executions, all scheduled before the first
# batch end (fit keeps no short lead here), seconds of work for the workers.
STEPS = 1024


def _model(strategy, steps_per_execution=2):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(STEPS, 4)).astype("float32"),
            rng.normal(size=(STEPS, 1)).astype("float32"))


class _StopAtLastBatch(keras.callbacks.Callback):
    """Ends the call at its last batch end, when every execution is
    scheduled and few have run; keeps the scheduled RemoteValues."""

    def __init__(self, last_batch, stop):
        super().__init__()
        self.last_batch, self.stop, self.remotes = last_batch, stop, []

    def _batch_end(self, batch, logs):
        self.remotes.append(logs.remote_value)
        if batch == self.last_batch:
            self.stop()

    def on_train_batch_end(self, batch, logs=None):
        self._batch_end(batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._batch_end(batch, logs)


def _raise():
    raise RuntimeError("the callback's own error")


def _ctrl_c():
    signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt


@pytest.fixture
def default_sigint():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _assert_nothing_runs_after(strategy, model, stopper):
    coordinator = keras_ps.ClusterCoordinator(strategy)
    assert coordinator.is_idle(), coordinator.calls_in_flight()
    iterations = int(model.optimizer.iterations.numpy())
    coordinator.join()  # would run what was left
    assert int(model.optimizer.iterations.numpy()) == iterations
    statuses = [r.status for r in stopper.remotes]
    assert RemoteValueStatus.PENDING not in statuses
    # Every execution that ended ran its two steps (one cancelled while it
    # ran may have run some of its steps too).
    assert 2 * statuses.count(RemoteValueStatus.READY) <= iterations
    assert iterations < STEPS
    with pytest.raises(keras_ps.errors.ClosureCancelledError):
        stopper.remotes[-1].fetch()


@pytest.mark.parametrize("stop, raised", [
    (_raise, RuntimeError), (_ctrl_c, KeyboardInterrupt)],
    ids=["callback_error", "ctrl_c"])
def test_fit_that_raises_runs_none_of_its_steps_after(strategy, stop, raised,
                                                      default_sigint):
    x, y = _data()
    model = _model(strategy)
    stopper = _StopAtLastBatch(STEPS - 1, stop)
    with pytest.raises(raised):
        model.fit(x, y, batch_size=1, epochs=1, steps_per_epoch=STEPS,
                  callbacks=[stopper], verbose=0)
    _assert_nothing_runs_after(strategy, model, stopper)
    # The next fit, of another model with another pack size, trains its
    # planned steps and no more, and raises nothing of the dropped model's.
    del model
    gc.collect()
    model = _model(strategy, steps_per_execution=4)
    model.fit(x, y, batch_size=1, epochs=1, steps_per_epoch=STEPS, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS


def test_evaluate_that_raises_runs_none_of_its_steps_after(strategy):
    x, y = _data()
    model = _model(strategy)
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=2, verbose=0)
    stopper = _StopAtLastBatch(STEPS - 1, _raise)
    with pytest.raises(RuntimeError, match="the callback's own error"):
        model.evaluate(x, y, batch_size=1, steps=STEPS, callbacks=[stopper],
                       verbose=0)
    coordinator = keras_ps.ClusterCoordinator(strategy)
    assert coordinator.is_idle(), coordinator.calls_in_flight()
    statuses = [r.status for r in stopper.remotes]
    assert RemoteValueStatus.PENDING not in statuses
    assert RemoteValueStatus.FAILED in statuses, statuses
    # And the model evaluates in full afterwards.
    assert np.isfinite(model.evaluate(x, y, batch_size=32, steps=4, verbose=0))
