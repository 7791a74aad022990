"""Shards on the cluster: the ps-side progress of each shard, the function
that trains one shard on a worker, and the epoch whose ledger its closures
report to.

One scheduled closure trains one shard: a tf.function on the worker that
builds the shard's dataset and runs the step on each batch in a loop. Two
int64 variables on a ps, one entry per shard, make a retry exact:

- `progress[shard]`: records trained by completed steps. Written before each
  execution of `steps_per_execution` steps (covering the executions before
  it, all finished) and at the end. A retry skips that many records of the
  (deterministically shuffled) shard.
- `lease[shard]`: the call that owns the shard. A call claims it when it
  starts and checks it before running each execution's steps, so a worker
  that was given up as hung and continues later applies at most the
  execution it had started.
- `started[shard]`: records of the executions a call has started (marked
  before its lease check). The next attempt counts `started - progress`:
  the records a lost attempt may have applied, which it trains again.

So a record is trained twice only when its step was in flight on a worker
that failed: at most one execution per lost attempt, counted in the
ledger (`records_retrained_max`: an upper bound, exact unless a worker dies
between marking an execution and applying it).
"""

import itertools
import logging
import weakref

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.coordinator.closures import ClosureListener
from keras_ps.coordinator.closures import ScheduledShard
from keras_ps.errors import KerasPSError
from keras_ps.shards.ledger import ShardLedger, ShardState

logger = logging.getLogger(__name__)

_PS_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"
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


def _run(step_fn, batch):
    step_fn(batch)
    return tf.constant(True)


class _ShardsOnCluster:
    """The progress and lease variables of one ShardedInput on a ps."""

    def __init__(self, sharded_input, coordinator):
        self.input = sharded_input
        self.coordinator = coordinator
        n = sharded_input.num_shards
        with tf.device(_PS_DEVICE):
            self.progress = tf.Variable(tf.zeros([n], tf.int64),
                                        name="keras_ps_shard_progress",
                                        trainable=False)
            self.lease = tf.Variable(tf.zeros([n], tf.int64),
                                     name="keras_ps_shard_lease",
                                     trainable=False)
            self.started = tf.Variable(tf.zeros([n], tf.int64),
                                       name="keras_ps_shard_started",
                                       trainable=False)
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
        for variable in (self.progress, self.lease, self.started):
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
        key = (step_fn, steps_per_execution)
        fn = self._functions.get(key)
        if fn is None:
            # Autograph on, so the functions read_fn passes to tf.data (e.g.
            # a map with Python control flow) are converted as they are in
            # a dataset_fn; the step itself runs unconverted (see _build).
            fn = tf.function(self._build(step_fn, steps_per_execution))
            # Read by the shard's listener: a lost attempt may have applied
            # up to this many steps that its retry runs again.
            fn._keras_ps_steps_per_execution = steps_per_execution
            self._functions[key] = fn
        return fn

    def _build(self, step_fn, steps_per_execution):
        data, progress, lease = self.input, self.progress, self.lease
        started = self.started
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
                start = tf.reshape(progress.sparse_read(one), [])
                marked = tf.reshape(started.sparse_read(one), [])
            # Batches an earlier attempt had started and not finished: it
            # may have applied them, and this attempt trains them again.
            retrained = tf.maximum(marked - start, 0)
            batches = data.records(index, seed).skip(start).batch(batch_size)
            iterator = iter(batches.with_options(_shard_options()))

            def owned():
                return tf.equal(tf.reshape(lease.sparse_read(one), []), token)

            def write_progress(done):
                return tf.raw_ops.ResourceScatterUpdate(
                    resource=progress.handle, indices=one,
                    updates=tf.reshape(start + done, [1]))

            def execution(done):
                # Reads the next `steps_per_execution` batches, marks them
                # started, checks the lease, then runs the steps. `done`
                # counts only finished steps: the loop variables of an
                # iteration wait for all of its stateful ops. Progress,
                # marker and lease cost a few ps ops per execution, which
                # keeps the per-step cost of dynamic shards low.
                with tf.control_dependencies([write_progress(done)]):
                    optionals = [iterator.get_next_as_optional()]
                for _ in range(steps_per_execution - 1):
                    optionals.append(iterator.get_next_as_optional())
                sizes = [tf.cond(o.has_value(),
                                 lambda o=o: _batch_size(o.get_value()),
                                 lambda: tf.constant(0, tf.int64))
                         for o in optionals]
                total = tf.add_n(sizes)
                # Marked before the lease check: a call that loses the lease
                # after this has its batches counted by the next attempt
                # (maybe trained twice); one that lost it before applies
                # nothing. Monotonic (max), so a late call cannot lower it.
                mark = tf.raw_ops.ResourceScatterMax(
                    resource=started.handle, indices=one,
                    updates=tf.reshape(start + done + total, [1]))
                with tf.control_dependencies([mark]):
                    keep = owned()

                def run_steps():
                    for o in optionals:
                        tf.cond(o.has_value(),
                                lambda o=o: _run(step_fn, o.get_value()),
                                lambda: tf.constant(False))
                    return done + total, optionals[-1].has_value()

                return tf.cond(keep, run_steps,
                               lambda: (tf.identity(done), tf.constant(False)))

            def body(done, _):
                return execution(done)

            done, _ = tf.while_loop(
                lambda done, running: running, body,
                (tf.constant(0, tf.int64), tf.constant(True)),
                parallel_iterations=1)

            # Only the owner reports its progress (a call given up as hung
            # that continues later has lost the lease).
            def report():
                with tf.control_dependencies([write_progress(done)]):
                    return tf.constant(True)

            final = tf.cond(owned(), report, lambda: tf.constant(False))
            with tf.control_dependencies([final]):
                return (tf.identity(start), tf.identity(done),
                        tf.identity(retrained))

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
        return self.ledger.summary()

    def snapshot(self):
        return dict(self.ledger.snapshot(), seed=self._state.input.seed)


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
        return _ShardListener(self._epoch, self.index, getattr(
            fn, "_keras_ps_steps_per_execution", 1))

    def __repr__(self):
        return (f"<shard {self.index} of epoch {self._epoch.epoch}: "
                f"{self._epoch.ledger.description(self.index)}>")


class _ShardListener(ClosureListener):
    """Told by the coordinator's worker threads what happens to one shard's
    closure; moves the shard in the ledger."""

    def __init__(self, epoch, index, steps_per_execution):
        self._epoch = epoch
        self._ledger = epoch.ledger
        self.index = index
        self.steps_per_execution = steps_per_execution
        self._max_attempts = epoch._state.input.max_attempts

    def started(self, worker):
        self._ledger.hand_out(self.index, worker)

    def finished(self, worker, output):
        start, done, retrained = (int(t.numpy()) for t in output)
        self._ledger.finish(self.index, worker, start, done, retrained)

    def requeued(self, reason="its worker failed"):
        """The closure goes back to the queue (its worker failed, hung or
        left). The retry counts what the lost attempt may have applied."""
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
        wrapped = ShardReadError(
            f"Shard {self.index} of {len(self._ledger)} "
            f"({self._ledger.description(self.index)}) failed on "
            f"{self._ledger.attempts(self.index)} attempts (workers "
            f"{self._ledger.workers_tried(self.index)}): "
            f"{type(error).__name__}: {first} {fix}")
        wrapped.__cause__ = error
        return wrapped
