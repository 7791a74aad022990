"""One thread per worker task: takes closures, runs them, handles failures."""

import enum
import logging
import threading
import time

import grpc
import tensorflow as tf

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


def probe(address, timeout):
    """True if a gRPC server answers at `address` within `timeout` seconds.

    Works on a stopped (SIGSTOP) process too: the kernel accepts the TCP
    connection but the HTTP/2 handshake never completes.
    """
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


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

    def _process(self, batch):
        try:
            with self._coordinator._gate.shared():
                # Read under the gate: a reconnect cannot start mid-call.
                generation = self._coordinator.reconnect_generation
                outputs = self._execute(batch)
        except Exception as error:  # decided below, never swallowed
            stale = generation != self._coordinator.reconnect_generation
            self._on_failure(batch, error, stale)
            return
        for closure, output in zip(batch, outputs):
            closure.remote_value._set_values(output)
        self.closures_run += len(batch)
        self._consecutive_failures = 0
        self._just_recovered = False
        self._queue.mark_finished(len(batch))

    def _execute(self, batch):
        coordinator = self._coordinator
        packed = coordinator._packed_function(batch[0].fn, len(batch))
        calls = [self._select(c) for c in batch]
        # Traced outside any device scope, so one trace serves every worker
        # (a joining worker runs at once instead of tracing the step again);
        # the call below places the whole function on this worker.
        concrete = packed.get_concrete_function(calls)
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
            time.sleep(interval)
            return
        self._just_recovered = True
        self.transition(WorkerState.HEALTHY, "context and datasets rebuilt")
        self._coordinator._notify_worker_change()
