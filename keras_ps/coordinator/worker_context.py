"""Inside a scheduled tf.function: which worker runs it, and how many there are."""

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.strategy._per_worker import current_worker


def worker_index():
    """Inside a scheduled tf.function: the index of the worker running it.

    A scalar int64 tensor fed at every call, so one traced function serves
    every worker (e.g. `dataset.shard(num_workers(), worker_index())`).

    Raises:
        RuntimeError: called outside a tf.function.
    """
    return _call_time_value(0, "keras_ps_worker_index")


def num_workers():
    """Inside a scheduled tf.function: how many workers the cluster has."""
    return _call_time_value(1, "keras_ps_num_workers")


def _call_time_value(position, name):
    if not _tf_adapter.inside_function():
        raise RuntimeError(
            f"keras_ps.coordinator.{name[9:]}() must be called inside a "
            "tf.function that is scheduled with coordinator.schedule.")

    def value():
        current = current_worker()
        if current is None:
            raise RuntimeError(
                "This tf.function reads the worker index, so it can only run "
                "through coordinator.schedule.")
        return tf.constant(current[position], tf.int64)

    return _tf_adapter.capture_call_time_value(
        value, tf.TensorSpec([], tf.int64), name)
