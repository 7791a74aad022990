"""One thread per worker task: takes closures, runs them, handles failures.

A worker's lifecycle is the `WorkerState` enum (worker_states.py);
`Worker.transition` is the only place it changes, checks the move against
`ALLOWED_TRANSITIONS` and logs it. A worker sees the rest of the
coordinator only through `WorkerServices` (worker_services.py).
"""

import logging
import threading
import time
import weakref

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.cluster._network import look_at_new_worker
from keras_ps.cluster._network import probe
from keras_ps.strategy._per_worker import PerWorkerValues
from keras_ps.strategy._per_worker import dispatch_scope
from keras_ps.strategy._per_worker import worker_device
from keras_ps.coordinator import failure_handling
from keras_ps.coordinator import values
from keras_ps.coordinator import watchdog
from keras_ps.coordinator.failure_handling import Decision
from keras_ps.coordinator.worker_states import ALLOWED_TRANSITIONS
from keras_ps.coordinator.worker_states import Call
from keras_ps.coordinator.worker_states import GONE as _GONE
from keras_ps.coordinator.worker_states import IN_CLUSTER  # noqa: F401 (re-exported)
from keras_ps.coordinator.worker_states import OUT
from keras_ps.coordinator.worker_states import RUNNABLE
from keras_ps.coordinator.worker_states import WorkerState

logger = logging.getLogger(__name__)


class Worker:
    """Runs closures on `/job:worker/task:<index>` from the coordinator's queue."""

    def __init__(self, services, index, address, state=WorkerState.HEALTHY):
        self.index = index
        self.address = address
        self.device = worker_device(index)
        self.state = state
        self.closures_run = 0
        # Closures of given-up calls that ran here after all, and elsewhere.
        self.closures_run_twice = 0
        self._consecutive_failures = 0
        self._failed_readmissions = 0
        self._in_flight = None  # the Call running now
        # fn -> the longest a finished call of it took here, per closure.
        self._call_times = weakref.WeakKeyDictionary()
        self._services = services
        self._state_lock = threading.Lock()
        self._state_changed = threading.Condition(self._state_lock)
        self._thread = threading.Thread(
            target=self._run, name=f"keras_ps-worker-{index}", daemon=True)

    def start(self):
        self._thread.start()

    # -- state -----------------------------------------------------------------
    def transition(self, new_state, reason):
        """Moves to `new_state` if `ALLOWED_TRANSITIONS` allows it, and logs why.

        Returns:
            Whether the worker is now in `new_state`.
        """
        with self._state_lock:
            old = self.state
            if old is new_state:
                return True
            if new_state not in ALLOWED_TRANSITIONS[old]:
                if old not in _GONE:
                    logger.warning("[worker:%d] ignored move %s -> %s (%s)",
                                   self.index, old.value, new_state.value,
                                   reason)
                return False
            self.state = new_state
            self._state_changed.notify_all()
        logger.info("[worker:%d] %s -> %s (%s)", self.index, old.value,
                    new_state.value, reason)
        if new_state not in RUNNABLE and self._services is not None:
            # An idle worker thread waits for closures: it must start
            # recovering now (e.g. marked failed while a dataset was made).
            self._services.queue.wake()
        return True

    def wait_for_state(self, states, timeout):
        """Waits until the state is one of `states` (a state or a tuple)."""
        states = states if isinstance(states, tuple) else (states,)
        with self._state_lock:
            return self._state_changed.wait_for(
                lambda: self.state in states, timeout)

    def wait_until_runnable(self, timeout):
        """Waits until the worker takes closures (healthy or just re-admitted)."""
        return self.wait_for_state(RUNNABLE, timeout)

    def stop(self):
        self.transition(WorkerState.STOPPED, "coordinator shut down")

    def leave(self, reason):
        self.transition(WorkerState.LEFT, reason)

    # -- the loop --------------------------------------------------------------
    def _run(self):
        with _tf_adapter.own_executor():
            self._loop()

    def _loop(self):
        queue = self._services.queue
        while self.state not in _GONE:
            if self.state not in RUNNABLE:
                self._recover()
                continue
            batch = queue.take(
                self._services.config.max_pack, self._services.num_healthy(),
                interrupted=lambda: self.state not in RUNNABLE)
            if batch is None:
                return
            if self.state not in RUNNABLE:
                if batch:
                    queue.put_back(batch)
                continue
            try:
                self._process(batch)
            finally:
                self._services.packing.release_claim()
            # Not held while waiting for work: the closures' arguments (a
            # dataset's iterators) are freed when the user drops them.
            batch = None

    def in_flight_call(self):
        """The remote call running now (its `batch` and monotonic `started`
        time), or None when idle."""
        call = self._in_flight
        if call is None or call.settled or self.state not in RUNNABLE:
            return None
        return call

    def in_flight_seconds(self):
        """How long the current remote call has run (None when idle)."""
        call = self.in_flight_call()
        return None if call is None else time.monotonic() - call.started

    def seconds_per_closure(self, fn):
        """The longest a finished call of `fn` took here, per closure in it
        (None before the first)."""
        try:
            return self._call_times.get(fn)
        except TypeError:  # no weak reference to it: no history kept
            return None

    def abandon_in_flight(self, reason, state=WorkerState.HUNG, call=None):
        """Gives up on a call that will not return (a hung worker, or a call
        stuck on one that answers): its closures go back to the queue and the
        worker moves to `state`. When the call returns after all, its outcome
        is dropped. `call`: give up only that call, if it still runs."""
        with self._state_lock:
            running = self._in_flight
            if running is None or running.settled or (
                    call is not None and running is not call):
                return
            running.settled = running.abandoned = True
        running.gate_hold.release_early()
        self.transition(state, reason)
        batch = running.batch
        if state is WorkerState.STUCK:
            for closure in batch:
                closure.stuck_on.add(self.index)
            stuck_on = max((c.stuck_on for c in batch), key=len)
            if len(stuck_on) >= watchdog.STUCK_GIVE_UPS:
                self._fail_job(batch, watchdog.stuck_failure(
                    batch[0], sorted(stuck_on), reason))
                return
        self._services.queue.put_back(batch)

    def _process(self, batch):
        services = self._services
        batch, rest = services.packing.without_new_trace(
            batch, services.trace_is_safe)
        if rest:
            services.queue.put_back(rest)
        elif not services.packing.is_traced(batch[0].fn, len(batch)) and \
                not services.trace_is_safe():
            logger.warning("[worker:%d] must trace a new function while a "
                           "worker may be hung; this waits for that worker",
                           self.index)
        call = Call(batch)
        for closure in batch:  # dynamic data shards: the shard is handed out
            if closure.listener is not None:
                closure.listener.started(self.index)
        try:
            with services.gate.shared() as hold:
                call.gate_hold = hold
                call.started = time.monotonic()  # not the wait for the gate
                self._in_flight = call
                # Read under the gate: a re-admission cannot start mid-call.
                generation = services.readmission.generation
                outputs = self._execute(batch, call)
        except Exception as error:  # decided below, never swallowed
            if self._finish_call(call):
                stale = generation != services.readmission.generation
                self._on_failure(batch, error, stale, call)
            return
        if not self._finish_call(call):
            return
        if self.state is WorkerState.READMITTED:
            logger.info("[worker:%d] first call after (re)admission: %d "
                        "closures in %.2fs", self.index, len(batch),
                        time.monotonic() - call.started)
            self.transition(WorkerState.HEALTHY, "first call after admission ran")
        for closure, output in zip(batch, outputs):
            if closure.listener is not None:  # dynamic data shards: done
                closure.listener.finished(self.index, output)
            closure.remote_value._set_values(output)
        per_closure = (time.monotonic() - call.started) / len(batch)
        fn = batch[0].fn
        try:
            self._call_times[fn] = max(per_closure,
                                       self._call_times.get(fn, 0.0))
        except TypeError:  # no weak reference to it: no history kept
            pass
        self.closures_run += len(batch)
        services.cut_off.ran(self.index)
        self._consecutive_failures = 0
        self._failed_readmissions = 0
        services.queue.mark_finished(len(batch))

    def _finish_call(self, call):
        """False when the watchdog gave up on this call (already requeued)."""
        with self._state_lock:
            self._in_flight = None
            if call.abandoned:
                if call.ran:  # requeued too (unless they failed the job)
                    self.closures_run_twice += len(call.batch)
                logger.info("[worker:%d] a call given up (hung or stuck) "
                            "returned (ran: %s); dropped", self.index, call.ran)
                return False
            call.settled = True
            return True

    def _execute(self, batch, call):
        packing = self._services.packing
        fn = batch[0].fn
        calls = [self._select(c) for c in batch]
        # Traced outside any device scope, so one trace serves every worker
        # (a joining worker runs at once instead of tracing the step again);
        # the call below places the whole function on this worker.
        call.tracing = True
        try:
            pack = packing.prepare(fn, calls)
            if len(batch) > 1 and not packing.is_traced(fn, 1):
                # Size 1 is the fallback while a worker may be hung.
                packing.prepare(fn, calls[:1])
        finally:
            call.tracing = False
        if call.abandoned:  # its worker stopped while the trace waited
            return None  # its closures run elsewhere; dropped by the caller
        if batch[0].cancellation.is_cancelled:  # while it was traced
            raise tf.errors.CancelledError(None, None, "cancelled unsent")
        call.started = time.monotonic()  # the call proper, not the trace
        run = batch[0].cancellation.get_cancelable_function(pack.function)
        call.sent = True
        with tf.device(self.device), dispatch_scope(
                self.index, self._services.num_workers()):
            results, token = run(*pack.args)
        # A remote call returns once it is enqueued; fetching the token (an
        # output of the same function) waits until every step has run.
        token.numpy()
        call.ran = True
        # Copy results to the coordinator now: the worker may be gone later.
        return pack.split(values.copy_to(results,
                                         self._services.local_device))

    def _select(self, closure):
        if not closure.per_worker:
            return closure.args, closure.kwargs
        pick = lambda v: v.values[self.index] if isinstance(v, PerWorkerValues) else v
        return (tf.nest.map_structure(pick, closure.args),
                tf.nest.map_structure(pick, closure.kwargs))

    # -- failures ------------------------------------------------------------------
    def _on_failure(self, batch, error, stale, call):
        services, ran = self._services, call.ran
        queue = services.queue
        if self.state in _GONE:
            # It left the cluster mid-call: its closures run elsewhere.
            logger.info("[worker:%d] left with %d closures in flight; requeued",
                        self.index, len(batch))
            queue.put_back(batch)
            return
        if batch[0].cancellation.is_cancelled:
            # Cancelled in flight because another closure failed first.
            logger.info("[worker:%d] %d closures cancelled %s after an error "
                        "elsewhere", self.index, len(batch), "in flight"
                        if call.sent else "before they were sent")
            queue.mark_cancelled(batch)
            if call.sent:  # else its iterators were not touched
                self._read_again()
            return
        worker_alive = probe(self.address, services.config.probe_timeout)
        # Any error may come from a lost ps: a restarted ps fails calls with
        # connectivity errors first, then, once workers are rebuilt, with
        # others (its variables are gone), so the ps are always looked at.
        dead_ps = services.dead_ps()
        connectivity = failure_handling.is_connectivity_error(error)
        # A worker that answers and fails otherwise than on the connection
        # was restarted (a restart policy brings it back before anyone sees
        # it gone) or ran into the function's own error: its incarnation
        # says.
        context_lost = stale or (worker_alive and not connectivity
                                 and not self._holds_context())
        self._consecutive_failures += 1
        if context_lost and worker_alive and not connectivity:
            self._failed_readmissions += 1
        # The function ran to its end and its outputs were lost on the way
        # back: not an error of the function. Counted on the closures, which
        # a retry may give to another worker.
        outputs_lost = 0
        if ran and not connectivity:
            for closure in batch:
                closure.outputs_lost += 1
            outputs_lost = max(closure.outputs_lost for closure in batch)
        decision = failure_handling.decide(
            error, worker_alive, dead_ps, context_lost=context_lost,
            consecutive_failures=self._consecutive_failures,
            failed_readmissions=self._failed_readmissions,
            outputs_lost=outputs_lost)
        logger.info("[worker:%d] closure failed with %s%s; worker %s, dead ps "
                    "%s -> %s", self.index, type(error).__name__,
                    " copying its outputs back" if ran else "",
                    "answers" if worker_alive else "unreachable", sorted(dead_ps),
                    decision.value)
        if decision is Decision.RETRY:
            queue.put_back(batch)
            # Failed while it ran (a connection to a ps dropped): TF
            # cancelled the rest of the call, its iterators' reads too (a
            # restarted worker's re-admission makes them again).
            if call.sent and not ran and batch[0].per_worker and \
                    self._holds_context():
                self._read_again()
        elif decision is Decision.RETRY_ELSEWHERE:
            self.transition(WorkerState.FAILED, type(error).__name__)
            # On a connection, while it (the same process) and every ps
            # answer: cut off from a ps (a restarted worker is not).
            fatal = worker_alive and connectivity and not context_lost and \
                self._holds_context() and \
                services.cut_off.put_out(self.index, self.address, error)
            if fatal:  # every worker is
                self._fail_job(batch, fatal)
            else:
                queue.put_back(batch)
        elif decision is Decision.RAISE_PS_FAILURE:
            self._fail_job(batch, failure_handling.ps_failure(dead_ps, error))
        elif decision is Decision.RAISE_REPEATED:
            self._fail_job(batch, failure_handling.repeated_failure(
                self.index, self.address, self._failed_readmissions, error))
        else:
            if outputs_lost:
                failure_handling.note_lost_outputs(error, outputs_lost)
            if self.state is WorkerState.READMITTED:
                failure_handling.note_after_readmission(error, self.index)
            listener = batch[0].listener
            if listener is not None:
                # Dynamic data shards: a shard that fails to read is retried
                # a bounded number of times, then fails naming the shard.
                if listener.retry_after_error(error):
                    queue.put_back(batch)
                    return
                error = listener.error(error)
            batch[0].remote_value._set_error(error)
            for c in batch[1:]:
                c.cancel()
            queue.mark_failed(len(batch), error, batch[0].generation)

    def _read_again(self):
        """Makes this worker's datasets again (its iterators start over),
        context kept: a call ended inside an iterator's next() (cancelled,
        or failed while it ran) leaves that iterator ended for good."""
        try:
            self._services.readmission.remake_datasets(self.index)
        except Exception as rebuild_error:  # recovered like a failure
            self.transition(WorkerState.FAILED, type(rebuild_error).__name__)

    def _holds_context(self):
        return self._services.readmission.holds_context(
            self.index, self.address, self._services.config.probe_timeout)

    def _fail_job(self, batch, fatal):
        for closure in batch:
            closure.remote_value._set_error(fatal)
        self._services.queue.mark_fatal(len(batch), fatal)

    def _answers(self, timeout):
        """Whether the worker answers a probe. A new member's address is
        looked at closer, once something answers there: one that is no
        worker task's (TF's cluster update fails on it at every
        re-admission, or hangs on a ps) is refused, and does not answer."""
        if self.state is not WorkerState.JOINING:
            return probe(self.address, timeout)
        answers, why = look_at_new_worker(self.address, timeout)
        if why is not None and self.transition(WorkerState.REFUSED,
                                               "not a worker task"):
            logger.warning("%s", failure_handling.refused_member(
                self.index, self.address, why))
        return answers and why is None

    def _recover(self):
        """Waits until the worker answers, then has it re-admitted."""
        config = self._services.config
        if self.state in OUT and not config.readmit_workers:
            logger.info("[worker:%d] stays out of training (re-admission is "
                        "off: KERAS_PS_READMIT_WORKERS=0)", self.index)
            self.wait_for_state(_GONE, timeout=float("inf"))
            return
        self._services.cut_off.wait_out(self.index, self._state_changed,
                                        lambda: self.state in OUT)
        joined, warn_after = time.monotonic(), config.hang_timeout
        while self.state in (*OUT, WorkerState.JOINING):
            if self._answers(config.probe_timeout):
                if warn_after != config.hang_timeout:  # it was warned about
                    logger.warning(
                        "[worker:%d] %s answers now, %.0fs after it joined",
                        self.index, self.address, time.monotonic() - joined)
                self.transition(WorkerState.RECOVERING, "answers")
                break
            if self.state is WorkerState.JOINING:
                warn_after = failure_handling.warn_if_silent(
                    self.index, self.address, time.monotonic() - joined,
                    warn_after, config.probe_timeout)
            with self._state_lock:
                if self.state not in _GONE:
                    self._state_changed.wait(config.recovery_interval)
        if self.state is not WorkerState.RECOVERING:
            return
        try:
            replaced = self._services.readmission.readmit(self.index)
        except Exception as error:  # still flaky: back to FAILED, try again
            logger.info("[worker:%d] recovery failed (%s: %s); retrying",
                        self.index, type(error).__name__,
                        str(error).splitlines()[0] if str(error) else "")
            self.transition(WorkerState.FAILED, "recovery failed")
            time.sleep(max(config.recovery_interval,
                           config.rebuild_retry_delay))
            return
        self.transition(WorkerState.READMITTED, "context and datasets rebuilt")
        self._services.on_admitted()
        self._services.readmission.release(self.index, replaced)
