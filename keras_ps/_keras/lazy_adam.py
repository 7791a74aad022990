"""LazyAdam's row steps and update (`keras.src...` through
keras_ps._keras.optimizers and keras_ps._keras.per_apply): what
keras_ps.optimizers.LazyAdam adds to Keras' Adam.

Missing public API: Keras 3's Adam has no sparse update, and an optimizer
subclass cannot make a slot colocated with its variable on a ps without the
optimizer's distribution strategy (`_distribution_strategy`), nor find a
variable's moment slots (`_momentums`, `_velocities`) without its index
(`_get_variable_index`), nor have a checkpoint restored before the build
fill a sharded weight's row-step slot without its variable list
(`_variables`).
"""

import tensorflow as tf

from keras_ps import _native
from keras_ps.tables import _dirty_rows
from keras_ps.tables import _rowwise
from keras_ps.tables import _slot_restore
from keras_ps._keras import optimizers as _optimizers
from keras_ps._keras import per_apply


tf_variable = _optimizers.tf_variable


def add_row_step_slots(optimizer, var_list):
    """One int64 slot of shape `[rows]` per variable (none for scalars): the
    step at which each row was last updated (0: never). Made on the
    variable's ps; a sharded weight's are grouped like its other slots."""
    slots = []
    for variable in var_list:
        inner = tf_variable(variable)
        if not inner.shape.rank:
            slots.append(None)
            continue

        def make_slot(inner=inner, variable=variable):
            extended = optimizer._distribution_strategy.extended
            with extended.colocate_vars_with(inner):
                return optimizer.add_variable(
                    shape=(inner.shape[0],), initializer="zeros",
                    dtype="int64", name=f"{variable.name}_row_step")

        slots.append(_slot_restore.add_grouped_slot(
            optimizer._variables, variable, "row_step", make_slot))
    return slots


def lazy_adam_update(optimizer, gradient, variable, learning_rate, row_steps):
    """LazyAdam's update of one variable; see keras_ps.optimizers.LazyAdam."""
    index = optimizer._get_variable_index(variable)
    row_step = row_steps[index]
    inner = tf_variable(variable)
    if not isinstance(gradient, tf.IndexedSlices) or row_step is None:
        _optimizers.ADAM_CLASS.update_step(optimizer, gradient, variable,
                                           learning_rate)
        if row_step is not None:
            # Every row was updated at this step; as in the sparse update, a
            # row's step never goes back (an apply whose `t` is older than
            # another worker's, already applied, leaves that one).
            with tf.device(inner.device):
                step = per_apply.adam_scalars(
                    optimizer, inner.dtype, learning_rate, inner.device)[0]
                steps = tf_variable(row_step)
                steps.assign(tf.maximum(steps.read_value(), step))
        _dirty_rows.mark_all(inner)
        return
    if _optimizers.uses_weight_decay(optimizer, inner):
        raise ValueError(
            f"LazyAdam cannot apply weight_decay to {inner.name!r} row by row: "
            "Keras decays every row of the weight at every step. Received: "
            f"weight_decay={optimizer.weight_decay}. Exclude the table before "
            "the optimizer is built, e.g. optimizer.exclude_from_weight_decay("
            "var_names=['embeddings']), or use keras.optimizers.AdamW (dense).")
    # The step and the learning rate arrive with Adam's other scalars: one
    # message to this ps for the whole apply.
    with tf.device(inner.device):
        step, _, _, learning_rate, _, _, _ = per_apply.adam_scalars(
            optimizer, inner.dtype, learning_rate, inner.device)
    _rowwise.lazy_adam(
        inner, _optimizers.slot(optimizer, "_momentums", variable),
        _optimizers.slot(optimizer, "_velocities", variable),
        tf_variable(row_step),
        gradient, step, learning_rate, optimizer.beta_1, optimizer.beta_2,
        optimizer.epsilon,
        kernels=_native.kernels_for(optimizer._distribution_strategy))
