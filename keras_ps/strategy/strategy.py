"""ParameterServerStrategy: variables on parameter servers, steps on workers.

A `tf.distribute.Strategy` subclass, so Keras 3's optimizer and trainer (which
ask `tf.distribute.get_strategy()` for `colocate_vars_with`, `update`, `run`
and replica contexts) work with it unchanged. This module decides where
variables live and connects the coordinator process to the cluster (once per
process); scheduling lives in `keras_ps.ClusterCoordinator`, which sits above
it. Importing it installs the Keras hooks that variable placement needs
(keras_ps/_keras: sharded weights, atomic updates, optimizer updates).

The strategy overrides private hooks of `tf.distribute.StrategyExtended`
(`_create_variable`, `_update`, `_reduce_to`, ...): the public classes have no
other way to define a strategy. keras_ps/_tf_adapter.py lists them and its
test pins that they exist.
"""

import itertools
import logging
import threading

import tensorflow as tf

from keras_ps.tables import _blockwise_init
from keras_ps.cluster import _connection
from keras_ps.strategy import _ps_state
from keras_ps.tables import _sharded_variable_ops
from keras_ps import _tf_adapter
from keras_ps import cluster as cluster_lib
from keras_ps._keras import atomic_updates as keras_atomic_updates
from keras_ps._keras import compat as keras_compat
from keras_ps._keras import grouped_reads as keras_grouped_reads
from keras_ps._keras import initializers as keras_initializers
from keras_ps._keras import optimizers as keras_optimizers
from keras_ps._keras import sharding as keras_sharding
from keras_ps.strategy._per_worker import PerWorkerValues
from keras_ps.strategy._per_worker import WorkerInputContext
from keras_ps.strategy._per_worker import current_worker
from keras_ps.strategy._per_worker import worker_device
from keras_ps.errors import ClusterConfigError
from keras_ps.errors import ScheduleUsageError

logger = logging.getLogger(__name__)

COORDINATOR_JOB = _connection.COORDINATOR_JOB
COORDINATOR_DEVICE = _connection.COORDINATOR_DEVICE
WORKER_DEVICE_FILTERS = _connection.WORKER_DEVICE_FILTERS


class ParameterServerStrategy(tf.distribute.Strategy):
    """Places variables on parameter servers; workers run the steps.

    Variables created under `strategy.scope()` go to the ps tasks round-robin
    (or are split into shards by `variable_partitioner`); variables created
    outside stay on the coordinator. Connecting to the cluster happens here.

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            (e.g. `keras_ps.cluster.resolver_from_tf_config()` or
            `LocalCluster(...).resolver`) with `ps` and `worker` jobs. An
            `evaluator` job may be listed; it is ignored.
        variable_partitioner: None, or a callable `(shape, dtype, axis=0) ->
            list of partitions per axis` (keras_ps's or TF's partitioners).
        fused_adam: True (default): `keras.optimizers.Adam` (and subclasses
            that keep its `update_step`, such as AdamW) updates each ps
            variable with TF's one-pass `ResourceApplyAdam` kernel instead of
            Keras' dozen ops: same formula, 2.5x faster per update. One
            difference: a sparse gradient whose rows repeat (an embedding id
            seen twice in a batch) is summed per row before it is squared, as
            Adam's formula says; Keras squares each repeat and adds the
            squares into the second moment. False: Keras' own update_step.
            (An `Embedding` lookup of a table on a ps sends each distinct row
            once, so its gradient has no repeated rows either way.) Adam
            still updates every row of a table at each step; see
            `keras_ps.optimizers.LazyAdam` for an update of the looked-up rows.

    Example:
    ```python
    strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        v = tf.Variable(1.0)   # lives on /job:ps/task:0
    ```
    """

    def __init__(self, cluster_resolver, variable_partitioner=None,
                 fused_adam=True):
        if not isinstance(cluster_resolver,
                          tf.distribute.cluster_resolver.ClusterResolver):
            raise TypeError(
                "ParameterServerStrategy needs a cluster resolver. Received: "
                f"cluster_resolver={cluster_resolver!r}. Use "
                "keras_ps.cluster.resolver_from_tf_config() or "
                "keras_ps.cluster.resolver_from_spec({...})."
            )
        if variable_partitioner is not None and (
                not callable(variable_partitioner)
                or isinstance(variable_partitioner, type)):
            raise TypeError(
                "variable_partitioner must be callable (shape, dtype, axis=0): "
                "a partitioner, e.g. FixedShardsPartitioner(2), not its class. "
                f"Received: variable_partitioner={variable_partitioner!r}.")
        if not isinstance(fused_adam, bool):
            raise TypeError(
                f"fused_adam must be True or False. Received: "
                f"fused_adam={fused_adam!r}.")
        spec = cluster_lib.training_cluster(cluster_resolver.cluster_spec())
        _check_resolver(cluster_resolver, spec)
        for job in ("ps", "worker"):
            if not spec.get(job):
                raise ClusterConfigError(
                    f"The cluster has no {job!r} job. Received jobs: "
                    f"{sorted(spec)}. A parameter-server cluster needs at "
                    "least one ps and one worker task."
                )
        self._cluster_resolver = cluster_resolver
        self._cluster_spec = spec
        self._variable_partitioner = variable_partitioner
        self._fused_adam = fused_adam
        extended = _Extended(self, spec, variable_partitioner)
        super().__init__(extended)
        self._connection = _connection.connect(spec)
        self._ps_markers = _ps_state.PsMarkers(len(spec["ps"]))
        logger.info("[chief] connected to %d ps and %d workers",
                    len(spec["ps"]), len(spec["worker"]))

    def move_ps(self, index, address):
        """Ps `index` serves at `address` now (a replacement machine), in
        the cluster spec and the connection's (the coordinator pushes it)."""
        self._cluster_spec["ps"][index] = address
        self._connection.jobs["ps"][index] = address

    def check_connected(self):
        """Raises if a strategy for another cluster replaced this one's connection.

        Raises:
            ClusterConfigError: this process connected to another cluster
                since; this strategy's variables and coordinator are gone.
        """
        if self._connection.replaced:
            raise ClusterConfigError(
                "This strategy's cluster connection was replaced: the process "
                "has since connected to another cluster (TF's eager runtime "
                "holds one per process). Received: a strategy for ps "
                f"{self._cluster_spec['ps']}. Create a new strategy (and "
                "model) for the cluster you want to train on, or run each "
                "cluster's coordinator in its own process.")

    def ps_holds_state(self, index):
        """Whether ps `index` still holds this strategy's variables: False
        when it cannot be reached, and when it answers but was restarted
        (its variables are gone)."""
        return self._ps_markers.holds_state(index)

    def variables_on_ps(self, index):
        """The live variables this strategy placed on ps `index`."""
        return self.extended.placed.on_ps(index)

    def track_ps_variable(self, variable):
        """Records a variable placed on a ps outside `scope()` (keras_ps'
        own bookkeeping), so that a recovery of that ps makes it again."""
        self.extended.placed.add(variable)

    def track_ps_resource(self, device, remake):
        """Records `remake` (a bound method), which makes a resource that is
        not a variable (a hash table, a mutex) again on ps `device`: a
        recovery of that ps calls it once the variables are made again."""
        self.extended.placed.add_resource(device, remake)

    def recreate_ps_variables(self, index, restore_follows=False):
        """Gives ps `index`, restarted and empty, every variable this strategy
        placed there again (same shapes, dtypes and shards), in place, and
        its other tracked resources (empty); the caller restores their
        values from a checkpoint next. Variables start as zeros, but large
        ones with `restore_follows` (a restore of every table and its slots
        follows): those are left unwritten, undefined until the restore.

        Returns:
            A `_ps_state.Recreated`: how many variables and other resources
            were made again, and the variables' old and new handles.
        """
        variables = self.variables_on_ps(index)
        handles = _ps_state.recreate(variables, fill=not restore_follows)
        resources = self.extended.placed.remake_resources(index)
        self._ps_markers.renew(index)
        return _ps_state.Recreated(len(variables), resources, handles)

    def on_disconnect(self, callback):
        """Calls `callback()` when another cluster's connection replaces this one."""
        self._connection.on_replace(callback)

    @property
    def cluster_resolver(self):
        return self._cluster_resolver

    @property
    def cluster_spec(self):
        """The training cluster as {job: [address, ...]} (no evaluator)."""
        return {job: list(tasks) for job, tasks in self._cluster_spec.items()}

    @property
    def variable_partitioner(self):
        """The `variable_partitioner` given at construction (None: no sharding)."""
        return self._variable_partitioner

    @property
    def fused_adam(self):
        """Whether Adam updates ps variables with one fused kernel."""
        return self._fused_adam

    @property
    def num_workers(self):
        return len(self._cluster_spec["worker"])

    @property
    def num_ps(self):
        return len(self._cluster_spec["ps"])

    def input_context(self):
        """The `tf.distribute.InputContext` for the worker being dispatched to
        (pipeline 0 of 1 outside a dispatch)."""
        current = current_worker()
        index, count = current if current else (0, 1)
        return WorkerInputContext(
            num_input_pipelines=count, input_pipeline_id=index,
            num_replicas_in_sync=1)


def _check_resolver(resolver, spec):
    """Refuses what TF's strategy refuses: several chiefs, a task type that
    is not a cluster role."""
    chiefs = spec.get(COORDINATOR_JOB) or []
    if len(chiefs) > 1:
        raise ClusterConfigError(
            "A cluster has at most one chief: the coordinator, the one "
            "process that creates the strategy and schedules the steps. "
            f"Received: chief={list(chiefs)}. List one chief address (or none: "
            "the process creating the strategy is then the coordinator); "
            "put the other tasks in the worker job.")
    task_type = getattr(resolver, "task_type", None)
    if task_type is not None and task_type not in cluster_lib.TASK_TYPES:
        raise ClusterConfigError(
            "The cluster resolver's task type is not a cluster role. "
            f"Received: task_type={task_type!r}. Use one of "
            f"{', '.join(cluster_lib.TASK_TYPES)} (the strategy runs on the "
            "chief), or leave it unset.")


class _DistributedDatasetsFromFunction:
    """What `strategy.distribute_datasets_from_function(dataset_fn)` returns
    on the coordinator: datasets that exist only on the workers. Pass it to
    `coordinator.create_per_worker_dataset`, which calls it (as a dataset_fn)
    on each worker; iterating it on the coordinator is refused, as TF's
    strategy refuses it."""

    def __init__(self, dataset_fn, strategy):
        self._dataset_fn = dataset_fn
        self._strategy = strategy
        self.__name__ = getattr(dataset_fn, "__name__", "dataset_fn")

    def __call__(self, input_context):
        return self._dataset_fn(input_context)

    def __iter__(self):
        raise ScheduleUsageError(
            "A dataset from strategy.distribute_datasets_from_function lives "
            "on the workers; it cannot be iterated on the coordinator. "
            f"Received: iteration of distribute_datasets_from_function("
            f"{self.__name__}) outside a scheduled function. Pass it to "
            "coordinator.create_per_worker_dataset(...) and call next() on "
            "that iterator inside a function given to coordinator.schedule "
            "(or use model.fit with a keras_ps.DatasetCreator).")

    def __repr__(self):
        return f"<distribute_datasets_from_function({self.__name__})>"


_NOT_SCHEDULED_WARNING = (
    "keras_ps.ParameterServerStrategy.%s was called outside "
    "ClusterCoordinator.schedule: it runs here, on the coordinator, which can "
    "be slow. To run on the workers, call strategy.run and strategy.reduce "
    "inside a tf.function passed to coordinator.schedule.")


def _warn_if_not_scheduled(method):
    """Logs TF's warning when `method` runs eagerly on the coordinator,
    outside a function being dispatched to a worker."""
    if current_worker() is None and not _tf_adapter.inside_function():
        logger.warning(_NOT_SCHEDULED_WARNING, method)


class _Extended(tf.compat.v1.distribute.StrategyExtended):
    # The V1 extended class: Strategy.run calls its call_for_each_replica.
    """The strategy's hooks that TF's and Keras' code call."""

    def __init__(self, strategy, spec, variable_partitioner):
        super().__init__(strategy)
        self._num_ps = len(spec["ps"])
        self._num_workers = len(spec["worker"])
        self._partitioner = variable_partitioner
        self._next_ps = itertools.count()
        self._lock = threading.Lock()
        self.placed = _ps_state.PlacedVariables()

    # -- variable placement --------------------------------------------------
    def _next_ps_device(self):
        with self._lock:
            return _ps_state.ps_device(next(self._next_ps) % self._num_ps)

    def _create_variable(self, next_creator, **kwargs):
        if kwargs.pop("per_worker_variable", False):
            raise ValueError(
                "keras_ps does not create per-worker variables. Received: "
                "tf.Variable(..., per_worker_variable=True) under a keras_ps "
                "strategy's scope. Return per-worker results from the "
                "scheduled function and combine them on the coordinator "
                "(coordinator.fetch), or keep the state in a ps variable.")
        colocate_with = kwargs.pop("colocate_with", None)
        if colocate_with is not None:
            # Optimizer slots and the like: same ps as their variable, never split.
            with tf.device(colocate_with.device):
                return self._place(next_creator, kwargs)
        if self._partitioner is not None:
            created = _sharded_variable_ops.maybe_create_sharded(
                self, next_creator, self._partitioner, kwargs)
            if created is not None:
                return created
        with tf.device(self._next_ps_device()):
            return self._place(next_creator, kwargs)

    def _create_shard(self, next_creator, kwargs):
        with tf.device(self._next_ps_device()):
            return self._place(next_creator, kwargs)

    def _place(self, next_creator, kwargs):
        """Creates one variable on the device in scope and records it."""
        variable = _blockwise_init.create(next_creator, kwargs)
        self.placed.add(variable)
        return variable

    def _allow_variable_partition(self):
        return True

    def _validate_colocate_with_variable(self, colocate_with_variable):
        pass

    # -- replica plumbing: one replica per worker, updates are local ---------
    def _call_for_each_replica(self, fn, args, kwargs):
        _warn_if_not_scheduled("run")
        with tf.distribute.ReplicaContext(self._container_strategy(),
                                          replica_id_in_sync_group=0):
            return fn(*args, **kwargs)

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group

    def _get_replica_id_in_sync_group(self, replica_id):
        return replica_id

    def _use_merge_call(self):
        return False

    def _reduce_to(self, reduce_op, value, destinations, options):
        _warn_if_not_scheduled("reduce")
        return value

    def _gather_to_implementation(self, value, destinations, axis, options):
        return value

    def _update(self, var, fn, args, kwargs, group):
        # Run the update where the variable lives: only the gradient travels.
        with tf.device(var.device):
            result = fn(var, *args, **(kwargs or {}))
        if group:
            return result
        return tf.nest.map_structure(self._local_results, result)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, should_group):
        with tf.device(colocate_with.device):
            result = fn(*args, **(kwargs or {}))
        if should_group:
            return result
        return tf.nest.map_structure(self._local_results, result)

    def _local_results(self, value):
        if isinstance(value, PerWorkerValues):
            return tuple(value.values)
        return (value,)

    def value_container(self, value):
        return value

    def read_var(self, var):
        return tf.identity(var)

    @property
    def _num_replicas_in_sync(self):
        return 1

    @property
    def worker_devices(self):
        return tuple(worker_device(i) for i in range(self._num_workers))

    @property
    def parameter_devices(self):
        return tuple(_ps_state.ps_device(i) for i in range(self._num_ps))

    def non_slot_devices(self, var_list):
        return min(var_list, key=lambda x: x.name)

    def _in_multi_worker_mode(self):
        return True

    @property
    def should_checkpoint(self):
        return True

    @property
    def should_save_summary(self):
        return True

    # -- input ----------------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset, options):
        return dataset

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if current_worker() is None and not _tf_adapter.inside_function():
            return _DistributedDatasetsFromFunction(
                dataset_fn, self._container_strategy())
        return dataset_fn(self._container_strategy().input_context())

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(tf.distribute.experimental.ValueContext(0, 1))


def _current_partitioner():
    """(partitioner, device for initializers) of the current keras_ps strategy,
    or (None, None): what the sharding hooks ask when a layer adds a weight."""
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, ParameterServerStrategy) or \
            strategy.variable_partitioner is None:
        return None, None
    return strategy.variable_partitioner, strategy.extended.parameter_devices[0]


# A model is built under a strategy: Keras' hooks must be in place by then.
keras_sharding.install(_current_partitioner)
keras_atomic_updates.install()
keras_optimizers.install()
keras_grouped_reads.install()
keras_initializers.install()
keras_compat.install(lambda s: isinstance(s, ParameterServerStrategy))
