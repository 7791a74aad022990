"""One transfer per parameter server, not one per variable, for a step's
small dense variables: their reads (ps to worker) and their gradients
(worker to ps).

Why: a tensor that crosses from one process to another costs about the same
CPU whatever its size (measured on this project's row-wise benchmark: the
lookup of 204 rows from one ps cost 70 % of 2,325 rows from the other; an
MLP of 18 variable shards read and updated one tensor each way per shard
cost 0.65x the CPU as one flat tensor per ps each way). TF moves every
variable a step reads, and every gradient it applies, as a tensor of its own.

What this module does, inside a traced step (`scope`):

- reads: the first read of a grouped variable reads every variable of its
  group (same ps, same dtype) on that ps, concatenates them there, and splits
  the one tensor on the worker; later reads in the same step (and graph) take
  their piece. The reads run where the first read runs, normally inside the
  step's gradient tape, so gradients flow to each variable as before.
  `close_reads()` (called when the optimizer starts applying) ends the
  sharing: a variable read after its update reads it again.
- gradients (`gradients_to_ps`): the dense gradients of one ps' variables,
  and the gradient rows of its embedding shards, are concatenated on the
  worker and split on the ps, where the optimizer's update of each variable
  runs (the strategy updates a variable under its device). A shard's row
  count is taken on the ps from the rows' indices, which its lookup sent
  there already.

One difference from one tensor per variable: a grouped variable that the
loss does not use gets a zero gradient, not none (the split's gradient fills
the pieces nobody used). The optimizers keras_ps updates leave such a weight
where it is (SGD, Adagrad, Ftrl: zero change; Adam: its moments stay zero),
and Keras' warning about weights without gradients is not shown for it.
"""

import contextlib
import threading

import tensorflow as tf

from keras_ps import _constants

_local = threading.local()


def enabled():
    """Whether steps group their transfers (KERAS_PS_GROUP_TRANSFERS)."""
    return bool(_constants.env_int(_constants.GROUP_TRANSFERS_ENV_VAR,
                                   _constants.DEFAULT_GROUP_TRANSFERS))


def _on_ps(variable):
    return "/job:ps/" in (getattr(variable, "device", None) or "")


def groupable(variable):
    """Whether a tf.Variable's reads and gradients may be grouped: on a ps,
    of a fully known shape of at most GROUPED_TRANSFER_MAX_ELEMENTS
    elements."""
    return (_on_ps(variable) and variable.shape.is_fully_defined()
            and variable.shape.num_elements()
            <= _constants.GROUPED_TRANSFER_MAX_ELEMENTS)


class _StepReads:
    """The grouped reads of one traced step (see the module docstring)."""

    def __init__(self, variables):
        groups = {}
        for variable in variables:
            groups.setdefault((variable.device, variable.dtype), []).append(variable)
        # A group of one would move the same one tensor.
        self._groups = [group for group in groups.values() if len(group) > 1]
        self._where = {}
        for g, group in enumerate(self._groups):
            for i, variable in enumerate(group):
                self._where[id(variable)] = (g, i)
        self._pieces = {}  # (graph, group index) -> one tensor per variable
        self.open = True

    def get(self, variable):
        """`variable`'s value in this step, from its group's one transfer;
        None for a variable that is not grouped, after `close_reads()`, or
        outside a traced function."""
        if not self.open or tf.executing_eagerly():
            return None
        where = self._where.get(id(variable))
        if where is None:
            return None
        # A read inside a nested graph (a cond branch, a loop body) cannot
        # use tensors of the graph around it: each graph reads its own.
        key = (tf.compat.v1.get_default_graph(), where[0])
        pieces = self._pieces.get(key)
        if pieces is None:
            pieces = self._pieces[key] = _read_group(self._groups[where[0]])
        return pieces[where[1]]


def _read_group(group):
    with tf.device(group[0].device):
        flat = tf.concat([tf.reshape(v.read_value(), [-1]) for v in group],
                         axis=0)
    # Split where the step runs: one tensor crosses.
    pieces = tf.split(flat, [v.shape.num_elements() for v in group])
    return [tf.reshape(piece, v.shape) for piece, v in zip(pieces, group)]


@contextlib.contextmanager
def scope(variables):
    """Groups the reads of `variables` (tf.Variables) in the step traced
    inside; an empty list groups nothing."""
    previous = getattr(_local, "reads", None)
    _local.reads = _StepReads(variables) if variables else None
    try:
        yield
    finally:
        _local.reads = previous


def read(variable):
    """The grouped value of tf.Variable `variable` in the current step, or
    None: the caller then reads it as usual."""
    reads = getattr(_local, "reads", None)
    return None if reads is None else reads.get(variable)


def read_value(variable):
    """tf.Variable `variable`'s value: grouped in a step, else read as usual."""
    grouped = read(variable)
    return variable.read_value() if grouped is None else grouped


def close_reads():
    """Ends the sharing of grouped reads in the current step: the optimizer
    is about to write the variables."""
    reads = getattr(_local, "reads", None)
    if reads is not None:
        reads.open = False


def _row_gradient(grad, variable):
    """Whether `grad` is rows of `variable` (a tf.IndexedSlices over axis 0
    of a ps variable whose rows have a known shape) that can join its ps'
    one tensor."""
    return (isinstance(grad, tf.IndexedSlices) and _on_ps(variable)
            and variable.shape[1:].is_fully_defined())


def gradients_to_ps(grads, variables):
    """`grads` with the gradients of each ps' variables moved there as one
    tensor per (ps, dtype) and split on the ps: the dense gradients of its
    groupable variables, and the rows of its sparse gradients (an embedding
    shard's), whose indices the ps has already (its lookup sent them).

    Args:
        grads: one gradient (or None) per variable.
        variables: the tf.Variables, in the order of `grads`.
    """
    if tf.executing_eagerly():
        return list(grads)
    groups = {}
    for i, (grad, variable) in enumerate(zip(grads, variables)):
        if (isinstance(grad, tf.Tensor) and groupable(variable)
                and grad.shape == variable.shape):
            groups.setdefault((variable.device, grad.dtype), []).append(i)
        elif _row_gradient(grad, variable):
            groups.setdefault((variable.device, grad.values.dtype), []).append(i)
    moved = list(grads)
    for (device, _), members in groups.items():
        if len(members) < 2:
            continue
        flat = tf.concat([tf.reshape(_values(grads[i]), [-1]) for i in members],
                         axis=0)
        with tf.device(device):
            sizes = [_size_on_ps(grads[i], variables[i]) for i in members]
            if all(isinstance(size, int) for size in sizes):
                pieces = tf.split(flat, sizes)
            else:
                pieces = tf.split(flat, tf.stack(sizes), num=len(sizes))
            for i, piece in zip(members, pieces):
                moved[i] = _as_before(piece, grads[i], variables[i])
    return moved


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _size_on_ps(grad, variable):
    """How many elements `grad` has: static for a dense gradient; for rows,
    counted on the ps from their indices (which are there already)."""
    if not isinstance(grad, tf.IndexedSlices):
        return variable.shape.num_elements()
    return tf.size(grad.indices) * variable.shape[1:].num_elements()


def _as_before(piece, grad, variable):
    if not isinstance(grad, tf.IndexedSlices):
        return tf.reshape(piece, variable.shape)
    shape = tf.concat([tf.shape(grad.indices), variable.shape[1:]], axis=0)
    return tf.IndexedSlices(tf.reshape(piece, shape), grad.indices,
                            grad.dense_shape)
