"""Where a dynamic table's variables go: one shard per ps, never split.

Uses the strategy's public `colocate_vars_with` (a keras_ps strategy places a
variable made under it on the device of the variable it is colocated with)
and Keras' own `add_weight`, unwrapped from keras_ps' partitioning hook, so
a shard's rows are exactly one weight on its ps. Outside a keras_ps strategy
the table has one shard, on the current device.
"""

import contextlib

import keras
import tensorflow as tf

from keras_ps import _keras as hooks
from keras_ps.tables._sharded_weights import (
    OWNED_STATE_ATTR, SAVED_BY_OWNER_ATTR, SLOT_OWNER_ATTR)
from keras_ps.strategy import ParameterServerStrategy


class _Device:
    """What `colocate_vars_with` needs of a variable: its device."""

    def __init__(self, device):
        self.device = device


def _is_keras_ps(strategy):
    return isinstance(strategy, ParameterServerStrategy)


def ps_devices(strategy):
    if _is_keras_ps(strategy):
        return list(strategy.extended.parameter_devices)
    return [None]


@contextlib.contextmanager
def on(strategy, device):
    """Variables made in the block go to `device` (a ps), unsplit."""
    if _is_keras_ps(strategy):
        with strategy.extended.colocate_vars_with(_Device(device)):
            yield
    elif device is not None:
        with tf.device(device):
            yield
    else:
        yield


def unsplit_add_weight(layer):
    """Keras' own `layer.add_weight` (never split by a partitioner)."""
    add_weight = hooks.original(keras.layers.Layer, "add_weight")
    return lambda **kwargs: add_weight(layer, **kwargs)


def tf_variable(variable):
    """The `tf.Variable` inside a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def mark_owned(variable, on_slot, state):
    """Marks `variable` saved by its owner; `on_slot(name, tf_variable)` is
    called for each optimizer slot made for it (marked the same way).
    `state` (a SlotShard) is what incremental backups write besides the
    rows and restore the key map with."""
    setattr(variable, SAVED_BY_OWNER_ATTR, True)
    setattr(variable, OWNED_STATE_ATTR, state)

    def announce(slot, name):
        setattr(slot, SAVED_BY_OWNER_ATTR, True)
        setattr(slot, OWNED_STATE_ATTR, state)
        on_slot(name, tf_variable(slot))

    setattr(variable, SLOT_OWNER_ATTR, announce)


def remade_on_recovery(strategy, device, remake):
    """Has a keras_ps strategy call `remake` (a bound method) when ps
    `device` is given its variables back after a restart."""
    if _is_keras_ps(strategy):
        strategy.track_ps_resource(device, remake)
