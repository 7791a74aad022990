"""Keras weights files of weights on the ps, streamed a block of rows at a time.

Missing public API: Keras' saving has no way for a variable to write or read
itself in parts. `H5IOStore.__setitem__` converts each weight to one numpy
array, `__getitem__` reads each dataset back whole, the optimizer saves
`variable.numpy()`, and `model.save` builds the whole h5 file in memory
(`io.BytesIO`, then `ZipFile.writestr`) unless `is_memory_sufficient(model)`
says no. For a 10M x 64 table with Adam slots (7.2 GB on the ps) that put
10.6 GB on the coordinator for `save_weights`, and `model.save` was killed
for memory. The hooks below, for weights on the ps only:

- `H5IOStore.__setitem__`: a sharded weight (or a weight on a ps larger than
  a block) is written by `keras_ps.tables._row_chunks.write_dataset`, one full
  dataset filled a block of rows at a time;
- `H5IOStore.__getitem__`: while an object whose weights live on the ps
  loads, a dataset larger than a block comes back as `DatasetRows`, which
  `ShardedVariable.assign` and (for a table on one ps) `Variable.assign`
  read a block of rows at a time;
- the optimizer's `save_own_variables` hands the store the variable, not
  `variable.numpy()`;
- `is_memory_sufficient` is False for a model with weights on the ps, so
  Keras itself writes the h5 of a `.keras` to a temporary file next to the
  destination and adds it with `ZipFile.write` (streamed; zip64 when large),
  and `load_model` extracts it to a temporary directory instead of reading
  it into memory.

Files keep Keras' layout (one full dataset per weight): plain Keras loads
them. Sharded weights files (`max_shard_size`) keep Keras' whole-array path.
"""

import functools

from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.optimizers import base_optimizer
from keras.src.saving import saving_lib

from keras_ps.tables import _row_chunks
from keras_ps.tables import _sharded_weights
from keras_ps.tables import sharded_variable
from keras_ps import _keras as hooks

STORE_CLASS = saving_lib.H5IOStore
SAVING_MODULE = saving_lib
OPTIMIZER_CLASS = base_optimizer.BaseOptimizer
VARIABLE_CLASS = tf_core.Variable
# (owner, attribute) of every Keras internal this module wraps.
SAVING_TARGETS = (
    (STORE_CLASS, "__setitem__"),
    (STORE_CLASS, "__getitem__"),
    (OPTIMIZER_CLASS, "save_own_variables"),
    (SAVING_MODULE, "is_memory_sufficient"),
    (VARIABLE_CLASS, "assign"),
)


def _ps_variables(value):
    """The tf.Variables holding `value` if it is a weight on the ps to stream
    (a sharded weight: its shards; a Keras weight on one ps larger than a
    block: its variable), else None."""
    if isinstance(value, sharded_variable.ShardedVariable):
        return value.variables
    table = _sharded_weights.ps_table(value)
    if (table is not None and table.shape.rank and table.shape.is_fully_defined()
            and table.shape.num_elements() * table.dtype.size
            > _row_chunks.chunk_bytes()):
        return [table]
    return None


def _streamed_setitem(keras_setitem):
    @functools.wraps(keras_setitem)
    def __setitem__(self, key, value):
        variables = _ps_variables(value)
        if variables is None or self.mode not in ("w", "a") or \
                variables[0].dtype.name == "bfloat16":
            return keras_setitem(self, key, value)
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        _row_chunks.write_dataset(self._h5_entry_group, key, variables)

    return __setitem__


def _rows_getitem(keras_getitem):
    @functools.wraps(keras_getitem)
    def __getitem__(self, key):
        if not _row_chunks.rows_wanted():
            return keras_getitem(self, key)
        dataset = saving_lib.safe_get_h5_dataset(self._h5_entry_group, key)
        if ("dtype" in dataset.attrs or not dataset.shape
                or dataset.size * dataset.dtype.itemsize
                <= _row_chunks.chunk_bytes()):
            return keras_getitem(self, key)
        return _row_chunks.DatasetRows(dataset)

    return __getitem__


def _variables_saved_by_reference(keras_save):
    @functools.wraps(keras_save)
    def save_own_variables(self, store):
        variables = self.variables
        if not any(_ps_variables(v) is not None for v in variables):
            return keras_save(self, store)
        for i, variable in enumerate(variables):
            store[str(i)] = (variable if _ps_variables(variable) is not None
                             else variable.numpy())

    return save_own_variables


def _on_ps(model):
    return any(isinstance(v, sharded_variable.ShardedVariable)
               or _sharded_weights.ps_table(v) is not None
               for v in model.variables)


def _streamed_archive(keras_is_memory_sufficient):
    @functools.wraps(keras_is_memory_sufficient)
    def is_memory_sufficient(model):
        # The weights are on the ps: whatever this process has free, they
        # would all come here. Keras then streams through a file.
        if _on_ps(model):
            return False
        return keras_is_memory_sufficient(model)

    return is_memory_sufficient


def _rows_assign(keras_assign):
    @functools.wraps(keras_assign)
    def assign(self, value):
        table = _sharded_weights.ps_table(self)
        if (not isinstance(value, _row_chunks.DatasetRows) or table is None
                or in_stateless_scope()):
            return keras_assign(self, value)
        _row_chunks.assign_by_rows(self, [table], value)
        return value

    return assign


_SAVING_WRAPPERS = (_streamed_setitem, _rows_getitem,
                    _variables_saved_by_reference, _streamed_archive,
                    _rows_assign)


def reads_by_rows(variables):
    """A context in which a weights file hands large datasets out as
    `DatasetRows` if any of `variables` (an object's state, shards
    collapsed) lives on the ps."""
    return _row_chunks.rows_for_reads(any(
        isinstance(v, sharded_variable.ShardedVariable)
        or _sharded_weights.ps_table(v) is not None for v in variables))


def install():
    for (owner, name), wrap in zip(SAVING_TARGETS, _SAVING_WRAPPERS):
        hooks.wrap(owner, name, wrap)
