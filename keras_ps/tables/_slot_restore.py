"""Restoring optimizer slots of sharded weights made after a checkpoint
restore: a `tf.train.Checkpoint.restore` before the optimizer is built
fills the slots when the optimizer makes them, as it does for a plain
model. The slots are made and grouped here (`add_grouped_slot`).
"""

import contextlib
import threading

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.tables._sharded_weights import PENDING_SLOT_ATTR
from keras_ps.tables._sharded_weights import SLOT_OWNER_ATTR
from keras_ps.tables._sharded_weights import collapse
from keras_ps.tables._sharded_weights import group_slot
from keras_ps.tables._sharded_weights import holds_shards
from keras_ps.tables._sharded_weights import shard_of


def add_grouped_slot(optimizer_variables, reference, name, make_slot):
    """`make_slot()`, an optimizer slot named `name` of `reference`, grouped
    with its shards' slots (`group_slot`) and restored from a checkpoint
    that waits for it (`restores_by_collapsed_index`).

    Args:
        optimizer_variables: the optimizer's variable list (`_variables`),
            to which `make_slot` appends the slot.
        reference: the variable the slot is made for.
        name: the slot's name ("momentum", ...).
        make_slot: `() -> slot`.
    """
    grouped = (shard_of(reference) is not None
               or getattr(reference, SLOT_OWNER_ATTR, None) is not None)
    with restores_by_collapsed_index(optimizer_variables, grouped):
        slot = make_slot()
        group_slot(slot, reference, name)
    return slot


# -- restoring slots made after a checkpoint restore ------------------------
# `tf.train.Checkpoint.restore` before an optimizer is built leaves each saved
# slot waiting on the optimizer's variable list under its index in the
# checkpoint, which counts a sharded weight's slot once (`collapse`). TF
# restores each variable appended later under its own index in the list,
# which counts every shard: past the first sharded weight every slot, sharded
# or not, met another slot's value (a shape error that TF's list swallows),
# and stayed at zero. So once shards are involved, what waits on the list is
# held back while it grows and restored after, by checkpoint index, into
# whole sharded slots (any number of shards: one full tensor is split).
_holding = threading.local()


def _pending(variable):
    return getattr(variable, PENDING_SLOT_ATTR, False)


@contextlib.contextmanager
def restores_by_collapsed_index(values, grouped=False):
    """Within the block, variables appended to `values` (an optimizer's
    variable list) are not restored under their index in it; after it, what
    a checkpoint restore left waiting on `values` is restored into
    `collapse(values)` by index, up to the first slot whose shards are not
    all made. Does nothing while no restore waits on `values`, or while it
    holds no shards and `grouped` (a shard's slot is being made) is False:
    then the two indices agree and TF restores as for a plain model."""
    waiting = (_tf_adapter.waiting_restorations(values) if
               isinstance(values, tf.__internal__.tracking.Trackable) else None)
    holding = _holding.__dict__.setdefault("ids", set())
    if (not waiting or id(values) in holding or not (
            grouped or holds_shards(values) or any(map(_pending, values)))):
        yield
        return
    held = dict(waiting)
    waiting.clear()
    holding.add(id(values))
    try:
        yield
    finally:
        holding.discard(id(values))
        waiting.update(held)
    for index, value in enumerate(collapse(values)):
        if _pending(value):
            break
        if str(index) in waiting:
            _tf_adapter.restore_waiting(values, str(index), value)
