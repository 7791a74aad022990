"""How Keras optimizers update variables that live on a parameter server.

Missing public API: Keras 3 has no way for a distribution strategy to choose
how an optimizer applies its update. Keras' Adam.update_step is a dozen
separate ops (densify the gradient, sub, mul, assign_add for m; square, sub,
mul, assign_add for v; sqrt, add, mul, div, assign_sub for the variable),
each a full pass over the variable. On a ps holding a large embedding that
is where the training step's CPU goes (measured on
benchmarks/fit_embedding.py: Adam cost 4.5x the CPU per step of SGD; fused,
1.7x more steps/s). TF's `ResourceApplyAdam` kernel computes the same
formula in one pass, in place, under the variables' locks. We use it for
variables on a ps when the keras_ps strategy says `fused_adam=True`; any
other variable, a stateless scope, amsgrad and dtypes the kernel lacks go to
Keras' own update_step. The one difference (documented on the strategy):
repeated rows of a sparse gradient are summed before squaring, where Keras
squares each. tests/fit/test_fused_adam.py checks both paths against Keras.
"""

import functools
import threading

import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as tf_core
from keras.src.optimizers import adam as adam_lib

from keras_ps._keras import hooks

ADAM_CLASS = adam_lib.Adam
FUSED_ADAM_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _tf_variable(variable):
    # Keras' TF optimizer hands update_step the inner tf.Variable of each
    # trainable weight; its slots are keras Variables.
    return variable.value if isinstance(variable, tf_core.Variable) else variable


def _can_fuse_adam(optimizer, variable):
    inner = _tf_variable(variable)
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return (getattr(strategy, "fused_adam", False) is True
            and not optimizer.amsgrad and not in_stateless_scope()
            and isinstance(inner, tf.Variable)
            and "/job:ps/" in (inner.device or "")
            and inner.dtype in FUSED_ADAM_DTYPES)


def _adam_scalars(optimizer, dtype, learning_rate):
    """(beta1^t, beta2^t, lr, beta1, beta2, epsilon) of this step, as `dtype`.

    Made once per `apply` (see _per_apply_scalars) and shared by every
    variable's update: one read of `iterations` per step, not one per
    variable (each a message from the ps holding it)."""
    cache = getattr(_apply_state, "caches", {}).get(id(optimizer))
    if cache is not None and dtype in cache:
        return cache[dtype]
    step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1 = tf.cast(optimizer.beta_1, dtype)
    beta_2 = tf.cast(optimizer.beta_2, dtype)
    scalars = (tf.pow(beta_1, step), tf.pow(beta_2, step),
               tf.cast(learning_rate, dtype), beta_1, beta_2,
               tf.cast(optimizer.epsilon, dtype))
    if cache is not None:
        cache[dtype] = scalars
    return scalars


# Per thread: the coordinator's worker threads trace steps concurrently, and
# a tensor belongs to the graph its thread is tracing.
_apply_state = threading.local()


def _per_apply_scalars(keras_backend_update_step):
    @functools.wraps(keras_backend_update_step)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        caches = _apply_state.__dict__.setdefault("caches", {})
        caches[id(self)] = {}
        try:
            return keras_backend_update_step(self, grads, trainable_variables,
                                             learning_rate)
        finally:
            caches.pop(id(self), None)

    return _backend_update_step


def _fused_adam_update_step(keras_update_step):
    @functools.wraps(keras_update_step)
    def update_step(self, gradient, variable, learning_rate):
        if not _can_fuse_adam(self, variable):
            return keras_update_step(self, gradient, variable, learning_rate)
        inner = _tf_variable(variable)
        index = self._get_variable_index(variable)
        dtype = inner.dtype
        # Same formula as Keras' Adam (and the kernel's doc):
        # alpha = lr * sqrt(1 - b2^t) / (1 - b1^t); m += (g - m)(1 - b1);
        # v += (g^2 - v)(1 - b2); var -= m * alpha / (sqrt(v) + epsilon).
        with tf.device(inner.device):
            beta1_power, beta2_power, lr, beta_1, beta_2, epsilon = \
                _adam_scalars(self, dtype, learning_rate)
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


def install():
    hooks.wrap(ADAM_CLASS, "_backend_update_step", _per_apply_scalars)
    hooks.wrap(ADAM_CLASS, "update_step", _fused_adam_update_step)
