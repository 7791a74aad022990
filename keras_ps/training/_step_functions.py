"""The tf.functions that `fit` and `evaluate` schedule on the workers: a
model's `steps_per_execution` steps per function, the metrics' results read
once after them, kept across calls until the next `compile()`.
"""

import collections
import logging
import weakref

import tensorflow as tf

from keras_ps import _constants
from keras_ps.tables import _grouped_transfers
from keras_ps.tables import _held_adds
from keras_ps._keras import compat
from keras_ps._keras import grouped_reads
from keras_ps.coordinator import packing

logger = logging.getLogger(__name__)


class StepFunctions:
    """`count` steps of `model.<step_name>` per scheduled tf.function, traced
    once per count (an epoch's last execution may be shorter) and input
    structure (tf.function traces a new one by itself).

    A count's function runs its steps one per iteration of a tf.while_loop
    for its first `KERAS_PS_UNROLL_AFTER` executions, then with
    `KERAS_PS_UNROLL_STEPS` written out in each iteration (the loop's control
    messages paid once per K steps): the larger function costs a few seconds
    once, which a long run earns back and a short one never pays.

    Holds the model weakly: the functions are kept across fit/evaluate calls
    (see `for_model`) and must not keep a discarded model alive.
    """

    def __init__(self, model, step_name):
        self._model = weakref.ref(model)
        self._step_name = step_name
        self._functions = {}
        self._unroll = _constants.env_int(_constants.UNROLL_STEPS_ENV_VAR,
                                          _constants.DEFAULT_UNROLL_STEPS,
                                          minimum=0)
        self._unroll_after = _constants.env_int(
            _constants.UNROLL_AFTER_ENV_VAR, _constants.DEFAULT_UNROLL_AFTER,
            minimum=0)
        self._looped = collections.Counter()  # count -> loop form handed out
        self._deferred = set()  # counts whose written-out form waited
        self._found_traits = None  # see _traits

    def get(self, count, may_trace=lambda: True):
        """The function to schedule for `count` steps. Before the form with
        steps written out is handed out the first time, `may_trace()` is
        asked: a new function is registered on every worker, a hung one
        too, and waits for it, so the loop form (traced already) goes on
        while that is False. (A worker given up as hung is known at once; a
        stopped worker not given up yet costs each call its probe's
        timeout, until the hang watchdog gives it up.)"""
        written_out = (self._looped[count] >= self._unroll_after
                       and self._writes_out(count))
        if written_out and (count, True) not in self._functions:
            written_out = self._may_trace(count, may_trace)
        if not written_out:
            self._looped[count] += 1
        fn = self._functions.get((count, written_out))
        if fn is None:
            # Its outputs are the step's logs, the same shapes every call:
            # a worker's queued executions run in one loop. The loop form
            # stands in for the form written out while a worker stopped
            # after this was handed out (see packing.loop_packable).
            fn = packing.loop_packable(tf.function(
                self._multi_step(count, self._unroll if written_out else 1),
                autograph=False),
                stand_in=self._functions.get((count, False)) if written_out
                else None)
            self._functions[(count, written_out)] = fn
            if written_out:
                logger.info("[chief] %s: %d steps an iteration from now on "
                            "(after %d executions of %d steps)",
                            self._step_name, min(self._unroll, count),
                            self._looped[count], count)
        return fn

    def _may_trace(self, count, may_trace):
        if may_trace():
            return True
        if count not in self._deferred:
            self._deferred.add(count)
            logger.info("[chief] %s: %d steps written out waits while a "
                        "worker may be hung (a new function would wait for "
                        "it)", self._step_name, count)
        return False

    def _traits(self):
        """(whether the model's layers need one step an iteration, whether
        its step's logs are Keras' metric results), found once."""
        if self._found_traits is None:
            model = self._model()
            self._found_traits = (
                grouped_reads.steps_in_a_loop(model),
                grouped_reads.logs_are_metric_results(model, self._step_name))
        return self._found_traits

    def _writes_out(self, count):
        """Whether `count` steps have a form with steps written out (see
        `_multi_step`): not one step, a model whose layers need one step an
        iteration, or a custom step with more steps than the knob."""
        in_a_loop, keras_logs = self._traits()
        return (self._unroll > 1 and count > 1 and not in_a_loop
                and (keras_logs or count <= self._unroll))

    def _multi_step(self, count, unroll):
        model_ref, step_name = self._model, self._step_name
        in_a_loop, keras_logs = self._traits()
        unrolled = count <= unroll and not in_a_loop
        # Keras' own steps: this many written out per iteration of the loop.
        per_iteration = 1 if in_a_loop else max(1, min(unroll, count))

        def multi_step(iterator):
            model = model_ref()
            grouped = grouped_reads.step_variables(model, step_name)
            passengers = grouped_reads.step_passengers(model, step_name, grouped)
            model_step = getattr(model, step_name)

            def step(batch):
                # Each step reads its ps' small weights in one transfer per
                # ps, and sends its metric additions in one.
                with _grouped_transfers.scope(grouped, passengers), \
                        grouped_reads.metric_adds_held(model, step_name):
                    return model_step(batch)

            if count > 1 and keras_logs:
                return _steps_then_results(model, step_name, step, iterator,
                                           count, per_iteration)
            logs = step(next(iterator))
            if count > 1 and unrolled:
                # Written out: automatic control dependencies keep every
                # step's reads and updates in the order of the loop.
                for _ in range(count - 1):
                    logs = step(next(iterator))
            elif count > 1:
                def body(i, _):
                    return i + 1, step(next(iterator))
                _, logs = tf.while_loop(
                    lambda i, _: i < count - 1, body, (tf.constant(0), logs))
            return logs

        multi_step.__name__ = f"keras_ps_{step_name}_x{count}"
        return multi_step


def _steps_then_results(model, step_name, step, iterator, count,
                        per_iteration):
    """`count` steps, then the metrics' results: Keras' step logs are those
    results, and only the last step's are returned, so the steps skip
    reading them (a read of each metric's variables on the ps per step).

    The steps run in a tf.while_loop, `per_iteration` of them written out in
    each iteration (the remainder after the loop); all of them written out
    when `per_iteration` is `count`. Each iteration of a loop whose body
    reads and updates ps variables sends the loop's condition and control
    signals to each ps: written out, those are paid once per iteration.
    The steps' metric additions are held and sent once for the `count`
    steps: the loop carries their sums on the worker."""
    def run(n):
        # Automatic control dependencies keep every step's reads and updates
        # in the order written.
        for _ in range(n):
            with grouped_reads.metric_results_skipped():
                step(next(iterator))

    loops, rest = divmod(count, per_iteration)
    if loops == 1 and not rest:
        with grouped_reads.metric_adds_held(model, step_name):
            run(count)
    else:
        carried = grouped_reads.carried_metric_variables(model, step_name)

        def body(i, *sums):
            with grouped_reads.metric_adds_held(model, step_name):
                run(per_iteration)
                sums = _held_adds.carried_adds(carried, sums)
            return (i + 1, *sums)

        _, *sums = tf.while_loop(
            lambda i, *_: i < loops, body,
            (tf.constant(0), *[tf.zeros(v.shape, v.dtype) for v in carried]))
        with grouped_reads.metric_adds_held(model, step_name):
            for variable, total in zip(carried, sums):
                if not _held_adds.defer_add(variable, total):
                    variable.assign_add(total)
            if rest:
                run(rest)
    # Read after the steps' updates (ordered by automatic control
    # dependencies on the metrics' variables).
    return model.get_metrics_result()


# model -> {step name: (compile count, StepFunctions)}.
_by_model = weakref.WeakKeyDictionary()


def for_model(model, step_name):
    """The model's step functions, kept across fit/evaluate calls as Keras
    keeps `model.train_function`: until the next `compile()`.

    A later call then traces nothing, and its packed functions (held by the
    coordinator as long as these live) are already on the workers: a new
    function costs a trace on the coordinator and an instantiation on every
    worker, which dominated the start-up of a later call.
    """
    compiled = compat.compile_count(model)
    kept = _by_model.setdefault(model, {})
    entry = kept.get(step_name)
    if entry is None or entry[0] != compiled:
        entry = kept[step_name] = (compiled, StepFunctions(model, step_name))
    return entry[1]
