"""Variable partitioners: how many shards a variable is split into on axis 0.

Same results as TF's `tf.distribute.experimental.partitioners` (which keras_ps
accepts too): `partitioner(shape, dtype, axis=0)` returns one count per axis.
"""

import contextlib
import math
import numbers
import threading

import tensorflow as tf

from keras_ps.errors import PartitionerError

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner",
           "MaxSizePartitioner"]


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_ints(owner, optional=(), **args):
    """Returns the values of `args` as ints; ValueError unless each is >= 1."""
    for arg, value in args.items():
        if (arg in optional and value is None) or (_is_int(value) and value >= 1):
            continue
        problem = "is not an integer" if not _is_int(value) else "is less than 1"
        none_ok = ", or None for no limit" if arg in optional else ""
        raise ValueError(
            f"{owner}: `{arg}` {problem}. Received: {arg}={value!r}. "
            f"Expected a positive integer{none_ok}.")
    return [None if v is None else int(v) for v in args.values()]


def _prepare(shape, dtype, axis, bytes_per_string):
    """(shape, axis, bytes per element) after checking the inputs."""
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined() or not -shape.rank <= axis < shape.rank:
        raise ValueError(
            f"Cannot partition this variable along axis {axis}. Received: "
            f"shape={shape}, axis={axis}. Expected a fully defined shape "
            f"with -rank <= axis < rank.")
    if dtype is None:
        return shape, axis, None
    dtype = tf.as_dtype(dtype).base_dtype
    return shape, axis, bytes_per_string if dtype == tf.string else dtype.size


def _spec(shape, axis, num_shards):
    spec = [1] * shape.rank
    spec[axis] = num_shards
    return spec


class Partitioner:
    """Base class of partitioners.

    A subclass implements `__call__(shape, dtype, axis=0)`, which returns a
    list with one int per dimension of `shape`: the number of shards along
    `axis`, 1 everywhere else.

    Example:
    >>> class TwoShards(Partitioner):
    ...     def __call__(self, shape, dtype, axis=0):
    ...         return [2] + [1] * (len(shape) - 1)
    """

    def __call__(self, shape, dtype, axis=0):
        raise NotImplementedError(
            f"{type(self).__name__} must implement __call__(shape, dtype, axis=0).")


class FixedShardsPartitioner(Partitioner):
    """Splits each variable into `num_shards` shards (fewer if it has fewer rows).

    Args:
        num_shards: positive int, the number of shards.

    Example:
    >>> FixedShardsPartitioner(2)(tf.TensorShape([8, 16384]), tf.float32)
    [2, 1]
    """

    def __init__(self, num_shards):
        [self._num_shards] = _positive_ints(
            "FixedShardsPartitioner", num_shards=num_shards)

    def __call__(self, shape, dtype, axis=0):
        shape, axis, _ = _prepare(shape, None, axis, None)
        return _spec(shape, axis, min(self._num_shards, shape[axis]))


class MinSizePartitioner(Partitioner):
    """As many shards as possible, each of at least `min_shard_bytes`.

    Args:
        min_shard_bytes: positive int, the smallest shard size in bytes.
        max_shards: positive int, the most shards to make.
        bytes_per_string: positive int, the assumed size of one string element.

    Example:
    >>> MinSizePartitioner(256 << 10, max_shards=2)([1024, 1024], tf.float32)
    [2, 1]
    """

    def __init__(self, min_shard_bytes=256 << 10, max_shards=1,
                 bytes_per_string=16):
        self._min_shard_bytes, self._max_shards, self._bytes_per_string = (
            _positive_ints("MinSizePartitioner", min_shard_bytes=min_shard_bytes,
                           max_shards=max_shards, bytes_per_string=bytes_per_string))

    def __call__(self, shape, dtype, axis=0):
        shape, axis, element_bytes = _prepare(
            shape, dtype, axis, self._bytes_per_string)
        total_bytes = shape.num_elements() * element_bytes
        # Float division then ceil, exactly as TF computes it.
        by_size = int(math.ceil(total_bytes / self._min_shard_bytes))
        num_shards = min(shape[axis], self._max_shards, by_size)
        return _spec(shape, axis, max(1, num_shards))


class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each of at most `max_shard_bytes`.

    A shard holds at least one row, and `max_shards` takes precedence.

    Args:
        max_shard_bytes: positive int, the largest shard size in bytes.
        max_shards: positive int, the most shards to make; None for no limit.
        bytes_per_string: positive int, the assumed size of one string element.

    Example:
    >>> MaxSizePartitioner(max_shard_bytes=4)(tf.TensorShape([6, 1]), tf.float32)
    [6, 1]
    """

    def __init__(self, max_shard_bytes, max_shards=None, bytes_per_string=16):
        self._max_shard_bytes, self._max_shards, self._bytes_per_string = (
            _positive_ints("MaxSizePartitioner", optional=("max_shards",),
                           max_shard_bytes=max_shard_bytes, max_shards=max_shards,
                           bytes_per_string=bytes_per_string))

    def __call__(self, shape, dtype, axis=0):
        shape, axis, element_bytes = _prepare(
            shape, dtype, axis, self._bytes_per_string)
        rows = shape[axis]
        if rows == 0:  # TF divides by zero here; nothing to split.
            return _spec(shape, axis, 1)
        # Float arithmetic, exactly as TF computes it.
        row_bytes = (shape.num_elements() / rows) * element_bytes
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / row_bytes))
        num_shards = int(math.ceil(rows / rows_per_shard))
        if self._max_shards is not None:
            num_shards = min(num_shards, self._max_shards)
        return _spec(shape, axis, num_shards)


def validate_partition_spec(spec, shape, name):
    """Checks any partitioner's result; returns the number of shards (axis 0).

    The count is capped at `shape[0]`; a variable without rows gets 1 shard
    (its spec may then hold 0 at axis 0, as FixedShardsPartitioner returns).

    Raises:
        PartitionerError: `spec` is not a list of ints >= 1, one per axis, or
            partitions an axis other than 0.
    """
    shape = tf.TensorShape(shape)
    rank = shape.rank
    if not shape.is_fully_defined():
        raise PartitionerError(
            f"Variable {name!r} with shape {shape}: only variables of fully "
            f"defined shape can be partitioned.")
    where = f"Variable {name!r} with shape {tuple(shape.as_list())}"
    expected = "[" + ", ".join(["num_shards"] + ["1"] * (rank - 1)) + "]"
    returned = f"{where}: the variable_partitioner returned {spec!r}"
    if not isinstance(spec, (list, tuple)):
        raise PartitionerError(
            f"{returned}, which is not a list. Expected a list of {rank} ints, "
            f"one per axis: {expected}.")
    if len(spec) != rank:
        raise PartitionerError(
            f"{returned}, which has {len(spec)} entries. Expected {rank} "
            f"entries, one per axis: {expected}.")
    rows = shape[0] if rank else 1
    for axis, count in enumerate(spec):
        if not _is_int(count) or (count < 1 and (axis, count, rows) != (0, 0, 0)):
            raise PartitionerError(
                f"{returned}, whose entry {count!r} at axis {axis} is not an "
                f"integer >= 1. Expected a list of positive ints: {expected}.")
    for axis, count in enumerate(spec[1:], start=1):
        if count != 1:
            raise PartitionerError(
                f"{returned}, which partitions axis {axis}. keras_ps only "
                f"partitions axis 0; return {expected}.")
    return max(1, min(int(spec[0]), rows)) if rank else 1


def shard_row_ranges(num_rows, num_shards):
    """Splits `num_rows` rows into `num_shards` contiguous (start, stop) ranges.

    "div" strategy: every shard gets `num_rows // num_shards` rows and the first
    `num_rows % num_shards` shards one more, e.g. 13 rows over 5 shards give
    [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)].
    """
    if not _is_int(num_rows) or num_rows < 0:
        raise ValueError(f"Received: num_rows={num_rows!r}. Expected an integer >= 0.")
    most = max(1, num_rows)
    if not _is_int(num_shards) or not 1 <= num_shards <= most:
        raise ValueError(
            f"Cannot split {num_rows} rows into {num_shards!r} shards. Received: "
            f"num_shards={num_shards!r}. Expected an integer in [1, {most}].")
    base, extra = divmod(int(num_rows), int(num_shards))
    starts = [i * base + min(i, extra) for i in range(int(num_shards) + 1)]
    return list(zip(starts[:-1], starts[1:]))


def shard_sizes(num_rows, num_shards):
    """Rows per shard under `shard_row_ranges`, e.g. (13, 5) -> [3, 3, 3, 2, 2]."""
    return [stop - start for start, stop in shard_row_ranges(num_rows, num_shards)]



# -- where partitioning applies ---------------------------------------------
_switch = threading.local()


@contextlib.contextmanager
def no_partitioning():
    """Variables created by this thread inside the block are never split.

    Used around the one `tf.Variable` that each `keras.Variable` wraps (a
    Keras weight, metric or optimizer slot must be exactly one variable: the
    gradient tape asks a `keras.Variable` for `.handle`, which a container of
    shards has none of); Keras layer weights are split one level up instead.
    """
    depth = getattr(_switch, "depth", 0)
    _switch.depth = depth + 1
    try:
        yield
    finally:
        _switch.depth = depth


def partitioning_allowed():
    """False inside `no_partitioning()` on this thread."""
    return not getattr(_switch, "depth", 0)


# Shown (and pickled) under the public module that re-exports them.
for _cls in (Partitioner, FixedShardsPartitioner, MinSizePartitioner,
             MaxSizePartitioner):
    _cls.__module__ = "keras_ps.partitioners"
del _cls
