"""Sharded Keras 3 weights: one `keras.Variable` per shard, one container.

A Keras 3 weight must be a `keras.Variable` wrapping exactly one `tf.Variable`
(the gradient tape asks it for `.handle`, and a container of shards has none). So a weight that
the strategy's `variable_partitioner` splits becomes:

- one `keras.Variable` per shard, each a real weight of the layer
  (`layer.weights` lists `embeddings_part_0`, `embeddings_part_1`, ...): the
  tape, every Keras optimizer and its slots work per shard, on the shard's ps;
- one `ShardedWeight` that the layer stores in place of the weight
  (`Embedding._embeddings`, `Dense._kernel`) and reads through: conversion to
  a tensor concatenates, `ops.take(..., axis=0)` gathers only requested rows.

Saving sees the container, never the shards (`collapse`), so every format
holds one full tensor per weight; Keras weights files write and read it a
block of rows at a time, shard by shard (`keras_ps.tables._row_chunks`), so no
process holds the whole weight. This module uses only public Keras API; the
hooks that call it live in `keras_ps._keras.sharding`.
"""

import contextlib
import logging
import threading

import keras
import tensorflow as tf

from keras_ps.tables import _grouped_transfers
from keras_ps.tables import _rowwise
from keras_ps.tables import partitioners as partitioners_lib
from keras_ps.tables.sharded_variable import ShardedVariable

logger = logging.getLogger(__name__)

# Each shard (a keras.Variable, or an optimizer slot of a shard) carries
# (container, shard index) under this attribute; a shard's slot made before
# the slots of the other shards carries True under PENDING_SLOT_ATTR.
_SHARD_ATTR = "_keras_ps_shard"
PENDING_SLOT_ATTR = "_keras_ps_pending_slot"
# A variable with this attribute set is saved by the layer that owns it (e.g.
# a dynamic table's rows, with only its live rows): the variable lists that
# saving and checkpoints walk leave it out. Its optimizer slots are announced
# to the callable under SLOT_OWNER_ATTR, `(slot, name) -> None`, instead.
SAVED_BY_OWNER_ATTR = "_keras_ps_saved_by_owner"
SLOT_OWNER_ATTR = "_keras_ps_slot_owner"
# Such a variable (and each of its optimizer slots) may also carry, under
# OWNED_STATE_ATTR, what incremental backups (keras_ps.backups) need to
# cover its owner's state on its ps: an object with `backup_variables()`,
# {name: tf.Variable} of the rest of that state, written whole by every
# backup, and `restore_key_map()`, which rebuilds what is not a variable
# from them after a restore. Without it, incremental backups refuse it.
OWNED_STATE_ATTR = "_keras_ps_owned_state"


class ShardedWeight(ShardedVariable):
    """A Keras weight split on axis 0 into shards on different ps.

    What a layer holds instead of one `keras.Variable` (e.g.
    `layer.embeddings`). `variables` are the shards' `tf.Variable`s (with
    `.device`); `keras_variables` the shards as Keras weights, as listed in
    `layer.weights`.

    Args:
        keras_variables: the shards, as `keras.Variable`s, in row order.
        tf_variables: the `tf.Variable` inside each of them.
        path: the logical weight's Keras path, e.g. `"embedding/embeddings"`.

    Example:
    ```python
    with strategy.scope():  # variable_partitioner=FixedShardsPartitioner(2)
        layer = keras.layers.Embedding(8, 16384)
        layer.build()
    [tuple(v.shape) for v in layer.embeddings.variables]  # [(4, 16384)] * 2
    ```
    """

    # In a SavedModel the shards are the variables (Keras lists them as the
    # model's weights; `model.export()` tracks those).
    _saved_as_one_variable = False

    def __init__(self, keras_variables, tf_variables, path):
        super().__init__(tf_variables, name=path.split("/")[-1])
        self._keras_variables = list(keras_variables)
        self._path = path
        self._pending_slots = {}
        for index, variable in enumerate(self._keras_variables):
            setattr(variable, _SHARD_ATTR, (self, index))

    @property
    def keras_variables(self):
        """The shards as Keras weights (the entries of `layer.weights`)."""
        return list(self._keras_variables)

    @property
    def path(self):
        return self._path

    def __array__(self, dtype=None, copy=None):
        del copy
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def __repr__(self):
        return (f"<ShardedWeight path={self._path!r} shape={tuple(self.shape)} "
                f"shards={len(self._variables)}>")


def shard_of(variable):
    """(container, index) if `variable` is a shard (or a shard's slot), else None."""
    return getattr(variable, _SHARD_ATTR, None)


# -- creating sharded weights ---------------------------------------------------
def num_shards(partitioner, shape, dtype, name):
    """How many shards `partitioner` asks for; 1 for scalars.

    Raises:
        PartitionerError: (a ValueError) the partitioner's result is not a
            list of positive ints, one per axis, that splits only axis 0.
    """
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank == 0 or not shape.is_fully_defined():
        return 1
    spec = partitioner(shape, tf.as_dtype(dtype))
    return partitioners_lib.validate_partition_spec(spec, shape, name)


class _CaptureVariable:
    """A variable creator that records the tf.Variables created under it."""

    def __init__(self):
        self.created = []

    def __call__(self, next_creator, **kwargs):
        variable = next_creator(**kwargs)
        self.created.append(variable)
        return variable


def add_sharded_weight(layer, keras_add_weight, partitioner, init_device,
                       shape=None, initializer=None, dtype=None, name=None,
                       eager_scope=contextlib.nullcontext, **kwargs):
    """`layer.add_weight(...)` under a partitioner: a ShardedWeight or a Variable.

    Up to SLICED_INIT_MAX_BYTES the full initializer runs once, on
    `init_device` (a ps), and each shard starts from its slice, so seeded
    initialization gives the same numbers as an unpartitioned layer. Larger
    weights are initialised shard by shard on each shard's own ps. The
    coordinator never holds the full table.

    Args:
        layer: the layer adding the weight.
        keras_add_weight: Keras' own `add_weight`, bound to `layer`.
        partitioner: the strategy's `variable_partitioner`.
        init_device: where to evaluate the full initializer.
        shape, initializer, dtype, name, **kwargs: as `Layer.add_weight`.
        eager_scope: `() -> context manager` under which the shards are made
            eagerly, with their tf.Variables, even while Keras traces a
            model's `call` to build it (a stateless scope).

    Raises:
        PartitionerError: see `num_shards`.
    """
    shape = tuple(shape) if shape is not None else ()
    dtype = (keras.backend.standardize_dtype(dtype) if dtype is not None
             else layer.variable_dtype)
    name = name or "variable"
    count = num_shards(partitioner, shape, dtype, f"{layer.name}/{name}")
    if count <= 1:
        return keras_add_weight(shape=shape, initializer=initializer,
                                dtype=dtype, name=name, **kwargs)
    if initializer is None:
        initializer = "glorot_uniform" if "float" in dtype else "zeros"
    initializer = keras.initializers.get(initializer)
    with eager_scope():
        shards, inner = _make_shards(layer, keras_add_weight, init_device,
                                     shape, initializer, dtype, name, count,
                                     kwargs)
    path = shards[0].path[: -len("_part_0")]
    logger.info("[chief] weight %s %s split into %d shards", path, shape, count)
    return ShardedWeight(shards, inner, path)


def _make_shards(layer, keras_add_weight, init_device, shape, initializer,
                 dtype, name, count, kwargs):
    """The shards of a weight (keras.Variables) and their tf.Variables."""
    ranges = partitioners_lib.shard_row_ranges(shape[0], count)
    nbytes = tf.TensorShape(shape).num_elements() * tf.as_dtype(dtype).size
    if nbytes <= SLICED_INIT_MAX_BYTES:
        with tf.init_scope(), tf.device(init_device):
            full = tf.convert_to_tensor(initializer(shape, dtype=dtype), dtype=dtype)
        initializers = [_SliceInitializer(full, start, stop, init_device)
                        for start, stop in ranges]
    else:
        initializers = [per_shard_initializer(initializer, i) for i in range(count)]
    shards, inner = [], []
    for i, ((start, stop), shard_init) in enumerate(zip(ranges, initializers)):
        capture = _CaptureVariable()
        with tf.variable_creator_scope(capture):
            shards.append(keras_add_weight(
                shape=(stop - start,) + shape[1:], initializer=shard_init,
                dtype=dtype, name=f"{name}_part_{i}", **kwargs))
        if len(capture.created) != 1:
            raise ValueError(
                f"Layer {layer.name!r} created weight {name!r} without its "
                f"variable (received {len(capture.created)} tf.Variables). "
                "keras_ps shards only weights created eagerly; build the layer "
                "under strategy.scope().")
        inner.append(capture.created[0])
    return shards, inner


# Up to this size a sharded weight is initialised whole on one ps and sliced,
# so a seeded initializer gives the numbers of an unsharded weight. Above it,
# each shard is initialised on its own ps from its own shape: no full copy
# anywhere, no initial value on the wire (a 10M x 64 float32 table is 2.4 GB).
SLICED_INIT_MAX_BYTES = 256 * 2**20


def per_shard_initializer(initializer, index):
    """`initializer` for shard `index`; one seeded with an int gets seed
    `seed + index`, so shards of equal shape do not start equal. (An unseeded
    Keras random initializer holds a fixed int seed too, and would draw the
    same numbers for every shard of equal shape.)"""
    seed = getattr(initializer, "seed", None)
    if isinstance(seed, int) and hasattr(initializer, "get_config"):
        config = dict(initializer.get_config(), seed=seed + index)
        return type(initializer).from_config(config)
    return initializer


class _SliceInitializer:
    """Rows [start, stop) of a tensor computed once for the whole weight."""

    def __init__(self, full, start, stop, device):
        self._full, self._start, self._stop = full, start, stop
        self._device = device

    def __call__(self, shape, dtype=None):
        with tf.device(self._device):
            part = self._full[self._start:self._stop]
        return part if dtype is None else tf.cast(part, dtype)


def group_slot(slot, reference, name):
    """Records an optimizer slot made for a shard; once every shard has its
    slot `name`, groups them into a ShardedWeight (for saving only)."""
    announce = getattr(reference, SLOT_OWNER_ATTR, None)
    if announce is not None:
        announce(slot, name)
        return
    owner = shard_of(reference)
    if owner is None:
        return
    container, index = owner
    pending = container._pending_slots.setdefault(
        name, [None] * len(container.variables))
    pending[index] = slot
    setattr(slot, PENDING_SLOT_ATTR, True)
    if all(p is not None for p in pending):
        del container._pending_slots[name]
        for p in pending:
            delattr(p, PENDING_SLOT_ATTR)
        slots = [_inner(s) for s in pending]
        ShardedWeight(pending, slots, f"{container.path}_{name}")


def _inner(variable):
    # `keras.Variable.value` is the tf.Variable itself outside an autocast scope.
    return variable.value if isinstance(variable, keras.Variable) else variable


# -- saving: one entry per logical weight ---------------------------------------
def collapse(variables):
    """`variables` with each complete group of shards replaced, at its first
    shard's position, by its ShardedWeight. Anything else stays as it is."""
    variables = list(variables)
    present = {id(v) for v in variables}
    out = []
    for v in variables:
        if getattr(v, SAVED_BY_OWNER_ATTR, False):
            continue
        owner = shard_of(v)
        if owner is None:
            out.append(v)
            continue
        container, index = owner
        complete = all(id(s) in present for s in container.keras_variables)
        if not complete:
            out.append(v)
        elif index == 0:
            out.append(container)
    return out


def holds_shards(values):
    return isinstance(values, list) and any(
        shard_of(v) or getattr(v, SAVED_BY_OWNER_ATTR, False) for v in values)


_swap_lock = threading.RLock()


@contextlib.contextmanager
def collapsed_attributes(obj, names):
    """Within the block, each list attribute `names` of `obj` that holds shards
    reads as `collapse(list)`; the original lists are put back after."""
    with _swap_lock:
        saved = {}
        for name in names:
            values = obj.__dict__.get(name)
            if holds_shards(values):
                saved[name] = values
                object.__setattr__(obj, name, collapse(values))
        try:
            yield
        finally:
            for name, values in saved.items():
                object.__setattr__(obj, name, values)


class CheckpointList(tf.__internal__.tracking.Trackable):
    """A list as tf.train.Checkpoint sees it (children "0", "1", ...), used
    to present a collapsed optimizer variable list."""

    def __init__(self, values):
        self._values = list(values)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        del save_type, kwargs
        return {str(i): v for i, v in enumerate(self._values)
                if isinstance(v, tf.__internal__.tracking.Trackable)}


# id(original list) -> (original list, ids of its collapsed items, CheckpointList).
# The checkpoint walks an object's children several times per save and needs
# the same child object each time.
_checkpoint_lists = {}


def _checkpoint_list(values):
    collapsed = collapse(values)
    ids = tuple(id(v) for v in collapsed)
    cached = _checkpoint_lists.get(id(values))
    if cached is None or cached[0] is not values or cached[1] != ids:
        cached = (values, ids, CheckpointList(collapsed))
        with _swap_lock:
            _checkpoint_lists[id(values)] = cached
    return cached[2]


def collapse_children(children):
    """Trackable children with every list that holds shards collapsed."""
    return {name: _checkpoint_list(child) if holds_shards(child) else child
            for name, child in children.items()}


# -- the forward lookup -----------------------------------------------------------
def take_rows(table, indices):
    """`ops.take(table, indices, axis=0)` reading only the requested rows,
    each distinct one once.

    Args:
        table: a ShardedVariable, or a `tf.Variable` (one table on one ps).
        indices: integer ids of any shape.
    """
    indices = tf.convert_to_tensor(indices)
    if not indices.dtype.is_integer:
        indices = tf.cast(indices, tf.int64)
    rows = tf.cast(table.shape[0], indices.dtype)
    indices = tf.where(indices < 0, indices + rows, indices)  # Keras' "fill" mode
    if isinstance(table, ShardedVariable):
        return table.embedding_lookup(indices)
    flat = tf.reshape(indices, [-1])
    unique, position = tf.unique(flat)
    gathered = _rowwise.expand(
        _grouped_transfers.gather_rows(table, unique), position)
    return tf.reshape(gathered, tf.concat(
        [tf.shape(indices), tf.shape(gathered)[1:]], 0))


def ps_table(x):
    """The `tf.Variable` of keras Variable `x` if it lives on a ps, else None."""
    inner = getattr(x, "_value", None) if isinstance(x, keras.Variable) else None
    if isinstance(inner, tf.Variable) and "/job:ps/" in (inner.device or ""):
        return inner
    return None
