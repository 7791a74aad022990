"""What a ShardedVariable needs beyond its class: its creation under a
`variable_partitioner`, and what TF's own ShardedVariable supports: its
operators and `tf.nn.embedding_lookup` (and the sparse variants) dispatching to
one gather per shard.

Importing this module registers the operators and lookups (keras_ps.strategy
imports it, so every ShardedVariable a strategy makes has them).
"""

import logging
import typing

import tensorflow as tf

from keras_ps.tables import partitioners as partitioners_lib
from keras_ps.tables.sharded_variable import ShardedVariable
from keras_ps.tables.partitioners import partitioning_allowed

logger = logging.getLogger(__name__)


# -- operators and slicing, as TF's ShardedVariable -----------------------------
# `==` and `!=` keep Python identity: Keras keeps sharded weights in lists and
# compares them with `in`; an element-wise `==` would make that a tensor.
_IDENTITY_OPERATORS = ("__getitem__", "__eq__", "__ne__")


def _overload(operator):
    tensor_operator = getattr(tf.Tensor, operator)

    def method(self, *args, **kwargs):
        return tensor_operator(self.read_value(), *args, **kwargs)

    method.__name__ = operator
    setattr(ShardedVariable, operator, method)


for _operator in sorted(tf.Tensor.OVERLOADABLE_OPERATORS):
    if _operator not in _IDENTITY_OPERATORS and hasattr(tf.Tensor, _operator):
        _overload(_operator)


# -- tf.nn.embedding_lookup and its sparse variants ------------------------------
def _lookup(sv, ids, max_norm=None, name=None):
    with tf.name_scope(name or "embedding_lookup"):
        if isinstance(ids, tf.RaggedTensor):
            return tf.ragged.map_flat_values(
                lambda flat: _lookup(sv, flat, max_norm), ids)
        ids = tf.convert_to_tensor(ids)
        result = sv.embedding_lookup(ids)
        if max_norm is not None:
            axes = list(range(ids.shape.rank, result.shape.rank))
            result = tf.clip_by_norm(result, max_norm, axes=axes)
        return result


def _single(params, api):
    if isinstance(params, (list, tuple)):
        if len(params) != 1:
            raise ValueError(
                f"{api} takes one ShardedVariable (its shards are already the "
                f"partitions). Received: a list of {len(params)} "
                "ShardedVariables. Pass the ShardedVariable itself.")
        params = params[0]
    return params


def _div_shards(sv, api):
    """The shards of `sv`, which TF's embedding ops read with the "div"
    strategy; a clear error if `sv` is split otherwise."""
    shards = sv.variables  # one full variable while a SavedModel traces
    sizes = [int(v.shape[0]) for v in shards]
    expected = [end - begin for begin, end in
                partitioners_lib.shard_row_ranges(sum(sizes), len(sizes))]
    if sizes != expected:
        raise ValueError(
            f"{api} reads a ShardedVariable's shards with TF's \"div\" "
            f"strategy, which needs shards of {expected} rows. Received: "
            f"{sv.name!r} with shards of {sizes} rows. Create it with a "
            "keras_ps partitioner (they always split that way).")
    return shards


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup)
def _embedding_lookup_v2(params: ShardedVariable, ids, max_norm=None,
                         name=None):
    return _lookup(params, ids, max_norm, name)


@tf.experimental.dispatch_for_api(tf.compat.v1.nn.embedding_lookup)
def _embedding_lookup_v1(
        params: typing.Union[ShardedVariable, typing.List[ShardedVariable]],
        ids, partition_strategy="mod", name=None, validate_indices=True,
        max_norm=None):
    # One logical table: the rows are partitioned already.
    del partition_strategy, validate_indices
    return _lookup(_single(params, "embedding_lookup"), ids, max_norm, name)


# TF's sparse lookups call `embedding_lookup([params], ...)` for a composite
# tensor, which the dispatch above serves shard by shard.
@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup_sparse)
def _embedding_lookup_sparse_v2(params: ShardedVariable, sp_ids, sp_weights,
                                combiner=None, max_norm=None, name=None,
                                allow_fast_lookup=False):
    return tf.nn.embedding_lookup_sparse(
        [params], sp_ids, sp_weights, combiner=combiner, max_norm=max_norm,
        name=name, allow_fast_lookup=allow_fast_lookup)


@tf.experimental.dispatch_for_api(tf.compat.v1.nn.embedding_lookup_sparse)
def _embedding_lookup_sparse_v1(params: ShardedVariable, sp_ids, sp_weights,
                                partition_strategy="mod", name=None,
                                combiner=None, max_norm=None,
                                allow_fast_lookup=False):
    return tf.compat.v1.nn.embedding_lookup_sparse(
        [params], sp_ids, sp_weights, partition_strategy=partition_strategy,
        name=name, combiner=combiner, max_norm=max_norm,
        allow_fast_lookup=allow_fast_lookup)


@tf.experimental.dispatch_for_api(tf.nn.safe_embedding_lookup_sparse)
def _safe_embedding_lookup_sparse_v2(
        embedding_weights: ShardedVariable, sparse_ids, sparse_weights=None,
        combiner="mean", default_id=None, max_norm=None, name=None,
        allow_fast_lookup=False):
    return tf.nn.safe_embedding_lookup_sparse(
        _div_shards(embedding_weights, "safe_embedding_lookup_sparse"),
        sparse_ids, sparse_weights=sparse_weights, combiner=combiner,
        default_id=default_id, max_norm=max_norm, name=name,
        allow_fast_lookup=allow_fast_lookup)


@tf.experimental.dispatch_for_api(tf.compat.v1.nn.safe_embedding_lookup_sparse)
def _safe_embedding_lookup_sparse_v1(
        embedding_weights: ShardedVariable, sparse_ids, sparse_weights=None,
        combiner="mean", default_id=None, name=None, partition_strategy="div",
        max_norm=None, allow_fast_lookup=False):
    del partition_strategy  # the shards are split "div"
    return tf.compat.v1.nn.safe_embedding_lookup_sparse(
        _div_shards(embedding_weights, "safe_embedding_lookup_sparse"),
        sparse_ids, sparse_weights=sparse_weights, combiner=combiner,
        default_id=default_id, name=name, partition_strategy="div",
        max_norm=max_norm, allow_fast_lookup=allow_fast_lookup)


# -- creation under a partitioner ------------------------------------------------
def maybe_create_sharded(extended, next_creator, partitioner, kwargs):
    """Creates a ShardedVariable if `partitioner` asks for 2+ shards, else None.

    As TF's strategy: a callable `initial_value` with a known `shape` and
    `dtype` is called once per shard with `partition_shape` and
    `partition_offset` when it accepts them (a partition-aware initializer),
    else once for the whole value, which is sliced; without a known shape or
    dtype it is called first and the value's shape decides. Always None
    inside `no_partitioning()`. When it returns None, `kwargs` holds the
    value already computed (so an initializer runs once).
    """
    if not partitioning_allowed():
        return None
    initial_value = kwargs.get("initial_value")
    shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
    init_fn = None
    if initial_value is None:
        # `tf.saved_model.load` makes uninitialised variables (its creator
        # below ours takes `shape` and `dtype`) and restores them after.
        return _uninitialized_sharded(extended, next_creator, partitioner,
                                      kwargs)
    if callable(initial_value):
        if (shape is not None and dtype is not None
                and tf.TensorShape(shape).is_fully_defined()):
            init_fn = initial_value
            shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
        else:
            initial_value = initial_value()
    if init_fn is None:
        initial_value = tf.convert_to_tensor(initial_value, dtype=dtype)
        kwargs["initial_value"] = initial_value
        shape, dtype = initial_value.shape, initial_value.dtype
    if shape.rank is None or shape.rank == 0 or not shape.is_fully_defined():
        return None
    name = kwargs.get("name") or "Variable"
    spec = partitioner(shape, dtype)
    num_shards = partitioners_lib.validate_partition_spec(spec, shape, name)
    if num_shards <= 1:
        return None
    if init_fn is None:
        part_value = lambda start, stop: initial_value[start:stop]  # noqa: E731
    else:
        part_value = _PartValues(init_fn, shape, dtype)
    shards = []
    for i, (start, stop) in enumerate(
            partitioners_lib.shard_row_ranges(int(shape[0]), num_shards)):
        shard_kwargs = dict(kwargs)
        shard_kwargs["initial_value"] = part_value(start, stop)
        shard_kwargs["shape"] = None
        shard_kwargs["name"] = f"{name}/part_{i}"
        shards.append(extended._create_shard(next_creator, shard_kwargs))
    logger.info("[chief] %s %s split into %d shards", name, tuple(shape), num_shards)
    return ShardedVariable(shards, name=name)


def _uninitialized_sharded(extended, next_creator, partitioner, kwargs):
    """Shards without values (as `tf.saved_model.load` asks for), or None
    when the variable is not split or its shape is unknown."""
    shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
    if shape is None or dtype is None:
        return None
    shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
    if shape.rank in (None, 0) or not shape.is_fully_defined():
        return None
    name = kwargs.get("name") or "Variable"
    num_shards = partitioners_lib.validate_partition_spec(
        partitioner(shape, dtype), shape, name)
    if num_shards <= 1:
        return None
    shards = []
    for i, (start, stop) in enumerate(
            partitioners_lib.shard_row_ranges(int(shape[0]), num_shards)):
        shards.append(extended._create_shard(next_creator, dict(
            kwargs, shape=[stop - start] + shape[1:].as_list(),
            name=f"{name}/part_{i}")))
    logger.info("[chief] %s %s made as %d uninitialised shards", name,
                tuple(shape), num_shards)
    return ShardedVariable(shards, name=name)


class _PartValues:
    """Rows [start, stop) of a callable initial value: asked for that
    partition (`partition_shape`, `partition_offset`, as TF's strategy asks),
    or sliced from the whole value, computed once, when the callable does
    not take them."""

    def __init__(self, init_fn, shape, dtype):
        self._init_fn, self._shape, self._dtype = init_fn, shape, dtype
        self._full = None

    def __call__(self, start, stop):
        if self._full is None:
            part_shape = tf.TensorShape([stop - start]).concatenate(
                self._shape[1:])
            offset = [start] + [0] * (self._shape.rank - 1)
            try:
                value = self._init_fn(partition_shape=part_shape.as_list(),
                                      partition_offset=offset)
            except (TypeError, ValueError):  # not partition-aware
                value = self._init_fn()
            value = tf.convert_to_tensor(value, dtype=self._dtype)
            if value.shape == part_shape and part_shape != self._shape:
                return value
            self._full = value
        return self._full[start:stop]
