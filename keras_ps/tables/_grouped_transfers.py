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
- rows (`gather_rows`): an embedding shard's rows gathered on its ps ride in
  the same one tensor as that ps' group, when the lookup comes before the
  group's first read in the step (the usual order: the embedding comes
  first). The worker splits the rows off by their count, which it knows from
  the ids it sent.
- additions: a step's metric additions are held and sent as one tensor per
  ps, in keras_ps.tables._held_adds.
- gradients (`gradients_to_ps`): the dense gradients of one ps' variables,
  and the gradient rows of its embedding shards, are concatenated on the
  worker and split on the ps, where the optimizer's update of each variable
  runs (the strategy updates a variable under its device). A shard's row
  count is taken on the ps from the rows' indices, which its lookup sent
  there already. The optimizer's learning rate, read with its own ps' group
  at the step's start, rides in every other ps' tensor (`riders`): without
  it each of those ps would fetch it from its ps, one message a step each.
  So does the optimizer's step count (`iterations`), for Adam's updates:
  a passenger of its ps' read (int64, carried as the bytes of floats).

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
from keras_ps import _tf_adapter

_local = threading.local()


def enabled():
    """Whether steps group their transfers (KERAS_PS_GROUP_TRANSFERS)."""
    return _constants.env_switch(_constants.GROUP_TRANSFERS_ENV_VAR,
                                 _constants.DEFAULT_GROUP_TRANSFERS)


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

    def __init__(self, variables, passengers=()):
        groups = {}
        for variable in variables:
            groups.setdefault((variable.device, variable.dtype), []).append(variable)
        # A group of one would move the same one tensor.
        self._groups = [group for group in groups.values() if len(group) > 1]
        self._where = {}
        self._by_ps = {}  # (device, dtype) -> group index
        for g, group in enumerate(self._groups):
            self._by_ps[(group[0].device, group[0].dtype)] = g
            for i, variable in enumerate(group):
                self._where[id(variable)] = (g, i)
        # Int64 scalars read with the first group of their ps, as its bytes.
        self._passengers = [[] for _ in self._groups]
        for passenger in passengers:
            g = next((g for g, group in enumerate(self._groups)
                      if group[0].device == passenger.device), None)
            if g is not None and _carries_int64(self._groups[g][0].dtype):
                self._where[id(passenger)] = (
                    g, len(self._groups[g]) + len(self._passengers[g]))
                self._passengers[g].append(passenger)
        # (graph, group index) -> one tensor per variable, then per passenger
        self._pieces = {}
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
            pieces = self._pieces[key] = _read_group(
                self._groups[where[0]], self._passengers[where[0]])
        return pieces[where[1]]

    def read_already(self, variable):
        """`variable`'s value from its group's transfer if this graph has
        made it (whether or not reads are still shared), else None."""
        where = self._where.get(id(variable))
        if where is None or tf.executing_eagerly():
            return None
        pieces = self._pieces.get(
            (tf.compat.v1.get_default_graph(), where[0]))
        return None if pieces is None else pieces[where[1]]

    def gather_with_group(self, table, rows):
        """Rows `rows` of tf.Variable `table`, moved from its ps in one
        tensor with the group of the same ps and dtype, which is read now
        (its later reads in this graph take their piece). None when there
        is no such group, or it was read already in this graph."""
        if not self.open or tf.executing_eagerly():
            return None
        g = self._by_ps.get((table.device, table.dtype))
        row_shape = table.shape[1:]
        key = (tf.compat.v1.get_default_graph(), g)
        if g is None or key in self._pieces or not row_shape.is_fully_defined():
            return None
        group, passengers = self._groups[g], self._passengers[g]
        with tf.device(table.device):
            gathered = tf.gather(table, rows)
            values = [v.read_value() for v in group]
        # The pieces' gradients are those of the rows and values they carry;
        # TF's own gradients of the concat and split would take the shapes of
        # the ps' tensors, moving them to the worker to get them.
        with _tf_adapter.stop_recording():
            with tf.device(table.device):
                flat = _joined([gathered] + values + [
                    as_bits(p.read_value(), table.dtype) for p in passengers])
            pieces = _split(flat, [tf.size(rows) * row_shape.num_elements()]
                            + [v.shape.num_elements() for v in group]
                            + [_bits_size(table.dtype)] * len(passengers))
            own_rows = tf.reshape(pieces[0], [-1] + row_shape.as_list())
            own_values = [tf.reshape(piece, v.shape)
                          for piece, v in zip(pieces[1:], group)]
            carried = [from_bits(piece) for piece in pieces[1 + len(group):]]
        _tf_adapter.record_operation(
            "KerasPsRowsWithGroup", [own_rows] + own_values,
            [gathered] + values, lambda *grads: list(grads))
        self._pieces[key] = own_values + carried
        return own_rows


def _read_group(group, passengers=()):
    dtype = group[0].dtype
    with tf.device(group[0].device):
        values = [v.read_value() for v in group]
        with _tf_adapter.stop_recording():
            bits = [as_bits(p.read_value(), dtype) for p in passengers]
        flat = _joined(values + bits)
    # Split where the step runs: one tensor crosses.
    pieces = _split(flat, [v.shape.num_elements() for v in group]
                    + [_bits_size(dtype)] * len(passengers))
    own = [tf.reshape(piece, v.shape) for piece, v in zip(pieces, group)]
    with _tf_adapter.stop_recording():
        return own + [from_bits(piece) for piece in pieces[len(group):]]


# -- An int64 scalar (the optimizer's step) carried in a tensor of floats ------
# A step count read with a ps' weights, or sent with a ps' gradients, crosses
# in the one tensor that crosses anyway, as its 8 bytes reinterpreted
# (`tf.bitcast`; the concat, split and transfer copy bytes, no arithmetic
# touches them), so any count is carried exactly.

def _carries_int64(dtype):
    return dtype.is_floating and 8 % dtype.size == 0


def _bits_size(dtype):
    return 8 // dtype.size


def as_bits(value, dtype):
    """Int64 scalar `value` as a vector of `dtype` holding its bytes."""
    return tf.reshape(tf.bitcast(tf.cast(value, tf.int64), dtype), [-1])


def from_bits(piece):
    """The int64 scalar whose bytes vector `piece` holds (see `as_bits`)."""
    if piece.dtype.size == 8:
        return tf.reshape(tf.bitcast(piece, tf.int64), [])
    return tf.reshape(tf.bitcast(tf.reshape(piece, [-1, _bits_size(piece.dtype)]),
                                 tf.int64), [])


@contextlib.contextmanager
def scope(variables, passengers=()):
    """Groups the reads of `variables` (tf.Variables) in the step traced
    inside; an empty list groups nothing. `passengers`: int64 scalar
    tf.Variables read with the first group of their ps (as its bytes, see
    `as_bits`), for `read_already` to give (a passenger without a group on
    its ps is not read)."""
    previous = getattr(_local, "reads", None)
    _local.reads = _StepReads(variables, passengers) if variables else None
    try:
        yield
    finally:
        _local.reads = previous


def read(variable):
    """The grouped value of tf.Variable `variable` in the current step, or
    None: the caller then reads it as usual."""
    reads = getattr(_local, "reads", None)
    return None if reads is None else reads.get(variable)


def read_already(variable):
    """tf.Variable `variable`'s value as the current step's grouped
    transfer brought it, or None when the step has not moved it (see
    `_StepReads.read_already`)."""
    reads = getattr(_local, "reads", None)
    return None if reads is None else reads.read_already(variable)


def read_value(variable):
    """tf.Variable `variable`'s value: grouped in a step, else read as usual."""
    grouped = read(variable)
    return variable.read_value() if grouped is None else grouped


def gather_rows(table, rows):
    """`tf.gather(table, rows)` run on tf.Variable `table`'s ps, the rows
    moved with its ps' grouped reads when the step has some (see the module
    docstring)."""
    reads = getattr(_local, "reads", None)
    if reads is not None:
        gathered = reads.gather_with_group(table, rows)
        if gathered is not None:
            return gathered
    with tf.device(table.device):
        return tf.gather(table, rows)


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


def gradients_to_ps(grads, variables, riders=None):
    """`grads` with the gradients of each ps' variables moved there as one
    tensor per (ps, dtype) and split on the ps: the dense gradients of its
    groupable variables, and the rows of its sparse gradients (an embedding
    shard's), whose indices the ps has already (its lookup sent them).

    Args:
        grads: one gradient (or None) per variable.
        variables: the tf.Variables, in the order of `grads`.
        riders: None, or {name: (scalar tensor on the worker, the device it
            came from)}: values the step holds already (the learning rate
            and the step count, read with their ps' group) that each other
            ps needs. Each joins the one tensor of that ps' gradients of its
            dtype (an int64 one: of a float dtype, as its bytes), which
            crosses anyway, instead of crossing from its own ps as a message
            of its own.

    Returns:
        (the gradients, {ps device: {name: the rider's value there}}); the
        second lacks a rider on a ps whose gradients it could not join, and
        on its own ps.
    """
    if tf.executing_eagerly():
        return list(grads), {}
    groups = {}
    for i, (grad, variable) in enumerate(zip(grads, variables)):
        if (isinstance(grad, tf.Tensor) and groupable(variable)
                and grad.shape == variable.shape):
            groups.setdefault((variable.device, grad.dtype), []).append(i)
        elif _row_gradient(grad, variable):
            groups.setdefault((variable.device, grad.values.dtype), []).append(i)
    moved, landed = list(grads), {}
    for (device, dtype), members in groups.items():
        here = landed.setdefault(device, {})
        rides = [(name, value) for name, (value, origin) in (riders or {}).items()
                 if origin != device and name not in here and _rides_in(value, dtype)]
        if len(members) + len(rides) < 2:
            continue
        flat = _joined([_values(grads[i]) for i in members]
                       + [_riding(value, dtype) for _, value in rides])
        with tf.device(device):
            pieces = _split(flat, [_size_on_ps(grads[i], variables[i])
                                   for i in members]
                            + [_riding_size(value, dtype) for _, value in rides])
            for i, piece in zip(members, pieces):
                moved[i] = _as_before(piece, grads[i], variables[i])
            for (name, value), piece in zip(rides, pieces[len(members):]):
                here[name] = (from_bits(piece) if value.dtype == tf.int64
                              else tf.reshape(piece, []))
    return moved, {device: here for device, here in landed.items() if here}


def _rides_in(value, dtype):
    return value.dtype == dtype or (value.dtype == tf.int64
                                    and _carries_int64(dtype))


def _riding(value, dtype):
    return (as_bits(value, dtype) if value.dtype == tf.int64
            else tf.reshape(value, [1]))


def _riding_size(value, dtype):
    return _bits_size(dtype) if value.dtype == tf.int64 else 1


def _joined(tensors):
    """`tensors` flattened and concatenated: the one tensor that crosses.
    Made on the device around the call."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _split(flat, sizes):
    """`flat` cut into pieces of `sizes` elements (ints, or scalar tensors
    known only when the step runs), on the device around the call."""
    if all(isinstance(size, int) for size in sizes):
        return tf.split(flat, sizes)
    return tf.split(flat, tf.stack(sizes), num=len(sizes))


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
