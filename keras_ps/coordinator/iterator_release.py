"""Dropping a per-worker dataset iterator without stalling its worker.

TF 2.21 destroys a dataset iterator on the thread that drops its last
reference. When the coordinator drops its handle to an iterator on a worker,
that is the worker's thread serving the coordinator's requests, and the
destructor waits for the iterator's autotuning thread to stop. That thread
sleeps between tuning rounds (10 ms at first, doubling up to 60 s), and TF can
miss the wake-up it sends it (it signals before it marks the iterator
cancelled, and the woken thread goes back to sleep). Every later request to
the worker then waits out the sleep: measured here 2.1-2.5 s at the start of a
fit call after one of 3 s, and 14-15 s after one of 27 s, in 1 to 3 of every 4
calls, with TF's own ClusterCoordinator as with keras_ps.

So fit and evaluate hand their iterators over instead of dropping them,
and so does the coordinator for the iterators of a custom loop that the user
drops (`DroppedIterators`: a new `iter(per_worker_dataset)` each epoch), and
for those replaced when a worker that kept its process has its datasets made
again (after a call cancelled on it, a hung or stuck worker re-admitted, a
ps recovery). Each
worker has a release line: a queue on the worker, and a dataset on the worker
whose own background thread takes each iterator from the queue and holds it
until the next one arrives, then drops it. The coordinator's handle is never
the last one, and the destruction (and its wait) runs on tf.data's thread. A
worker thus keeps one released iterator (its buffers and threads) until the
next release. The hand-over runs on an asynchronous executor and is waited for
at most a few seconds, so a hung worker cannot hold the caller longer. A
hand-over that fails (the worker died) is seen at the next one, which then
drops its iterator the plain way and makes the line again. After the cluster
is pushed to the tasks again (a worker re-admitted, a ps recovered) each line
is checked first (an iterator of nothing handed over): a worker that kept its
process keeps its line, since dropping it would destroy what it holds on the
thread serving the worker (a ps recovery was seen to wait 5-36 s on it);
another gets a new line.
"""

import atexit
import collections
import contextlib
import ctypes
import logging
import threading
import time
import uuid
import weakref

import tensorflow as tf

from keras_ps import _constants
from keras_ps import _tf_adapter
from keras_ps.coordinator.worker import RUNNABLE
from keras_ps.strategy._per_worker import PerWorkerValues
from keras_ps.strategy._per_worker import worker_device

logger = logging.getLogger(__name__)

# Elements of the holding dataset; far more than any process releases.
_ENDLESS = 2**62

# Seconds a release waits for its hand-overs to be done on the workers (a few
# milliseconds each), so none is still running when the caller goes on. A
# worker that hung is not waited for longer; its hand-over finishes, or fails,
# on the executor's own thread.
_HAND_OVER_WAIT = 5.0

# Every line's executor, kept for the life of the process: a dropped executor
# first waits for its pending calls, and one to a worker that hung would
# never end. A process makes one per worker, and one more per re-admission.
_EXECUTORS = []


@atexit.register
def _keep_executors_at_exit():
    # Destroying an executor waits for its pending calls and raises the error
    # of one to a worker that died (printed as an ignored exception; that
    # iterator was dropped the plain way, nothing to report). At exit there
    # is nothing left to wait for: the errors are cleared, and each executor
    # gets one more reference so that the interpreter's teardown never
    # destroys it (its thread idles until the process ends, as TF's own do).
    for releaser in list(_RELEASERS):
        releaser.stop()
    for executor in _EXECUTORS:
        _tf_adapter.clear_executor_error(executor)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(executor))


def _nothing():
    """A dataset of no element, without a tuning thread: what a line holds
    after a check that it was kept."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.range(0).with_options(options)


@tf.function
def _holding_dataset(queue):
    def hold(previous, unused_index):
        del previous  # the iterator held so far: dropped on tf.data's thread
        (handle,) = tf.raw_ops.QueueDequeueV2(handle=queue,
                                              component_types=[tf.resource])
        return handle, False

    # The first element comes at once (taking it starts the background
    # thread); the thread then waits in the queue for ever, yielding nothing.
    held = tf.data.Dataset.range(_ENDLESS).scan(queue, hold).filter(
        lambda keep: keep)
    dataset = tf.data.Dataset.from_tensors(True).concatenate(held).prefetch(1)
    options = tf.data.Options()
    options.autotune.enabled = False  # no tuning thread of its own to wait for
    return dataset.with_options(options)


def _enqueue(queue, handle):
    tf.raw_ops.QueueEnqueueV2(handle=queue, components=[handle])


# Traced once per worker (the device is part of a trace's key).
_hand_over = _tf_adapter.traced_once_each(tf.function(_enqueue))


class _ReleaseLine:
    """One worker's queue and holding dataset (see the module docstring)."""

    def __init__(self, index, generation):
        self.worker = index
        self.generation = generation
        self._device = worker_device(index)
        self._executor = _tf_adapter.new_executor()
        _EXECUTORS.append(self._executor)
        with self._on_worker():
            self._queue = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.resource], shapes=[[]], capacity=-1,
                shared_name=f"keras_ps_iterator_release_{uuid.uuid4().hex}")
            self._holder = iter(_holding_dataset(self._queue))
            next(self._holder)

    @contextlib.contextmanager
    def _on_worker(self):
        with _tf_adapter.executor_scope(self._executor), tf.device(self._device):
            yield

    def wait(self, timeout, errors=None):
        """Whether the calls made on the line finished within `timeout`
        seconds (an error of theirs surfaces at the next hand-over, and is
        appended to `errors` if given)."""
        done = threading.Event()

        def wait():
            try:
                self._executor.wait()
            except Exception as error:  # noqa: BLE001  raised again next call
                if errors is not None:
                    errors.append(error)
            finally:
                done.set()
        threading.Thread(target=wait, daemon=True,
                         name=f"release-wait-{self.worker}").start()
        return done.wait(max(0.0, timeout))

    def kept(self, timeout):
        """Whether the line still works after the cluster was pushed to the
        tasks again: an iterator of nothing handed over without an error
        within `timeout` seconds (the worker kept its process, and the line
        its queue). The iterator the line held is dropped meanwhile, on
        tf.data's thread. A line that was not kept is dropped by the
        caller; what it held goes with the worker's old process, or, on a
        worker that hung, is destroyed when that worker answers."""
        errors = []
        try:
            with self._on_worker():
                nothing = iter(_nothing())
            self.hand_over(nothing)
        except Exception as error:  # noqa: BLE001  the worker's process changed
            errors.append(error)
        else:
            if not self.wait(timeout, errors):
                return False
        if errors:
            _tf_adapter.clear_executor_error(self._executor)
            return False
        return True

    def hand_over(self, iterator):
        (handle,) = tf.nest.flatten(iterator, expand_composites=True)
        with self._on_worker():
            _hand_over(self._queue, handle)


class IteratorRelease:
    """The release lines of one coordinator, made on first use per worker
    (none with KERAS_PS_RELEASE_ITERATORS=0).

    Args:
        generation: () -> the coordinator's count of cluster pushes; a
            line made before one may be on a process that is gone, so it is
            checked before its next use (`_ReleaseLine.kept`).
    """

    def __init__(self, generation):
        self._generation = generation
        self._lines = {}
        # fit's release and the release of dropped iterators may overlap.
        self._lock = threading.Lock()
        self.enabled = _constants.env_switch(
            _constants.RELEASE_ITERATORS_ENV_VAR,
            _constants.DEFAULT_RELEASE_ITERATORS)

    def release(self, iterators, workers):
        """Hands each worker's iterator in `iterators` (a `PerWorkerValues`,
        emptied) to that worker's line; those of workers in `workers` that
        do not take calls now are dropped the plain way."""
        if not isinstance(iterators, PerWorkerValues):
            raise TypeError(
                "release_iterators takes the iterators of iter(per_worker_"
                f"dataset). Received: {iterators!r}.")
        values = iterators.take_values()
        if not self.enabled:
            return
        with self._lock:
            self._release_values(values, workers)

    def _release_values(self, values, workers):
        generation = self._generation()
        used = []
        for index, iterator in enumerate(values):
            if (iterator is None or index >= len(workers)
                    or workers[index].state not in RUNNABLE):
                continue
            try:
                line = self._line(index, generation)
                line.hand_over(iterator)
                used.append(line)
            except Exception as error:  # noqa: BLE001  fall back: plain drop
                logger.info("[worker:%d] iterator dropped without its release "
                            "line (%s: %s); the line is made again next time",
                            index, type(error).__name__, error)
                self._discard(index)
        deadline = time.monotonic() + _HAND_OVER_WAIT
        for line in used:
            if not line.wait(deadline - time.monotonic()):
                logger.info("[worker:%d] a hand-over did not finish within "
                            "%gs; it goes on without the caller",
                            line.worker, _HAND_OVER_WAIT)

    def _line(self, index, generation):
        line = self._lines.get(index)
        if line is not None and line.generation != generation:
            # The cluster was pushed again (a worker re-admitted, a ps
            # recovered). A line dropped now would have its held iterator
            # destroyed on the thread serving the worker's requests, the
            # stall lines are for (seen: 5-36 s in a ps recovery): a worker
            # that kept its process keeps its line.
            if line.kept(_HAND_OVER_WAIT):
                line.generation = generation
            else:
                logger.info("[worker:%d] its iterator release line is made "
                            "again: the worker's process changed, or it did "
                            "not answer within %gs", index, _HAND_OVER_WAIT)
                self._discard(index)
                line = None
        if line is None:
            line = self._lines[index] = _ReleaseLine(index, generation)
        return line

    def _discard(self, index):
        # Dropping the holder's iterator cancels its wait in the queue; what it
        # held is destroyed then (on a worker that is still there).
        self._lines.pop(index, None)

    def close(self):
        with self._lock:
            self._lines.clear()


class DroppedIterators:
    """Releases the iterators of `iter(per_worker_dataset)` results that
    the user dropped (a custom loop that makes a new iterator each epoch),
    on a thread of its own, so that dropping one never stalls a worker.

    Args:
        release: `release(values)`, each worker's iterator or None; runs on
            this object's thread.
    """

    def __init__(self, release):
        self._release = release
        self._pending = collections.deque()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = None
        _RELEASERS.add(self)

    def start(self):
        """Starts the thread (before the first iterator is handed out: the
        garbage collector, which reports a drop, must not start threads)."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(
                target=self._run, daemon=True, name="keras_ps-iterator-release")
            self._thread.start()

    def dropped(self, values):
        # Called by the garbage collector, on whatever thread it runs on:
        # only hands the iterators over.
        if self._stopped or self._thread is None or \
                all(value is None for value in values):
            return
        self._pending.append(list(values))
        self._wake.set()

    def _run(self):
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            while self._pending and not self._stopped:
                values = self._pending.popleft()
                try:
                    self._release(values)
                except Exception as error:  # noqa: BLE001  dropped plainly
                    logger.info("dropped iterators released the plain way "
                                "(%s: %s)", type(error).__name__, error)
                del values

    def stop(self, timeout=_HAND_OVER_WAIT + 1.0):
        """Stops the thread; iterators still pending are dropped plainly."""
        self._stopped = True
        self._pending.clear()
        self._wake.set()
        if self._thread is not None and \
                self._thread is not threading.current_thread():
            self._thread.join(timeout)


# Every DroppedIterators of the process, stopped at exit before the
# interpreter tears down what their threads use.
_RELEASERS = weakref.WeakSet()
