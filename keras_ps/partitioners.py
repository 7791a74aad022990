"""Variable partitioners: how many shards a variable is split into on axis 0.

Same call signature and results as TF's `tf.distribute.experimental.partitioners`
(whose instances keras_ps accepts too): `partitioner(shape, dtype, axis=0)`
returns one count per axis, all 1 but `axis`.
"""

import math

import tensorflow as tf

from keras_ps.errors import PartitionerError

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer. Received: {name}={value!r}.")
    return value


def _element_bytes(dtype, bytes_per_string):
    dtype = tf.as_dtype(dtype)
    return bytes_per_string if dtype == tf.string else dtype.size


def _spec(shape, axis, shards):
    spec = [1] * len(shape)
    spec[axis] = shards
    return spec


class Partitioner:
    """Base class: `__call__(shape, dtype, axis=0)` -> partitions per axis."""

    def __call__(self, shape, dtype, axis=0):
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """Splits every variable into `num_shards` shards (fewer if it has fewer rows).

    Args:
        num_shards: number of shards.

    Example:
    >>> FixedShardsPartitioner(2)(tf.TensorShape([8, 16384]), tf.float32)
    [2, 1]
    """

    def __init__(self, num_shards):
        self._num_shards = _positive_int("num_shards", num_shards)

    def __call__(self, shape, dtype, axis=0):
        shape = tf.TensorShape(shape)
        return _spec(shape, axis, min(self._num_shards, shape[axis]))


class MinSizePartitioner(Partitioner):
    """As many shards as possible, each at least `min_shard_bytes`.

    Args:
        min_shard_bytes: smallest shard size in bytes.
        max_shards: most shards.
        bytes_per_string: assumed size of one string element.

    Example:
    >>> MinSizePartitioner(256 << 10, max_shards=2)([1024, 1024], tf.float32)
    [2, 1]
    """

    def __init__(self, min_shard_bytes=256 << 10, max_shards=1,
                 bytes_per_string=16):
        self._min_shard_bytes = _positive_int("min_shard_bytes", min_shard_bytes)
        self._max_shards = _positive_int("max_shards", max_shards)
        self._bytes_per_string = _positive_int("bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype, axis=0):
        shape = tf.TensorShape(shape)
        total = shape.num_elements() * _element_bytes(dtype, self._bytes_per_string)
        # Rounded up, as TF's min_max_variable_partitioner does.
        shards = math.ceil(total / self._min_shard_bytes)
        shards = min(self._max_shards, shards, shape[axis])
        return _spec(shape, axis, max(1, shards))


class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each at most `max_shard_bytes`.

    Args:
        max_shard_bytes: largest shard size in bytes.
        max_shards: most shards (None: no limit).
        bytes_per_string: assumed size of one string element.

    Example:
    >>> MaxSizePartitioner(max_shard_bytes=4)([6, 1], tf.float32)
    [6, 1]
    """

    def __init__(self, max_shard_bytes, max_shards=None, bytes_per_string=16):
        self._max_shard_bytes = _positive_int("max_shard_bytes", max_shard_bytes)
        self._max_shards = (None if max_shards is None
                            else _positive_int("max_shards", max_shards))
        self._bytes_per_string = _positive_int("bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype, axis=0):
        shape = tf.TensorShape(shape)
        rows = shape[axis]
        row_bytes = (shape.num_elements() / rows) * _element_bytes(
            dtype, self._bytes_per_string)
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / row_bytes))
        shards = math.ceil(rows / rows_per_shard)
        if self._max_shards is not None:
            shards = min(shards, self._max_shards)
        return _spec(shape, axis, shards)


def validate_partition_spec(spec, shape, name):
    """Checks a partitioner's result; returns the number of shards.

    Raises:
        PartitionerError: not a list of positive ints, one per axis, or an
            axis other than 0 is partitioned.
    """
    shape = tf.TensorShape(shape)
    where = f"Variable {name!r} with shape {tuple(shape.as_list())}"
    if not isinstance(spec, (list, tuple)):
        raise PartitionerError(
            f"{where}: the variable_partitioner returned {spec!r}, not a list. "
            f"Return one count per axis, e.g. {_spec(shape, 0, 2)}.")
    if len(spec) != shape.rank:
        raise PartitionerError(
            f"{where}: the variable_partitioner returned {list(spec)} with "
            f"{len(spec)} entries; expected {shape.rank} (one per axis).")
    for count in spec:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise PartitionerError(
                f"{where}: the variable_partitioner returned {list(spec)}; "
                f"every entry must be a positive integer, got {count!r}.")
    for axis, count in enumerate(spec[1:], start=1):
        if count != 1:
            raise PartitionerError(
                f"{where}: the variable_partitioner returned {list(spec)}, "
                f"which partitions axis {axis}. keras_ps only partitions "
                f"axis 0; return [num_shards{', 1' * (shape.rank - 1)}].")
    return min(spec[0], shape[0])


def shard_row_ranges(num_rows, num_shards):
    """(start, stop) rows of each shard; the first `num_rows % num_shards`
    shards get one extra row ("div" strategy)."""
    base, extra = divmod(num_rows, num_shards)
    ranges, start = [], 0
    for i in range(num_shards):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def shard_sizes(num_rows, num_shards):
    return [stop - start for start, stop in shard_row_ranges(num_rows, num_shards)]
