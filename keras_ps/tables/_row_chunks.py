"""Weights on the ps to and from files, a block or a slice of rows at a time:
Keras weights files, and TF checkpoints of a large sharded variable.

A Keras weights file (`.weights.h5`, the h5 inside a `.keras`) holds one full
dataset per weight. For a weight on the ps (a sharded weight, an optimizer
slot of one, a table on one ps) keras_ps writes that dataset a block of rows
at a time, each block read from its shard by a strided slice that runs on the
shard's ps, so only the block crosses the wire; it loads it back the same
way, each block of the file's rows assigned to the shard that holds them. No
process holds more than a block (`KERAS_PS_SAVE_CHUNK_BYTES`, 64 MB by
default), and the file is the one plain Keras writes, so a plain Keras model
loads it. That part uses public TF and numpy API only; the Keras hooks that
call it live in `keras_ps._keras.saving`. A TF checkpoint holds a large
sharded variable as one slice per shard, each read and written by its ps
through TF's saveable objects (`keras_ps._tf_adapter`).
"""

import contextlib
import math
import threading

import numpy as np
import tensorflow as tf

from keras_ps import _constants
from keras_ps import _tf_adapter

_state = threading.local()


def chunk_bytes():
    """The most bytes of a weight moved at once (read at each save and load)."""
    return _constants.env_int(_constants.SAVE_CHUNK_BYTES_ENV_VAR,
                              _constants.DEFAULT_SAVE_CHUNK_BYTES, minimum=1)


def rows_per_chunk(shape, dtype):
    """Rows of a weight of `shape` and `dtype` that fit in one block (>= 1)."""
    row_bytes = math.prod(shape[1:]) * np.dtype(dtype).itemsize
    return max(1, chunk_bytes() // max(1, row_bytes))


def _blocks(variables, step):
    """(shard, first row in the shard, stop, first row in the whole weight)."""
    offset = 0
    for variable in variables:
        rows = int(variable.shape[0])
        for start in range(0, rows, step):
            yield variable, start, min(rows, start + step), offset + start
        offset += rows


def read_rows(variable, start, stop):
    """Rows [start, stop) of `variable` as a numpy array; the slice runs on
    the variable's device, so only those rows cross the wire."""
    with tf.device(variable.device):
        part = variable[start:stop]
    return part.numpy()


def assign_rows(variable, start, value):
    """Writes `value` (an array, or a tensor of the variable's dtype, which
    may already be on the variable's device) into rows
    [start, start + len(value)) of `variable`, on the variable's device."""
    if not isinstance(value, tf.Tensor):
        value = np.asarray(value, dtype=variable.dtype.as_numpy_dtype)
    rest = list(variable.shape[1:])
    with tf.device(variable.device):
        tf.raw_ops.ResourceStridedSliceAssign(
            ref=variable.handle, begin=[start] + [0] * len(rest),
            end=[start + value.shape[0]] + rest,
            strides=[1] * (len(rest) + 1), value=value)


def write_dataset(group, key, variables):
    """Creates dataset `key` in h5 `group` holding `variables` (the shards of
    one weight, in row order, or one variable) as one array, and fills it a
    block of rows at a time."""
    dtype = variables[0].dtype.as_numpy_dtype
    shape = (sum(int(v.shape[0]) for v in variables),) + tuple(
        variables[0].shape[1:])
    dataset = group.create_dataset(key, shape=shape, dtype=dtype)
    for variable, start, stop, at in _blocks(
            variables, rows_per_chunk(shape, dtype)):
        dataset[at:at + stop - start] = read_rows(variable, start, stop)
    return dataset


class DatasetRows:
    """A weight in a weights file (an h5 dataset of rank >= 1), read a block
    of rows at a time by `assign_by_rows`; anything else sees an array
    (`np.asarray(rows)` reads it whole).

    Args:
        dataset: an `h5py.Dataset` (or anything sliced like an array, with
            `shape` and `dtype`).
    """

    def __init__(self, dataset):
        self._dataset = dataset

    @property
    def shape(self):
        return tuple(self._dataset.shape)

    @property
    def dtype(self):
        return np.dtype(self._dataset.dtype)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def rows(self, start, stop):
        return self._dataset[start:stop]

    def __getitem__(self, spec):
        return self._dataset[spec]

    def __array__(self, dtype=None, copy=None):
        del copy
        value = self._dataset[()]
        return value if dtype is None else value.astype(dtype)

    def __repr__(self):
        return f"<DatasetRows shape={self.shape} dtype={self.dtype.name}>"


def value_to_assign(target, value):
    """`value` as a tensor of `target`'s dtype, with Keras' own error when
    its shape differs from `target`'s."""
    value = tf.convert_to_tensor(value, dtype=target.dtype)
    check_assign_shape(target, value.shape)
    return value


def check_assign_shape(target, value_shape):
    """Keras' own error for `target.assign(value)` with a different shape."""
    if not tf.TensorShape(value_shape).is_compatible_with(target.shape):
        raise ValueError(
            "The shape of the target variable and the shape of the target "
            "value in `variable.assign(value)` must match. "
            f"variable.shape={tuple(target.shape)}, "
            f"Received: value.shape={tuple(tf.TensorShape(value_shape))}. "
            f"Target variable: {target}")


def assign_by_rows(target, variables, rows):
    """`target.assign(rows)` a block of rows at a time: each block of the
    file's rows goes to the shard in `variables` (`target`'s shards, in row
    order, or its one variable) that holds them.

    Raises:
        ValueError: the shapes differ (Keras' message).
    """
    check_assign_shape(target, rows.shape)
    for variable, start, stop, at in _blocks(
            variables, rows_per_chunk(rows.shape, rows.dtype)):
        assign_rows(variable, start, rows.rows(at, at + stop - start))


# -- which loads read by rows --------------------------------------------------
@contextlib.contextmanager
def rows_for_reads(enabled):
    """Inside the block, on this thread, a weights file hands large datasets
    out as `DatasetRows` when `enabled` (while an object whose weights live
    on the ps loads), as arrays otherwise (plain Keras objects)."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def rows_wanted():
    return getattr(_state, "enabled", False)


# -- TF checkpoints of a large sharded variable, one slice per shard ---------
# Each slice is read and written by the shard's own ps, so no process holds the
# whole variable; the entry restores into any number of shards or a plain
# variable, as TF's own ShardedVariable's does.
def _gather_sliced_saveables(self):
    """Checkpoint entry of a large sharded variable: its key holds one slice
    per shard (as TF's own ShardedVariable saves), each read and written by
    the shard's ps and restored straight into the shard, so no process holds
    the whole variable. It restores into any number of shards or into a
    plain variable, and a plain variable's entry restores into it."""
    def factory(name=self._name):
        return [_tf_adapter.resource_variable_saveable(
            v, self._slice_spec(i), name) for i, v in enumerate(self._variables)]
    return {"VARIABLE_VALUE": factory}


_sliced_classes = {}


def sliced_class(cls):
    """`cls` checkpointed as slices: TF takes a class's
    `_gather_saveables_for_checkpoint` when the class defines it before any
    `_serialize_to_tensors` in its MRO."""
    if cls.__name__.startswith("_Sliced"):
        return cls
    if cls not in _sliced_classes:
        _sliced_classes[cls] = type(f"_Sliced{cls.__name__}", (cls,), {
            "_gather_saveables_for_checkpoint": _gather_sliced_saveables,
            "__module__": cls.__module__})
    return _sliced_classes[cls]
