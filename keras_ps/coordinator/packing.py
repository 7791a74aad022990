"""Packing: consecutive closures of one function run as one remote call.

One remote call costs about a millisecond of round trip whatever it does, so
the coordinator runs up to `max_pack` queued calls of the same function in one
traced function on the worker. This module decides how many closures go in a
pack, keeps the packed functions, and says when a new trace must wait.

Pack sizes are exact powers of two, so each function is traced at most
log2(max_pack) + 1 times, all early in a job. That matters because TF
registers every newly traced function on every worker with a synchronous RPC
while holding the GIL: with one worker stopped (SIGSTOP, a hung host) a new
trace freezes the whole coordinator until that worker continues.
"""

import threading
import weakref

import tensorflow as tf


def pack_limit(pending, max_pack, num_takers):
    """The most closures one worker may take now: a fair share of `pending`
    among `num_takers` workers, at most `max_pack`, a power of two."""
    share = -(-pending // max(1, num_takers))
    limit = max(1, min(max_pack, share))
    return 1 << (limit.bit_length() - 1)


def pack_size(run):
    """The size of the pack cut from `run` closures of one function at the
    head of the queue: the largest power of two not above it."""
    return 1 << (run.bit_length() - 1)


class PackedFunctions:
    """The traced `run_all(calls)` of each (function, pack size).

    Entries live as long as the user's function does: `fit` keeps a model's
    step functions until the model is compiled again or discarded, and their
    packed functions are released with them.
    """

    def __init__(self):
        self._by_fn = weakref.WeakKeyDictionary()  # fn -> {count: packed}
        self._lock = threading.Lock()

    def get(self, fn, count):
        """The packed function running `count` calls of `fn`."""
        with self._lock:
            sizes = self._by_fn.setdefault(fn, {})
            packed = sizes.get(count)
            if packed is None:
                packed = sizes[count] = _pack(fn)
            return packed

    def is_traced(self, fn, count):
        with self._lock:
            return count in self._by_fn.get(fn, {})

    def clear(self):
        """Forgets every packed function (their traces are stale: a lost ps
        was given new variables), so `is_traced` tells the truth again."""
        with self._lock:
            self._by_fn = weakref.WeakKeyDictionary()

    def __len__(self):
        """How many (function, pack size) pairs are held."""
        with self._lock:
            return sum(len(sizes) for sizes in self._by_fn.values())

    def without_new_trace(self, batch, trace_is_safe):
        """(batch to run now, closures to put back).

        While some worker may be hung (`trace_is_safe()` is False) and this
        pack size is not traced yet, the batch shrinks to the largest size
        already traced; the rest goes back to the queue. With no size traced
        the whole batch runs (and its trace waits for the hung worker).
        """
        fn = batch[0].fn
        if self.is_traced(fn, len(batch)) or trace_is_safe():
            return batch, []
        for size in range(len(batch) - 1, 0, -1):
            if self.is_traced(fn, size):
                return batch[:size], batch[size:]
        return batch, []


def _pack(fn):
    # The packed function holds `fn` weakly: the cache entry must not keep
    # its own key alive.
    fn_ref = weakref.ref(fn)

    def run_all(calls):
        step = fn_ref()
        results = [step(*args, **kwargs) for args, kwargs in calls]
        # Automatic control dependencies make every output of a tf.function
        # wait for all its stateful ops.
        return results, tf.constant(True)

    return tf.function(run_all)
