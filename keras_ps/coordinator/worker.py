"""One thread per worker task: takes closures, runs them, handles failures."""

import enum
import logging
import socket
import threading
import time

import tensorflow as tf

from keras_ps import _constants
from keras_ps import _tf_adapter
from keras_ps import strategy as strategy_lib
from keras_ps.coordinator import failure_policy
from keras_ps.coordinator.failure_policy import Decision
from keras_ps.coordinator.values import PerWorkerValues
from keras_ps.errors import ParameterServerUnavailableError

logger = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    HEALTHY = "healthy"
    FAILED = "failed"  # unreachable; closures go to other workers
    RECOVERING = "recovering"  # answers again; context and datasets rebuilt
    JOINING = "joining"  # new member; admitted once it answers
    LEFT = "left"  # no longer a member; its closures go to other workers
    STOPPED = "stopped"


# States in which a worker is part of the cluster definition TF holds.
IN_CLUSTER = (WorkerState.HEALTHY, WorkerState.RECOVERING)
_FINAL = (WorkerState.LEFT, WorkerState.STOPPED)


# An HTTP/2 client connection preface and an empty SETTINGS frame.
_HTTP2_PREFACE = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                  b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
_SETTINGS_FRAME = 4


def probe(address, timeout):
    """True if a gRPC server answers at `address` within `timeout` seconds.

    Opens an HTTP/2 connection and waits for the server's SETTINGS frame, the
    first thing a live gRPC server sends: milliseconds on a live server, an
    immediate False when nothing listens, and False after `timeout` for a
    stopped (SIGSTOP) process, whose kernel still accepts the TCP connection.
    (gRPC's own channel-ready check polls, about 0.2 s per call.)
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=timeout) as sock:
            sock.sendall(_HTTP2_PREFACE)
            header = b""
            while len(header) < 9:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                sock.settimeout(remaining)
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return False
                header += chunk
            return header[3] == _SETTINGS_FRAME
    except (OSError, ValueError):
        return False


class _Call:
    """One remote call in flight: its batch, when it started, its gate hold."""

    def __init__(self, batch):
        self.batch = batch
        self.started = time.monotonic()
        self.gate_hold = None
        self.settled = False  # its outcome was handled, or it was given up
        self.abandoned = False  # given up by the watchdog


class Worker:
    """Runs closures on `/job:worker/task:<index>` from the coordinator's queue."""

    def __init__(self, coordinator, index, address, state=WorkerState.HEALTHY):
        self.index = index
        self.address = address
        self.device = strategy_lib.worker_device(index)
        self.state = state
        self.closures_run = 0
        self._consecutive_failures = 0
        # Until its first success after recovery, any error of this worker is
        # blamed on the recovery, not on the user's function.
        self._just_recovered = False
        self._in_flight = None  # the _Call running now
        self.hung = False  # its last call was given up; not yet back
        self._coordinator = coordinator
        self._queue = coordinator._queue
        self._state_lock = threading.Lock()
        self._state_changed = threading.Condition(self._state_lock)
        self._thread = threading.Thread(
            target=self._run, name=f"keras_ps-worker-{index}", daemon=True)

    def start(self):
        self._thread.start()

    # -- state -----------------------------------------------------------------
    def transition(self, new_state, reason):
        """Moves to `new_state` and logs why. LEFT and STOPPED are final."""
        with self._state_lock:
            old = self.state
            if old in _FINAL and new_state is not WorkerState.STOPPED:
                return
            self.state = new_state
            self._state_changed.notify_all()
        if old is not new_state:
            logger.info("[worker:%d] %s -> %s (%s)", self.index, old.value,
                        new_state.value, reason)

    def wait_for_state(self, state, timeout):
        deadline = time.monotonic() + timeout
        with self._state_lock:
            while self.state is not state:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._state_changed.wait(remaining)
            return True

    def stop(self):
        self.transition(WorkerState.STOPPED, "coordinator shut down")

    def leave(self, reason):
        self.transition(WorkerState.LEFT, reason)

    # -- the loop --------------------------------------------------------------
    def _run(self):
        with _tf_adapter.own_executor():
            self._loop()

    def _loop(self):
        while self.state not in _FINAL:
            if self.state is not WorkerState.HEALTHY:
                self._recover()
                continue
            batch = self._queue.take(
                self._coordinator.max_pack, self._coordinator.num_healthy())
            if batch is None:
                return
            if self.state is not WorkerState.HEALTHY:
                self._queue.put_back(batch)
                continue
            self._process(batch)

    def in_flight_seconds(self):
        """How long the current remote call has run (None when idle)."""
        call = self._in_flight
        if call is None or call.settled or self.state is not WorkerState.HEALTHY:
            return None
        return time.monotonic() - call.started

    def abandon_in_flight(self, reason):
        """Gives up on a call that will not return (hung worker): its
        closures go back to the queue and the worker counts as failed. When
        the call returns after all, its outcome is dropped."""
        with self._state_lock:
            call = self._in_flight
            if call is None or call.settled:
                return
            call.settled = call.abandoned = True
            self.hung = True
        call.gate_hold.release_early()
        self.transition(WorkerState.FAILED, f"hung: {reason}")
        self._queue.put_back(call.batch)

    def _process(self, batch):
        batch = self._without_new_trace(batch)
        call = _Call(batch)
        for closure in batch:  # dynamic data shards: the shard is handed out
            if closure.listener is not None:
                closure.listener.started(self.index)
        try:
            with self._coordinator._gate.shared() as hold:
                call.gate_hold = hold
                self._in_flight = call
                # Read under the gate: a reconnect cannot start mid-call.
                generation = self._coordinator.reconnect_generation
                outputs = self._execute(batch)
        except Exception as error:  # decided below, never swallowed
            if self._finish_call(call):
                stale = generation != self._coordinator.reconnect_generation
                self._on_failure(batch, error, stale)
            return
        if not self._finish_call(call):
            return
        if self._just_recovered:
            logger.info("[worker:%d] first call after (re)admission: %d "
                        "closures in %.2fs", self.index, len(batch),
                        time.monotonic() - call.started)
        for closure, output in zip(batch, outputs):
            if closure.listener is not None:  # dynamic data shards: done
                closure.listener.finished(self.index, output)
            closure.remote_value._set_values(output)
        self.closures_run += len(batch)
        self._consecutive_failures = 0
        self._just_recovered = False
        self._queue.mark_finished(len(batch))

    def _without_new_trace(self, batch):
        """Shrinks `batch` to an already traced pack size while some worker
        may be hung. TF registers every newly traced function on every worker
        synchronously, holding the GIL: with one worker stopped, a new trace
        would freeze the whole coordinator until that worker continues."""
        coordinator = self._coordinator
        fn = batch[0].fn
        if coordinator.is_traced(fn, len(batch)) or coordinator.trace_is_safe():
            return batch
        sizes = [n for n in range(len(batch) - 1, 0, -1)
                 if coordinator.is_traced(fn, n)]
        if not sizes:
            logger.warning("[worker:%d] must trace a new function while a "
                           "worker may be hung; this waits for that worker",
                           self.index)
            return batch
        self._queue.put_back(batch[sizes[0]:])
        return batch[:sizes[0]]

    def _finish_call(self, call):
        """False when the watchdog gave up on this call (already requeued)."""
        with self._state_lock:
            self._in_flight = None
            if call.abandoned:
                logger.info("[worker:%d] a call given up as hung returned; "
                            "its outcome is dropped", self.index)
                return False
            call.settled = True
            return True

    def _execute(self, batch):
        coordinator = self._coordinator
        packed = coordinator._packed_function(batch[0].fn, len(batch))
        calls = [self._select(c) for c in batch]
        # Traced outside any device scope, so one trace serves every worker
        # (a joining worker runs at once instead of tracing the step again);
        # the call below places the whole function on this worker.
        concrete = packed.get_concrete_function(calls)
        if len(batch) > 1 and not coordinator.is_traced(batch[0].fn, 1):
            # Size 1 is the fallback while a worker may be hung: have it ready.
            coordinator._packed_function(batch[0].fn, 1).get_concrete_function(
                calls[:1])
        with tf.device(self.device), strategy_lib._DispatchScope(
                self.index, coordinator.num_workers):
            results, token = concrete(calls)
        # A remote call returns once it is enqueued; fetching the token (an
        # output of the same function) waits until every step has run.
        token.numpy()
        # Copy results to the coordinator now: the worker may be gone later.
        return [self._to_local(r) for r in results]

    def _select(self, closure):
        if not closure.per_worker:
            return closure.args, closure.kwargs
        pick = lambda v: v.values[self.index] if isinstance(v, PerWorkerValues) else v
        return (tf.nest.map_structure(pick, closure.args),
                tf.nest.map_structure(pick, closure.kwargs))

    def _to_local(self, result):
        if result is None:
            return None
        with tf.device(self._coordinator.local_device):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                result)

    def _on_failure(self, batch, error, stale=False):
        if self.state in _FINAL:
            # It left the cluster mid-call: its closures run elsewhere.
            logger.info("[worker:%d] left with %d closures in flight; requeued",
                        self.index, len(batch))
            self._queue.put_back(batch)
            return
        worker_alive = probe(self.address, self._coordinator.probe_timeout)
        dead_ps = []
        if failure_policy.is_connectivity_error(error) or not worker_alive:
            dead_ps = self._coordinator.dead_ps()
        self._consecutive_failures += 1
        decision = failure_policy.decide(
            error, worker_alive, dead_ps, context_lost=self._just_recovered or stale,
            consecutive_failures=self._consecutive_failures)
        logger.info("[worker:%d] closure failed with %s; worker %s, dead ps %s "
                    "-> %s", self.index, type(error).__name__,
                    "answers" if worker_alive else "unreachable", dead_ps,
                    decision.value)
        if decision is Decision.RETRY:
            self._queue.put_back(batch)
        elif decision is Decision.RETRY_ELSEWHERE:
            self.transition(WorkerState.FAILED, type(error).__name__)
            self._queue.put_back(batch)
        elif decision is Decision.RAISE_PS_FAILURE:
            addresses = [self._coordinator.ps_addresses[i] for i in dead_ps]
            fatal = ParameterServerUnavailableError(
                f"Parameter server(s) {dead_ps} at {addresses} cannot be "
                "reached; the model's variables there are lost. Restart the "
                "job (ps tasks included) and resume from the last checkpoint, "
                "e.g. with keras_ps.callbacks.BackupAndRestore. Cause: "
                f"{type(error).__name__}")
            for c in batch:
                c.remote_value._set_error(fatal)
            self._queue.mark_fatal(len(batch), fatal)
        else:
            listener = batch[0].listener
            if listener is not None:
                # Dynamic data shards: a shard that fails to read is retried
                # a bounded number of times, then fails naming the shard.
                if listener.retry_after_error(error):
                    self._queue.put_back(batch)
                    return
                error = listener.error(error)
            batch[0].remote_value._set_error(error)
            for c in batch[1:]:
                c.cancel()
            self._queue.mark_failed(len(batch), error, batch[0].generation)

    def _recover(self):
        """Waits until the worker answers, then rebuilds its context and data."""
        interval = self._coordinator.recovery_interval
        if self.state is WorkerState.FAILED and \
                not self._coordinator.readmit_workers:
            logger.info("[worker:%d] stays out of training (re-admission is "
                        "off: KERAS_PS_READMIT_WORKERS=0)", self.index)
            with self._state_lock:
                while self.state not in _FINAL:
                    self._state_changed.wait()
            return
        while self.state in (WorkerState.FAILED, WorkerState.JOINING):
            if probe(self.address, self._coordinator.probe_timeout):
                self.transition(WorkerState.RECOVERING, "answers")
                break
            with self._state_lock:
                if self.state not in _FINAL:
                    self._state_changed.wait(interval)
        if self.state is not WorkerState.RECOVERING:
            return
        try:
            self._coordinator._reconnect_and_rebuild(self.index)
        except Exception as error:  # still flaky: back to FAILED, try again
            logger.info("[worker:%d] recovery failed (%s: %s); retrying",
                        self.index, type(error).__name__,
                        str(error).splitlines()[0] if str(error) else "")
            self.transition(WorkerState.FAILED, "recovery failed")
            time.sleep(max(interval, _constants.REBUILD_RETRY_DELAY))
            return
        self._just_recovered = True
        self.hung = False
        self.transition(WorkerState.HEALTHY, "context and datasets rebuilt")
        self._coordinator._notify_worker_change()
