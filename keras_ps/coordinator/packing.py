"""Packing: consecutive closures of one function run as one remote call.

One remote call costs about a millisecond of round trip whatever it does, so
the coordinator runs up to `max_pack` queued calls of the same function in one
traced function on the worker. This module decides how many closures go in a
pack, keeps the packed functions, and says when a new trace must wait.

Pack sizes are exact powers of two, so each function is traced at most
log2(max_pack) + 1 times, all early in a job. That matters because TF
registers every newly traced function on every worker with a synchronous RPC:
with one worker stopped (SIGSTOP, a hung host) a new trace waits until that
worker continues (only the tracing thread: keras_ps has TF register functions
without holding the GIL, see `_tf_adapter.register_functions_without_the_gil`).

A function marked with `loop_packable` (fit's and evaluate's step functions)
is packed in a loop instead: one traced function runs any number of calls
with the same arguments (a worker's iterator), its outputs stacked. Its graph
does not grow with the pack, so it is traced and instantiated on a worker
once, not once per pack size: an unrolled pack of 16 steps of a large model
took minutes to instantiate on a worker, each new size again. It may name a
stand-in (fit's steps in a loop for its steps written out) that runs in its
place while tracing it would wait for a worker that may be hung.
"""

import collections
import contextlib
import logging
import threading
import weakref

import tensorflow as tf

from keras_ps import _exit_guard
from keras_ps import _native

# Functions whose closures may run in a loop (see `loop_packable`).
_LOOP_PACKABLE = weakref.WeakSet()
_LOOP = "loop"  # the key of a looped pack among a function's pack sizes
# Function -> a function computing the same from the same arguments, run in
# its place while tracing it would wait for a hung worker.
_STAND_INS = weakref.WeakKeyDictionary()
_STOOD_IN = weakref.WeakSet()  # functions whose stand-in has run (logged)
# The job of TF's eager context before it connects to a cluster: a variable
# made then stays on it, a device no task of the cluster can reach.
_UNCONNECTED_JOB = "localhost"

logger = logging.getLogger(__name__)


def loop_packable(fn, stand_in=None):
    """Marks `fn`, a tf.function whose outputs are all tensors of the same
    shapes at every call, as packable in a loop; returns it.

    `stand_in`: another such function giving the same results from the same
    arguments (fit's steps in a loop for its steps written out): a worker
    runs it instead of `fn` while `fn` is not traced and a worker may be
    hung. Decided when the call runs, not when it was scheduled: a worker
    may stop in between.
    """
    _LOOP_PACKABLE.add(fn)
    if stand_in is not None:
        _STAND_INS[fn] = stand_in
    return fn


class Pack:
    """How one batch of closures runs: `function(*args)` returns
    `(results, token)`; `split(local results)` gives each closure's."""

    def __init__(self, function, args, split):
        self.function, self.args, self.split = function, args, split


def _same_call(calls):
    first = [id(x) for x in tf.nest.flatten(calls[0])]
    return all([id(x) for x in tf.nest.flatten(c)] == first for c in calls[1:])


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

    def __init__(self, strategy=None):
        """`strategy`: the cluster the functions run on; they are traced for
        it (keras_ps._native.tracing_for: its tasks' C++ kernels)."""
        self._by_fn = weakref.WeakKeyDictionary()  # fn -> {count: packed}
        # fn -> the counts whose trace finished. A trace under way is not
        # counted: it may be waiting for a hung worker (see `prepare`).
        self._traced = weakref.WeakKeyDictionary()
        self._under_way = weakref.WeakKeyDictionary()  # fn -> {key: threads}
        self._claims = {}  # thread id -> (fn, key) it was let through to trace
        self._checked = weakref.WeakSet()  # traced functions whose captures passed
        self._lock = threading.Lock()
        self._strategy = strategy

    def _get(self, fn, key):
        """The packed function of `fn` for `key`: a pack size (unrolled) or
        `_LOOP`."""
        with self._lock:
            sizes = self._by_fn.setdefault(fn, {})
            packed = sizes.get(key)
            if packed is None:
                packed = sizes[key] = _loop(fn) if key == _LOOP else _pack(fn)
            return packed

    def prepare(self, fn, calls):
        """The Pack running `calls` (each `(args, kwargs)`) of `fn`, traced:
        in a loop when `fn` is loop-packable and the calls share their
        arguments, else unrolled."""
        looped = fn in _LOOP_PACKABLE and _same_call(calls)
        key = _LOOP if looped else len(calls)
        # Not cut short by the process' exit: see keras_ps._exit_guard.
        with _exit_guard.tf_section(), _native.tracing_for(self._strategy), \
                self._tracing(fn, key):
            if looped:
                count = tf.constant(len(calls))
                function = self._get(fn, _LOOP).get_concrete_function(
                    calls[0], count)
                self._check_captures(fn, function)
                return Pack(function, (calls[0], count),
                            lambda stacked: _unstack(stacked, len(calls)))
            function = self._get(fn, len(calls)).get_concrete_function(calls)
            self._check_captures(fn, function)
            return Pack(function, (calls,), list)

    def _check_captures(self, fn, function):
        """Refuses a traced function that reads a variable made before the
        strategy connected to the cluster (TF's workers fail it with
        "/job:localhost/... unknown device"). Once per traced function."""
        if function in self._checked:
            return
        for variable in function.variables:
            if tf.DeviceSpec.from_string(variable.device).job == _UNCONNECTED_JOB:
                raise ValueError(
                    f"The scheduled function '{function_name(fn)}' reads variable "
                    f"'{variable.name}' (shape {variable.shape}), which was "
                    f"created before the keras_ps strategy connected to the "
                    f"cluster: it lives on {variable.device}, a device no "
                    f"worker can reach. Create it after `ParameterServerStrategy("
                    f"...)`: inside `with strategy.scope():` to place it on a "
                    f"ps, or outside the scope to keep it on the coordinator. "
                    f"A Keras model or optimizer made before the strategy is "
                    f"the same case: create it after.")
        self._checked.add(function)

    @contextlib.contextmanager
    def _tracing(self, fn, key):
        """Counts the pack as traced only once its trace returned: until
        then it waits to be registered on every worker, a hung one too, and
        the other workers' threads must not join that wait while a size
        traced already, or a stand-in, can run (`without_new_trace`)."""
        with self._lock:
            # This thread's claim becomes its count here, in one step: no
            # other thread sees the size free in between.
            self._give_back_claim()
            new = key not in self._traced.get(fn, ())
            if new:
                self._under_way.setdefault(fn, collections.Counter())[key] += 1
        try:
            yield
            if new:
                with self._lock:
                    self._traced.setdefault(fn, set()).add(key)
        finally:
            if new:
                with self._lock:
                    self._under_way[fn][key] -= 1

    def _claim(self, fn, count):
        """Lets this thread trace the pack of `count` calls of `fn` unless
        another thread's trace of it is under way (or let through): checked
        and counted at once, so two threads never both start it."""
        key = _LOOP if fn in _LOOP_PACKABLE else count
        with self._lock:
            keys = self._under_way.setdefault(fn, collections.Counter())
            if keys[key] > 0:
                return False
            keys[key] += 1
            self._claims[threading.get_ident()] = (fn, key)
            return True

    def release_claim(self):
        """Forgets this thread's claim if its batch never reached `prepare`."""
        with self._lock:
            self._give_back_claim()

    def _give_back_claim(self):  # under self._lock
        claim = self._claims.pop(threading.get_ident(), None)
        if claim is not None:
            self._under_way[claim[0]][claim[1]] -= 1

    def is_traced(self, fn, count):
        """Whether a pack of `count` calls of `fn` has a finished trace."""
        with self._lock:
            sizes = self._traced.get(fn, ())
            return count in sizes or _LOOP in sizes

    def clear(self):
        """Forgets every packed function (their traces are stale: a lost ps
        was given new variables), so `is_traced` tells the truth again."""
        with self._lock:
            self._by_fn = weakref.WeakKeyDictionary()
            self._traced = weakref.WeakKeyDictionary()

    def sizes(self, fn):
        """The packs of `fn` traced: pack sizes, or "loop"."""
        with self._lock:
            return sorted(self._traced.get(fn, ()), key=str)

    def has_fallback(self, fn):
        """Whether closures of `fn` can run without a new trace, as
        `without_new_trace` runs them: a pack of `fn`, or of its stand-in,
        is traced."""
        stand_in = _STAND_INS.get(fn)
        return bool(self.sizes(fn)) or (
            stand_in is not None and bool(self.sizes(stand_in)))

    def __len__(self):
        """How many (function, pack size) pairs are held."""
        with self._lock:
            return sum(len(sizes) for sizes in self._by_fn.values())

    def without_new_trace(self, batch, trace_is_safe):
        """(batch to run now, closures to put back).

        While this pack size is not traced yet, and some worker may be hung
        (`trace_is_safe()` is False) or another thread's trace of it is
        under way (which a worker stopped since then may hold), a function
        never traced gives way to its traced stand-in (see `loop_packable`;
        the closures are changed), and the batch shrinks to the largest
        size already traced; the rest goes back to the queue. With no size
        traced the whole batch runs (and its trace waits for the hung
        worker, or for the trace under way).
        """
        fn = batch[0].fn
        if self.is_traced(fn, len(batch)) or (
                trace_is_safe() and self._claim(fn, len(batch))):
            return batch, []
        stand_in = _STAND_INS.get(fn)
        if stand_in is not None and not self.sizes(fn) and \
                self.sizes(stand_in):
            if fn not in _STOOD_IN:  # once per function
                _STOOD_IN.add(fn)
                logger.info("[chief] a function not traced yet gives way "
                            "to its stand-in, traced already, while a "
                            "worker may be hung or its trace is under way "
                            "(%s)", function_name(fn))
            for closure in batch:
                closure.fn = stand_in
            fn = stand_in
            if self.is_traced(fn, len(batch)):
                return batch, []
        for size in range(len(batch) - 1, 0, -1):
            if self.is_traced(fn, size):
                return batch[:size], batch[size:]
        return batch, []


def function_name(fn):
    """How errors and warnings name a scheduled function: its `__name__`
    (a tf.function's is the Python function's), else its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


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


def _loop(fn):
    """`run_loop(call, n)`: `n` calls of `fn` with the same arguments in a
    while loop; returns its outputs stacked (a leading axis of `n`)."""
    fn_ref = weakref.ref(fn)

    def run_loop(call, n):
        step = fn_ref()
        args, kwargs = call
        outputs = step.get_concrete_function(*args, **kwargs).structured_outputs
        leaves = tf.nest.flatten(outputs)
        arrays = [tf.TensorArray(t.dtype, size=n, element_shape=t.shape)
                  for t in leaves]

        def body(i, arrays):
            out = tf.nest.flatten(step(*args, **kwargs))
            return i + 1, [a.write(i, t) for a, t in zip(arrays, out)]

        _, arrays = tf.while_loop(lambda i, _: i < n, body,
                                  (tf.constant(0), arrays))
        stacked = tf.nest.pack_sequence_as(outputs, [a.stack() for a in arrays])
        # Automatic control dependencies make every output wait for all the
        # loop's stateful ops.
        return stacked, tf.constant(True)

    return tf.function(run_loop, autograph=False)


def _unstack(stacked, count):
    """The outputs of each of `count` calls from their stacked outputs."""
    leaves = tf.nest.flatten(stacked)
    parts = [tf.unstack(t, num=count) for t in leaves]
    return [tf.nest.pack_sequence_as(stacked, [p[i] for p in parts])
            for i in range(count)]
