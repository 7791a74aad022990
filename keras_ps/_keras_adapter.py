"""Every use of Keras internals (`keras.src...`) in keras_ps.

Keras 3.15 has no public extension points for these; each hook below says which
one is missing. Hooks are installed once, by `install()` (called when keras_ps
is imported), and each one leaves models that are not built under a keras_ps
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


def _install_sharding_hooks():
    pass
