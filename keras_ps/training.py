"""Keras 3 `Model.fit`, `evaluate` and `predict` on a parameter-server cluster.

A model built under `keras_ps.ParameterServerStrategy` is trained by this
module instead of Keras' synchronous loop (keras_ps/_keras_adapter.py routes
the calls). Training steps run on the workers through the strategy's
`ClusterCoordinator`, `steps_per_execution` steps per scheduled function and
many functions in flight; metrics live on the parameter servers and are read
from there at the end of each epoch.
"""

import logging
import math
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_ps import _keras_adapter
from keras_ps.coordinator import ClusterCoordinator
from keras_ps.training_logs import StepLogs, StepLogsTracker

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32

_coordinators = weakref.WeakKeyDictionary()


def coordinator_for(strategy):
    """The ClusterCoordinator that `fit`/`evaluate` use for `strategy` (one
    per strategy, created on first use)."""
    coordinator = _coordinators.get(strategy)
    if coordinator is None:
        coordinator = ClusterCoordinator(strategy)
        _coordinators[strategy] = coordinator
    return coordinator


class DatasetCreator:
    """Input for `model.fit`: a function that builds the dataset on each worker.

    Args:
        dataset_fn: `dataset_fn(input_context) -> tf.data.Dataset`. It runs
            on every worker; `input_context.input_pipeline_id` is the worker's
            index and `input_context.num_input_pipelines` the number of
            workers, so each worker can read its own shard. The dataset should
            repeat: `fit` takes `steps_per_epoch` batches per epoch from it.

    Example:
    ```python
    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.shuffle(1024).batch(64).repeat()

    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=100)
    ```
    """

    def __init__(self, dataset_fn):
        if not callable(dataset_fn):
            raise TypeError(
                "DatasetCreator needs a callable dataset_fn(input_context). "
                f"Received: dataset_fn={dataset_fn!r}.")
        self.dataset_fn = dataset_fn

    def __call__(self, input_context):
        dataset = self.dataset_fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "The DatasetCreator's dataset_fn must return a tf.data.Dataset. "
                f"Received: {type(dataset).__name__} from {self.dataset_fn!r}.")
        return dataset

    def __repr__(self):
        return f"DatasetCreator({self.dataset_fn!r})"


# -- input ----------------------------------------------------------------------
def _is_array_like(x):
    return isinstance(x, (np.ndarray, tf.Tensor, list, tuple, dict)) or \
        hasattr(x, "__array__")


def _arrays_dataset_fn(x, y, sample_weight, batch_size, shuffle):
    """Numpy arrays / tensors become a per-worker dataset: each worker reads
    its own 1/num_workers of the rows (shard by worker index), shuffled each
    pass, batched, repeated. The arrays travel inside the dataset's graph, so
    keep them small (use a DatasetCreator for large data)."""
    data = _as_arrays(x, y, sample_weight)
    batch_size = batch_size or DEFAULT_BATCH_SIZE

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices(data)
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        if shuffle:
            ds = ds.shuffle(8 * batch_size, reshuffle_each_iteration=True)
        return ds.batch(batch_size).repeat()

    return dataset_fn


def _as_arrays(x, y, sample_weight):
    """(x,), (x, y) or (x, y, sample_weight) as numpy arrays, checked to have
    one row per example in every array."""
    data = (x,) if y is None else (x, y) if sample_weight is None \
        else (x, y, sample_weight)
    data = tf.nest.map_structure(np.asarray, data)
    rows = []
    for name, part in zip(("x", "y", "sample_weight"), data):
        leaves = tf.nest.flatten(part)
        for i, leaf in enumerate(leaves):
            label = name if len(leaves) == 1 else f"{name}[{i}]"
            rows.append((label, leaf.shape[0] if leaf.ndim else None))
    if len({count for _, count in rows}) > 1:
        received = ", ".join(
            f"{label} has {'no rows (a scalar)' if count is None else count}"
            + ("" if count is None else " rows") for label, count in rows)
        raise ValueError(
            "x, y and sample_weight must have the same number of rows (one "
            f"per example). Received: {received}. Fix: pass arrays of equal "
            "length.")
    return data


def _training_input(x, y, sample_weight, batch_size, shuffle):
    """A dataset_fn or a tf.data.Dataset for the coordinator, repeated."""
    if isinstance(x, DatasetCreator):
        _no_targets(x, y, sample_weight)
        return x
    if isinstance(x, tf.data.Dataset):
        _no_targets(x, y, sample_weight)
        return x.repeat()
    if isinstance(x, keras.utils.PyDataset) or (
            callable(getattr(x, "__iter__", None)) and not _is_array_like(x)):
        raise TypeError(
            "With parameter-server training the input must be a "
            "keras_ps.DatasetCreator, a tf.data.Dataset or numpy arrays/"
            f"tensors. Received: x of type {type(x).__name__}. Wrap a Python "
            "generator in tf.data.Dataset.from_generator inside a "
            "DatasetCreator's dataset_fn.")
    if x is None:
        raise ValueError("fit/evaluate need input data. Received: x=None.")
    return _arrays_dataset_fn(x, y, sample_weight, batch_size, shuffle)


def _no_targets(x, y, sample_weight):
    if y is not None or sample_weight is not None:
        raise ValueError(
            f"When x is a {type(x).__name__}, the targets and sample weights "
            "come from it: y and sample_weight must be None. Received: "
            f"y={type(y).__name__}, sample_weight={type(sample_weight).__name__}.")


def _require_steps(name, value, what):
    if value is None:
        raise ValueError(
            f"`{name}` is required with parameter-server training: workers "
            "read their data independently, so the coordinator cannot tell "
            f"where an epoch ends. Received: {name}=None. Pass {name}=<number "
            f"of batches per {what}>.")
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}.")
    return int(value)


# -- scheduled functions ---------------------------------------------------------
class _StepFunctions:
    """`count` steps of `model.<step_name>` per scheduled tf.function, traced
    once per count (an epoch's last execution may be shorter)."""

    def __init__(self, model, step_name):
        self._model = model
        self._step_name = step_name
        self._functions = {}

    def get(self, count):
        fn = self._functions.get(count)
        if fn is None:
            fn = tf.function(self._multi_step(count), autograph=False)
            self._functions[count] = fn
        return fn

    def _multi_step(self, count):
        step = getattr(self._model, self._step_name)

        def multi_step(iterator):
            logs = step(next(iterator))
            if count > 1:
                def body(i, _):
                    return i + 1, step(next(iterator))
                _, logs = tf.while_loop(
                    lambda i, _: i < count - 1, body, (tf.constant(0), logs))
            return logs

        multi_step.__name__ = f"keras_ps_{self._step_name}_x{count}"
        return multi_step


def _executions(steps, per_execution):
    """(first step, step count) of each scheduled execution."""
    return [(begin, min(per_execution, steps - begin))
            for begin in range(0, steps, per_execution)]


def _python_logs(logs):
    out = {}
    for key, value in logs.items():
        value = np.asarray(value)
        out[key] = float(value) if value.size == 1 else value
    return out


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


def _resume_position(callback_list):
    from keras_ps.callbacks import BackupAndRestore

    for callback in callback_list.callbacks:
        if isinstance(callback, BackupAndRestore):
            return callback.resume_position()
    return None


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
    # Dynamic data shards: a ShardedInput has its own epoch loop
    # (keras_ps/shards/fit.py); everything below is the steps_per_epoch path.
    from keras_ps.shards import ShardedInput

    if isinstance(x, ShardedInput):
        from keras_ps.shards import fit as sharded_fit

        _no_targets(x, y, sample_weight)
        if class_weight is not None or validation_split:
            raise ValueError(
                "A ShardedInput carries its own data: class_weight and "
                "validation_split do not apply. Received: class_weight="
                f"{class_weight!r}, validation_split={validation_split!r}. "
                "Fix: put weights in the records; pass validation_data.")
        return sharded_fit.fit(
            model, coordinator_for(model.distribute_strategy), x, epochs,
            verbose, callbacks, validation_data,
            validation_steps, validation_batch_size, validation_freq,
            initial_epoch, steps_per_epoch)
    steps_per_epoch = _require_steps("steps_per_epoch", steps_per_epoch, "epoch")
    if class_weight is not None:
        raise ValueError(
            "class_weight is not supported with parameter-server training. "
            f"Received: class_weight={class_weight!r}. Put per-example weights "
            "in the dataset as (x, y, sample_weight) instead.")
    if validation_split:
        if not _is_array_like(x) or isinstance(x, tf.data.Dataset):
            raise ValueError(
                "validation_split only works with numpy arrays/tensors. "
                f"Received: x of type {type(x).__name__}. Pass validation_data.")
        (x, y, sample_weight), validation_data = _split_arrays(
            (x, y, sample_weight), validation_split)

    strategy = model.distribute_strategy
    coordinator = coordinator_for(strategy)
    dataset = coordinator.create_per_worker_dataset(
        _training_input(x, y, sample_weight, batch_size, shuffle))
    _keras_adapter.symbolic_build(model, strategy, dataset.element_spec)
    iterator = iter(dataset)
    steps_fn = _StepFunctions(model, "train_step")
    per_execution = max(1, int(model.steps_per_execution or 1))

    callback_list = _make_callbacks(model, callbacks, verbose, epochs,
                                    steps_per_epoch)
    model.stop_training = False
    callback_list.on_train_begin()
    start_epoch, start_step = initial_epoch, 0
    resume = _resume_position(callback_list)
    if resume is not None:
        start_epoch, start_step = resume
        logger.info("[chief] resuming at epoch %d, step %d", start_epoch,
                    start_step)
    training_logs = None
    for epoch in range(start_epoch, epochs):
        tracker = StepLogsTracker()
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        first_step = start_step if epoch == start_epoch else 0
        for begin, count in _executions(steps_per_epoch, per_execution):
            if begin + count <= first_step:
                continue
            callback_list.on_train_batch_begin(begin)
            remote = coordinator.schedule(steps_fn.get(count), args=(iterator,))
            logs = StepLogs(remote, tracker)
            _batch_end(callback_list, begin + count - 1, logs,
                       "on_train_batch_end")
            if model.stop_training:
                break
        coordinator.join()
        epoch_logs = _python_logs(model.get_metrics_result())
        if validation_data is not None and _should_validate(epoch,
                                                            validation_freq):
            val_x, val_y, val_w = keras.utils.unpack_x_y_sample_weight(
                validation_data) if isinstance(validation_data, tuple) else (
                validation_data, None, None)
            val_logs = evaluate(
                model, val_x, val_y, sample_weight=val_w,
                batch_size=validation_batch_size or batch_size,
                steps=validation_steps, verbose=0, return_dict=True)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callback_list.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        if model.stop_training:
            break
    if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callback_list.on_train_end(logs=training_logs)
    return model.history


def _check_compiled(model, what):
    if not getattr(model, "compiled", False):
        raise ValueError(
            f"You must call `compile()` before `{what}()`. Received: a model "
            f"{model.name!r} that is not compiled.")


def _should_validate(epoch, validation_freq):
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


def _split_arrays(arrays, validation_split):
    if not 0 < validation_split < 1:
        raise ValueError(
            "validation_split must be between 0 and 1. Received: "
            f"validation_split={validation_split}.")
    first = tf.nest.flatten(arrays[0])[0]
    rows = len(first)
    cut = int(math.floor(rows * (1.0 - validation_split)))

    def part(lo, hi):
        return tf.nest.map_structure(
            lambda a: None if a is None else np.asarray(a)[lo:hi], arrays)

    return part(0, cut), part(cut, rows)


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
    from keras_ps import exact_evaluation

    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise TypeError(f"Unexpected evaluate arguments: {sorted(kwargs)}.")
    from keras_ps.shards import ShardedInput

    if isinstance(x, ShardedInput):  # dynamic data shards train only
        raise TypeError(
            "evaluate does not take a ShardedInput (it is for training). "
            f"Received: x={x!r}. Fix: pass the records as a finite "
            "tf.data.Dataset: evaluate is exactly-once on finite data.")
    _check_compiled(model, "evaluate")
    strategy = model.distribute_strategy
    coordinator = coordinator_for(strategy)
    if exact is None:
        exact = steps is None
    if exact:
        if steps is not None:
            raise ValueError(
                "Exact evaluation visits every example once and ignores "
                f"`steps`. Received: steps={steps}, exact=True. Drop one.")
        logs = exact_evaluation.evaluate_exactly_once(
            model, coordinator, _exact_input(x, y, sample_weight, batch_size))
    else:
        logs = _evaluate_steps(model, coordinator, x, y, sample_weight,
                               batch_size, steps, callbacks, verbose)
    if return_dict:
        return logs
    return _logs_as_list(model, logs)


def _exact_input(x, y, sample_weight, batch_size):
    if isinstance(x, DatasetCreator):
        _no_targets(x, y, sample_weight)
        return x(tf.distribute.InputContext())
    if isinstance(x, tf.data.Dataset):
        _no_targets(x, y, sample_weight)
        return x
    data = _as_arrays(x, y, sample_weight)
    return tf.data.Dataset.from_tensor_slices(data).batch(
        batch_size or DEFAULT_BATCH_SIZE)


def _evaluate_steps(model, coordinator, x, y, sample_weight, batch_size,
                    steps, callbacks, verbose):
    steps = _require_steps("steps", steps, "evaluation")
    dataset = coordinator.create_per_worker_dataset(
        _training_input(x, y, sample_weight, batch_size, shuffle=False))
    _keras_adapter.symbolic_build(model, model.distribute_strategy,
                                  dataset.element_spec)
    iterator = iter(dataset)
    steps_fn = _StepFunctions(model, "test_step")
    per_execution = max(1, int(model.steps_per_execution or 1))
    callback_list = _make_callbacks(model, callbacks, verbose, 1, steps)
    callback_list.on_test_begin()
    model.reset_metrics()
    tracker = StepLogsTracker()
    for begin, count in _executions(steps, per_execution):
        callback_list.on_test_batch_begin(begin)
        remote = coordinator.schedule(steps_fn.get(count), args=(iterator,))
        _batch_end(callback_list, begin + count - 1, StepLogs(remote, tracker),
                   "on_test_batch_end")
    coordinator.join()
    logs = _python_logs(model.get_metrics_result())
    callback_list.on_test_end(logs)
    return logs


def _logs_as_list(model, logs):
    # Keras' order: the loss first, then the compiled metrics.
    del model
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


# -- predict ---------------------------------------------------------------------
def predict(model, x, batch_size=None, verbose="auto", steps=None,
            callbacks=None):
    """`model.predict` runs on the coordinator, reading the weights from the
    parameter servers (a sharded embedding reads only the rows it looks up).
    Predictions are returned in input order, which a distributed predict
    could not promise without extra bookkeeping."""
    if isinstance(x, DatasetCreator):
        x = x(tf.distribute.InputContext())
    keras_predict = _keras_adapter.original_trainer_method("predict")
    return keras_predict(model, x, batch_size=batch_size, verbose=verbose,
                         steps=steps, callbacks=callbacks)
