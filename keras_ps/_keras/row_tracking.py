"""Which weights a Keras optimizer updates row by row, and their slots.

An incremental backup writes a table's changed rows only if every change to
the table and to its optimizer slots goes through an update that marks the
rows it touches (keras_ps.tables._dirty_rows). That holds for the row-wise updates
keras_ps installs (keras_ps._keras.optimizers): SGD without momentum, Adagrad,
Ftrl without L2 shrinkage and keras_ps' LazyAdam, on a weight on a ps whose
optimizer has nothing that moves every row outside `update_step` (weight
decay on the weight, EMA, gradient accumulation). Anything else (Adam, RMSprop,
an optimizer that overrides `update_step`, a weight on the coordinator) is
written whole by every backup, which is always right.

Missing public API: Keras optimizers do not say which slot belongs to which
variable; each optimizer keeps one list per slot kind (`_accumulators`,
`_momentums`, ...) indexed by `_get_variable_index`. ROW_SLOT_LISTS names
those lists for the optimizers whose update is row-wise;
tests/api/test_keras_internals.py pins them.
"""

import threading

from keras_ps._keras import optimizers

# Optimizer class -> names of its slot lists, each indexed like its
# trainable variables. An optimizer qualifies if it is an instance of one of
# these classes and its `update_step` is that class' (not overridden).
ROW_SLOT_LISTS = {
    optimizers.SGD_CLASS: (),
    optimizers.ADAGRAD_CLASS: ("_accumulators",),
    optimizers.FTRL_CLASS: ("_accumulators", "_linears"),
}
_lock = threading.Lock()


def register_row_slots(optimizer_class, slot_lists):
    """Declares that `optimizer_class.update_step` is row-wise for sparse
    gradients, marks its rows (keras_ps.tables._dirty_rows) and changes only the
    slots in `slot_lists` (keras_ps.optimizers.LazyAdam registers itself)."""
    with _lock:
        ROW_SLOT_LISTS[optimizer_class] = tuple(slot_lists)


def _slot_lists(optimizer):
    with _lock:
        known = list(ROW_SLOT_LISTS.items())
    for cls, names in known:
        if (isinstance(optimizer, cls)
                and type(optimizer).update_step is cls.update_step):
            return names
    return None


def _moves_every_row(optimizer, variable):
    """Why `optimizer` changes rows of `variable` outside its row-wise
    update, or None."""
    if getattr(optimizer, "use_ema", False):
        return "use_ema"
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return "gradient_accumulation_steps"
    if optimizers.uses_weight_decay(optimizer, variable):
        return "weight_decay"
    if isinstance(optimizer, optimizers.SGD_CLASS) and optimizer.momentum != 0:
        return "momentum"
    if isinstance(optimizer, optimizers.FTRL_CLASS):
        return optimizers.ftrl_dense_reason(optimizer, variable)
    return None


def row_slots(optimizer, variable):
    """The optimizer slots (`tf.Variable`s) of `variable`, when each change
    to `variable` and to them is a row-wise update that marks its rows;
    None when some change is not (the weight must then be written whole).

    Args:
        optimizer: a built Keras optimizer, or None.
        variable: a trainable weight (a `keras.Variable`, one shard of a
            sharded weight included).
    """
    if optimizer is None or not getattr(optimizer, "built", False):
        return None
    names = _slot_lists(optimizer)
    inner = optimizers.tf_variable(variable)
    if (names is None or not inner.shape.rank or not variable.trainable
            or "/job:ps/" not in (inner.device or "")
            or _moves_every_row(optimizer, variable) is not None):
        return None
    try:
        index = optimizer._get_variable_index(variable)
    except KeyError:
        return None  # not a variable this optimizer updates
    slots = []
    for name in names:
        slot = getattr(optimizer, name, None)
        slot = slot[index] if slot is not None and index < len(slot) else None
        if slot is None:
            return None
        slots.append(optimizers.tf_variable(slot))
    return slots


tf_variable = optimizers.tf_variable


def strategy_of(optimizer):
    """The `tf.distribute` strategy `optimizer` makes its slots under (the
    one that placed its variables)."""
    return optimizer._distribution_strategy
