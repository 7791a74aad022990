"""ClusterCoordinator: schedules tf.functions on workers, asynchronously."""

import logging
import threading
import time
import weakref

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps import cluster as cluster_lib
from keras_ps import errors
from keras_ps.cluster import _network
from keras_ps.coordinator import failure_handling
from keras_ps.coordinator import iterator_release
from keras_ps.coordinator import membership
from keras_ps.coordinator import ps_addresses
from keras_ps.coordinator import watchdog
from keras_ps.coordinator import worker as worker_lib
from keras_ps.coordinator import worker_services
from keras_ps.coordinator.closures import Closure
from keras_ps.coordinator.closures import ClosureQueue
from keras_ps.coordinator.config import CoordinatorConfig
from keras_ps.coordinator.datasets import PerWorkerDataset
from keras_ps.coordinator.gate import SharedExclusiveLock
from keras_ps.coordinator.packing import PackedFunctions
from keras_ps.coordinator.values import RemoteValue
from keras_ps.strategy import _ps_state
from keras_ps.strategy import strategy as strategy_lib
from keras_ps.strategy._per_worker import PerWorkerValues

logger = logging.getLogger(__name__)

# One coordinator per strategy, as in TF: the strategy's cluster has one set
# of worker threads and one watchdog.
_by_strategy = weakref.WeakKeyDictionary()
_by_strategy_lock = threading.Lock()
# Seconds a ps recovery lets the calls in flight at the loss end by themselves
# (those touching the lost ps fail at once) before it cancels them.
_PS_LOSS_GRACE = 2.0
# Seconds `cancel_scheduled` waits for the calls in flight, cancelled or not.
_ABANDON_TIMEOUT = 10.0


class ClusterCoordinator:
    """Runs scheduled `tf.function`s on the workers of a ParameterServerStrategy.

    There is one coordinator per strategy: `ClusterCoordinator(strategy)`
    called again returns the same one (as does `Model.fit` under that
    strategy). Execution is at-least-once: a function whose worker is lost is
    run again on another worker. The first error a function raises comes out
    once from `schedule`, `join` or `done`; functions still pending then are
    cancelled, and so are those running on other workers (their `fetch()`
    raises `CancelledError`; the datasets of a worker whose call was cancelled
    are made again, as after a restart). Consecutive closures of one function
    are packed into a single remote call (up to `max_pack`), which is what
    makes dispatch cheap.

    Args:
        strategy: a `keras_ps.ParameterServerStrategy`.
        max_pack: most closures per remote call (default from
            `KERAS_PS_MAX_PACK`, 16); 1 disables packing. Only the first
            call for a strategy may set it.

    Example:
    ```python
    coordinator = keras_ps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(10)]
    coordinator.join()
    ```
    """

    def __new__(cls, strategy, max_pack=None):
        if not isinstance(strategy, strategy_lib.ParameterServerStrategy):
            raise TypeError(
                "ClusterCoordinator needs a keras_ps.ParameterServerStrategy. "
                f"Received: strategy={strategy!r}.")
        config = CoordinatorConfig.from_env(max_pack)  # validates max_pack
        strategy.check_connected()
        with _by_strategy_lock:
            existing = _by_strategy.get(strategy)
            if existing is not None:
                if max_pack is not None and max_pack != existing.config.max_pack:
                    raise ValueError(
                        "This strategy already has a coordinator with "
                        f"max_pack={existing.config.max_pack}. Received: "
                        f"max_pack={max_pack}. There is one coordinator per "
                        "strategy: pass max_pack on the first "
                        "ClusterCoordinator(strategy) call, or omit it.")
                return existing
            coordinator = super().__new__(cls)
            coordinator._start(strategy, config)
            _by_strategy[strategy] = coordinator
        strategy.on_disconnect(coordinator.shutdown)
        return coordinator

    def __init__(self, strategy, max_pack=None):
        del strategy, max_pack  # set up once, in __new__

    def _start(self, strategy, config):
        self.strategy = strategy
        self.config = config
        spec = strategy.cluster_spec
        self._queue = ClosureQueue()
        self._packing = PackedFunctions(strategy)
        self._gate = SharedExclusiveLock()
        # Per-worker datasets, alive while the user or an iterator holds them.
        self._datasets = weakref.WeakSet()
        self._workers = membership.Workers(config)
        self._readmission = failure_handling.Readmission(
            self._gate, self._workers.members_by_index, self._workers.count,
            lambda: list(self._datasets), self._release_replaced, strategy,
            self._packing)
        self._release = iterator_release.IteratorRelease(
            lambda: self._readmission.generation)
        self._dropped = iterator_release.DroppedIterators(
            lambda values: self.release_iterators(PerWorkerValues(values)))
        self._services = worker_services.WorkerServices(
            queue=self._queue, packing=self._packing, gate=self._gate,
            readmission=self._readmission, config=config,
            cut_off=self._workers.cut_off,
            num_workers=self._workers.count,
            num_healthy=self._workers.num_healthy, dead_ps=self._dead_ps,
            trace_is_safe=self._workers.trace_is_safe,
            on_admitted=self._workers.admitted,
            local_device=strategy_lib.COORDINATOR_DEVICE)
        for i, address in enumerate(spec["worker"]):
            self._readmission.record_incarnation(i, address)
        self._workers.start(self._services, spec["worker"])
        # A resolver that watches membership (the elastic one) moves workers
        # in and out while training runs.
        self._membership_watch = None
        resolver = strategy.cluster_resolver
        if isinstance(resolver, cluster_lib.MembershipWatcher):
            self._membership_watch = resolver.watch(self.update_workers)
        self._watchdog = None
        if config.hang_timeout > 0:
            self._watchdog = watchdog.HangWatchdog(
                self._workers.all, config, self._dead_ps,
                self._queue, self._packing, self._silent_ps,
                lambda: watchdog.call_under_way(strategy))
            self._watchdog.start()

    # -- public API ------------------------------------------------------------
    @property
    def max_pack(self):
        return self.config.max_pack

    @property
    def num_workers(self):
        return self._workers.count()

    @property
    def workers(self):
        """The Worker objects (index, address, state, closures_run,
        closures_run_twice)."""
        return tuple(self._workers.all())

    def schedule(self, fn, args=None, kwargs=None):
        """Schedules `fn(*args, **kwargs)` on some worker; returns a RemoteValue.

        Args:
            fn: a `tf.function`.
            args, kwargs: its arguments; `PerWorkerValues` (such as per-worker
                iterators) are replaced by the chosen worker's element.

        Raises:
            ScheduleUsageError: (a `ValueError`, as TF raises, and a
                `TypeError`) `fn` is not a tf.function, or an argument is a
                RemoteValue.
            The first error of an earlier scheduled function, once.
            ParameterServerUnavailableError: a ps was lost.
        """
        closure = Closure.of(fn, tuple(args or ()), dict(kwargs or {}))
        self._queue.put(closure)
        return closure.remote_value

    def join(self):
        """Blocks until every scheduled function has run.

        Raises:
            The first error of a scheduled function (once), a
            ParameterServerUnavailableError, or NoWorkersAvailableError when no
            worker was healthy for KERAS_PS_NO_WORKER_TIMEOUT seconds.
        """
        self._queue.wait(idle_check=self.raise_if_no_workers)

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
        (`num_input_pipelines`), so each worker can read its own shard. It
        is traced once and its graph run on every worker, unless it reads
        `input_pipeline_id` or draws from Python's or numpy's global random
        generator: then it is traced once per worker.
        """
        # Under the shared gate: a worker's re-admission (which rebuilds every
        # tracked dataset on it) cannot interleave with creating this one.
        with self._gate.shared():
            if self._release.enabled:
                self._dropped.start()
            dataset = PerWorkerDataset(dataset_fn, self.strategy, self._gate,
                                       self._workers.members,
                                       self._workers.mark_unreachable,
                                       self._dropped.dropped)
            self._datasets.add(dataset)
        return dataset

    def release_iterators(self, iterators):
        """Drops `iterators` (of `iter(per_worker_dataset)`) without
        stalling the workers, as fit and evaluate do when they end; see
        keras_ps/coordinator/iterator_release.py. Empty after."""
        with self._gate.shared():
            self._release.release(iterators, self._workers.all())

    def _release_replaced(self, index, iterators):
        """Releases iterators that a rebuild of worker `index`'s datasets
        replaced, one by one, as `release_iterators` does."""
        for iterator in iterators:
            values = [None] * self._workers.count()
            values[index] = iterator
            self.release_iterators(PerWorkerValues(values))

    def lost_parameter_servers(self):
        """{index: address} of the ps that do not hold this job's variables
        now: unreachable, or answering after a restart with nothing on them."""
        return self._dead_ps()

    def recover_parameter_servers(self, timeout=None, restore_follows=False):
        """Gives parameter servers that lost their variables those variables
        back, and makes the coordinator take work again.

        For a custom loop after `ParameterServerUnavailableError`: this waits
        for every lost ps to answer on its address (a restart policy), or
        where the strategy's cluster resolver names it now (a replacement
        machine; see ps_addresses.py), pushes the cluster to every task again,
        re-creates each variable the strategy placed on those ps in place
        (same objects, shapes, dtypes and shards; zeros), and feeds the
        functions traced before the new ones instead of tracing them again
        (traced again with a `DynamicEmbedding`, whose key maps are made
        again as new objects). Workers are kept, their iterators start
        over; values are not: restore a checkpoint before scheduling
        again (an example: docs/ps_recovery.md).

        Args:
            timeout: seconds to wait for a lost ps to answer (default from
                `KERAS_PS_PS_RECOVERY_TIMEOUT`, 300).
            restore_follows: True when the checkpoint restored next holds
                every table and its optimizer slots: not zeroed first
                (seconds per GB saved), undefined until the restore.

        Returns:
            A `PsRecovery` (`lost` empty when no ps was lost).

        Raises:
            ParameterServerRecoveryError: (a ParameterServerUnavailableError)
                a lost ps did not answer within `timeout`, or calls in
                flight did not end.
        """
        if timeout is None:
            timeout = self.config.ps_recovery_timeout
        started = time.monotonic()
        deadline = started + timeout
        lost = self._dead_ps()
        if not lost:
            self._drain_after_loss(deadline)
            return _ps_state.PsRecovery(lost=())
        logger.info("[chief] ps %s lost; waiting for them", sorted(lost))
        for index, address in sorted(lost.items()):
            lost[index] = ps_addresses.wait_for_ps(
                self.strategy.cluster_resolver, index, address, deadline)
            if lost[index] is None:
                raise errors.ParameterServerRecoveryError(
                    f"Parameter server {index} at {address} was lost (it "
                    "did not answer, or answered without this job's "
                    "variables) and has not answered again within "
                    f"{timeout:g}s. Bring it back on the same address (a "
                    "restart policy does; kill a process that is hung) or "
                    "where the cluster resolver names it (a ps announces "
                    "it with --rdzv_endpoint), or restart the job and "
                    "resume from the last checkpoint; raise "
                    "KERAS_PS_PS_RECOVERY_TIMEOUT to wait longer.")
        self._drain_after_loss(deadline)
        answered = time.monotonic()
        with self._gate.exclusive():
            ps_addresses.follow(self.strategy, self._readmission, lost)
            kernels_changed = self._readmission.reconnect(
                returned=[_ps_state.ps_device(i) for i in sorted(lost)])
            connected = time.monotonic()
            made = [self.strategy.recreate_ps_variables(
                i, restore_follows=restore_follows) for i in sorted(lost)]
            count = sum(m.variables + m.resources for m in made)
            recreated = time.monotonic()
            retraced = self._reuse_traces(made, kernels_changed)
            replaced = self._readmission.restart_iterators([  # the rollback's data
                w.index for w in self._workers.all()
                if w.state in worker_lib.RUNNABLE])
        for index, iterators in replaced.items():  # their workers kept them
            self._release_replaced(index, iterators)
        recovery = _ps_state.PsRecovery(
            lost=tuple(sorted(lost)), variables=count,
            waiting_seconds=answered - started,
            reconnect_seconds=connected - answered,
            recreate_seconds=recreated - connected,
            restart_seconds=time.monotonic() - recreated)
        logger.info("[chief] ps %s given %d variables back; %s",
                    list(recovery.lost), count, retraced)
        return recovery

    def _reuse_traces(self, made, kernels_changed):
        """Points the traced functions at the variables a recovery made
        again (`made`, `Recreated`s), so that none is traced again: a
        model's steps take seconds to trace. Resources made again as new
        objects (a dynamic table's) are captured as such: then every
        function is traced again, as the push did when keras_ps' kernels
        changed (`kernels_changed` functions). Returns what was done, for
        the log. Under the gate: a re-admission traces datasets."""
        if kernels_changed:
            return f"{kernels_changed} functions to retrace for the kernels"
        if any(m.resources for m in made):
            self._packing.clear()
            return (f"{_tf_adapter.retrace_all_functions()} functions to "
                    "retrace")
        handles = {}
        for m in made:
            handles.update(m.handles)
        return f"{_tf_adapter.rebind_captures(handles)} traces fed them"

    def _drain_after_loss(self, deadline):
        """Waits for the calls in flight at a ps loss to end (cancelled
        after `_PS_LOSS_GRACE` s: the restore rolls their work back anyway),
        then clears the queue's errors.

        Raises:
            ParameterServerRecoveryError: calls in flight at `deadline`.
        """
        if not (self._queue.drain(_PS_LOSS_GRACE,
                                  max(0.0, deadline - time.monotonic()),
                                  "since a ps loss")
                and self._queue.clear_after_fatal(0)):
            raise errors.ParameterServerRecoveryError(
                "Calls in flight did not end after a parameter server's "
                "loss, even cancelled, so its variables cannot be made again "
                "safely. Restart the job and resume from the last checkpoint.")

    def cancel_scheduled(self, timeout=_ABANDON_TIMEOUT):
        """Cancels the functions not yet run (their `fetch()` raises
        `CancelledError`) and waits for those running (cancelled after
        `_PS_LOSS_GRACE` s), ignoring their errors: `fit` and `evaluate` do
        this when they raise (a callback's error, Ctrl-C). Returns False
        when calls still ran after `timeout` s (a hung worker's)."""
        self._queue.abandon()
        return self._queue.drain(_PS_LOSS_GRACE, timeout, "after an error")

    def calls_in_flight(self):
        """One line per worker call in flight: its worker, how many
        closures of which function, and what it waits on now."""
        calls = [(w, w.in_flight_call()) for w in self._workers.all()]
        return [call.describe(w.index, w.address) for w, call in calls
                if call is not None]

    def update_workers(self, addresses):
        """Follows a new worker membership while training runs.

        Args:
            addresses: the worker addresses by task index (`None` for a
                place that is free), e.g. from a rendezvous server. A new
                address joins (admitted as soon as it answers, its per-worker
                datasets created); a missing one leaves (its closures run
                elsewhere). Nobody is restarted.
        """
        self._workers.update(addresses)

    def shutdown(self):
        """Stops the worker threads and the watchdog; pending calls are cancelled.

        A later `ClusterCoordinator(strategy)` starts a new coordinator."""
        with _by_strategy_lock:
            if _by_strategy.get(self.strategy) is self:
                del _by_strategy[self.strategy]
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._membership_watch is not None:
            self._membership_watch.stop()
        self._workers.stop()
        self._queue.stop()
        self._dropped.stop()
        self._release.close()

    # -- workers and parameter servers -----------------------------------------
    def num_healthy(self):
        """How many workers take closures now."""
        return self._workers.num_healthy()

    def _dead_ps(self):
        """{index: address} of the ps whose variables are lost: those that do
        not answer a probe, and those that answer but were restarted (a
        restart policy can bring a ps back before any probe sees it gone):
        the marker variable the strategy keeps on each ps cannot be read."""
        silent = self._silent_ps()
        return {i: a for i, a in enumerate(self.strategy.cluster_spec["ps"])
                if i in silent or not self._ps_holds_state(i)}

    def _silent_ps(self):
        """{index: address} of the ps that do not answer a probe."""
        return {i: a for i, a in enumerate(self.strategy.cluster_spec["ps"])
                if not _network.probe(a, self.config.probe_timeout)}

    def _ps_holds_state(self, index):
        with self._gate.shared():
            return self.strategy.ps_holds_state(index)

    def is_idle(self):
        """True when no scheduled function is queued or running (unlike
        `done`, it never raises)."""
        return self._queue.idle()

    def raise_if_no_workers(self):
        """Raises NoWorkersAvailableError when no worker has been healthy for
        KERAS_PS_NO_WORKER_TIMEOUT seconds (`join` calls it while it waits)."""
        self._workers.raise_if_none_healthy()

    def trace_is_safe(self):
        """False while a worker may be hung: a function run for the first
        time is registered on every worker, and waits for a hung one."""
        return self._workers.trace_is_safe()


# TF's `tf.distribute.coordinator.ClusterCoordinator(strategy)` returns
# `strategy._cluster_coordinator` once that is set: for a keras_ps strategy it
# is keras_ps' coordinator of it, so TF code that makes TF's coordinator runs
# as written.
strategy_lib.ParameterServerStrategy._cluster_coordinator = property(
    ClusterCoordinator, doc="keras_ps' coordinator of this strategy.")
