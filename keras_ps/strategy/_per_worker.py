"""Which worker a value or a call belongs to.

`PerWorkerValues` holds one value per worker (each worker's dataset iterator);
the dispatch context says which worker the calling thread is running a
closure or a `dataset_fn` for. Both sit below the strategy and the
coordinator: the strategy unwraps per-worker values in `_local_results`, the
coordinator's worker threads set the context.
"""

import threading
import weakref

import tensorflow as tf

_dispatch = threading.local()


def worker_device(index):
    """The device string of worker task `index`."""
    return f"/job:worker/replica:0/task:{index}/device:CPU:0"


def current_worker():
    """(worker_index, num_workers) of the closure this thread dispatches, or None."""
    return getattr(_dispatch, "worker", None)


class IndexWatch:
    """Notes whether Python code read the dispatched worker's index.

    A `dataset_fn` traced without reading it builds the same graph for every
    worker, so one trace can serve them all (`input_context()` contexts note
    their `input_pipeline_id` being read here)."""

    def __enter__(self):
        self.read = False
        self._saved = getattr(_dispatch, "watch", None)
        _dispatch.watch = self
        return self

    def __exit__(self, *exc):
        _dispatch.watch = self._saved


def note_index_read():
    """Tells the watches of this thread that the worker index was read."""
    watch = getattr(_dispatch, "watch", None)
    while watch is not None:
        watch.read = True
        watch = watch._saved


class WorkerInputContext(tf.distribute.InputContext):
    """TF's InputContext, noting when the worker's pipeline id is read."""

    @property
    def input_pipeline_id(self):
        note_index_read()
        return super().input_pipeline_id


class dispatch_scope:  # noqa: N801  (used like a function: `with dispatch_scope(...)`)
    """Within it, this thread dispatches for worker `index` of `num_workers`."""

    def __init__(self, index, num_workers):
        self._value = (index, num_workers)

    def __enter__(self):
        self._saved = getattr(_dispatch, "worker", None)
        _dispatch.worker = self._value

    def __exit__(self, *exc):
        _dispatch.worker = self._saved


class PerWorkerValues:
    """One value per worker (e.g. each worker's dataset iterator).

    Pass it to `coordinator.schedule`: each closure receives the value of the
    worker it runs on. It is not an iterator itself; call `next()` inside the
    scheduled `tf.function`.
    """

    def __init__(self, values, source=None):
        self._values = list(values)
        # What made the values (a per-worker dataset), kept alive as long as
        # they are, so the coordinator can rebuild them on a returning worker.
        self._source = source

    @property
    def values(self):
        return tuple(self._values)

    def replace(self, index, value):
        """Sets worker `index`'s value (a rebuilt iterator on a returning
        worker); returns the value it had (None if none)."""
        while len(self._values) <= index:
            self._values.append(None)
        old, self._values[index] = self._values[index], value
        return old

    def take_values(self):
        """Returns the values and forgets them (see
        `ClusterCoordinator.release_iterators`)."""
        values = list(self._values)
        self._values[:] = [None] * len(values)
        return values

    def on_dropped(self, callback):
        """Calls `callback(values)` with the values still held when this
        object is garbage-collected (not at interpreter exit): the callback
        then holds the last references to them."""
        # The list is changed in place (replace, take_values), never rebound.
        weakref.finalize(self, callback, self._values).atexit = False

    def __len__(self):
        return len(self._values)

    @property
    def type_spec(self):
        """The `tf.TypeSpec` of one worker's value (a per-worker iterator's
        `IteratorSpec`), or None before any worker has a value."""
        for value in self._values:
            if value is not None:
                return tf.type_spec_from_value(value)
        return None

    def __next__(self):
        raise TypeError(
            "next() was called on PerWorkerValues (a per-worker iterator) on "
            "the coordinator. Call next(iterator) inside the tf.function you "
            "pass to coordinator.schedule(fn, args=(iterator,)) instead.")

    def __iter__(self):
        raise TypeError(
            "PerWorkerValues cannot be iterated on the coordinator. Pass it "
            "to coordinator.schedule(fn, args=(value,)); each worker gets its "
            "own element.")

    def __repr__(self):
        return f"<PerWorkerValues of {len(self._values)} workers>"
