"""What one `apply` of an optimizer makes once and shares with every
variable's update (`keras.src...`, through keras_ps._keras.optimizers,
which installs `once_per_apply`).

Missing public API: Keras 3 applies a gradient per variable and gives a
strategy no say in how gradients travel or in what each update reads. Each
read of a variable on one ps by an update on another is a message between
processes, per variable and step; here the learning rate is read once (or
comes with the gradients), the step count `iterations` is read once (or
comes with the gradients), Adam's scalars are made once per ps, and each
ps' gradients cross as one tensor (keras_ps.tables._grouped_transfers).
"""

import functools
import threading

import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as tf_core

from keras_ps.tables import _grouped_transfers

VARIABLE_CLASS = tf_core.Variable


def tf_variable(variable):
    """The `tf.Variable` inside a Keras variable (`variable` itself
    otherwise): Keras' TF optimizer hands update_step the inner tf.Variable
    of each trainable weight; its slots are keras Variables."""
    return variable.value if isinstance(variable, VARIABLE_CLASS) else variable


def _cached(optimizer, key, make):
    """`make()`, made once per `apply` of `optimizer` (see once_per_apply) and
    shared by every variable's update; made anew outside an apply."""
    cache = getattr(_apply_state, "caches", {}).get(id(optimizer))
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _next_step(optimizer):
    """`iterations + 1` of this step, read once per `apply`: each read is a
    message from the ps holding `iterations` to the ps of the update."""
    return _cached(optimizer, "next_step",
                   lambda: tf.convert_to_tensor(optimizer.iterations) + 1)


def adam_scalars(optimizer, dtype, learning_rate, device):
    """(t, beta1^t, beta2^t, lr, beta1, beta2, epsilon) of this step for an
    update on `device`: t (`iterations + 1`) as int64, the others as `dtype`.

    On a ps to which `iterations`, read at the step's start, rode with the
    gradients (see `_riders`), they are made there from that read: no
    message. Otherwise made once per `apply` as one tensor, where the first
    update runs, and split again on each other device: one message per ps,
    not seven scalars (each a message between processes) per variable. The
    tensor is float64, which holds t exactly up to 2^53 and a value of
    `dtype` exactly; the powers are taken in `dtype`, as Keras' Adam does.

    The read at the step's start is the count the update would read on its
    own unless another worker's step added to it meanwhile: t is then one
    or two lower on that ps, as if the update had been applied before that
    step's; the bias corrections barely differ after the first steps, and
    LazyAdam's row steps never go back (keras_ps.tables._rowwise.lazy_adam).
    """
    def pack():
        scalars = _scalars(optimizer, dtype, learning_rate,
                           _next_step(optimizer))
        return tf.stack([tf.cast(value, tf.float64) for value in scalars])

    def unpack():
        packed = _cached(optimizer, ("adam", dtype), pack)
        with tf.device(device):
            parts = tf.unstack(packed)
            return ((tf.cast(parts[0], tf.int64),)
                    + tuple(tf.cast(part, dtype) for part in parts[1:]))

    def from_step_read(read):
        # `iterations` as the step read it at its start came with the
        # gradients: the scalars are made here, no message from its ps.
        with tf.device(device):
            return _scalars(optimizer, dtype, learning_rate, read + 1)

    read = _landed(optimizer, device, _STEP_READ)
    return _cached(optimizer, ("adam", dtype, device),
                   unpack if read is None else lambda: from_step_read(read))


def _scalars(optimizer, dtype, learning_rate, step):
    """Adam's (t, beta1^t, beta2^t, lr, beta1, beta2, epsilon) at int64
    `step`, made on the device around the call; t stays int64."""
    t = tf.cast(step, dtype)
    beta_1 = tf.cast(optimizer.beta_1, dtype)
    beta_2 = tf.cast(optimizer.beta_2, dtype)
    return (step, tf.pow(beta_1, t), tf.pow(beta_2, t),
            tf.cast(learning_rate, dtype), beta_1, beta_2,
            tf.cast(optimizer.epsilon, dtype))


# Per thread: the coordinator's worker threads trace steps concurrently, and
# a tensor belongs to the graph its thread is tracing.
_apply_state = threading.local()


def _read_once(learning_rate):
    """A learning rate held in a variable, read once for the whole `apply`.
    Keras passes the variable itself to every variable's update, and each
    update reads it again: a message from the ps holding it to every other
    ps, per variable and step."""
    if isinstance(learning_rate, (VARIABLE_CLASS, tf.Variable)):
        return tf.convert_to_tensor(learning_rate)
    return learning_rate


def once_per_apply(keras_backend_update_step):
    # Once per `apply` (every optimizer): the learning rate is read once (see
    # _read_once) or comes with the gradients (see _riders),
    # Adam's scalars are made once (see adam_scalars), and each ps' dense
    # gradients cross as one tensor (see keras_ps.tables._grouped_transfers),
    # every update then running on the ps from its piece. Missing public API:
    # Keras 3 applies a gradient per variable and gives a strategy no say in
    # how gradients travel.
    @functools.wraps(keras_backend_update_step)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        landed = {}
        if _grouped_transfers.enabled() and not in_stateless_scope():
            grads, landed = _grouped_transfers.gradients_to_ps(
                grads, [tf_variable(v) for v in trainable_variables],
                _riders(self, learning_rate))
        caches = _apply_state.__dict__.setdefault("caches", {})
        caches[id(self)] = {_LANDED: landed}
        try:
            if not landed:
                return keras_backend_update_step(
                    self, grads, trainable_variables, _read_once(learning_rate))
            # Each ps' variables with the learning rate that came with their
            # gradients; the others (its own ps') with the one read there.
            by_device = {}
            for grad, variable in zip(grads, trainable_variables):
                by_device.setdefault(tf_variable(variable).device, []).append(
                    (grad, variable))
            home = None
            # Where `iterations` lives first: Adam's scalars are made where
            # the first update runs (see adam_scalars).
            first = tf_variable(self.iterations).device
            for device in sorted(by_device, key=lambda d: d != first):
                rate = landed.get(device, {}).get(_RATE)
                if rate is None:
                    home = _read_once(learning_rate) if home is None else home
                    rate = home
                pairs = by_device[device]
                keras_backend_update_step(self, [g for g, _ in pairs],
                                          [v for _, v in pairs], rate)
        finally:
            caches.pop(id(self), None)

    return _backend_update_step


# Names of the values that ride with a step's gradients, and the key of the
# apply's cache where they landed ({ps device: {name: value there}}).
_RATE, _STEP_READ, _LANDED = "learning_rate", "iterations", "landed"


def _riders(optimizer, learning_rate):
    """The values this step has read with a ps' grouped transfer that ride
    with the gradients to every other ps
    (keras_ps.tables._grouped_transfers.gradients_to_ps), as {name: (value,
    device)}: the learning rate held in a ps variable (not a schedule's);
    `iterations` at the step's start, when the step read it (see
    keras_ps._keras.grouped_reads.step_passengers)."""
    riders = {}
    for name, variable in ((_RATE, learning_rate),
                           (_STEP_READ, optimizer.iterations)):
        if not isinstance(variable, (VARIABLE_CLASS, tf.Variable)):
            continue
        inner = tf_variable(variable)
        value = _grouped_transfers.read_already(inner)
        if value is not None:
            riders[name] = (value, inner.device)
    return riders


def _landed(optimizer, device, name):
    """Rider `name`'s value on `device` in the current apply, or None."""
    cache = getattr(_apply_state, "caches", {}).get(id(optimizer)) or {}
    return cache.get(_LANDED, {}).get(device, {}).get(name)
