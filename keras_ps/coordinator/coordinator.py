"""ClusterCoordinator: schedules tf.functions on workers, asynchronously."""

import logging
import threading
import time
import weakref

import tensorflow as tf

from keras_ps import _constants
from keras_ps import _tf_adapter
from keras_ps import strategy as strategy_lib
from keras_ps.coordinator import worker as worker_lib
from keras_ps.coordinator.closures import Closure, ClosureQueue
from keras_ps.coordinator.datasets import PerWorkerDataset
from keras_ps.coordinator.values import PerWorkerValues, RemoteValue
from keras_ps.elastic.resolver import ElasticClusterResolver
from keras_ps.errors import NoWorkersAvailableError

logger = logging.getLogger(__name__)


def _is_tf_function(fn):
    return hasattr(fn, "get_concrete_function")


class ClusterCoordinator:
    """Runs scheduled `tf.function`s on the workers of a ParameterServerStrategy.

    Execution is at-least-once: a function whose worker is lost is run again
    on another worker. The first error a function raises comes out once from
    `schedule`, `join` or `done`; functions still pending then are cancelled.
    Consecutive closures of one function are packed into a single remote call
    (up to `max_pack`), which is what makes dispatch cheap.

    Args:
        strategy: a `keras_ps.ParameterServerStrategy`.
        max_pack: most closures per remote call (default from
            `KERAS_PS_MAX_PACK`, 16); 1 disables packing.

    Example:
    ```python
    coordinator = keras_ps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(10)]
    coordinator.join()
    ```
    """

    def __init__(self, strategy, max_pack=None):
        if not isinstance(strategy, strategy_lib.ParameterServerStrategy):
            raise TypeError(
                "ClusterCoordinator needs a keras_ps.ParameterServerStrategy. "
                f"Received: strategy={strategy!r}.")
        self.strategy = strategy
        source = "max_pack"
        if max_pack is None:
            source = _constants.MAX_PACK_ENV_VAR
            max_pack = _constants.env_int(
                _constants.MAX_PACK_ENV_VAR, _constants.DEFAULT_MAX_PACK)
        self.max_pack = max_pack
        if self.max_pack < 1:
            raise ValueError(
                f"max_pack must be at least 1. Received: {source}="
                f"{self.max_pack}. Use 1 to turn packing off, or leave it "
                f"unset for the default {_constants.DEFAULT_MAX_PACK}.")
        self.probe_timeout = _constants.env_float(
            _constants.PROBE_TIMEOUT_ENV_VAR, _constants.DEFAULT_PROBE_TIMEOUT)
        self.recovery_interval = _constants.env_float(
            _constants.RECOVERY_INTERVAL_ENV_VAR,
            _constants.DEFAULT_RECOVERY_INTERVAL)
        self.no_worker_timeout = _constants.env_float(
            _constants.NO_WORKER_TIMEOUT_ENV_VAR,
            _constants.DEFAULT_NO_WORKER_TIMEOUT)
        self.readmit_workers = bool(_constants.env_int(
            _constants.READMIT_WORKERS_ENV_VAR,
            _constants.DEFAULT_READMIT_WORKERS))
        spec = strategy.cluster_spec
        self.ps_addresses = list(spec["ps"])
        self.local_device = "/job:chief/replica:0/task:0/device:CPU:0"
        self._queue = ClosureQueue()
        self._packed = {}
        self._packed_lock = threading.Lock()
        self._gate = _SharedExclusiveLock()
        self.reconnect_generation = 0
        # Per-worker datasets, alive while the user or an iterator holds them.
        self._datasets = weakref.WeakSet()
        # The cluster as connected: pushed again, unchanged, to re-admit a
        # restarted worker.
        self._server_def = _tf_adapter.get_server_def()
        self._unhealthy_since = None
        self.hang_timeout = _constants.env_float(
            _constants.HANG_TIMEOUT_ENV_VAR, _constants.DEFAULT_HANG_TIMEOUT)
        self._membership_lock = threading.Lock()
        self._workers = [worker_lib.Worker(self, i, address)
                         for i, address in enumerate(spec["worker"])]
        for w in self._workers:
            w.start()
        self._stopping = threading.Event()
        # An elastic resolver's workers follow the rendezvous membership.
        self._membership_watch = None
        if isinstance(strategy.cluster_resolver, ElasticClusterResolver):
            self._membership_watch = strategy.cluster_resolver.watch(
                self.update_workers)
        if self.hang_timeout > 0:
            threading.Thread(target=self._watch_for_hangs, daemon=True,
                             name="keras_ps-hang-watchdog").start()

    # -- public API ------------------------------------------------------------
    @property
    def num_workers(self):
        return len(self._workers)

    @property
    def workers(self):
        """The Worker objects (index, address, state, closures_run)."""
        return tuple(self._workers)

    def schedule(self, fn, args=None, kwargs=None):
        """Schedules `fn(*args, **kwargs)` on some worker; returns a RemoteValue.

        Args:
            fn: a `tf.function`.
            args, kwargs: its arguments; `PerWorkerValues` (such as per-worker
                iterators) are replaced by the chosen worker's element.

        Raises:
            TypeError: `fn` is not a tf.function, or an argument is a
                RemoteValue.
            The first error of an earlier scheduled function, once.
            ParameterServerUnavailableError: a ps was lost.
        """
        if not _is_tf_function(fn):
            raise TypeError(
                "coordinator.schedule needs a tf.function. Received: "
                f"fn={getattr(fn, '__name__', fn)!r} of type "
                f"{type(fn).__name__}. Wrap it: fn = tf.function(fn).")
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        per_worker = False
        listener = None
        for value in tf.nest.flatten((args, kwargs)):
            if hasattr(value, "_keras_ps_shard_listener"):
                # A shard of a keras_ps.ShardedInput epoch: replaced by its
                # arguments; its ledger follows the closure (keras_ps/shards).
                listener = value._keras_ps_shard_listener(fn)
                args, kwargs = tf.nest.map_structure(
                    lambda v: v._keras_ps_shard_arguments() if hasattr(
                        v, "_keras_ps_shard_arguments") else v, (args, kwargs))
                continue
            if isinstance(value, RemoteValue):
                raise TypeError(
                    "A RemoteValue was passed as an argument to schedule. "
                    f"Received: {value!r}. Call .fetch() on it first, or "
                    "return the value from the scheduled function that needs it.")
            if isinstance(value, PerWorkerValues):
                per_worker = True
        closure = Closure(fn, args, kwargs, per_worker, listener)
        self._queue.put(closure)
        return closure.remote_value

    def join(self):
        """Blocks until every scheduled function has run.

        Raises:
            The first error of a scheduled function (once), a
            ParameterServerUnavailableError, or NoWorkersAvailableError when no
            worker was healthy for KERAS_PS_NO_WORKER_TIMEOUT seconds.
        """
        self._queue.wait(idle_check=self._check_workers)

    def done(self):
        """True when every scheduled function has run (raises as `join`)."""
        return self._queue.done()

    def fetch(self, values):
        """Fetches RemoteValues (and PerWorkerValues of them) in a structure."""
        def one(v):
            if isinstance(v, RemoteValue):
                return v.fetch()
            if isinstance(v, PerWorkerValues):
                return tuple(one(x) for x in v.values)
            return v
        return tf.nest.map_structure(one, values)

    def create_per_worker_dataset(self, dataset_fn):
        """Creates `dataset_fn()` (or a tf.data.Dataset) on every worker.

        `dataset_fn` may take a `tf.distribute.InputContext` telling the
        worker's index (`input_pipeline_id`) and the number of workers
        (`num_input_pipelines`), so each worker can read its own shard.
        """
        # Under the shared gate: a worker's re-admission (which rebuilds every
        # tracked dataset on it) cannot interleave with creating this one.
        with self._gate.shared():
            dataset = PerWorkerDataset(self, dataset_fn)
            self._datasets.add(dataset)
        return dataset

    def update_workers(self, addresses):
        """Follows a new worker membership while training runs.

        Args:
            addresses: the worker addresses by task index (`None` for a
                place that is free), e.g. from a rendezvous server. A new
                address joins (admitted as soon as it answers, its per-worker
                datasets created); a missing one leaves (its closures run
                elsewhere). Nobody is restarted.
        """
        with self._membership_lock:
            addresses = list(addresses)
            for index, address in enumerate(addresses):
                current = self._workers[index] if index < len(self._workers) \
                    else None
                if current is not None and current.address == address and \
                        current.state is not worker_lib.WorkerState.LEFT:
                    continue
                if current is not None:
                    current.leave("left the membership" if address is None
                                  else f"replaced by {address}")
                if address is not None:
                    self._join(index, address)
            for w in self._workers[len(addresses):]:
                w.leave("left the membership")
            self._notify_worker_change()

    def _join(self, index, address):
        worker = worker_lib.Worker(self, index, address,
                                   state=worker_lib.WorkerState.JOINING)
        if index < len(self._workers):
            self._workers[index] = worker
        else:
            self._workers.extend(
                worker_lib.Worker(self, i, None, state=worker_lib.WorkerState.LEFT)
                for i in range(len(self._workers), index))
            self._workers.append(worker)
        logger.info("[worker:%d] %s joins", index, address)
        worker.start()

    def shutdown(self):
        self._stopping.set()
        if self._membership_watch is not None:
            self._membership_watch.stop()
        for w in self._workers:
            w.stop()
        self._queue.stop()

    # -- internals used by workers ---------------------------------------------
    def members(self):
        """For each worker index: is it in the cluster now?"""
        return [w.state in worker_lib.IN_CLUSTER for w in self._workers]

    def num_healthy(self):
        return sum(w.state is worker_lib.WorkerState.HEALTHY for w in self._workers)

    def dead_ps(self):
        return [i for i, address in enumerate(self.ps_addresses)
                if not worker_lib.probe(address, self.probe_timeout)]

    def _check_workers(self):
        if self.num_healthy():
            self._unhealthy_since = None
            return
        now = time.monotonic()
        if self._unhealthy_since is None:
            self._unhealthy_since = now
            logger.warning("[chief] no healthy worker; waiting for one to return")
        if self.no_worker_timeout and now - self._unhealthy_since > self.no_worker_timeout:
            raise NoWorkersAvailableError(
                f"No worker has been reachable for {self.no_worker_timeout:.0f}s "
                f"(workers: {[w.address for w in self._workers]}). Restart the "
                "worker tasks, or raise KERAS_PS_NO_WORKER_TIMEOUT.")

    def _notify_worker_change(self):
        self._unhealthy_since = None

    def _reconnect_and_rebuild(self, recovered_index):
        """Makes a restarted worker usable again.

        Pushing the unchanged server def creates a fresh eager context on the
        restarted task only; ps variables, traced functions and the other
        workers' iterators keep working. Everything that lived on the lost
        process (its datasets and iterators) is rebuilt, with no closure in
        flight.
        """
        started = time.monotonic()
        with self._gate.exclusive():
            gate = time.monotonic()
            _tf_adapter.update_server_def(self._membership_def())
            connected = time.monotonic()
            self.reconnect_generation += 1
            for dataset in list(self._datasets):
                dataset._rebuild(recovered_index)
        logger.info(
            "[worker:%d] rebuilt in %.2fs: %.2fs waiting for calls in flight, "
            "%.2fs server def, %.2fs datasets", recovered_index,
            time.monotonic() - started, gate - started, connected - gate,
            time.monotonic() - connected)

    def _watch_for_hangs(self):
        """Declares a worker failed when its call has run `hang_timeout`
        seconds and the worker does not answer a probe: a stopped or hung
        process never returns the call, and would hold its closures forever."""
        interval = min(1.0, self.hang_timeout / 2)
        while not self._stopping.wait(interval):
            for w in list(self._workers):
                age = w.in_flight_seconds()
                if age is None or age < self.hang_timeout:
                    continue
                if not worker_lib.probe(w.address, self.probe_timeout):
                    w.abandon_in_flight(
                        f"call running {age:.0f}s and the worker does not answer")

    def is_traced(self, fn, count):
        return (fn, count) in self._packed

    def trace_is_safe(self):
        """False while a worker may be hung (see Worker._without_new_trace):
        one given up as hung, or a member that does not answer a probe now
        (a busy worker answers). Runs only before a new trace."""
        for w in list(self._workers):
            if w.hung:
                return False
            if w.state in worker_lib.IN_CLUSTER and \
                    not worker_lib.probe(w.address, self.probe_timeout):
                return False
        return True

    def _membership_def(self):
        """The connected server def with the worker job reduced to the workers
        that are in the cluster now (HEALTHY or RECOVERING). Lost workers are
        left out: TF waits for every listed task when the def changes."""
        server_def = type(self._server_def)()
        server_def.CopyFrom(self._server_def)
        members = {w.index: w.address for w in self._workers
                   if w.state in worker_lib.IN_CLUSTER}
        for job in server_def.cluster.job:
            if job.name == "worker":
                job.ClearField("tasks")
                for index, address in members.items():
                    job.tasks[index] = address
        for job in server_def.cluster_device_filters.jobs:
            if job.name == "worker":
                job.ClearField("tasks")
                for index in members:
                    job.tasks[index].device_filters.extend(
                        ["/job:ps", f"/job:{strategy_lib.COORDINATOR_JOB}"])
        return server_def

    def _packed_function(self, fn, count):
        key = (fn, count)
        packed = self._packed.get(key)
        if packed is None:
            with self._packed_lock:
                packed = self._packed.get(key)
                if packed is None:
                    def run_all(calls):
                        results = [fn(*args, **kwargs) for args, kwargs in calls]
                        # Automatic control dependencies make every output of
                        # a tf.function wait for all its stateful ops.
                        return results, tf.constant(True)
                    packed = tf.function(run_all)
                    self._packed[key] = packed
        return packed


class _SharedExclusiveLock:
    """Many closures run at once (shared); a reconnect runs alone (exclusive)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def shared(self):
        return _Held(self._acquire_shared, self._release_shared)

    def exclusive(self):
        return _Held(self._acquire_exclusive, self._release_exclusive)

    def _acquire_shared(self):
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._shared += 1

    def _release_shared(self):
        with self._cv:
            self._shared -= 1
            self._cv.notify_all()

    def _acquire_exclusive(self):
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._exclusive = True
            while self._shared:
                self._cv.wait()

    def _release_exclusive(self):
        with self._cv:
            self._exclusive = False
            self._cv.notify_all()


class _Held:
    def __init__(self, acquire, release):
        self._acquire, self._release = acquire, release
        self._lock = threading.Lock()
        self._released = False

    def __enter__(self):
        self._acquire()
        return self

    def __exit__(self, *exc):
        self.release_early()

    def release_early(self):
        """Releases once, whoever calls first (the holder or a watchdog)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()


def worker_index():
    """Inside a scheduled tf.function: the index of the worker running it.

    A scalar int64 tensor fed at every call, so one traced function serves
    every worker (e.g. `dataset.shard(num_workers(), worker_index())`).

    Raises:
        RuntimeError: called outside a tf.function.
    """
    return _call_time_value(0, "keras_ps_worker_index")


def num_workers():
    """Inside a scheduled tf.function: how many workers the cluster has."""
    return _call_time_value(1, "keras_ps_num_workers")


def _call_time_value(position, name):
    if not _tf_adapter.inside_function():
        raise RuntimeError(
            f"keras_ps.coordinator.{name[9:]}() must be called inside a "
            "tf.function that is scheduled with coordinator.schedule.")

    def value():
        current = strategy_lib.current_worker()
        if current is None:
            raise RuntimeError(
                "This tf.function reads the worker index, so it can only run "
                "through coordinator.schedule.")
        return tf.constant(current[position], tf.int64)

    return _tf_adapter.capture_call_time_value(
        value, tf.TensorSpec([], tf.int64), name)
