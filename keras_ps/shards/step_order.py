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
  the sending op, not for the transfer).
"""

import tensorflow as tf
# Missing public API: which resources an op reads or writes, as automatic
# control dependencies see them (the order below must match theirs), and the
# manager that keeps the Asserts out of their chain of stateful ops.
from tensorflow.python.framework import auto_control_deps as _acd


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
    waits = [_arrival(device, tensors, controls)
             for device, (tensors, controls) in step.waits_by_device().items()]
    with tf.control_dependencies(waits + step.unplaced_waits()):
        begin = make_begin()
    for write in step.final:
        write._add_control_input(begin)  # pylint: disable=protected-access
    return begin


def _arrival(device, tensors, controls):
    """An op on `device` that runs once `tensors` are there and `controls`
    ran: an Assert that always holds, with the tensors as its data."""
    with tf.device(device), tf.control_dependencies(controls):
        holds = tf.constant(True)
        gate = tf.raw_ops.Assert(condition=holds, data=tensors or [holds],
                                 summarize=1)
    acd = getattr(gate.graph, "experimental_acd_manager", None)
    if acd is not None:
        # Not chained after the step's other stateful ops: some of those
        # come after its final writes, which will wait for this gate.
        acd.run_independently(gate)
    return gate


class _Step:
    """The writes of one traced step and what its final writes wait on."""

    def __init__(self, ops):
        self._writes = []  # in program order
        self._bit = {}  # write -> its bit in the masks below
        self._written = {}  # write -> the resource tensors it writes
        self._after = {}  # op -> mask of the writes it runs after
        self._holds = {}  # op -> mask of the writes its value reflects
        self._ordered_after = {}  # op -> ops automatic control deps add
        self._trace(list(ops))
        early = self._early()
        self.final = [w for w in self._writes if not self._bit[w] & early]
        self._final_ids = {id(w) for w in self.final}
        self._final_mask = 0
        for write in self.final:
            self._final_mask |= self._bit[write]
        self._unplaced = []

    # -- what runs after what -------------------------------------------------
    def _trace(self, ops):
        """Fills the masks, in program order. An op runs after the writes
        behind its inputs and control inputs and those automatic control
        dependencies put before it (a resource's last write, and for a write
        also the reads since; stateful ops without a resource in program
        order). Its value reflects the writes behind its data inputs and, for
        a resource it uses, that resource's writes so far."""
        last_write = {}  # resource -> (after, holds, [op]) of its last write
        reads = {}  # resource -> (after, ops) of its reads since
        chain = (0, [])  # the last stateful op without a resource
        for op in ops:
            after = holds = 0
            for tensor in op.inputs:
                source = self._mask(self._after, tensor.op)
                after |= source
                holds |= self._mask(self._holds, tensor.op)
            for control in op.control_inputs:
                after |= self._mask(self._after, control)
            read, written = _resources(op)
            before = []
            for key in list(read) + list(written):
                write_after, write_holds, write_ops = last_write.get(
                    key, (0, 0, []))
                after |= write_after
                holds |= write_holds
                before += write_ops
            for key in written:
                read_after, read_ops = reads.get(key, (0, []))
                after |= read_after
                before += read_ops
            unchained = not read and not written and _acd.op_is_stateful(op)
            if unchained:
                after |= chain[0]
                before += chain[1]
            if written:
                self._bit[op] = 1 << len(self._writes)
                self._writes.append(op)
                self._written[op] = list(written.values())
            self._after[op], self._holds[op] = after, holds
            self._ordered_after[op] = before
            own = self._bit.get(op, 0)
            for key in read:
                read_after, read_ops = reads.get(key, (0, []))
                reads[key] = (read_after | after | own, read_ops + [op])
            for key in written:
                last_write[key] = (after | own, holds | own, [op])
                reads[key] = (0, [])
            if unchained:
                chain = (after | own, [op])

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
    def waits_by_device(self):
        """{device: (tensors, control ops)} the final writes on that device
        consume; the waits of a write whose device is not known go to
        `unplaced_waits` instead."""
        found = {}
        captures = _Captures()
        for write in self.final:
            tensors = [t for t in write.inputs if t.dtype != tf.resource
                       and not self._after_final(t.op)]
            controls = [c for c in list(write.control_inputs) +
                        self._ordered_after[write]
                        if not self._after_final(c)]
            device = write.device or _one_device(
                captures, self._written[write])
            if device is None:
                # Ran, not arrived: the one wait that is not exact.
                self._unplaced += [t.op for t in tensors] + controls
                continue
            kept_tensors, kept_controls = found.setdefault(device, ({}, {}))
            for t in tensors:
                kept_tensors.setdefault(t.ref(), t)
            for c in controls:
                kept_controls.setdefault(id(c), c)
        return {device: (list(t.values()), list(c.values()))
                for device, (t, c) in found.items()}

    def unplaced_waits(self):
        return list({id(op): op for op in self._unplaced}.values())


def _resources(op):
    """({key: tensor} read, {key: tensor} written) by `op`, as automatic
    control dependencies count them."""
    read, written = {}, {}
    for tensor, kind in _acd._get_resource_inputs(op):  # pylint: disable=protected-access
        target = read if kind == _acd.ResourceType.READ_ONLY else written
        target[tensor.ref()] = tensor
    return read, written


class _Captures:
    """Follows a captured resource handle out of nested function graphs to
    the handle it stands for, whose device is the resource's."""

    def __init__(self):
        self._by_graph = {}

    def device(self, tensor):
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

    def _outer(self, graph):
        found = self._by_graph.get(id(graph))
        if found is None:
            found = {id(inner): outer
                     for outer, inner in getattr(graph, "captures", ())}
            self._by_graph[id(graph)] = found
        return found


def _one_device(captures, handles):
    """The device of the resources `handles` stand for, if they share one."""
    devices = {captures.device(h) for h in handles}
    return devices.pop() if len(devices) == 1 else None
