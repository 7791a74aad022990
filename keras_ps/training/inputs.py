"""The input of fit / evaluate / predict on a parameter-server cluster.

`DatasetCreator` (a function that builds the dataset on each worker), a
`tf.data.Dataset`, or numpy arrays; how each becomes a per-worker dataset (for
training) or one finite dataset (for exactly-once evaluation).
"""

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

from keras_ps.coordinator import worker_context

DEFAULT_BATCH_SIZE = 32


class DatasetCreator:
    """Input for `model.fit`: a function that builds the dataset on each worker.

    Args:
        dataset_fn: `dataset_fn(input_context) -> tf.data.Dataset`, whose
            graph runs on every worker; `input_context.input_pipeline_id` is
            the worker's index and `input_context.num_input_pipelines` the
            number of workers, so each worker can read its own shard (see
            `ClusterCoordinator.create_per_worker_dataset` for how often it
            is traced). The dataset should
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

    def __init__(self, dataset_fn, input_options=None):
        if not callable(dataset_fn):
            raise TypeError(
                "DatasetCreator needs a callable dataset_fn(input_context). "
                f"Received: dataset_fn={dataset_fn!r}.")
        if input_options is not None and not isinstance(
                input_options, tf.distribute.InputOptions):
            raise TypeError(
                "input_options must be a tf.distribute.InputOptions or None. "
                f"Received: input_options={input_options!r}.")
        self.dataset_fn = dataset_fn
        # TF's argument, taken so that its code runs as written. Its options
        # place elements on a replica's devices (prefetching to a GPU); a
        # keras_ps worker runs its steps where its dataset makes them.
        self.input_options = input_options

    def __call__(self, input_context):
        dataset = self.dataset_fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "The DatasetCreator's dataset_fn must return a tf.data.Dataset. "
                f"Received: {type(dataset).__name__} from {self.dataset_fn!r}.")
        return dataset

    def __repr__(self):
        return f"DatasetCreator({self.dataset_fn!r})"


def from_tf_keras(x):
    """`x`, or a keras_ps DatasetCreator for tf_keras' own (TF's
    `tf.keras.utils.experimental.DatasetCreator`): code moving off tf_keras
    may still make that one, and it holds the same function."""
    kind = type(x)
    if (kind.__name__ == "DatasetCreator" and not isinstance(x, DatasetCreator)
            and kind.__module__.split(".")[0] in ("tf_keras", "keras")
            and callable(getattr(x, "dataset_fn", None))):
        return DatasetCreator(x.dataset_fn, getattr(x, "input_options", None))
    return x



def is_array_like(x):
    return isinstance(x, (np.ndarray, tf.Tensor, list, tuple, dict)) or \
        hasattr(x, "__array__")


def arrays_dataset_fn(x, y, sample_weight, batch_size, shuffle):
    """Numpy arrays / tensors become a per-worker dataset: each worker reads
    its own 1/num_workers of the rows (shard by worker index), shuffled each
    pass, batched, repeated. The arrays travel inside the dataset's graph, so
    keep them small (use a DatasetCreator for large data). The worker's index
    is a tensor given at each call, so the graph is traced once and serves
    every worker."""
    data = as_arrays(x, y, sample_weight)
    batch_size = batch_size or DEFAULT_BATCH_SIZE

    def dataset_fn(context):
        del context  # the same graph on every worker
        ds = tf.data.Dataset.from_tensor_slices(data)
        ds = ds.shard(worker_context.num_workers(), worker_context.worker_index())
        if shuffle:
            ds = ds.shuffle(8 * batch_size, reshuffle_each_iteration=True)
        return ds.batch(batch_size).repeat()

    return dataset_fn


def as_arrays(x, y, sample_weight):
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


def training_input(x, y, sample_weight, batch_size, shuffle, what):
    """A dataset_fn or a tf.data.Dataset for the coordinator, repeated."""
    if isinstance(x, DatasetCreator):
        no_targets(x, y, sample_weight)
        return x
    if isinstance(x, tf.data.Dataset):
        no_targets(x, y, sample_weight)
        if int(x.cardinality()) == 0:
            raise ValueError(_no_batch_message(x, what))
        return x.repeat()
    if isinstance(x, keras.utils.PyDataset) or (
            callable(getattr(x, "__iter__", None)) and not is_array_like(x)):
        raise TypeError(
            "With parameter-server training the input must be a "
            "keras_ps.DatasetCreator, a tf.data.Dataset or numpy arrays/"
            f"tensors. Received: x of type {type(x).__name__}. Wrap a Python "
            "generator in tf.data.Dataset.from_generator inside a "
            "DatasetCreator's dataset_fn.")
    if x is None:
        raise ValueError("fit/evaluate need input data. Received: x=None.")
    return arrays_dataset_fn(x, y, sample_weight, batch_size, shuffle)


@contextlib.contextmanager
def empty_data_explained(x, what):
    """Turns running out of data into an error saying the data is empty,
    for input that `training_input` repeats (all but a DatasetCreator)."""
    try:
        yield
    except tf.errors.OutOfRangeError as error:
        if isinstance(x, DatasetCreator):
            raise
        raise ValueError(_no_batch_message(x, what)) from error


def _no_batch_message(x, what):
    return (
        f"The data given to {what} yields no batch: {what} repeats a "
        "tf.data.Dataset or arrays itself (no .repeat() is needed), so the "
        "data ran out only because there was nothing to read. Received: x of "
        f"type {type(x).__name__} with no batch. Fix: check the data: a "
        "filter that drops every example, an empty file, or fewer rows than "
        "workers (each worker reads its own part of the arrays).")


def no_targets(x, y, sample_weight):
    if y is not None or sample_weight is not None:
        raise ValueError(
            f"When x is a {type(x).__name__}, the targets and sample weights "
            "come from it: y and sample_weight must be None. Received: "
            f"y={type(y).__name__}, sample_weight={type(sample_weight).__name__}.")


def require_steps(name, value, what):
    if value is None:
        raise ValueError(
            f"`{name}` is required with parameter-server training: workers "
            "read their data independently, so the coordinator cannot tell "
            f"where an epoch ends. Received: {name}=None. Pass {name}=<number "
            f"of batches per {what}>.")
    if isinstance(value, (int, np.integer)) and value == -1:
        # TF's strategy runs until a worker's iterator raises OutOfRangeError.
        exact = (" (e.g. the number of examples // (batch_size * "
                 "num_workers) for data sharded by worker), or steps=None "
                 "to evaluate finite data exactly once") if name == "steps" \
            else (" (e.g. the number of examples // batch_size), with a "
                  "dataset that repeats")
        raise ValueError(
            f"`{name}=-1` (run until the data runs out) is not supported with "
            "parameter-server training: each worker reads its own iterator, "
            "so the data runs out on each worker at a different step, and "
            "where the epoch ended would depend on timing (batches still in "
            f"flight are lost or repeated). Received: {name}=-1. Pass "
            f"{name}=<number of batches per {what}>{exact}"
            + (", or give fit a keras_ps.ShardedInput: its epoch ends when "
               "every record has been trained on once." if name ==
               "steps_per_epoch" else "."))
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}.")
    return int(value)


def split_arrays(arrays, validation_split):
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


def exact_input(x, y, sample_weight, batch_size):
    if isinstance(x, DatasetCreator):
        no_targets(x, y, sample_weight)
        return x(tf.distribute.InputContext())
    if isinstance(x, tf.data.Dataset):
        no_targets(x, y, sample_weight)
        return x
    data = as_arrays(x, y, sample_weight)
    return tf.data.Dataset.from_tensor_slices(data).batch(
        batch_size or DEFAULT_BATCH_SIZE)


def check_batch_size(name, value):
    """A batch size keras_ps batches arrays with: a positive integer, or
    None or 0 for the default 32 (as Keras reads them)."""
    if value is None or (isinstance(value, (int, np.integer)) and
                         not isinstance(value, bool) and value >= 0):
        return
    raise ValueError(
        f"`{name}` must be a positive integer (or None for the default "
        f"{DEFAULT_BATCH_SIZE}). Received: {name}={value!r}.")


def check_validation_freq(validation_freq):
    """Keras' forms: validate every N epochs (a positive int), or after the
    epochs listed (1 for the first)."""
    if isinstance(validation_freq, int) and not isinstance(validation_freq,
                                                           bool):
        good = validation_freq >= 1
    else:
        good = isinstance(validation_freq, (list, tuple, set, range))
    if not good:
        raise ValueError(
            "validation_freq must be a positive integer (validate every N "
            "epochs) or a list of the epochs to validate after (1 for the "
            f"first). Received: validation_freq={validation_freq!r}.")


def check_validation_data(validation_data, validation_steps):
    """Without `validation_steps`, fit evaluates `validation_data` exactly
    once after each epoch: it must end. Checked before the first step, so
    no epoch is trained for nothing."""
    if validation_steps is None and isinstance(
            validation_data, tf.data.Dataset) and int(
            validation_data.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "Without validation_steps, fit evaluates validation_data exactly "
            "once after each epoch, so it must be finite. Received: "
            "validation_data of infinite cardinality (it repeats forever) "
            "and validation_steps=None. Fix: remove .repeat() from the "
            "validation data, or pass validation_steps=N to evaluate N "
            "batches after each epoch.")


def check_predict_data(x, steps):
    """Without `steps`, predict reads `x` until it ends: data that repeats
    forever would run until the process is stopped, its predictions held in
    memory and never returned (as Keras does; refused here instead)."""
    if steps is None and isinstance(x, tf.data.Dataset) and int(
            x.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "Without steps, predict reads its data until it ends, and this "
            "data repeats forever. Received: a dataset of infinite "
            "cardinality and steps=None. Fix: remove .repeat() from the "
            "data to predict on, or pass steps=N to predict N batches.")


def should_validate(epoch, validation_freq):
    """Whether `fit` evaluates `validation_data` after `epoch` (0-based)."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
