"""Closures (scheduled calls) and the queue that hands them to workers."""

import abc
import collections
import logging
import threading
import time

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.coordinator import packing
from keras_ps.coordinator.values import RemoteValue
from keras_ps.errors import ClosureCancelledError
from keras_ps.errors import ScheduleUsageError
from keras_ps.strategy._per_worker import PerWorkerValues

logger = logging.getLogger(__name__)


class ClosureListener(abc.ABC):
    """Told what happens to one closure (dynamic data shards keep their
    ledger with it: keras_ps/shards/epoch.py). Called from worker threads."""

    @abc.abstractmethod
    def started(self, worker_index):
        """A worker took the closure and is about to run it."""

    @abc.abstractmethod
    def finished(self, worker_index, output):
        """The closure ran; `output` is its result on the coordinator."""

    @abc.abstractmethod
    def requeued(self):
        """The closure goes back to the queue (its worker was lost)."""

    @abc.abstractmethod
    def retry_after_error(self, error):
        """Whether to run the closure again after it raised `error`."""

    @abc.abstractmethod
    def error(self, error):
        """The error the closure's RemoteValue raises (may add context)."""

    def describe(self):
        """What the closure reads, for errors that cannot wrap the call's
        own (a call given up as stuck); None: nothing to name."""
        return None


class ScheduledShard(abc.ABC):
    """An argument of `coordinator.schedule` that stands for a shard of data.

    The scheduled function receives `arguments()` in its place, and the
    closure reports to `listener(fn)` (a `ClosureListener`).
    """

    @abc.abstractmethod
    def arguments(self):
        """The structure of tensors passed to the function instead."""

    @abc.abstractmethod
    def listener(self, fn):
        """A ClosureListener for the closure of `fn` on this shard."""


class Closure:
    """One scheduled call: a tf.function, its arguments, its RemoteValue."""

    __slots__ = ("fn", "name", "args", "kwargs", "remote_value", "per_worker",
                 "generation", "cancellation", "listener", "outputs_lost",
                 "stuck_on")

    def __init__(self, fn, args, kwargs, per_worker, listener=None):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.per_worker = per_worker  # args hold PerWorkerValues to substitute
        self.name = packing.function_name(fn)
        self.remote_value = RemoteValue(self.name)
        self.generation = 0  # error generation when a worker took it
        self.cancellation = None  # cancels it in flight after another's error
        # Hook for dynamic data shards (keras_ps/shards/epoch.py): an object
        # told when the closure starts on a worker, finishes, is requeued or
        # fails; None for ordinary closures.
        self.listener = listener
        # Times its function ran to its end on a worker and the outputs were
        # lost on the way back to the coordinator.
        self.outputs_lost = 0
        # Workers on which a call holding it was given up as stuck.
        self.stuck_on = set()

    @classmethod
    def of(cls, fn, args, kwargs):
        """The closure of `schedule(fn, args, kwargs)`.

        Raises:
            ScheduleUsageError: `fn` is not a tf.function, or an argument is
                a RemoteValue.
        """
        if not isinstance(fn, (tf.types.experimental.PolymorphicFunction,
                               tf.types.experimental.ConcreteFunction)):
            raise ScheduleUsageError(
                "coordinator.schedule needs a tf.function. Received: "
                f"fn={packing.function_name(fn)!r} of type "
                f"{type(fn).__name__}. Wrap it: fn = tf.function(fn).")
        per_worker = False
        listener = None
        for value in tf.nest.flatten((args, kwargs)):
            if isinstance(value, ScheduledShard):
                # A shard of a keras_ps.ShardedInput epoch: replaced by its
                # arguments; its ledger follows the closure (keras_ps/shards).
                listener = value.listener(fn)
                args, kwargs = tf.nest.map_structure(
                    lambda v: v.arguments() if isinstance(v, ScheduledShard)
                    else v, (args, kwargs))
                continue
            if isinstance(value, RemoteValue):
                raise ScheduleUsageError(
                    "A RemoteValue was passed as an argument to schedule. "
                    f"Received: {value!r}. Call .fetch() on it first, or "
                    "return the value from the scheduled function that needs it.")
            if isinstance(value, PerWorkerValues):
                per_worker = True
        return cls(fn, args, kwargs, per_worker, listener)

    def cancel(self):
        self.remote_value._set_error(ClosureCancelledError(
            "This scheduled function was cancelled because an earlier one "
            "failed. Fix that error and schedule it again."))


class ClosureQueue:
    """Pending closures, the in-flight count, and the first error.

    Thread-safe. Workers take batches of closures of one function (packing);
    the coordinator waits for the queue to drain.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._pending = collections.deque()
        self._inflight = 0
        self._error = None  # first application error, raised once
        self._fatal = None  # a ps failure: raised until the coordinator restarts
        self._stopped = False
        # Bumped by every application error: errors of closures taken before
        # it (already in flight) are not raised again.
        self._generation = 0
        # Cancels the calls in flight when an application error is reported;
        # replaced then, so later closures are not cancelled.
        self._cancellation = _tf_adapter.new_cancellation_manager()

    def wake(self):
        """Makes every blocked `take` check its `interrupted` again."""
        with self._cv:
            self._cv.notify_all()

    def put(self, closure):
        with self._cv:
            self._raise_if_error_locked()
            self._pending.append(closure)
            self._cv.notify()

    def take(self, max_pack, num_takers, interrupted=None):
        """Blocks for work; returns a list of closures of one function, None
        when the queue stops, or [] when `interrupted()` (checked at each
        `wake`) turns true while there is no work."""
        with self._cv:
            while not self._pending and not self._stopped:
                if interrupted is not None and interrupted():
                    return []
                self._cv.wait()
            if self._stopped:
                return None
            # A fair share, so one worker doesn't starve the others.
            limit = packing.pack_limit(len(self._pending), max_pack, num_takers)
            first = self._pending[0]
            if first.listener is not None:
                # A shard closure runs alone: one shard per call keeps the
                # hand-out dynamic (a slow worker holds one shard at a time).
                limit = 1
            run = 0  # closures of the same function at the head of the queue
            while (run < limit and run < len(self._pending)
                   and self._pending[run].fn is first.fn):
                run += 1
            batch = [self._pending.popleft() for _ in range(packing.pack_size(run))]
            self._inflight += len(batch)
            for closure in batch:
                closure.generation = self._generation
                closure.cancellation = self._cancellation
            return batch

    def put_back(self, closures):
        """Requeues closures whose worker was lost (at-least-once); cancels
        them instead if an application error was reported while they were
        in flight (as TF's coordinator, whose `fetch()` then raises
        `CancelledError`), even when `join()` has raised that error since."""
        with self._cv:
            self._inflight -= len(closures)
            if self._error is not None or self._fatal is not None:
                for c in closures:
                    c.cancel()
                self._cv.notify_all()
                return
            cancelled = [c for c in closures if c.generation != self._generation]
            for c in cancelled:
                c.cancel()
            closures = [c for c in closures if c.generation == self._generation]
            if closures:
                # Dynamic data shards: the shard's ledger marks it lost.
                for c in closures:
                    if c.listener is not None:
                        c.listener.requeued()
                self._pending.extendleft(reversed(closures))
            self._cv.notify_all()

    def mark_finished(self, count):
        with self._cv:
            self._inflight -= count
            self._cv.notify_all()

    def mark_failed(self, count, error, generation):
        """An application error: cancel everything pending, remember the error
        (unless an error of the same generation was already reported)."""
        with self._cv:
            self._inflight -= count
            if generation == self._generation:
                self._error = error
                self._generation += 1
                # Long functions still running elsewhere are cancelled, as
                # TF's coordinator does: their fetch() raises CancelledError.
                self._cancel_in_flight_locked()
            self._cancel_pending_locked()
            self._cv.notify_all()

    def mark_cancelled(self, closures):
        """Closures whose call was cancelled in flight by an earlier error."""
        with self._cv:
            self._inflight -= len(closures)
            for closure in closures:
                closure.cancel()
            self._cv.notify_all()

    def mark_fatal(self, count, error):
        with self._cv:
            self._inflight -= count
            if self._fatal is None:
                self._fatal = error
            self._cancel_pending_locked()
            self._cv.notify_all()

    def _cancel_in_flight_locked(self):
        """Cancels the calls in flight (their closures end as cancelled) and
        takes a new cancellation manager, so later closures are not."""
        self._cancellation.start_cancel()
        self._cancellation = _tf_adapter.new_cancellation_manager()

    def _cancel_pending_locked(self):
        while self._pending:
            self._pending.popleft().cancel()

    def _raise_if_error_locked(self):
        if self._fatal is not None:
            raise self._fatal
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def abandon(self):
        """Cancels every pending closure, as an application error does, but
        records no error; closures in flight run on, and if their worker is
        lost they are cancelled instead of run again (an old generation),
        as is an error they raise."""
        with self._cv:
            self._generation += 1
            self._cancel_pending_locked()
            self._cv.notify_all()

    def drain(self, grace, timeout, why):
        """Waits up to `grace` seconds for the calls in flight to end, then
        cancels those still running (logging `why`) and waits until
        `timeout` seconds from now in all.

        Returns:
            True when no call is in flight, False when some still are.
        """
        now = time.monotonic()
        with self._cv:
            if self._wait_no_inflight_locked(now + min(grace, timeout)):
                return True
            logger.warning("[chief] cancelling %d calls in flight %s",
                           self._inflight, why)
            self._cancel_in_flight_locked()
            return self._wait_no_inflight_locked(now + timeout)

    def _wait_no_inflight_locked(self, deadline):
        while self._inflight > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._cv.wait(remaining)
        return True

    def clear_after_fatal(self, timeout):
        """Waits until no closure is in flight, then forgets the errors, so
        the queue takes work again (after the lost ps was given its
        variables back). Closures pending at the failure were cancelled.

        Returns:
            False when calls were still in flight after `timeout` seconds.
        """
        with self._cv:
            if not self._wait_no_inflight_locked(time.monotonic() + timeout):
                return False
            self._fatal = None
            self._error = None
            self._generation += 1
            return True

    def done(self):
        with self._cv:
            self._raise_if_error_locked()
            return not self._pending and self._inflight == 0

    def wait(self, idle_check=None):
        """Waits until nothing is pending or in flight; raises the first error.

        `idle_check` is called periodically and may raise (e.g. when no worker
        has been healthy for too long)."""
        with self._cv:
            while True:
                if self._fatal is not None or self._error is not None:
                    self._raise_if_error_locked()
                if not self._pending and self._inflight == 0:
                    return
                self._cv.wait(0.5)
                if idle_check is not None:
                    idle_check()

    def idle(self):
        """Nothing pending and nothing in flight (never raises)."""
        with self._cv:
            return not self._pending and self._inflight == 0

    def stop(self):
        with self._cv:
            self._stopped = True
            self._cancel_pending_locked()
            self._cv.notify_all()
