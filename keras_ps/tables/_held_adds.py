"""A step's additions to chosen ps variables (the metrics' totals and
counts), held and sent as one tensor per (ps, dtype) instead of one per
addition.

Inside an `adds_deferred` block of a traced step, `defer_add` holds each
`assign_add` to a chosen variable; `flush_adds()` (the block's end, or the
metrics' results being read) concatenates the held values of each ps on the
worker, and the one tensor is split and added on the ps, one variable at a
time. A loop of steps can take its held additions out each iteration
(`carried_adds`), carry their sums on the worker and add them once after
the loop: one tensor per ps per scheduled function instead of per
iteration.
"""

import contextlib
import threading

import tensorflow as tf

from keras_ps.tables import _grouped_transfers

_local = threading.local()


class _DeferredAdds:
    """The held `assign_add`s of one step (see `adds_deferred`)."""

    def __init__(self, chosen):
        self.chosen = chosen
        self.graph = tf.compat.v1.get_default_graph()
        self.adds = []  # (tf.Variable, value)


@contextlib.contextmanager
def adds_deferred(chosen):
    """Holds the `assign_add`s of tf.Variables for which `chosen(variable)`
    is true, made in the traced step inside, until `flush_adds()`; the held
    ones are made when the block ends. Additions inside nested graphs (a cond
    branch, a loop body of their own) are not held: they could not be made
    after them. Inside a block of the same graph, the outer block holds
    them."""
    previous = getattr(_local, "adds", None)
    if previous is not None and \
            previous.graph is tf.compat.v1.get_default_graph():
        yield
        return
    _local.adds = None if tf.executing_eagerly() else _DeferredAdds(chosen)
    try:
        yield
        flush_adds()
    finally:
        _local.adds = previous


def carried_adds(variables, sums):
    """`sums` (one per tf.Variable of `variables`, their shapes and dtypes)
    plus the additions to those variables held in this graph's
    `adds_deferred` block so far, which are taken out of it (not made): a
    loop body carries them to its end, where they are added once. The
    other held additions stay held."""
    held = getattr(_local, "adds", None)
    if held is None or held.graph is not tf.compat.v1.get_default_graph():
        return list(sums)
    index = {id(v): i for i, v in enumerate(variables)}
    sums, kept = list(sums), []
    for variable, value in held.adds:
        i = index.get(id(variable))
        if i is None:
            kept.append((variable, value))
        else:
            sums[i] = sums[i] + value
    held.adds = kept
    return sums


def defer_add(variable, value):
    """Holds `variable.assign_add(value)` if an `adds_deferred` block chose
    `variable`; returns whether it did."""
    held = getattr(_local, "adds", None)
    if (held is None or variable.dtype != value.dtype
            or not _grouped_transfers._on_ps(variable)
            or not variable.shape.is_fully_defined()
            or value.shape != variable.shape
            or tf.compat.v1.get_default_graph() is not held.graph
            or not held.chosen(variable)):
        return False
    held.adds.append((variable, value))
    return True


def flush_adds():
    """Makes the held additions: one tensor per (ps, dtype) crosses, split
    and added where the variables live."""
    held = getattr(_local, "adds", None)
    if held is None or not held.adds:
        return
    adds, held.adds = held.adds, []
    groups = {}
    for variable, value in adds:
        groups.setdefault((variable.device, variable.dtype), []).append(
            (variable, value))
    for (device, _), members in groups.items():
        if len(members) == 1:
            variable, value = members[0]
            variable.assign_add(value)
            continue
        flat = _grouped_transfers._joined([value for _, value in members])
        with tf.device(device):
            pieces = _grouped_transfers._split(
                flat, [v.shape.num_elements() for v, _ in members])
            for (variable, _), piece in zip(members, pieces):
                variable.assign_add(tf.reshape(piece, variable.shape))
