"""Reads of a step's small dense ps weights, one transfer per ps.

Missing public API: Keras 3 reads a weight where a layer uses it (its
conversion to a tensor, `Variable.__tf_tensor__`), one tensor per weight,
and has no hook through which a distribution strategy could fetch several
at once. keras_ps' step functions
open a `keras_ps.tables._grouped_transfers.scope` over the weights that
`step_variables` picks; the hook on that conversion below serves a weight
from its ps' one transfer there, and the hook on `Optimizer.apply` ends the
sharing before any weight is written (a constraint applied after the update
reads the updated weight). Gradients are grouped in
keras_ps._keras.optimizers. Outside such a scope, in a stateless scope and
for other weights, Keras' own read runs, as it does for a weight's Python
operators (`kernel * 2` reads the weight on its own: correct, not grouped).

A second section lets the step functions read the metrics' results once per
function instead of once per step; a third sends a step's metric additions
once per ps.
"""

import contextlib
import functools
import threading

import keras
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.metrics import reduction_metrics
from keras.src.optimizers import base_optimizer
from keras.src.trainers import compile_utils
from keras.src.trainers import trainer as trainer_lib

from keras_ps.tables import _grouped_transfers
from keras_ps.tables import _held_adds
from keras_ps.tables import _sharded_weights
from keras_ps import _keras as hooks
from keras_ps._keras import compat

VARIABLE_CLASS = tf_core.Variable
OPTIMIZER_CLASS = base_optimizer.BaseOptimizer
TRAINER_CLASS = tf_trainer.TensorFlowTrainer
# Layers that read their weight a few rows at a time: never read whole.
ROW_LOOKUP_LAYERS = (keras.layers.Embedding,)
# Optimizers whose updates read the step count (keras_ps.optimizers.LazyAdam
# is one).
ADAM_CLASSES = (keras.optimizers.Adam,)


def _grouped_tensor(keras_tf_tensor):
    @functools.wraps(keras_tf_tensor)
    def __tf_tensor__(self, dtype=None, name=None):
        if not in_stateless_scope():
            grouped = _grouped_transfers.read(self._value)
            if grouped is not None:
                return tf.convert_to_tensor(self._maybe_autocast(grouped),
                                            dtype=dtype, name=name)
        return keras_tf_tensor(self, dtype=dtype, name=name)

    return __tf_tensor__


def _closing_reads(keras_apply):
    @functools.wraps(keras_apply)
    def apply(self, grads, trainable_variables=None):
        # The one hook on `apply` also refuses an optimizer made outside
        # the strategy's scope (keras_ps._keras.compat).
        compat.refuse_optimizer_made_outside(
            self, getattr(self, "_trainable_variables", [])
            if trainable_variables is None else trainable_variables)
        _grouped_transfers.close_reads()
        return keras_apply(self, grads, trainable_variables)

    return apply


# -- Section: the metrics' results read once per scheduled function -------------
# Missing public API: Keras' train_step and test_step end by reading every
# metric's result (`get_metrics_result`), each a read of one or two variables
# on a ps; run `steps_per_execution` times in one function, only the last
# step's logs are returned, but every step's reads still run (TF keeps a
# variable read whose value is used, even by ops whose output nobody uses).
# `metric_results_skipped()` makes Keras' `get_metrics_result` return no
# logs, which the step functions use for every step but the last: they read
# the results once, after the steps.
_skip = threading.local()
TRAINER_BASE_CLASS = trainer_lib.Trainer


def _results_unless_skipped(keras_get_metrics_result):
    @functools.wraps(keras_get_metrics_result)
    def get_metrics_result(self):
        if getattr(_skip, "on", False):
            return {}
        # The step's held additions first (see metric_adds_held).
        _held_adds.flush_adds()
        return keras_get_metrics_result(self)

    return get_metrics_result


@contextlib.contextmanager
def metric_results_skipped():
    """Keras' `get_metrics_result` returns `{}` inside (this thread only)."""
    previous = getattr(_skip, "on", False)
    _skip.on = True
    try:
        yield
    finally:
        _skip.on = previous


def _is_keras_own_step(model, step_name):
    keras_step = getattr(TRAINER_CLASS, step_name, None)
    return (keras_step is not None and
            getattr(getattr(model, step_name), "__func__", None) is keras_step)


def logs_are_metric_results(model, step_name):
    """Whether `model.<step_name>` returns `model.get_metrics_result()`:
    Keras' own train_step or test_step with Keras' own compute_metrics."""
    return (_is_keras_own_step(model, step_name)
            and getattr(model.compute_metrics, "__func__", None)
            is TRAINER_BASE_CLASS.compute_metrics
            and getattr(model.get_metrics_result, "__func__", None)
            is TRAINER_BASE_CLASS.get_metrics_result)


# -- Section: a step's metric additions sent once per ps ---------------------
# Missing public API: Keras' metrics add to their variables one
# `assign_add` at a time (a loss's total and count, each accuracy's), each a
# tensor sent from the worker to the metric's ps. Keras' Sum and Mean (and
# MeanMetricWrapper, the class of every compiled metric given by name such as
# "accuracy", and of the loss trackers) only add in `update_state` and read
# their variables only in `result()`. For those, while Keras' own step runs
# and returns `get_metrics_result()` (so nothing else reads a result in the
# step), the additions are held and sent once per ps
# (keras_ps.tables._held_adds); reading the results
# makes the held ones first. A loop of such steps carries their sums on the
# worker and sends them once, after it (`carried_metric_variables`).
ADDING_UPDATES = (reduction_metrics.Sum.update_state,
                  reduction_metrics.Mean.update_state,
                  reduction_metrics.MeanMetricWrapper.update_state)
METRIC_CONTAINER_CLASSES = (compile_utils.CompileMetrics,)


def _flat_metrics(model):
    """`model`'s metrics, the containers' members in their place."""
    found, pending = [], list(reversed(model.metrics))
    while pending:
        metric = pending.pop()
        if isinstance(metric, METRIC_CONTAINER_CLASSES):
            pending.extend(reversed(metric.metrics))
        else:
            found.append(metric)
    return found


def _adding_metric_variables(model):
    """The tf.Variables of `model`'s metrics whose update only adds, in the
    metrics' order, each once."""
    found = []
    for metric in _flat_metrics(model):
        if getattr(type(metric), "update_state", None) in ADDING_UPDATES:
            for variable in metric.variables:
                inner = getattr(variable, "_value", variable)
                if all(inner is not v for v in found):
                    found.append(inner)
    return found


def _holds_metric_adds(model, step_name):
    return (_grouped_transfers.enabled()
            and logs_are_metric_results(model, step_name))


def metric_adds_held(model, step_name):
    """Holds the metric additions of `model.<step_name>` traced inside (one
    transfer per ps at the end; see the section comment): for Keras' own
    step whose logs are the metrics' results, with grouped transfers on.
    Otherwise a block that changes nothing."""
    if not _holds_metric_adds(model, step_name):
        return contextlib.nullcontext()
    return _held_adds.adds_deferred(
        lambda variable: id(variable) in
        {id(v) for v in _adding_metric_variables(model)})


def carried_metric_variables(model, step_name):
    """The metric variables whose additions `metric_adds_held` holds (on a
    ps, shapes known), in a fixed order: a loop of steps carries their
    sums from one iteration to the next, and adds them once after it
    (keras_ps.training.training). Empty when nothing is held."""
    if not _holds_metric_adds(model, step_name):
        return []
    return [v for v in _adding_metric_variables(model)
            if "/job:ps/" in (v.device or "") and v.shape.is_fully_defined()]


def install():
    hooks.wrap(VARIABLE_CLASS, "__tf_tensor__", _grouped_tensor)
    hooks.wrap(OPTIMIZER_CLASS, "apply", _closing_reads)
    hooks.wrap(TRAINER_BASE_CLASS, "get_metrics_result", _results_unless_skipped)


def steps_in_a_loop(model):
    """Whether a layer of `model` needs a function's steps in a
    tf.while_loop, not written out (`keras_ps_steps_in_a_loop`)."""
    return any(getattr(layer, "keras_ps_steps_in_a_loop", False)
               for layer in model._flatten_layers())


def step_variables(model, step_name):
    """The tf.Variables whose reads `model.<step_name>` groups: its trainable
    weights on a ps of at most GROUPED_TRANSFER_MAX_ELEMENTS elements, but
    not the tables of row-lookup layers, nor weights their layer saves
    itself (a dynamic table's); in a train_step, also the optimizer's
    learning rate when it is such a variable. Empty for a `train_step`
    other than Keras' own (a subclass' or one set on the model): its tape
    might start after a first read, and a read outside the tape would get
    no gradient."""
    if not _grouped_transfers.enabled():
        return []
    if step_name == "train_step" and not _is_keras_own_step(model, step_name):
        return []
    excluded = set()
    for layer in model._flatten_layers():
        if isinstance(layer, ROW_LOOKUP_LAYERS):
            excluded.update(id(w) for w in layer.weights)
    chosen = []
    for weight in model.trainable_weights:
        inner = getattr(weight, "_value", None)
        if (id(weight) in excluded or inner is None
                or getattr(weight, _sharded_weights.SAVED_BY_OWNER_ATTR, False)
                or getattr(inner, _sharded_weights.SAVED_BY_OWNER_ATTR, False)
                or not _grouped_transfers.groupable(inner)):
            continue
        chosen.append(inner)
    rate = _learning_rate_variable(model) if step_name == "train_step" else None
    if chosen and rate is not None and _grouped_transfers.groupable(rate):
        # Read with its ps' weights, it rides to the other ps with their
        # gradients (keras_ps._keras.per_apply.once_per_apply).
        chosen.append(rate)
    return chosen


def step_passengers(model, step_name, grouped):
    """The int64 tf.Variables a step reads with its grouped weights (see
    keras_ps.tables._grouped_transfers.scope): in a train_step that groups
    reads (`grouped`, from `step_variables`), the `iterations` of an Adam
    optimizer (Keras' Adam, LazyAdam), whose every update needs the step
    count; read with its ps' weights at the step's start, it rides to the
    other ps with their gradients (keras_ps._keras.per_apply.adam_scalars)
    instead of being sent there from its ps, one message a step. Else
    empty."""
    if step_name != "train_step" or not grouped:
        return []
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(optimizer, ADAM_CLASSES):
        return []
    inner = getattr(optimizer.iterations, "_value", None)
    if inner is None or "/job:ps/" not in (inner.device or ""):
        return []
    return [inner]


def _learning_rate_variable(model):
    """The tf.Variable holding the learning rate of `model`'s optimizer (the
    inner one of a loss-scale optimizer), or None (a schedule, none)."""
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    rate = getattr(optimizer, "_learning_rate", None)
    return getattr(rate, "_value", None) if isinstance(
        rate, VARIABLE_CLASS) else None
