"""ShardedVariable: one logical variable split by rows over the ps tasks.

Created by `ParameterServerStrategy` when its `variable_partitioner` asks for
more than one shard. Shards are ordinary variables, so gradients, optimizer
slots and updates work on each shard where it lives. A checkpoint holds the
whole variable as one tensor, so it restores into any number of shards or
into a plain variable. So does a SavedModel, as TF's own sharded variable's:
there it is one variable of the full shape, which loads as a plain variable,
or, under a strategy with a `variable_partitioner`, as a ShardedVariable.
"""

import logging

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.tables import _grouped_transfers
from keras_ps.tables import _row_chunks
from keras_ps.tables import _rowwise
from keras_ps.tables import _saved_model
from keras_ps.tables import _slicing


logger = logging.getLogger(__name__)


# Variables larger than this are checkpointed as one slice per shard, each
# written by its own ps (the checkpoint directory must then be writable by
# every ps at the same path, as with TF's ParameterServerStrategy); smaller
# ones as one tensor written by the coordinator.
SLICED_SAVE_MIN_BYTES = 256 * 2**20


class ShardedVariableSpec(tf.TypeSpec):
    """The `tf.TypeSpec` of a ShardedVariable: one `VariableSpec` per shard.

    A ShardedVariable passed to a `tf.function` becomes its shards' handles
    (like a `tf.Variable` argument), so calls with the same shard shapes and
    dtypes reuse one trace.
    """

    __slots__ = ("_variable_specs",)

    value_type = property(lambda self: ShardedVariable)

    def __init__(self, *variable_specs):
        self._variable_specs = tuple(variable_specs)

    def _serialize(self):
        return self._variable_specs

    @property
    def _component_specs(self):
        return self._variable_specs

    def _to_components(self, value):
        return tuple(value.variables)

    def _from_components(self, variables):
        return ShardedVariable(list(variables))

    def _cast(self, value, _):
        return value


def _check_shards(variables):
    """`variables` as a list of tf.Variables, or a Keras-style error."""
    received = variables
    if isinstance(variables, tf.Variable) or not isinstance(
            variables, (list, tuple)):
        raise TypeError(
            "ShardedVariable needs a list of tf.Variable shards (in row "
            f"order). Received: variables={received!r}. Pass e.g. "
            "ShardedVariable([tf.Variable(...), tf.Variable(...)]).")
    variables = list(variables)
    if not variables:
        raise ValueError(
            "ShardedVariable needs at least one shard. Received: "
            "variables=[]. Pass a non-empty list of tf.Variables.")
    wrong = [v for v in variables if not isinstance(v, tf.Variable)]
    if wrong:
        raise TypeError(
            "Every shard of a ShardedVariable must be a tf.Variable. "
            f"Received: an element of type {type(wrong[0]).__name__} "
            f"({wrong[0]!r:.100}). Create each shard with tf.Variable(...).")
    if any(v.shape.rank in (None, 0) or not v.shape.is_fully_defined()
           for v in variables):
        raise ValueError(
            "Shards must have a known shape of rank 1 or more. Received: "
            f"shapes {[v.shape for v in variables]}. Shard a variable with "
            "rows (axis 0); keep scalars as plain tf.Variables.")
    rest = variables[0].shape[1:]
    for v in variables:
        if v.shape[1:] != rest or v.dtype != variables[0].dtype:
            raise ValueError(
                "Shards must agree on dtype and on every axis but the first. "
                f"Received: shapes {[tuple(x.shape) for x in variables]}, "
                f"dtypes {[x.dtype.name for x in variables]}. Split one "
                "variable along axis 0 only.")
    return variables


class ShardedVariable(tf.__internal__.CompositeTensor,
                      tf.__internal__.tracking.Trackable):
    """A variable split on axis 0 into `variables`, each on its own ps.

    Behaves as TF's own sharded variable does: converts to one tensor,
    supports TF's operators, slicing (`v[1:3]`, `v[:, 0]`), `sparse_read`,
    the `scatter_*` methods and `tf.nn.embedding_lookup` (and its sparse
    variants), which read only the requested rows from each shard. A
    `tf.Module` holding one lists its shards in `variables`; as a
    `tf.function` argument it is traced once per shard layout.

    Args:
        variables: the shards (`tf.Variable`s), in row order; equal shapes
            and dtype past axis 0.
        name: the logical variable's name.
    """

    def __init__(self, variables, name=None):
        variables = _check_shards(variables)
        self._variables = variables
        self._name = name or variables[0].name.split("/part_")[0]
        self._row_offsets = [0]
        for v in variables:
            self._row_offsets.append(self._row_offsets[-1] + int(v.shape[0]))
        self._full_variable = None  # made by the first tf.saved_model.save
        if self.nbytes > SLICED_SAVE_MIN_BYTES:
            self.__class__ = _row_chunks.sliced_class(type(self))

    @property
    def variables(self):
        """The shards (each a tf.Variable on its own ps); while
        `tf.saved_model.save` traces, the one full variable the SavedModel
        holds instead (as TF's sharded variable)."""
        return list(self._parts()[0])

    def _parts(self):
        """(variables, row offsets) that reads and updates go through: the
        shards, or while `tf.saved_model.save` traces, one uninitialised
        variable of the full shape (it allocates nothing: the SavedModel's
        values are written from the shards), so the saved functions read
        one variable, which a plain TF process loads."""
        if not (self._saved_as_one_variable
                and _tf_adapter.in_save_context()):
            return self._variables, self._row_offsets
        if self._full_variable is None:
            with tf.init_scope():
                self._full_variable = _tf_adapter.uninitialized_variable(
                    shape=self.shape, dtype=self.dtype, name=self._name,
                    trainable=self.trainable)
        return [self._full_variable], [0, self._row_offsets[-1]]

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

    @property
    def _type_spec(self):
        return ShardedVariableSpec(
            *(tf.type_spec_from_value(v) for v in self._variables))

    def __iter__(self):
        """Iterates over the shards (as TF's ShardedVariable does)."""
        return iter(self._variables)

    def __getitem__(self, slice_spec):
        """`v[...]` as for a tensor, reading only the shards that hold the
        selected rows. Tensor indices are not supported (use
        `embedding_lookup` or `sparse_read`)."""
        return _slicing.slice_sharded(self, slice_spec)

    def sparse_read(self, indices, name=None):
        """Rows `indices` (1-D) of the variable, in the order of `indices`."""
        indices = tf.convert_to_tensor(indices)
        if indices.shape.rank != 1:
            raise ValueError(
                "sparse_read takes 1-D indices. Received: indices with shape "
                f"{indices.shape}. Use embedding_lookup for other shapes.")
        with tf.name_scope(name or "sparse_read"):
            return self.embedding_lookup(indices)

    def read_value(self):
        """The whole variable as one tensor (concatenates every shard)."""
        # Inside a step, from each ps' one transfer (_grouped_transfers).
        return tf.concat([_grouped_transfers.read_value(v)
                          for v in self._parts()[0]], axis=0)

    def value(self):
        return self.read_value()

    def numpy(self):
        return self.read_value().numpy()

    def _split(self, value, variables=None):
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        variables = self._parts()[0] if variables is None else variables
        sizes = [int(v.shape[0]) for v in variables]
        return tf.split(value, sizes, axis=0)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        if isinstance(value, _row_chunks.DatasetRows):  # block by block
            _row_chunks.assign_by_rows(self, self._variables, value)
            return self
        value = _row_chunks.value_to_assign(self, value)
        for v, part in zip(self._parts()[0], self._split(value)):
            v.assign(part)
        return self

    def assign_add(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        for v, part in zip(self._parts()[0], self._split(value)):
            v.assign_add(part)
        return self

    def assign_sub(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        for v, part in zip(self._parts()[0], self._split(value)):
            v.assign_sub(part)
        return self

    def _route(self, ids):
        """For each shard: (positions in `ids`, local row ids) of its rows."""
        ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
        variables, row_offsets = self._parts()
        ids = _slicing.ids_in_range(ids, row_offsets[-1], self._name)
        bounds = tf.constant(row_offsets[1:-1], dtype=tf.int64)
        shard = tf.searchsorted(bounds, ids, side="right")
        offsets = tf.constant(row_offsets[:-1], dtype=tf.int64)
        local = ids - tf.gather(offsets, shard)
        shard32 = tf.cast(shard, tf.int32)
        n = len(variables)
        positions = tf.dynamic_partition(tf.range(tf.size(ids)), shard32, n)
        locals_ = tf.dynamic_partition(local, shard32, n)
        return positions, locals_

    def _scatter(self, method, sparse_delta, name=None):
        if not isinstance(sparse_delta, tf.IndexedSlices):
            raise TypeError(
                f"{method} takes a tf.IndexedSlices. Received: "
                f"sparse_delta of type {type(sparse_delta).__name__}. Pass "
                "tf.IndexedSlices(values, indices).")
        flat_ids = tf.reshape(sparse_delta.indices, [-1])
        values = tf.reshape(sparse_delta.values,
                            tf.concat([[-1], tf.shape(sparse_delta.values)[
                                tf.rank(sparse_delta.indices):]], 0))
        positions, locals_ = self._route(flat_ids)
        for i, (v, pos, rows) in enumerate(
                zip(self._parts()[0], positions, locals_)):
            part_name = None if name is None else f"{name}/part_{i}"
            getattr(v, method)(tf.IndexedSlices(tf.gather(values, pos), rows),
                               name=part_name)
        return self

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_update", sparse_delta, name)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_add", sparse_delta, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_sub", sparse_delta, name)

    def scatter_mul(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_mul", sparse_delta, name)

    def scatter_div(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_div", sparse_delta, name)

    def scatter_min(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_min", sparse_delta, name)

    def scatter_max(self, sparse_delta, use_locking=False, name=None):
        del use_locking
        return self._scatter("scatter_max", sparse_delta, name)

    def batch_scatter_update(self, sparse_delta, use_locking=False, name=None):
        """Row updates, as `scatter_update` (TF's sharded variable does the
        same: its shards split rows only)."""
        del use_locking
        return self._scatter("scatter_update", sparse_delta, name)

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
        for v, rows in zip(self._parts()[0], locals_):
            # Each shard's rows are distinct: its gradient needs no summing.
            _rowwise.mark_distinct(rows)
            parts.append(_grouped_transfers.gather_rows(v, rows))
        gathered = _rowwise.expand(tf.dynamic_stitch(positions, parts), position)
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
        # A Keras weight while tf.saved_model.save traces its save and
        # restore functions: its shards are the SavedModel's variables, so
        # none. A restore function writing the shards would fail inside
        # tf.saved_model.load under a partitioner, which loads them sharded.
        if (not self._saved_as_one_variable
                and _tf_adapter.in_save_context()):
            return {}
        return {"VARIABLE_VALUE": tf.concat(
            [v.read_value() for v in self._variables], axis=0)}

    def _restore_from_tensors(self, restored_tensors):
        if not restored_tensors:
            return tf.no_op()
        value = restored_tensors["VARIABLE_VALUE"]
        # Inside the restore tf.function the shape may be unknown until run.
        if not value.shape.is_compatible_with(self.shape):
            raise ValueError(
                f"Checkpoint value for {self._name!r} has shape "
                f"{tuple(value.shape)}, but the variable has shape "
                f"{tuple(self.shape)}. Restore into a model built the same way.")
        # Ops (not self): a SavedModel traces this into its restore function.
        return tf.group(*[v.assign(part, read_value=False) for v, part in
                          zip(self._variables,
                              self._split(value, self._variables))])

    # -- SavedModel: one variable of the full shape, as TF's own --------------
    # False for Keras weights (ShardedWeight): Keras lists their shards as
    # the model's weights, which `model.export()` tracks and its functions
    # capture, so there the shards are the SavedModel's variables.
    _saved_as_one_variable = True

    # The functions traced for the SavedModel read `_parts()`, the full
    # variable; its node is a variable (so `tf.saved_model.load` gives a
    # plain variable, or a ShardedVariable under a partitioner) and its value
    # is written from the shards under this object's key, as in a checkpoint:
    # the SavedModel holds each row once, never a whole shard twice.
    @property
    def _should_act_as_resource_variable(self):
        """Present only while `tf.saved_model.save` runs, where it makes the
        SavedModel write this object as a variable node; elsewhere
        `hasattr(self, ...)` is False, so TF treats it as a container."""
        if not (self._saved_as_one_variable
                and _tf_adapter.in_save_context()):
            raise AttributeError("_should_act_as_resource_variable")
        return True

    @property
    def _shared_name(self):
        # The name TF's save gives a variable node's checkpoint entry.
        return self._name

    def _write_object_proto(self, proto, options):
        _tf_adapter.write_variable_proto(self._parts()[0][0], proto, options)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type == "savedmodel" and not self._saved_as_one_variable:
            return {f"part_{i}": v for i, v in enumerate(self._variables)}
        return super()._trackable_children(save_type, **kwargs)

    def _export_to_saved_model_graph(self, object_map, tensor_map, options,
                                     **kwargs):
        if not self._saved_as_one_variable:  # the shards hold the values
            object_map[self] = _saved_model.NoValues()
            return []
        full = self._parts()[0][0]
        resources = full._export_to_saved_model_graph(
            object_map, tensor_map, options, **kwargs)
        object_map[self] = _SavedModelCopy([object_map[full]], name=self._name)
        return resources

    @property
    def is_sharded_variable(self):
        """Read by `tf.saved_model.load` when a loaded function captured a
        variable that loads as a ShardedVariable (see
        `__tf_experimental_restore_capture__`)."""
        return True

    def __tf_experimental_restore_capture__(self, concrete_function,
                                            internal_capture):
        # A loaded function traced with one full variable cannot read
        # shards: one that only reads gets a copy of the value at each call;
        # one that writes raises LoadedFunctionError (TF gives None, and
        # its own ValueError, to either).
        return _saved_model.restored_capture(self, concrete_function,
                                             internal_capture)

    def __repr__(self):
        return (f"<ShardedVariable {self._name!r} shape={tuple(self.shape)} "
                f"shards={len(self._variables)}>")


class _SavedModelCopy(ShardedVariable):
    """A ShardedVariable in a SavedModel's graph: its one shard is the full
    variable there, which it reads and restores as is."""

    def _parts(self):
        return self._variables, self._row_offsets


def _to_tensor(var, dtype=None, name=None, as_ref=False):
    del name
    if as_ref:
        raise NotImplementedError(
            "A ShardedVariable cannot be used as a reference (it is several "
            "variables). Received: as_ref=True. Use its shards: "
            "`sharded_variable.variables`.")
    value = var.read_value()
    if dtype is not None and dtype != value.dtype:
        value = tf.cast(value, dtype)
    return value


tf.register_tensor_conversion_function(ShardedVariable, _to_tensor)
