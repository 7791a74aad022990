"""Model.fit / evaluate / predict of a keras_ps model go to keras_ps' loop.

Missing public API: Keras 3's `Model.fit` has no way to plug in a different
loop for a distribution strategy: it always runs `train_function` in a
synchronous for-loop, and a parameter-server step must be scheduled
asynchronously on the workers. We wrap the TF backend trainer's
fit/evaluate/predict: a model the caller's predicate accepts goes to the
handlers keras_ps.training registers; every other model to Keras' own method.
"""

import functools

from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_ps._keras import compat
from keras_ps import _keras as hooks

TRAINER_CLASS = tf_trainer.TensorFlowTrainer
TRAINER_METHODS = ("fit", "evaluate", "predict")
# Keras' `fit` passes this private flag to `evaluate` for validation data.
KERAS_PRIVATE_EVALUATE_ARGS = ("_use_cached_eval_dataset",)


def install(is_routed, handlers):
    """Sends `model.<name>(...)` to `handlers[name](model, ...)` for every
    model with `is_routed(model)`.

    Args:
        is_routed: `model -> bool`.
        handlers: {"fit": fn, "evaluate": fn, "predict": fn}.
    """
    for name in TRAINER_METHODS:
        handler = handlers[name]

        def make_wrapper(keras_method, handler=handler):
            @functools.wraps(keras_method)
            def method(self, *args, **kwargs):
                if not is_routed(self):
                    return keras_method(self, *args, **kwargs)
                return handler(self, *args, **kwargs)
            return method

        hooks.wrap(TRAINER_CLASS, name, make_wrapper)


def original_trainer_method(name):
    """Keras' own fit/evaluate/predict (for the plain path and for tests)."""
    return hooks.original(TRAINER_CLASS, name)


def symbolic_build(model, strategy, element_spec):
    """Builds the model, its compiled metrics and loss, and its optimizer from
    the input's element spec, on the coordinator under `strategy.scope()`, so
    every variable exists on the ps before a step is traced on a worker.

    Missing public API: Keras builds these lazily inside the first traced
    step (`Trainer._symbolic_build`), which would create variables inside a
    function running on a worker.
    """
    compat.place_model_state(model, strategy)
    compat.build_eagerly(model, strategy, element_spec)
    with strategy.scope():
        model._symbolic_build(data_batch=element_spec)


def take_initial_epoch(model):
    """The epoch Keras' own `keras.callbacks.BackupAndRestore` restored, or None.

    Missing public API: Keras' callback tells `fit` where to resume by setting
    the model's private `_initial_epoch` in `on_train_begin` (Keras' loop reads
    `self._initial_epoch or initial_epoch`). Read once, then cleared, so a
    later `fit` of the same model starts where its caller says.
    """
    epoch = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None
    return epoch
