"""Every use of Keras internals (`keras.src...`) in keras_ps.

Keras 3.15 has no public extension points for these; each hook below says which
one is missing. Hooks are installed once, by `install()` (called when
keras_ps.strategy is imported, and when a public keras_ps name is first used:
see keras_ps/__init__.py), and each one leaves models that are not built under a keras_ps
strategy exactly as plain Keras handles them. tests/test_keras_adapter.py pins
every internal used here, so a Keras upgrade that moves one fails loudly there.
Supported range: see setup.cfg.
"""

import functools
import threading

import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_ps._keras import optimizers as _keras_optimizers

_installed = False
_install_lock = threading.Lock()


def install():
    """Installs every hook, once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _install_training_hooks()
        _install_atomic_updates()
        _install_sharding_hooks()
        _keras_optimizers.install()
        _installed = True


# -- Section: training loop (Model.fit / evaluate / predict) ------------------
# Missing public API: Keras 3's `Model.fit` has no way to plug in a different
# loop for a distribution strategy (it always runs `train_function` in a
# synchronous for-loop, see DESIGN.md fact 5). We wrap the TF backend trainer's
# fit/evaluate/predict: a model whose `distribute_strategy` is a keras_ps
# strategy goes to keras_ps.training; every other model to Keras' own method.
TRAINER_CLASS = tf_trainer.TensorFlowTrainer
TRAINER_METHODS = ("fit", "evaluate", "predict")


def _is_keras_ps_model(model):
    from keras_ps.strategy import ParameterServerStrategy

    return isinstance(getattr(model, "distribute_strategy", None),
                      ParameterServerStrategy)


def _route_to_keras_ps(method_name, keras_method):
    @functools.wraps(keras_method)
    def method(self, *args, **kwargs):
        if not _is_keras_ps_model(self):
            return keras_method(self, *args, **kwargs)
        from keras_ps import training

        return getattr(training, method_name)(self, *args, **kwargs)

    method.__keras_ps_original__ = keras_method
    return method


def _install_training_hooks():
    for name in TRAINER_METHODS:
        keras_method = getattr(TRAINER_CLASS, name)
        setattr(TRAINER_CLASS, name, _route_to_keras_ps(name, keras_method))


def symbolic_build(model, strategy, element_spec):
    """Builds the model, its compiled metrics and loss, and its optimizer from
    the input's element spec, on the coordinator under `strategy.scope()`, so
    every variable exists on the ps before a step is traced on a worker.

    Missing public API: Keras builds these lazily inside the first traced
    step (`Trainer._symbolic_build`), which would create variables inside a
    function running on a worker.
    """
    with strategy.scope():
        model._symbolic_build(data_batch=element_spec)


def original_trainer_method(name):
    """Keras' own fit/evaluate/predict (for the plain path and for tests)."""
    method = getattr(TRAINER_CLASS, name)
    return getattr(method, "__keras_ps_original__", method)


# -- Section: atomic updates of variables on the parameter servers ------------
# Missing public API: Keras 3 implements `Variable.assign_add`/`assign_sub` as
# `assign(self + value)`, a read followed by a write. With several workers
# updating one ps variable at once (metrics, `optimizer.iterations`, the
# optimizer's own updates) that loses updates: checked, 3 epochs of 20 steps
# on 2 workers ended with `iterations == 55`. TF's resource variables have an
# atomic `assign_add` that runs on the ps under the variable's lock; for
# variables that live on a ps we use it. Inside a `keras.StatelessScope` and
# for every other variable, Keras' own method runs unchanged.
VARIABLE_CLASS = tf_core.Variable
ATOMIC_METHODS = ("assign_add", "assign_sub")


def _on_parameter_server(variable):
    inner = getattr(variable, "_value", None)
    return isinstance(inner, tf.Variable) and "/job:ps/" in (inner.device or "")


def _atomic_update(name, keras_method):
    @functools.wraps(keras_method)
    def method(self, value):
        if in_stateless_scope() or not _on_parameter_server(self):
            return keras_method(self, value)
        inner = self._value
        value = tf.cast(self._convert_to_tensor(value), inner.dtype)
        return getattr(inner, name)(value)

    method.__keras_ps_original__ = keras_method
    return method


def _install_atomic_updates():
    for name in ATOMIC_METHODS:
        keras_method = getattr(VARIABLE_CLASS, name)
        setattr(VARIABLE_CLASS, name, _atomic_update(name, keras_method))


# -- Section: sharded layer weights ---------------------------------------------
# (issue 3: variable_partitioner for Keras 3 layers)

# Which weights are split: every `Layer.add_weight` call made while a keras_ps
# strategy with a `variable_partitioner` is current (its scope), like TF's own
# strategy splits every variable. The logic lives in keras_ps._sharded_weights
# (public Keras API only); these hooks connect it to Keras.
from keras.src.backend.tensorflow import numpy as tf_numpy  # noqa: E402
from keras.src.backend.tensorflow import optimizer as tf_optimizer  # noqa: E402
from keras.src.layers import layer as layer_lib  # noqa: E402
from keras.src.saving import saving_lib  # noqa: E402

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
)
# Lists that Keras' saving code reads as "this object's variables, in order".
LAYER_STATE_LISTS = ("_trainable_variables", "_non_trainable_variables")
OPTIMIZER_STATE_LISTS = ("_variables",)
_ADD_WEIGHT_POSITIONAL = ("shape", "initializer", "dtype")


def _current_partitioner():
    """(partitioner, device for initializers) of the current keras_ps strategy."""
    from keras_ps.strategy import ParameterServerStrategy

    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, ParameterServerStrategy):
        return None, None
    if strategy.variable_partitioner is None:
        return None, None
    return strategy.variable_partitioner, strategy.extended.parameter_devices[0]


# Missing public API: Keras 3 has no variable partitioning and no hook on
# weight creation (tf_keras had `partitioner=` on add_weight). We wrap
# `Layer.add_weight`: under a partitioner it adds one weight per shard and
# returns the container the layer then reads through.
def _sharded_add_weight(keras_add_weight):
    @functools.wraps(keras_add_weight)
    def add_weight(self, *args, **kwargs):
        partitioner, device = _current_partitioner()
        clash = any(k in kwargs for k in _ADD_WEIGHT_POSITIONAL[:len(args)])
        if (partitioner is None or len(args) > 3 or clash
                or (args and isinstance(args[0], str))):
            return keras_add_weight(self, *args, **kwargs)  # Keras' own errors
        kwargs.update(zip(_ADD_WEIGHT_POSITIONAL, args))
        from keras_ps import _sharded_weights

        return _sharded_weights.add_sharded_weight(
            self, functools.partial(keras_add_weight, self), partitioner,
            device, **kwargs)

    add_weight.__keras_ps_original__ = keras_add_weight
    return add_weight


# Missing public API: no way to tell a tf.distribute strategy "this
# tf.Variable is the storage of one keras.Variable, do not split it". The TF
# backend's `Variable._initialize` creates that tf.Variable; we create it with
# partitioning off (weights, metrics and optimizer slots alike).
def _unpartitioned_initialize(keras_initialize):
    @functools.wraps(keras_initialize)
    def _initialize(self, value):
        from keras_ps import sharded_variable

        with sharded_variable.no_partitioning():
            return keras_initialize(self, value)

    _initialize.__keras_ps_original__ = keras_initialize
    return _initialize


# Missing public API: `ops.take` has no dispatch for variable types other than
# Keras'; the TF backend's `take` converts `x` to one tensor first (for a
# sharded table: a full concatenation). We wrap the backend function (looked
# up on the module at each call) so a sharded table gathers rows per shard,
# and any table on a ps (sharded or not) sends each distinct row once.
def _sharded_take(keras_take):
    @functools.wraps(keras_take)
    def take(x, indices, axis=None):
        from keras_ps import _sharded_weights
        from keras_ps.sharded_variable import ShardedVariable

        # A table on a ps (sharded or not) reads each distinct row once.
        table = x if isinstance(x, ShardedVariable) else _sharded_weights.ps_table(x)
        if (table is not None and axis is not None
                and axis in (0, -len(x.shape))
                and not isinstance(indices, (tf.SparseTensor, tf.RaggedTensor))):
            return _sharded_weights.take_rows(table, indices)
        return keras_take(x, indices, axis=axis)

    take.__keras_ps_original__ = keras_take
    return take


# Missing public API: Keras' saving format counts a layer's (an optimizer's)
# variables one by one (`save_own_variables`, `load_own_variables`,
# `_check_load_own_variables`); there is no way to store several variables as
# one weight. We wrap the saving walk (`saving_lib._save_state` /
# `_load_state`, called once per saveable object): while an object saves or
# loads, its variable lists show each sharded weight as its container, which
# reads and assigns the full tensor.
def _collapsed_state(keras_walk):
    @functools.wraps(keras_walk)
    def walk(saveable, *args, **kwargs):
        from keras_ps import _sharded_weights

        if isinstance(saveable, LAYER_CLASS):
            names = LAYER_STATE_LISTS
        elif isinstance(saveable, OPTIMIZER_CLASS):
            names = OPTIMIZER_STATE_LISTS
        else:
            return keras_walk(saveable, *args, **kwargs)
        with _sharded_weights.collapsed_attributes(saveable, names):
            return keras_walk(saveable, *args, **kwargs)

    walk.__keras_ps_original__ = keras_walk
    return walk


# Missing public API: Keras optimizers do not report which slot belongs to
# which variable. We wrap the TF optimizer's `add_variable_from_reference`
# (every built-in optimizer makes its slots there) to group a shard's slots,
# so saving writes one full slot per sharded weight.
def _grouping_add_slot(keras_add_slot):
    @functools.wraps(keras_add_slot)
    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        from keras_ps import _sharded_weights

        slot = keras_add_slot(self, reference_variable, name=name,
                              initializer=initializer)
        _sharded_weights.group_slot(slot, reference_variable, name or "var")
        return slot

    add_variable_from_reference.__keras_ps_original__ = keras_add_slot
    return add_variable_from_reference


# Missing public API: a Keras 3 optimizer is the path through which
# tf.train.Checkpoint reaches model weights and slots (its variable lists are
# checkpoint dependencies, e.g. `optimizer/_trainable_variables/0`). We wrap
# its `_trackable_children` so every list holding shards appears with one
# full-tensor entry per sharded weight: the same keys as a plain model.
def _collapsed_children(keras_children):
    @functools.wraps(keras_children)
    def _trackable_children(self, save_type="checkpoint", **kwargs):
        from keras_ps import _sharded_weights

        children = keras_children(self, save_type, **kwargs)
        if save_type != "checkpoint":
            return children
        return _sharded_weights.collapse_children(children)

    _trackable_children.__keras_ps_original__ = keras_children
    return _trackable_children


_SHARDING_WRAPPERS = (
    _sharded_add_weight, _unpartitioned_initialize, _sharded_take,
    _collapsed_state, _collapsed_state, _grouping_add_slot, _collapsed_children,
)


def _install_sharding_hooks():
    for (owner, name), wrap in zip(SHARDING_TARGETS, _SHARDING_WRAPPERS):
        setattr(owner, name, wrap(getattr(owner, name)))


def original_sharding_target(owner, name):
    """Keras' own function behind a sharding hook (for the plain path and tests)."""
    function = getattr(owner, name)
    return getattr(function, "__keras_ps_original__", function)
