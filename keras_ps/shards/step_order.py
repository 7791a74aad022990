"""The order of one traced step inside the shard function: the step is
counted on the ps (its `begin` op) before any of its final updates runs, and
only once everything those updates consume has reached their device.

Why: a step's updates are many ops, on the ps and on the worker, and as
Keras traces them some start before the step's gradients exist (the
optimizer's `iterations += 1` needs nothing from the worker, so it runs as
soon as the ps starts the execution's loop turn). A worker that dies inside a
step then leaves the step half applied, and the retry trains it again. With
the order below, when `begin` runs the ps already holds all that the step's
final updates need, so they run there whatever happens to the worker: a step
counted is a step applied, and the records of the steps counted beyond a
shard's size are exactly the records trained twice.

Terms, for the ops of one step in program order:

- a write: an op that changes a resource (a variable, a table);
- an early write: a write whose effect a later write of the step uses (its
  output, or the resource read again, e.g. a dropout seed's state). It runs
  when its inputs are ready, before `begin`;
- a final write: every other write (the optimizer's updates, `iterations`,
  the metrics, a model's own counters). Each waits for `begin`;
- what a final write waits on: its inputs, its control inputs and the ops
  automatic control dependencies will order it after (earlier uses of its
  resources), unless they come after a final write. `begin` waits until the
  tensors among them are on the device of the write that consumes them: per
  device, one Assert that always holds takes them as data, so it receives
  the very transfers the writes receive (no extra message per tensor; an
  Identity would be turned into a control edge by Grappler, which waits for
  the sending op, not for the transfer). A write that runs a function (a
  cond: Keras' first Ftrl step) receives its inputs through ops made when it
  is lowered, so for it `begin` waits for the ops that make them.
"""

import tensorflow as tf

# Which resources an op uses, as automatic control dependencies see them (the
# order below must match theirs), comes from TF internals.
from keras_ps import _tf_adapter


# Ops that run functions: a cond, a loop, a call.
_FUNCTIONAL_OPS = frozenset((
    "If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile",
    "PartitionedCall", "StatefulPartitionedCall"))


def order_step(ops, make_begin):
    """Makes the final writes among `ops` wait for the op `make_begin()`
    returns, made once what they consume has reached their devices.

    Args:
        ops: the operations of one step, just traced, in program order.
        make_begin: () -> the op that counts the step (it places itself).

    Returns:
        That op.
    """
    step = _Step(ops)
    by_device, unplaced = step.waits()
    gates = [_arrival(device, tensors, controls)
             for device, (tensors, controls) in by_device.items()]
    with tf.control_dependencies(gates + unplaced):
        begin = make_begin()
    for write in step.final:
        _tf_adapter.add_control_input(write, begin)
    return begin


def _arrival(device, tensors, controls):
    """An op on `device` that runs once `tensors` are there and `controls`
    ran: an Assert that always holds, with the tensors as its data."""
    with tf.device(device), tf.control_dependencies(controls):
        holds = tf.constant(True)
        gate = tf.raw_ops.Assert(condition=holds, data=tensors or [holds],
                                 summarize=1)
    # Not chained after the step's other stateful ops: some of those come
    # after its final writes, which will wait for this gate.
    _tf_adapter.run_independently(gate)
    return gate


class _Step:
    """The writes of one traced step and what its final writes wait on.

    Masks hold one bit per write of the step: for each op, the writes it
    runs after (`after`) and the writes its value reflects (`holds`)."""

    def __init__(self, ops):
        self._writes = []  # in program order
        self._bit = {}  # write -> its bit
        self._written = {}  # write -> the resource tensors it writes
        self._after = {}
        self._holds = {}
        self._ordered_after = {}  # op -> ops automatic control deps add
        order = _ResourceOrder()
        for op in ops:
            self._add(op, order)
        early = self._early()
        self.final = [w for w in self._writes if not self._bit[w] & early]
        self._final_ids = {id(w) for w in self.final}
        self._final_mask = 0
        for write in self.final:
            self._final_mask |= self._bit[write]

    def _add(self, op, order):
        """Records `op` (the next in program order): it runs after the
        writes behind its inputs and control inputs and the ops automatic
        control dependencies put before it; its value reflects the writes
        behind its data inputs and the resources it uses."""
        after = holds = 0
        for tensor in op.inputs:
            after |= self._mask(self._after, tensor.op)
            holds |= self._mask(self._holds, tensor.op)
        for control in op.control_inputs:
            after |= self._mask(self._after, control)
        read, written = _resources(op)
        before_after, before_holds, before = order.before(op, read, written)
        after |= before_after
        holds |= before_holds
        if written:
            self._bit[op] = 1 << len(self._writes)
            self._writes.append(op)
            self._written[op] = list(written.values())
        self._after[op], self._holds[op] = after, holds
        self._ordered_after[op] = before
        own = self._bit.get(op, 0)
        order.record(op, read, written, after | own, holds | own)

    def _mask(self, masks, op):
        """`masks[op]` with op's own bit: what comes out of `op` reflects
        it (or runs after it)."""
        return masks.get(op, 0) | self._bit.get(op, 0)

    def _early(self):
        """The writes that run before `begin`: those whose effect the value
        of another write's input reflects (a dropout seed's state, read
        again for the forward pass: `begin` waits for the gradients, so the
        seed's update cannot wait for `begin`), and every write they run
        after."""
        reflected = 0
        for write in self._writes:
            for tensor in write.inputs:
                if tensor.dtype != tf.resource:
                    reflected |= self._mask(self._holds, tensor.op)
        early = reflected
        for write in self._writes:
            if self._bit[write] & reflected:
                early |= self._after[write]
        return early

    def _after_final(self, op):
        return id(op) in self._final_ids or bool(
            self._after.get(op, 0) & self._final_mask)

    # -- what begin waits for ---------------------------------------------------
    def waits(self):
        """({device: (tensors, control ops)} that the final writes on each
        device consume, [ops] behind the final writes whose device is not
        known): `begin` waits for the tensors to be on their device, and
        for the ops to have run (for an op that makes a tensor, not exact:
        the tensor may still be on its way)."""
        by_device, unplaced = {}, {}
        captures = _Captures()
        for write in self.final:
            tensors = [t for t in write.inputs if t.dtype != tf.resource
                       and not self._after_final(t.op)]
            controls = [c for c in list(write.control_inputs) +
                        self._ordered_after[write]
                        if not self._after_final(c)]
            if write.type in _FUNCTIONAL_OPS:
                # Lowered before it runs, it receives its inputs through
                # Switch ops beside their sources: the Assert would receive
                # a second copy. Waits for the sources instead (not exact).
                controls += [t.op for t in tensors]
                tensors = []
            device = write.device or captures.one_device(
                self._written[write])
            if device is None:
                for op in [t.op for t in tensors] + controls:
                    unplaced.setdefault(id(op), op)
                continue
            kept_tensors, kept_controls = by_device.setdefault(
                device, ({}, {}))
            for t in tensors:
                kept_tensors.setdefault(t.ref(), t)
            for c in controls:
                kept_controls.setdefault(id(c), c)
        return ({device: (list(t.values()), list(c.values()))
                 for device, (t, c) in by_device.items()},
                list(unplaced.values()))


class _ResourceOrder:
    """The order automatic control dependencies give the ops of one step:
    a use of a resource after its last write, a write also after the reads
    since; stateful ops without a resource in program order. Holds, per
    resource, the masks (see _Step) of the ops later ones are put after."""

    def __init__(self):
        self._last_write = {}  # resource -> (after, holds, [op])
        self._reads = {}  # resource -> (after, [ops]) since its last write
        self._chain = (0, [])  # the last stateful op without a resource

    def before(self, op, read, written):
        """(after, holds, ops) that `op` is put after."""
        after = holds = 0
        ops = []
        for key in list(read) + list(written):
            write_after, write_holds, write_ops = self._last_write.get(
                key, (0, 0, []))
            after |= write_after
            holds |= write_holds
            ops += write_ops
        for key in written:
            read_after, read_ops = self._reads.get(key, (0, []))
            after |= read_after
            ops += read_ops
        if self._chained(op, read, written):
            after |= self._chain[0]
            ops += self._chain[1]
        return after, holds, ops

    def record(self, op, read, written, after, holds):
        """Notes `op` (with its own bit in `after` and `holds`)."""
        for key in read:
            read_after, read_ops = self._reads.get(key, (0, []))
            self._reads[key] = (read_after | after, read_ops + [op])
        for key in written:
            self._last_write[key] = (after, holds, [op])
            self._reads[key] = (0, [])
        if self._chained(op, read, written):
            self._chain = (after, [op])

    @staticmethod
    def _chained(op, read, written):
        return not read and not written and _tf_adapter.op_is_stateful(op)


def _resources(op):
    """({key: tensor} read, {key: tensor} written) by `op`, as automatic
    control dependencies count them."""
    read, written = {}, {}
    for tensor, read_only in _tf_adapter.resource_inputs(op):
        target = read if read_only else written
        target[tensor.ref()] = tensor
    return read, written


class _Captures:
    """Follows a captured resource handle out of nested function graphs to
    the handle it stands for, whose device is the resource's."""

    def __init__(self):
        self._by_graph = {}

    def device(self, tensor):
        """The device of the resource handle `tensor`, or None."""
        for _ in range(64):  # nesting depth; a cycle is impossible
            if not tf.is_symbolic_tensor(tensor):
                return tensor.device or None
            if tensor.op.device:
                return tensor.op.device
            outer = self._outer(tensor.graph).get(id(tensor))
            if outer is None:
                return None
            tensor = outer
        return None

    def one_device(self, handles):
        """The device of the resources `handles` stand for, if they share
        one (else None)."""
        devices = {self.device(h) for h in handles}
        return devices.pop() if len(devices) == 1 else None

    def _outer(self, graph):
        found = self._by_graph.get(id(graph))
        if found is None:
            found = {id(inner): outer
                     for outer, inner in getattr(graph, "captures", ())}
            self._by_graph[id(graph)] = found
        return found
