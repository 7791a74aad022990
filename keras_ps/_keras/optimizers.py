"""Keras optimizer internals that keras_ps hooks (`keras.src...`).

Keras 3.15 has no public way for a distribution strategy to choose how an
optimizer applies its update; each hook below says which API is missing.
`install()` (called when keras_ps.strategy is imported) puts them in place
once; models not built under a keras_ps strategy, variables that are not on a
ps, and stateless scopes keep Keras' own update. tests/api/test_keras_internals.py
pins every internal used here.

Sections: one fused kernel for Adam; row-wise updates for sparse gradients
(SGD, Adagrad, Ftrl automatically). What one apply makes once for every
variable's update (the step count, Adam's scalars, the learning rate, the
values that ride with the gradients) is in keras_ps._keras.per_apply;
LazyAdam's row-wise update in keras_ps._keras.lazy_adam.
"""

import functools
import logging
import threading

import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.optimizers import adagrad as adagrad_lib
from keras.src.optimizers import adam as adam_lib
from keras.src.optimizers import ftrl as ftrl_lib
from keras.src.optimizers import sgd as sgd_lib
from keras.src.optimizers.schedules import learning_rate_schedule

from keras_ps.tables import _dirty_rows
from keras_ps.tables import _rowwise
from keras_ps.tables import _sharded_weights
from keras_ps import _keras as hooks
from keras_ps import _native
from keras_ps._keras import per_apply

logger = logging.getLogger(__name__)

VARIABLE_CLASS = per_apply.VARIABLE_CLASS
OPTIMIZER_CLASS = tf_optimizer.TFOptimizer


def install():
    """Installs the optimizer hooks (the caller makes it once per process)."""
    _install_fused_adam()
    _install_rowwise()


# -- Section: one fused kernel for Adam updates on the parameter servers ------
# Missing public API: Keras 3 has no way for a distribution strategy to choose
# how an optimizer applies its update. Keras' Adam.update_step is a dozen
# separate ops (densify the gradient, sub, mul, assign_add for m; square, sub,
# mul, assign_add for v; sqrt, add, mul, div, assign_sub for the variable),
# each a full pass over the variable. On a ps holding a large embedding that
# is where the training step's CPU goes (measured on
# benchmarks/fit_embedding.py: Adam cost 4.5x the CPU per step of SGD; fused,
# 1.7x more steps/s). TF's `ResourceApplyAdam` kernel computes the same
# formula in one pass, in place, under the variables' locks. We use it for
# variables on a ps when the keras_ps strategy says `fused_adam=True`; any
# other variable, a stateless scope, amsgrad and dtypes the kernel lacks go to
# Keras' own update_step. The one difference (documented on the strategy):
# repeated rows of a sparse gradient are summed before squaring, where Keras
# squares each. tests/fit/test_fused_adam.py checks both paths against Keras.
ADAM_CLASS = adam_lib.Adam
FUSED_ADAM_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


tf_variable = _tf_variable = per_apply.tf_variable


def _can_fuse_adam(optimizer, variable):
    inner = _tf_variable(variable)
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return (getattr(strategy, "fused_adam", False) is True
            and not optimizer.amsgrad and not in_stateless_scope()
            and isinstance(inner, tf.Variable)
            and "/job:ps/" in (inner.device or "")
            and inner.dtype in FUSED_ADAM_DTYPES)


def _fused_adam_update_step(keras_update_step):
    @functools.wraps(keras_update_step)
    def update_step(self, gradient, variable, learning_rate):
        if not _can_fuse_adam(self, variable):
            return keras_update_step(self, gradient, variable, learning_rate)
        inner = _tf_variable(variable)
        index = self._get_variable_index(variable)
        dtype = inner.dtype
        if isinstance(gradient, tf.IndexedSlices):
            warn_dense_update(self, inner, "Adam moves every row by its "
                              "momentum, even with a zero gradient",
                              "keras_ps.optimizers.LazyAdam")
        # Same formula as Keras' Adam (and the kernel's doc):
        # alpha = lr * sqrt(1 - b2^t) / (1 - b1^t); m += (g - m)(1 - b1);
        # v += (g^2 - v)(1 - b2); var -= m * alpha / (sqrt(v) + epsilon).
        with tf.device(inner.device):
            _, beta1_power, beta2_power, lr, beta_1, beta_2, epsilon = \
                per_apply.adam_scalars(self, dtype, learning_rate, inner.device)
            tf.raw_ops.ResourceApplyAdam(
                var=inner.handle,
                m=_tf_variable(self._momentums[index]).handle,
                v=_tf_variable(self._velocities[index]).handle,
                beta1_power=beta1_power, beta2_power=beta2_power, lr=lr,
                beta1=beta_1, beta2=beta_2, epsilon=epsilon,
                # A sparse gradient (an embedding's) becomes dense here, on
                # the ps: rows travel, the zeros are made where they are used.
                grad=tf.cast(tf.convert_to_tensor(gradient), dtype),
                use_locking=True)

    return update_step


def _install_fused_adam():
    hooks.wrap(OPTIMIZER_CLASS, "_backend_update_step", per_apply.once_per_apply)
    hooks.wrap(ADAM_CLASS, "update_step", _fused_adam_update_step)


# -- Section: row-wise updates for sparse gradients -----------------------------
# Missing public API: Keras 3 optimizers have no sparse update. Their
# update_step hands a `tf.IndexedSlices` gradient (an embedding lookup's) to
# `ops.*`, which turn it dense: every row of the weight and of each slot is
# read and written at every step, whatever the batch touched (measured on a
# 10M x 64 table: 1.2 s per Adam step against 2.7 ms for the 4,096 rows
# touched). We wrap `update_step` of the optimizers whose dense update leaves
# a row with a zero gradient unchanged (SGD without momentum, Adagrad, Ftrl
# without L2 shrinkage): for a sparse gradient of a variable on a ps, the
# update runs on the gradient's rows only (keras_ps.tables._rowwise), which gives
# Keras' dense result. Anything else (momentum, shrinkage, a variable off the
# ps, a stateless scope) takes Keras' own update_step; a sparse gradient made
# dense that way is reported once per weight (`warn_dense_update`).
SGD_CLASS = sgd_lib.SGD
ADAGRAD_CLASS = adagrad_lib.Adagrad
FTRL_CLASS = ftrl_lib.Ftrl
ROWWISE_CLASSES = (SGD_CLASS, ADAGRAD_CLASS, FTRL_CLASS)

_warned = set()
_warned_lock = threading.Lock()


class DenseUpdateWarning(UserWarning):
    """A sparse gradient of a ps variable was made dense by its optimizer."""


def warn_dense_update(optimizer, variable, why, instead):
    """Warns once per (optimizer, variable, why) that `variable`'s sparse
    gradient is made dense: every row is read and written per step."""
    key = (id(optimizer), variable.name, why)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    import warnings

    warnings.warn(
        f"{type(optimizer).__name__} updates all {variable.shape[0]:,} rows of "
        f"{variable.name!r} at each step: {why}, so its sparse gradient is "
        f"made dense (a full pass over the weight and its slots per step). "
        f"For an update of the looked-up rows only, use {instead}.",
        DenseUpdateWarning, stacklevel=3)


def rowwise_applies(variable, gradient):
    """Whether `variable`'s update can run row-wise: a sparse gradient, a
    variable on a ps, outside a stateless scope."""
    inner = _tf_variable(variable)
    return (isinstance(gradient, tf.IndexedSlices) and not in_stateless_scope()
            and isinstance(inner, tf.Variable)
            and "/job:ps/" in (inner.device or ""))


def uses_weight_decay(optimizer, variable):
    """Whether the optimizer's `weight_decay` applies to `variable`."""
    return (optimizer.weight_decay is not None
            and optimizer._use_weight_decay(variable))


def has_constant_learning_rate(optimizer):
    rate = optimizer._learning_rate
    return not (isinstance(rate, learning_rate_schedule.LearningRateSchedule)
                or callable(rate))


def slot(optimizer, name, variable):
    """The tf.Variable of slot list `name` (e.g. "_accumulators") for `variable`."""
    return _tf_variable(getattr(optimizer, name)[optimizer._get_variable_index(variable)])


def _check_weight_decay(optimizer, inner):
    if uses_weight_decay(optimizer, inner):
        warn_dense_update(
            optimizer, inner,
            f"weight_decay={optimizer.weight_decay} shrinks every row (Keras "
            "applies it before the update)",
            "optimizer.exclude_from_weight_decay(var_names=[...]) for the table")


def _dense_update(keras_update_step, optimizer, gradient, variable,
                  learning_rate):
    """Keras' own update of `variable`; a table tracked for incremental
    backups then has every row marked (they may all have changed)."""
    result = keras_update_step(optimizer, gradient, variable, learning_rate)
    _dirty_rows.mark_all(_tf_variable(variable))
    return result


def _rowwise_sgd(keras_update_step):
    @functools.wraps(keras_update_step)
    def update_step(self, gradient, variable, learning_rate):
        if not rowwise_applies(variable, gradient):
            return _dense_update(keras_update_step, self, gradient, variable,
                                 learning_rate)
        inner = _tf_variable(variable)
        if self.momentum != 0:
            warn_dense_update(self, inner, f"momentum={self.momentum} moves "
                              "every row", "SGD with momentum=0 or Adagrad")
            return _dense_update(keras_update_step, self, gradient, variable,
                                 learning_rate)
        _check_weight_decay(self, inner)
        _rowwise.sgd(inner, gradient, learning_rate)

    return update_step


def _rowwise_adagrad(keras_update_step):
    @functools.wraps(keras_update_step)
    def update_step(self, gradient, variable, learning_rate):
        if not rowwise_applies(variable, gradient):
            return _dense_update(keras_update_step, self, gradient, variable,
                                 learning_rate)
        inner = _tf_variable(variable)
        _check_weight_decay(self, inner)
        _rowwise.adagrad(inner, slot(self, "_accumulators", variable), gradient,
                         learning_rate, self.epsilon,
                         kernels=_native.kernels_for(self._distribution_strategy))

    return update_step


def ftrl_dense_reason(optimizer, inner):
    if optimizer.l2_shrinkage_regularization_strength != 0:
        return (f"l2_shrinkage_regularization_strength="
                f"{optimizer.l2_shrinkage_regularization_strength} moves every row")
    if uses_weight_decay(optimizer, inner):
        return (f"weight_decay={optimizer.weight_decay} shrinks every row and "
                "Ftrl then recomputes every row")
    if not has_constant_learning_rate(optimizer):
        return ("a learning-rate schedule changes every row's closed form "
                "when the rate changes")
    return None


def _rowwise_ftrl(keras_update_step):
    # Keras' dense Ftrl sets every row to its closed form
    # `(clip(linear, -l1, l1) - linear) / quadratic` at each step; a row's
    # zero gradient keeps it there once it is there, but a weight starts from
    # its initializer. So the first step (iterations == 0) is Keras' own dense
    # update, and the later ones are row-wise: the same result at every step.
    @functools.wraps(keras_update_step)
    def update_step(self, gradient, variable, learning_rate):
        if not rowwise_applies(variable, gradient):
            return _dense_update(keras_update_step, self, gradient, variable,
                                 learning_rate)
        inner = _tf_variable(variable)
        reason = ftrl_dense_reason(self, inner)
        if reason is not None:
            warn_dense_update(self, inner, reason, "Ftrl without it")
            return _dense_update(keras_update_step, self, gradient, variable,
                                 learning_rate)

        def dense():
            # The dense gradient: Keras squares a sparse one's repeats apart.
            _dense_update(keras_update_step, self,
                          tf.convert_to_tensor(gradient), variable,
                          learning_rate)
            return tf.constant(True)

        def rowwise():
            _rowwise.ftrl(inner, slot(self, "_accumulators", variable),
                          slot(self, "_linears", variable), gradient,
                          learning_rate, self.l1_regularization_strength,
                          self.l2_regularization_strength, self.beta,
                          self.learning_rate_power)
            return tf.constant(True)

        tf.cond(tf.equal(tf.convert_to_tensor(self.iterations), 0), dense, rowwise)

    return update_step


_ROWWISE_WRAPPERS = (_rowwise_sgd, _rowwise_adagrad, _rowwise_ftrl)


def _install_rowwise():
    for cls, wrap in zip(ROWWISE_CLASSES, _ROWWISE_WRAPPERS):
        hooks.wrap(cls, "update_step", wrap)
