"""Shards on the cluster: the ps-side progress of each shard, the function
that trains one shard on a worker, and the epoch whose ledger its closures
report to.

One scheduled closure trains one shard: a tf.function on the worker that
builds the shard's dataset and runs the step on each batch in a loop, in
executions of `max(steps_per_execution, MIN_STEPS_PER_EXECUTION)` steps.
Three int64 variables on a ps, one entry per shard:

- `begun[shard]`: records of every step of the shard that began, on any
  attempt (a late one too). A step begins with one op on the ps that the
  step's final updates wait for, and which runs once everything those
  updates consume is on their device (keras_ps/shards/step_order.py): from
  then on the ps applies them whatever happens to the worker, so a step
  counted is a step applied. Every record of a shard is begun at least once;
  the records begun beyond the shard's size are the records trained twice,
  the epoch's `records_retrained`.
- `applied[shard]`: records of the owner's applied steps. After each step,
  ops on the ps with a control dependency on every stateful op of the step
  read the lease and, if the call still owns the shard, raise it (a max).
  A retry resumes there (the shard's order is deterministic).
- `lease[shard]`: the call that owns the shard. A call claims it when it
  starts and checks it after reading each execution's batches, before
  running their steps, so a worker that was given up as hung and continues
  later applies at most the rest of the execution it was in (each of those
  steps counted when it begins).

A step of a lost attempt that began but was not marked applied (its worker
died or left inside the step, or a retry claimed the shard first) is
trained again by the retry, and counted twice in `begun`.

A full execution runs its steps unconditionally (the loop's condition
checks that all its batches were read and the lease held); the shard's
last, shorter execution runs after the loop, each step under a condition.
The progress values of an execution are sent to the ps once and sliced
there, so the per-step ops need nothing from the worker but the step.
"""

import itertools
import logging
import weakref

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.coordinator.closures import ClosureListener
from keras_ps.coordinator.closures import ScheduledShard
from keras_ps.errors import KerasPSError
from keras_ps.shards import step_order
from keras_ps.shards.ledger import ShardLedger, ShardState

logger = logging.getLogger(__name__)

_PS_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"
# Fewest steps between two lease checks (see ShardedInput.shard_function).
MIN_STEPS_PER_EXECUTION = 4
_tokens = itertools.count(1)
_states = weakref.WeakKeyDictionary()  # ShardedInput -> {coordinator id: state}


class ShardReadError(KerasPSError, RuntimeError):
    """A shard failed on every attempt (a missing file, a corrupt record, or
    an error in the step)."""


def state_for(sharded_input, coordinator):
    """The ps state of `sharded_input` on `coordinator`'s cluster (made once)."""
    per_input = _states.setdefault(sharded_input, {})
    state = per_input.get(id(coordinator))
    if state is None:
        state = _ShardsOnCluster(sharded_input, coordinator)
        per_input[id(coordinator)] = state
    return state


def _call_token():
    """Inside the shard function: a number unique to each remote call (fed
    at call time, so one trace serves every call)."""
    return _tf_adapter.capture_call_time_value(
        lambda: tf.constant(next(_tokens), tf.int64),
        tf.TensorSpec([], tf.int64), "keras_ps_shard_call")


def _shard_options():
    """tf.data options for a shard's pipeline, built once per shard: no
    static graph rewrites (their optimizer pass costs more CPU than a short
    shard's reads) and no autotuning thread."""
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.autotune.enabled = False
    return options


def _batch_size(batch):
    return tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]


class _ShardsOnCluster:
    """The progress, lease and begun-step variables of one ShardedInput on
    a ps."""

    def __init__(self, sharded_input, coordinator):
        self.input = sharded_input
        self.coordinator = coordinator
        n = sharded_input.num_shards
        with tf.device(_PS_DEVICE):
            self.applied = tf.Variable(tf.zeros([n], tf.int64),
                                       name="keras_ps_shard_applied",
                                       trainable=False)
            self.lease = tf.Variable(tf.zeros([n], tf.int64),
                                     name="keras_ps_shard_lease",
                                     trainable=False)
            self.begun = tf.Variable(tf.zeros([n], tf.int64),
                                     name="keras_ps_shard_begun",
                                     trainable=False)
        for variable in (self.applied, self.lease, self.begun):
            # Made again (zeros) if their ps is lost and recovered; each
            # epoch, a recovered one included, sets them anew.
            coordinator.strategy.track_ps_variable(variable)
        self._functions = {}
        self.current = None

    def new_epoch(self, epoch, ledger=None):
        """Resets progress and leases (no shard of this input may be in
        flight) and returns the epoch."""
        if self.current is not None and not self.current.settled() and \
                not self.coordinator.is_idle():
            raise RuntimeError(
                "A new epoch of this ShardedInput started while shards of "
                f"epoch {self.current.epoch} are still running. Call "
                "coordinator.join() first.")
        n = self.input.num_shards
        for variable in (self.applied, self.lease, self.begun):
            variable.assign(tf.zeros([n], tf.int64))
        if ledger is None:
            ledger = ShardLedger(self.input.descriptions,
                                 list(self.input.shard_records), epoch,
                                 self.input.order(epoch))
        self.current = ShardedEpoch(self, ledger)
        logger.info("[chief] epoch %d: %d shards (%d already done), %s", epoch,
                    n, ledger.count(ShardState.DONE), self.input)
        return self.current

    def shard_function(self, step_fn, steps_per_execution=1):
        # Each execution costs a lease read and a turn of a loop whose frame
        # spans the worker and the ps, more than a tiny step: at least
        # MIN_STEPS_PER_EXECUTION steps run between two lease checks.
        steps_per_execution = max(steps_per_execution, MIN_STEPS_PER_EXECUTION)
        key = (step_fn, steps_per_execution)
        fn = self._functions.get(key)
        if fn is None:
            # Autograph on, so the functions read_fn passes to tf.data (e.g.
            # a map with Python control flow) are converted as they are in
            # a dataset_fn; the step itself runs unconverted (see _build).
            fn = tf.function(self._build(step_fn, steps_per_execution))
            self._functions[key] = fn
        return fn

    def _build(self, step_fn, steps_per_execution):
        data, applied, lease, begun = (self.input, self.applied, self.lease,
                                       self.begun)
        # As keras_ps' own step functions: traced as written, not converted.
        step_fn = tf.autograph.experimental.do_not_convert(step_fn)
        batch_size = data.batch_size

        def train_shard(shard):
            index, seed = shard
            token = _call_token()
            one = tf.reshape(index, [1])
            claim = tf.raw_ops.ResourceScatterUpdate(
                resource=lease.handle, indices=one,
                updates=tf.reshape(token, [1]))
            with tf.control_dependencies([claim]):
                start = tf.reshape(applied.sparse_read(one), [])
            batches = data.records(index, seed).skip(start).batch(batch_size)
            iterator = iter(batches.with_options(_shard_options()))
            with tf.device(_PS_DEVICE):  # sent to the ps once, not per step
                ps_one, ps_token = tf.identity(one), tf.identity(token)

            def read():
                # The next execution's batches, then the lease: a call given
                # up as hung while it read applies none of them.
                optionals = [iterator.get_next_as_optional()
                             for _ in range(steps_per_execution)]
                flags = [o.has_value() for o in optionals]
                with tf.control_dependencies(flags):
                    keep = tf.equal(
                        tf.reshape(lease.sparse_read(one), []), token)
                return optionals, keep

            def step(batch, i, progress):
                # The step; then, on the ps, once what its final updates
                # consume is there, `begin` counts its records in `begun`
                # and lets those updates run; after every stateful op of the
                # step, the lease: the owner's step raises `applied` (a step
                # of a call that lost the shard leaves it to the owner).
                # `progress` holds the execution's marks and batch sizes: one
                # tensor sent to the ps per execution, sliced there.
                graph = tf.compat.v1.get_default_graph()
                first = len(graph.get_operations())
                step_fn(batch)
                ops = graph.get_operations()[first:]
                stateful = [op for op in ops if op.op_def.is_stateful]

                def count_begin():
                    with tf.device(_PS_DEVICE):
                        return tf.raw_ops.ResourceScatterAdd(
                            resource=begun.handle, indices=ps_one,
                            updates=progress[1, i:i + 1])

                begin = step_order.order_step(ops, count_begin)
                with tf.device(_PS_DEVICE):
                    with tf.control_dependencies(stateful + [begin]):
                        mine = tf.equal(tf.reshape(
                            lease.sparse_read(ps_one), []), ps_token)
                    # A late step leaves `applied` to the owner (in a later
                    # epoch, raising it would skip that epoch's records).
                    return tf.raw_ops.ResourceScatterMax(
                        resource=applied.handle, indices=ps_one,
                        updates=tf.where(mine, progress[0, i:i + 1],
                                         tf.zeros([1], tf.int64)))

            def run(optionals, done, tail):
                # In the shard's last execution some batches may be missing:
                # those present are the first `count` (the iterator ran out
                # after them).
                sizes = tf.stack([
                    tf.cond(o.has_value(),
                            lambda o=o: _batch_size(o.get_value()),
                            lambda: tf.constant(0, tf.int64)) if tail
                    else _batch_size(o.get_value()) for o in optionals])
                progress = tf.stack([start + done + tf.cumsum(sizes), sizes])
                if not tail:
                    for i, o in enumerate(optionals):
                        step(o.get_value(), i, progress)
                    return done + tf.reduce_sum(sizes)

                # One loop over them, so the step is traced once here, not
                # once per batch that may be missing (a heavy step, e.g. a
                # DynamicEmbedding's, takes seconds to trace).
                count = tf.add_n([tf.cast(o.has_value(), tf.int32)
                                  for o in optionals])

                def tail_step(i):
                    batch = tf.switch_case(
                        i, [lambda o=o: o.get_value() for o in optionals])
                    # The next batch's step after this one's updates.
                    with tf.control_dependencies([step(batch, i, progress)]):
                        return i + 1

                tf.while_loop(lambda i: i < count, tail_step,
                              (tf.constant(0),), parallel_iterations=1)
                return done + tf.reduce_sum(sizes)

            def full(done, optionals, keep):
                del done
                return tf.logical_and(keep, optionals[-1].has_value())

            def body(done, optionals, keep):
                done = run(optionals, done, tail=False)
                return (done,) + read()

            # Executions of `steps_per_execution` full steps run without a
            # condition on the ps; the last, shorter one runs after the loop.
            done, optionals, keep = tf.while_loop(
                full, body, (tf.constant(0, tf.int64),) + read(),
                parallel_iterations=1)
            done = tf.cond(keep, lambda: run(optionals, done, tail=True),
                           lambda: tf.identity(done))
            # One output: one copy back to the coordinator.
            return tf.stack([start, done])

        train_shard.__name__ = (
            f"keras_ps_train_shard_{getattr(step_fn, '__name__', 'step')}"
            f"_x{steps_per_execution}")
        return train_shard


class ShardedEpoch:
    """One epoch of a ShardedInput: its ledger and the shards to schedule.

    Iterating gives a shard object per shard still to train, in this epoch's
    order; pass each to `coordinator.schedule` with the input's
    `shard_function`. `summary()` gives the epoch's figures.
    """

    def __init__(self, state, ledger):
        self._state = state
        self.ledger = ledger
        self.epoch = ledger.epoch
        self._abandoned = False

    def __iter__(self):
        for index in self.ledger.todo():
            yield _ShardTicket(self, index)

    def __len__(self):
        return len(self.ledger)

    def settled(self):
        """No shard of the epoch is handed out or queued again (or the epoch
        was abandoned after an error)."""
        return self._abandoned or (
            self.ledger.count(ShardState.HANDED_OUT) == 0 and
            self.ledger.count(ShardState.LOST) == 0)

    def abandon(self):
        """An error ended the epoch: its unfinished shards are dropped (the
        next epoch resets every lease, so a closure still running stops)."""
        self._abandoned = True

    def summary(self):
        self._count_retrained()
        return self.ledger.summary()

    def snapshot(self):
        self._count_retrained()
        return dict(self.ledger.snapshot(), seed=self._state.input.seed)

    def _count_retrained(self):
        # The ps counts of this epoch (a later epoch resets them).
        if self._state.current is self:
            self.ledger.set_begun(self._state.begun.numpy(),
                                  self._state.applied.numpy())


class _ShardTicket(ScheduledShard):
    """A shard to schedule. `coordinator.schedule` replaces it by its
    arguments and reports the closure's fate to its listener."""

    def __init__(self, epoch, index):
        self._epoch = epoch
        self.index = index
        data = epoch._state.input
        self._args = (tf.constant(index, tf.int64),
                      tf.constant(data.shard_seed(epoch.epoch, index), tf.int64))

    def arguments(self):
        return self._args

    def listener(self, fn):
        del fn  # every shard function reports the same way
        return _ShardListener(self._epoch, self.index)

    def __repr__(self):
        return (f"<shard {self.index} of epoch {self._epoch.epoch}: "
                f"{self._epoch.ledger.description(self.index)}>")


class _ShardListener(ClosureListener):
    """Told by the coordinator's worker threads what happens to one shard's
    closure; moves the shard in the ledger."""

    def __init__(self, epoch, index):
        self._epoch = epoch
        self._ledger = epoch.ledger
        self.index = index
        self._max_attempts = epoch._state.input.max_attempts

    def started(self, worker):
        self._ledger.hand_out(self.index, worker)

    def finished(self, worker, output):
        start, done = (int(n) for n in output.numpy())
        self._ledger.finish(self.index, worker, start, done)

    def requeued(self, reason="its worker failed"):
        """The closure goes back to the queue (its worker failed, hung or
        left). The retry resumes after the steps the lost attempt applied."""
        if self._ledger.state(self.index) is not ShardState.HANDED_OUT:
            return  # put back before it ran: nothing was in flight
        self._ledger.lose(self.index, reason)

    def retry_after_error(self, error):
        """An error in the shard's function: True to run it again (on
        whichever worker takes it), False when its attempts are used up."""
        if self._ledger.attempts(self.index) < self._max_attempts:
            self.requeued(f"{type(error).__name__}; retrying")
            return True
        self._ledger.fail(self.index, type(error).__name__)
        return False

    def describe(self):
        return (f"shard {self.index} of {len(self._ledger)} "
                f"({self._ledger.description(self.index)})")

    def error(self, error):
        """The error the user sees: names the shard, its file or records,
        and the workers that tried."""
        data = self._epoch._state.input
        lines = [l.strip() for l in str(error).splitlines() if l.strip()]
        # The first line, unless it only introduces the next ones (TF's
        # "in user code:"): then the last, which holds the error itself.
        first = "" if not lines else lines[-1] if lines[0].endswith(":") \
            else lines[0]
        name = type(error).__name__
        if first.startswith(f"{name}: "):
            first = first[len(name) + 2:]
        fix = ("Fix: check that the file exists and is readable on every "
               "worker, and that read_fn parses its records (a corrupt file "
               "can be removed from the list)." if data.kind == "files" else
               "Fix: the records or the step raise this error; check the "
               "data in this range.")
        shard = self.describe()
        wrapped = ShardReadError(
            f"{shard[0].upper()}{shard[1:]} failed on "
            f"{self._ledger.attempts(self.index)} attempts (workers "
            f"{self._ledger.workers_tried(self.index)}): "
            f"{type(error).__name__}: {first} {fix}")
        wrapped.__cause__ = error
        return wrapped
