"""ShardedVariable: one logical variable split by rows over the ps tasks.

Created by `ParameterServerStrategy` when its `variable_partitioner` asks for
more than one shard. Shards are ordinary variables, so gradients, optimizer
slots and updates work on each shard where it lives. A checkpoint holds the
whole variable as one tensor, so it restores into any number of shards or
into a plain variable.
"""

import contextlib
import logging
import threading

import tensorflow as tf

from keras_ps import partitioners as partitioners_lib

logger = logging.getLogger(__name__)

_switch = threading.local()

# Variables larger than this are checkpointed as one slice per shard, each
# written by its own ps (the checkpoint directory must then be writable by
# every ps at the same path, as with TF's ParameterServerStrategy); smaller
# ones as one tensor written by the coordinator.
SLICED_SAVE_MIN_BYTES = 256 * 2**20


@contextlib.contextmanager
def no_partitioning():
    """Variables created by this thread inside the block are never split.

    Used around the one `tf.Variable` that each `keras.Variable` wraps (a
    Keras weight, metric or optimizer slot must be exactly one variable, see
    DESIGN.md fact 6); Keras layer weights are split one level up instead.
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


class ShardedVariable(tf.__internal__.tracking.Trackable):
    """A variable split on axis 0 into `variables`, each on its own ps.

    Args:
        variables: the shards, in row order; equal shapes past axis 0.
        name: the logical variable's name.
    """

    def __init__(self, variables, name=None):
        variables = list(variables)
        if not variables:
            raise ValueError("A ShardedVariable needs at least one shard. Received: [].")
        rest = variables[0].shape[1:]
        for v in variables:
            if v.shape[1:] != rest or v.dtype != variables[0].dtype:
                raise ValueError(
                    "Shards must agree on dtype and on every axis but the first. "
                    f"Received shapes {[tuple(x.shape) for x in variables]}.")
        self._variables = variables
        self._name = name or variables[0].name.split("/part_")[0]
        self._row_offsets = [0]
        for v in variables:
            self._row_offsets.append(self._row_offsets[-1] + int(v.shape[0]))
        if self.nbytes > SLICED_SAVE_MIN_BYTES:
            self.__class__ = _sliced_class(type(self))

    @property
    def variables(self):
        """The shards (each a tf.Variable on its own ps)."""
        return list(self._variables)

    @property
    def name(self):
        return self._name

    @property
    def dtype(self):
        return self._variables[0].dtype

    @property
    def shape(self):
        return tf.TensorShape([self._row_offsets[-1]]).concatenate(
            self._variables[0].shape[1:])

    @property
    def trainable(self):
        return self._variables[0].trainable

    def read_value(self):
        """The whole variable as one tensor (concatenates every shard)."""
        return tf.concat([v.read_value() for v in self._variables], axis=0)

    def value(self):
        return self.read_value()

    def numpy(self):
        return self.read_value().numpy()

    def _split(self, value):
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        sizes = [int(v.shape[0]) for v in self._variables]
        return tf.split(value, sizes, axis=0)

    def assign(self, value):
        for v, part in zip(self._variables, self._split(value)):
            v.assign(part)
        return self

    def assign_add(self, value):
        for v, part in zip(self._variables, self._split(value)):
            v.assign_add(part)
        return self

    def assign_sub(self, value):
        for v, part in zip(self._variables, self._split(value)):
            v.assign_sub(part)
        return self

    def _route(self, ids):
        """For each shard: (positions in `ids`, local row ids) of its rows."""
        ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
        bounds = tf.constant(self._row_offsets[1:-1], dtype=tf.int64)
        shard = tf.searchsorted(bounds, ids, side="right")
        offsets = tf.constant(self._row_offsets[:-1], dtype=tf.int64)
        local = ids - tf.gather(offsets, shard)
        shard32 = tf.cast(shard, tf.int32)
        n = len(self._variables)
        positions = tf.dynamic_partition(tf.range(tf.size(ids)), shard32, n)
        locals_ = tf.dynamic_partition(local, shard32, n)
        return positions, locals_

    def _scatter(self, method, sparse_delta):
        flat_ids = tf.reshape(sparse_delta.indices, [-1])
        values = tf.reshape(sparse_delta.values,
                            tf.concat([[-1], tf.shape(sparse_delta.values)[
                                tf.rank(sparse_delta.indices):]], 0))
        positions, locals_ = self._route(flat_ids)
        for v, pos, rows in zip(self._variables, positions, locals_):
            getattr(v, method)(tf.IndexedSlices(tf.gather(values, pos), rows))
        return self

    def scatter_update(self, sparse_delta):
        return self._scatter("scatter_update", sparse_delta)

    def scatter_add(self, sparse_delta):
        return self._scatter("scatter_add", sparse_delta)

    def scatter_sub(self, sparse_delta):
        return self._scatter("scatter_sub", sparse_delta)

    def embedding_lookup(self, ids):
        """Rows `ids` of the variable, gathering only those rows from each shard.

        Each distinct id is read once (the ids are deduplicated first), so a
        shard sends each requested row once and receives its gradient once,
        the repeats' gradients summed where the lookup runs."""
        ids = tf.convert_to_tensor(ids)
        flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
        unique, position = tf.unique(flat)
        positions, locals_ = self._route(unique)
        parts = []
        for v, rows in zip(self._variables, locals_):
            with tf.device(v.device):
                parts.append(tf.gather(v, rows))
        gathered = tf.gather(tf.dynamic_stitch(positions, parts), position)
        return tf.reshape(gathered, tf.concat(
            [tf.shape(ids), tf.shape(gathered)[1:]], 0))

    # -- checkpointing: the whole variable under one key ------------------------
    @property
    def nbytes(self):
        return self.shape.num_elements() * self.dtype.size

    def _slice_spec(self, index):
        offset = [0] * self.shape.rank
        offset[0] = self._row_offsets[index]
        return tf.Variable.SaveSliceInfo(
            full_name=self._name, full_shape=self.shape.as_list(),
            var_offset=offset,
            var_shape=self._variables[index].shape.as_list()).spec

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.read_value()}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors["VARIABLE_VALUE"]
        # Inside the restore tf.function the shape may be unknown until run.
        if not value.shape.is_compatible_with(self.shape):
            raise ValueError(
                f"Checkpoint value for {self._name!r} has shape "
                f"{tuple(value.shape)}, but the variable has shape "
                f"{tuple(self.shape)}. Restore into a model built the same way.")
        return self.assign(value)

    def __repr__(self):
        return (f"<ShardedVariable {self._name!r} shape={tuple(self.shape)} "
                f"shards={len(self._variables)}>")


def _gather_sliced_saveables(self):
    """Checkpoint entry of a large sharded variable: its key holds one slice
    per shard (as TF's own ShardedVariable saves), each read and written by
    the shard's ps and restored straight into the shard, so no process holds
    the whole variable. It restores into any number of shards or into a
    plain variable, and a plain variable's entry restores into it."""
    from tensorflow.python.training.saving import saveable_object_util

    def factory(name=self._name):
        return [saveable_object_util.ResourceVariableSaveable(
            v, self._slice_spec(i), name) for i, v in enumerate(self._variables)]
    return {"VARIABLE_VALUE": factory}


_sliced_classes = {}


def _sliced_class(cls):
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


def _to_tensor(var, dtype=None, name=None, as_ref=False):
    del name, as_ref
    value = var.read_value()
    if dtype is not None and dtype != value.dtype:
        value = tf.cast(value, dtype)
    return value


tf.register_tensor_conversion_function(ShardedVariable, _to_tensor)


def maybe_create_sharded(extended, next_creator, partitioner, kwargs):
    """Creates a ShardedVariable if `partitioner` asks for 2+ shards, else None.

    Always None inside `no_partitioning()`.
    """
    if not partitioning_allowed():
        return None
    initial_value = kwargs.get("initial_value")
    shape = kwargs.get("shape")
    if callable(initial_value):
        if shape is None or not tf.TensorShape(shape).is_fully_defined():
            return None
        initial_value = initial_value()
    initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
    shape = initial_value.shape
    if shape.rank is None or shape.rank == 0 or not shape.is_fully_defined():
        return None
    name = kwargs.get("name") or "Variable"
    spec = partitioner(shape, initial_value.dtype)
    num_shards = partitioners_lib.validate_partition_spec(spec, shape, name)
    if num_shards <= 1:
        return None
    shards = []
    for i, (start, stop) in enumerate(
            partitioners_lib.shard_row_ranges(int(shape[0]), num_shards)):
        shard_kwargs = dict(kwargs)
        shard_kwargs["initial_value"] = initial_value[start:stop]
        shard_kwargs["shape"] = None
        shard_kwargs["name"] = f"{name}/part_{i}"
        shards.append(extended._create_shard(next_creator, shard_kwargs))
    logger.info("[chief] %s %s split into %d shards", name, tuple(shape), num_shards)
    return ShardedVariable(shards, name=name)
