"""Keras 3 `Model.fit`, `evaluate` and `predict` on a parameter-server cluster.

A model built under `keras_ps.ParameterServerStrategy` is trained by this
module instead of Keras' synchronous loop: importing it routes those models'
`fit` / `evaluate` / `predict` here (keras_ps/_keras/fit_routing.py). Training
steps run on the workers through the strategy's `ClusterCoordinator`,
`steps_per_execution` steps per scheduled function and many functions in
flight; metrics live on the parameter servers and are read from there at the
end of each epoch.
"""

import functools
import inspect
import logging

import keras
import tensorflow as tf

from keras_ps.training import _fit_epochs
from keras_ps.training import _step_functions
from keras_ps.training import exact_evaluation
from keras_ps.training import inputs
from keras_ps import shards
from keras_ps._keras import fit_routing
from keras_ps.coordinator import ClusterCoordinator
from keras_ps.coordinator import watchdog
from keras_ps.training.inputs import DatasetCreator
from keras_ps.training._fit_epochs import ResumableCallback
from keras_ps.training import sharded_fit
from keras_ps.strategy import ParameterServerStrategy
from keras_ps.training.logs import StepLogs, StepLogsTracker, python_logs

logger = logging.getLogger(__name__)


def _executions(steps, per_execution):
    """(first step, step count) of each scheduled execution."""
    return [(begin, min(per_execution, steps - begin))
            for begin in range(0, steps, per_execution)]


def _make_callbacks(model, callbacks, verbose, epochs, steps):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0,
        verbose=verbose, epochs=epochs, steps=steps, model=model)


def _batch_end(callback_list, batch, logs, hook):
    """Calls each callback's batch hook with lazy logs: a callback that reads
    them waits for that execution; one that does not read them (History,
    ModelCheckpoint per epoch) costs no synchronisation. The progress bar
    shows the newest logs that are already in, without waiting. A
    TensorBoard with a batch-level `update_freq` reads every execution's
    logs, so it waits for each one (a few ms, but no pipelining past it)."""
    for callback in callback_list.callbacks:
        if isinstance(callback, keras.callbacks.ProgbarLogger):
            getattr(callback, hook)(batch, logs.tracker.latest())
        elif isinstance(callback, keras.callbacks.TensorBoard) and \
                callback.update_freq == "epoch":
            # It would read (and so wait for) every batch's logs only to
            # drop them: it records nothing per batch with "epoch".
            getattr(callback, hook)(batch, None)
        else:
            getattr(callback, hook)(batch, logs)


def _resume_position(model, callback_list, initial_epoch):
    """(epoch, step) where this fit starts: a ResumableCallback's position, or
    the epoch Keras' own BackupAndRestore restored, or `initial_epoch`."""
    for callback in callback_list.callbacks:
        if isinstance(callback, ResumableCallback):
            position = callback.resume_position()
            if position is not None:
                return position
    restored = fit_routing.take_initial_epoch(model)
    if restored:
        return restored, 0
    return initial_epoch, 0


# -- fit ------------------------------------------------------------------------
def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
        callbacks=None, validation_split=0.0, validation_data=None,
        shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
        steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`model.fit` for a model built under a keras_ps strategy (same arguments
    as Keras' `Model.fit`; `steps_per_epoch` is required, except with a
    `keras_ps.ShardedInput`, whose epoch is every record once)."""
    _check_compiled(model, "fit")
    x, validation_data = inputs.from_tf_keras(x), inputs.from_tf_keras(
        validation_data)
    inputs.check_validation_freq(validation_freq)
    inputs.check_validation_data(validation_data, validation_steps)
    inputs.check_batch_size("batch_size", batch_size)
    inputs.check_batch_size("validation_batch_size", validation_batch_size)
    if isinstance(x, shards.ShardedInput):
        # Dynamic data shards: the epoch is every shard once (training/sharded_fit.py).
        inputs.no_targets(x, y, sample_weight)
        if class_weight is not None or validation_split:
            raise ValueError(
                "A ShardedInput carries its own data: class_weight and "
                "validation_split do not apply. Received: class_weight="
                f"{class_weight!r}, validation_split={validation_split!r}. "
                "Fix: put weights in the records; pass validation_data.")
        return sharded_fit.fit(
            model, ClusterCoordinator(model.distribute_strategy), x, epochs,
            verbose, callbacks, validation_data,
            validation_steps, validation_batch_size, validation_freq,
            initial_epoch, steps_per_epoch)
    steps_per_epoch = inputs.require_steps("steps_per_epoch", steps_per_epoch, "epoch")
    if class_weight is not None:
        raise ValueError(
            "class_weight is not supported with parameter-server training. "
            f"Received: class_weight={class_weight!r}. Put per-example weights "
            "in the dataset as (x, y, sample_weight) instead.")
    if validation_split:
        if not inputs.is_array_like(x) or isinstance(x, tf.data.Dataset):
            raise ValueError(
                "validation_split only works with numpy arrays/tensors. "
                f"Received: x of type {type(x).__name__}. Pass validation_data.")
        (x, y, sample_weight), validation_data = inputs.split_arrays(
            (x, y, sample_weight), validation_split)

    strategy = model.distribute_strategy
    coordinator = ClusterCoordinator(strategy)
    dataset = coordinator.create_per_worker_dataset(
        inputs.training_input(x, y, sample_weight, batch_size, shuffle, "fit"))
    fit_routing.symbolic_build(model, strategy, dataset.element_spec)
    iterator = iter(dataset)
    steps_fn = _step_functions.for_model(model, "train_step")
    per_execution = max(1, int(model.steps_per_execution or 1))

    callback_list = _make_callbacks(model, callbacks, verbose, epochs,
                                    steps_per_epoch)
    model.stop_training = False
    callback_list.on_train_begin()
    start_epoch, start_step = _resume_position(model, callback_list,
                                               initial_epoch)
    if (start_epoch, start_step) != (initial_epoch, 0):
        logger.info("[chief] resuming at epoch %d, step %d", start_epoch,
                    start_step)
    progress = _fit_epochs.Progress(
        steps_per_epoch, _fit_epochs.recovering_callback(callback_list) is not None)
    progress.keep_with(_fit_epochs.resumable_callback(callback_list), model)
    lead = _fit_epochs.Lead(callback_list, coordinator)

    def train_from(position):
        start_epoch, start_step = position
        training_logs = None
        for epoch in range(start_epoch, epochs):
            tracker = StepLogsTracker()
            model.reset_metrics()
            progress.rates.begin(epoch, model.optimizer)
            callback_list.on_epoch_begin(epoch)
            first_step = start_step if epoch == start_epoch else 0
            trained = False
            for begin, count in _executions(steps_per_epoch, per_execution):
                if begin + count <= first_step:
                    continue
                trained = True
                callback_list.on_train_batch_begin(begin)
                remote = coordinator.schedule(
                    steps_fn.get(count, coordinator.trace_is_safe),
                    args=(iterator,))
                progress.reached = progress.at(epoch, begin + count)
                progress.scheduled(progress.at(epoch, begin),
                                   progress.reached, remote)
                lead.scheduled(remote)
                logs = StepLogs(remote, tracker)
                _batch_end(callback_list, begin + count - 1, logs,
                           "on_train_batch_end")
                if model.stop_training:
                    break
            coordinator.join()
            progress.joined()
            epoch_logs = progress.epoch_metrics(epoch, trained)
            epoch_logs.update(progress.epoch_logs())
            training_logs = epoch_logs
            if _fit_epochs.finish_epoch(
                    model, callback_list, epoch, epoch_logs, validation_data,
                    validation_batch_size or batch_size, validation_steps,
                    validation_freq):
                break
        return training_logs

    with inputs.empty_data_explained(x, "fit"), \
            _fit_epochs.cancelled_on_error(coordinator):
        training_logs = _fit_epochs.train_with_ps_recovery(
            coordinator, _fit_epochs.recovering_callback(callback_list),
            train_from, (start_epoch, start_step), progress)
    coordinator.release_iterators(iterator)
    return _fit_epochs.end_training(model, callback_list, epochs,
                                    training_logs)


def _check_compiled(model, what):
    if not getattr(model, "compiled", False):
        raise ValueError(
            f"You must call `compile()` before `{what}()`. Received: a model "
            f"{model.name!r} that is not compiled.")


# -- evaluate --------------------------------------------------------------------
def evaluate(model, x=None, y=None, batch_size=None, verbose="auto",
             sample_weight=None, steps=None, callbacks=None,
             return_dict=False, exact=None, **kwargs):
    """`model.evaluate` on the workers.

    With `steps`, each worker evaluates batches of its own per-worker dataset
    until `steps` batches are done (at-least-once: a batch of a lost worker may
    count twice). Without `steps` (or with `exact=True`) the data must be
    finite and every example is evaluated exactly once: the dataset is split
    into shards, each shard is one scheduled function that accumulates the
    metrics locally and returns them, and the coordinator adds each shard's
    metrics once, so a shard redone after a worker loss is not counted twice.
    """
    x = inputs.from_tf_keras(x)
    for name in fit_routing.KERAS_PRIVATE_EVALUATE_ARGS:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"Unexpected evaluate arguments: {sorted(kwargs)}.")
    if isinstance(x, shards.ShardedInput):  # dynamic data shards train only
        raise TypeError(
            "evaluate does not take a ShardedInput (it is for training). "
            f"Received: x={x!r}. Fix: pass the records as a finite "
            "tf.data.Dataset: evaluate is exactly-once on finite data.")
    _check_compiled(model, "evaluate")
    inputs.check_batch_size("batch_size", batch_size)
    strategy = model.distribute_strategy
    coordinator = ClusterCoordinator(strategy)
    if exact is None:
        exact = steps is None
    if exact:
        if steps is not None:
            raise ValueError(
                "Exact evaluation visits every example once, so it cannot "
                f"stop after `steps`. Received: steps={steps}, exact=True. "
                "Drop one.")
        with _fit_epochs.cancelled_on_error(coordinator):
            logs = exact_evaluation.evaluate_exactly_once(
                model, coordinator,
                inputs.exact_input(x, y, sample_weight, batch_size))
    else:
        logs = _evaluate_steps(model, coordinator, x, y, sample_weight,
                               batch_size, steps, callbacks, verbose)
    if return_dict:
        return logs
    return _logs_as_list(logs)


def _evaluate_steps(model, coordinator, x, y, sample_weight, batch_size,
                    steps, callbacks, verbose):
    steps = inputs.require_steps("steps", steps, "evaluation")
    dataset = coordinator.create_per_worker_dataset(
        inputs.training_input(x, y, sample_weight, batch_size, shuffle=False,
                              what="evaluate"))
    fit_routing.symbolic_build(model, model.distribute_strategy,
                                  dataset.element_spec)
    iterator = iter(dataset)
    steps_fn = _step_functions.for_model(model, "test_step")
    per_execution = max(1, int(model.steps_per_execution or 1))
    callback_list = _make_callbacks(model, callbacks, verbose, 1, steps)
    callback_list.on_test_begin()
    model.reset_metrics()
    tracker = StepLogsTracker()
    with inputs.empty_data_explained(x, "evaluate"), \
            _fit_epochs.cancelled_on_error(coordinator):
        for begin, count in _executions(steps, per_execution):
            callback_list.on_test_batch_begin(begin)
            remote = coordinator.schedule(
                steps_fn.get(count, coordinator.trace_is_safe),
                args=(iterator,))
            _batch_end(callback_list, begin + count - 1,
                       StepLogs(remote, tracker), "on_test_batch_end")
        coordinator.join()
    coordinator.release_iterators(iterator)
    logs = python_logs(model.get_metrics_result())
    callback_list.on_test_end(logs)
    return logs


def _logs_as_list(logs):
    # Keras' order: the loss first, then the compiled metrics.
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


# -- predict ---------------------------------------------------------------------
def predict(model, x, batch_size=None, verbose="auto", steps=None,
            callbacks=None):
    """`model.predict` runs on the coordinator, reading the weights from the
    parameter servers (a sharded embedding reads only the rows it looks up).
    Predictions are returned in input order, which a distributed predict
    could not promise without extra bookkeeping."""
    # Reading weights through a replaced connection crashes the process.
    model.distribute_strategy.check_connected()
    x = inputs.from_tf_keras(x)
    if isinstance(x, DatasetCreator):
        x = x(tf.distribute.InputContext())
    inputs.check_predict_data(x, steps)
    keras_predict = fit_routing.original_trainer_method("predict")
    return keras_predict(model, x, batch_size=batch_size, verbose=verbose,
                         steps=steps, callbacks=callbacks)


def _is_keras_ps_model(model):
    return isinstance(getattr(model, "distribute_strategy", None),
                      ParameterServerStrategy)


_FIT_SIGNATURE = inspect.signature(fit)


def _fit_telling_callbacks(model, *args, **kwargs):
    """`fit`, then `on_fit_exit` of its ResumableCallbacks, whether it
    returned or raised."""
    try:
        callbacks = _FIT_SIGNATURE.bind(model, *args, **kwargs).arguments.get(
            "callbacks")
    except TypeError:
        callbacks = None  # fit raises the TypeError itself
    try:
        return fit(model, *args, **kwargs)
    finally:
        _fit_epochs.fit_exited(callbacks)


def _ps_watched(method):
    """`method` with the ps watched while it runs (`watchdog.ps_watched`)."""
    @functools.wraps(method)
    def run(model, *args, **kwargs):
        with watchdog.ps_watched(model.distribute_strategy):
            return method(model, *args, **kwargs)
    return run


fit_routing.install(_is_keras_ps_model, {
    "fit": _ps_watched(_fit_telling_callbacks),
    "evaluate": _ps_watched(evaluate), "predict": predict})
