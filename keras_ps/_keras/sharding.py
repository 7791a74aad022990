"""Sharded layer weights: creation, lookup and saving.

Which weights are split: every `Layer.add_weight` call made while the
current strategy has a `variable_partitioner` (its scope), as TF's own
strategy splits every variable. The logic lives in keras_ps.tables._sharded_weights
(public Keras API only); the hooks below connect it to Keras. Which strategy
is current, and its partitioner, is told by the function the strategy passes
to `install` (this module sits below the strategy and does not import it).
"""

import contextlib
import functools

import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import numpy as tf_numpy
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.layers import layer as layer_lib
from keras.src.saving import saving_lib

from keras_ps.tables import _sharded_weights
from keras_ps.tables import _slot_restore
from keras_ps.tables import partitioners
from keras_ps.tables import sharded_variable
from keras_ps import _keras as hooks
from keras_ps._keras import compat
from keras_ps._keras import saving

LAYER_CLASS = layer_lib.Layer
OPTIMIZER_CLASS = tf_optimizer.TFOptimizer
TF_NUMPY_MODULE = tf_numpy
SAVING_MODULE = saving_lib
# (owner, attribute) of every Keras internal this section wraps.
SHARDING_TARGETS = (
    (LAYER_CLASS, "add_weight"),
    (tf_core.Variable, "_initialize"),
    (TF_NUMPY_MODULE, "take"),
    (SAVING_MODULE, "_save_state"),
    (SAVING_MODULE, "_load_state"),
    (OPTIMIZER_CLASS, "add_variable_from_reference"),
    (OPTIMIZER_CLASS, "_trackable_children"),
    (OPTIMIZER_CLASS, "_track_variable"),
)
# Lists that Keras' saving code reads as "this object's variables, in order".
LAYER_STATE_LISTS = ("_trainable_variables", "_non_trainable_variables")
OPTIMIZER_STATE_LISTS = ("_variables",)
_ADD_WEIGHT_POSITIONAL = ("shape", "initializer", "dtype")
# Keras' global attribute holding the current `keras.StatelessScope`.
STATELESS_SCOPE_ATTRIBUTE = "stateless_scope"


# Missing public API: Keras 3 has no variable partitioning and no hook on
# weight creation (tf_keras had `partitioner=` on add_weight). We wrap
# `Layer.add_weight`: under a partitioner it adds one weight per shard and
# returns the container the layer then reads through.
def _sharded_add_weight(keras_add_weight):
    @functools.wraps(keras_add_weight)
    def add_weight(self, *args, **kwargs):
        partitioner, device = _partitioner_source()
        clash = any(k in kwargs for k in _ADD_WEIGHT_POSITIONAL[:len(args)])
        if (partitioner is None or len(args) > 3 or clash
                or (args and isinstance(args[0], str))):
            return keras_add_weight(self, *args, **kwargs)  # Keras' own errors
        kwargs.update(zip(_ADD_WEIGHT_POSITIONAL, args))
        return _sharded_weights.add_sharded_weight(
            self, functools.partial(keras_add_weight, self), partitioner,
            device, eager_scope=_outside_stateless_scope, **kwargs)

    return add_weight


# Missing public API: Keras builds a layer or model without a `build()` of
# its own by tracing its `call` in `backend.compute_output_spec`, inside a
# `keras.StatelessScope`; there `add_weight` makes a variable without its
# tf.Variable and creates that when the outermost scope ends. The shards of
# a sharded weight must have their tf.Variables at once (the container the
# layer reads through is made of them), and Keras has no way to step out of
# a stateless scope. So the shards are made with no stateless scope current
# and eagerly (`tf.init_scope`): the layer's real weights, as the deferred
# ones would have been at the end of the scope.
@contextlib.contextmanager
def _outside_stateless_scope():
    scope = global_state.get_global_attribute(STATELESS_SCOPE_ATTRIBUTE)
    global_state.set_global_attribute(STATELESS_SCOPE_ATTRIBUTE, None)
    try:
        with tf.init_scope():
            yield
    finally:
        global_state.set_global_attribute(STATELESS_SCOPE_ATTRIBUTE, scope)


# Missing public API: no way to tell a tf.distribute strategy "this
# tf.Variable is the storage of one keras.Variable, do not split it". The TF
# backend's `Variable._initialize` creates that tf.Variable; we create it with
# partitioning off (weights, metrics and optimizer slots alike).
def _unpartitioned_initialize(keras_initialize):
    @functools.wraps(keras_initialize)
    def _initialize(self, value):
        with partitioners.no_partitioning():
            return keras_initialize(self, value)

    return _initialize


# Missing public API: `ops.take` has no dispatch for variable types other than
# Keras'; the TF backend's `take` converts `x` to one tensor first (for a
# sharded table: a full concatenation). We wrap the backend function (looked
# up on the module at each call) so a sharded table gathers rows per shard,
# and any table on a ps (sharded or not) sends each distinct row once.
def _sharded_take(keras_take):
    @functools.wraps(keras_take)
    def take(x, indices, axis=None):
        # A table on a ps (sharded or not) reads each distinct row once.
        table = x if isinstance(x, sharded_variable.ShardedVariable) \
            else _sharded_weights.ps_table(x)
        if (table is not None and axis is not None
                and axis in (0, -len(x.shape))
                and not isinstance(indices, (tf.SparseTensor, tf.RaggedTensor))):
            return _sharded_weights.take_rows(table, indices)
        return keras_take(x, indices, axis=axis)

    return take


# Missing public API: Keras' saving format counts a layer's (an optimizer's)
# variables one by one (`save_own_variables`, `load_own_variables`,
# `_check_load_own_variables`); there is no way to store several variables as
# one weight. We wrap the saving walk (`saving_lib._save_state` /
# `_load_state`, called once per saveable object): while an object saves or
# loads, its variable lists show each sharded weight as its container, which
# is written and read a block of rows at a time (keras_ps._keras.saving).
def _collapsed_state(keras_walk):
    @functools.wraps(keras_walk)
    def walk(saveable, *args, **kwargs):
        if isinstance(saveable, LAYER_CLASS):
            names = LAYER_STATE_LISTS
        elif isinstance(saveable, OPTIMIZER_CLASS):
            names = OPTIMIZER_STATE_LISTS
        else:
            return keras_walk(saveable, *args, **kwargs)
        with _sharded_weights.collapsed_attributes(saveable, names), \
                saving.reads_by_rows([v for name in names for v in
                                      saveable.__dict__.get(name) or ()]):
            return keras_walk(saveable, *args, **kwargs)

    return walk


# Missing public API: Keras optimizers do not report which slot belongs to
# which variable. We wrap the TF optimizer's `add_variable_from_reference`
# (every built-in optimizer makes its slots there) to group a shard's slots,
# so saving writes one full slot per sharded weight, and a checkpoint restored
# before the optimizer was built fills them (`add_grouped_slot`). An
# optimizer made outside the strategy's scope and built under it, or made
# under it and built outside it, is refused here, before its slot (see
# keras_ps._keras.compat).
def _grouping_add_slot(keras_add_slot):
    @functools.wraps(keras_add_slot)
    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        compat.refuse_optimizer_made_outside(self, [reference_variable],
                                             scope_only=True)
        compat.refuse_slot_outside_scope(self, reference_variable)
        return _slot_restore.add_grouped_slot(
            self._variables, reference_variable, name or "var",
            lambda: keras_add_slot(self, reference_variable, name=name,
                                   initializer=initializer))

    return add_variable_from_reference


# Missing public API: Keras has no hook on an optimizer adding a variable.
# TF restores a variable made after `tf.train.Checkpoint.restore` by its
# index in the optimizer's variable list (`_track_variable` appends every
# one), where a checkpoint counts each sharded weight's slot once. We wrap
# `_track_variable` so that, once the list holds shards, a variable added
# later (a slot of an unsharded weight) is restored by the checkpoint's index.
def _restoring_track_variable(keras_track_variable):
    @functools.wraps(keras_track_variable)
    def _track_variable(self, variable):
        with _slot_restore.restores_by_collapsed_index(
                getattr(self, "_variables", None)):
            return keras_track_variable(self, variable)

    return _track_variable


# Missing public API: a Keras 3 optimizer is the path through which
# tf.train.Checkpoint reaches model weights and slots (its variable lists are
# checkpoint dependencies, e.g. `optimizer/_trainable_variables/0`). We wrap
# its `_trackable_children` so every list holding shards appears with one
# full-tensor entry per sharded weight: the same keys as a plain model.
def _collapsed_children(keras_children):
    @functools.wraps(keras_children)
    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = keras_children(self, save_type, **kwargs)
        if save_type != "checkpoint":
            return children
        return _sharded_weights.collapse_children(children)

    return _trackable_children


_SHARDING_WRAPPERS = (
    _sharded_add_weight, _unpartitioned_initialize, _sharded_take,
    _collapsed_state, _collapsed_state, _grouping_add_slot, _collapsed_children,
    _restoring_track_variable,
)


def _no_partitioner():
    return None, None


_partitioner_source = _no_partitioner


def install(partitioner_source):
    """Installs the sharding hooks, once.

    Args:
        partitioner_source: `() -> (partitioner, init_device)` of the current
            strategy, `(None, None)` when no keras_ps strategy with a
            partitioner is current.
    """
    global _partitioner_source
    _partitioner_source = partitioner_source
    for (owner, name), wrap in zip(SHARDING_TARGETS, _SHARDING_WRAPPERS):
        hooks.wrap(owner, name, wrap)
    saving.install()
