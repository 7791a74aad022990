"""ParameterServerStrategy: variables on parameter servers, steps on workers.

A `tf.distribute.Strategy` subclass, so Keras 3's optimizer and trainer (which
ask `tf.distribute.get_strategy()` for `colocate_vars_with`, `update`, `run`
and replica contexts) work with it unchanged. Scheduling lives in
`keras_ps.ClusterCoordinator`; this module only decides placement.
"""

import itertools
import logging
import threading

import tensorflow as tf

from keras_ps import _keras_adapter
from keras_ps import _tf_adapter
from keras_ps import cluster as cluster_lib
from keras_ps import partitioners as partitioners_lib
from keras_ps.errors import ClusterConfigError

# A model is built under a strategy: Keras' hooks must be in place by then.
_keras_adapter.install()

logger = logging.getLogger(__name__)

COORDINATOR_JOB = "chief"

# The dispatch context: which worker the calling thread is running a closure
# or dataset_fn for. Set by the coordinator's worker threads.
_dispatch = threading.local()


def current_worker():
    """(worker_index, num_workers) of the closure this thread dispatches, or None."""
    return getattr(_dispatch, "worker", None)


class _DispatchScope:
    def __init__(self, index, num_workers):
        self._value = (index, num_workers)

    def __enter__(self):
        self._saved = getattr(_dispatch, "worker", None)
        _dispatch.worker = self._value

    def __exit__(self, *exc):
        _dispatch.worker = self._saved


def _ps_device(index):
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


def worker_device(index):
    return f"/job:worker/replica:0/task:{index}/device:CPU:0"


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
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "variable_partitioner must be callable (shape, dtype, axis=0). "
                f"Received: variable_partitioner={variable_partitioner!r}."
            )
        if not isinstance(fused_adam, bool):
            raise TypeError(
                f"fused_adam must be True or False. Received: "
                f"fused_adam={fused_adam!r}.")
        spec = cluster_lib.training_cluster(cluster_resolver.cluster_spec())
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
        _connect(spec)
        logger.info("[chief] connected to %d ps and %d workers",
                    len(spec["ps"]), len(spec["worker"]))

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
        return tf.distribute.InputContext(
            num_input_pipelines=count, input_pipeline_id=index,
            num_replicas_in_sync=1)


def cluster_device_filters(spec):
    """Workers see only the ps tasks and the coordinator, never each other, so
    a dead worker cannot break another worker's context."""
    filters = tf.config.experimental.ClusterDeviceFilters()
    for i in range(len(spec["worker"])):
        filters.set_device_filters("worker", i, ["/job:ps", f"/job:{COORDINATOR_JOB}"])
    for i in range(len(spec["ps"])):
        filters.set_device_filters("ps", i, ["/job:worker", f"/job:{COORDINATOR_JOB}"])
    return filters


_connected = None  # the cluster this process is connected to


def _connect(spec):
    """Connects this process (as the coordinator) to the cluster, once.

    Reconnecting would invalidate every remote handle, so a second strategy on
    the same cluster reuses the connection.
    """
    global _connected
    jobs = {job: spec[job] for job in ("ps", "worker")}
    if spec.get(COORDINATOR_JOB):
        jobs[COORDINATOR_JOB] = spec[COORDINATOR_JOB][:1]
    if _connected == jobs:
        return
    _connected = jobs
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(jobs), rpc_layer="grpc")
    tf.config.experimental_connect_to_cluster(
        resolver, job_name=COORDINATOR_JOB, task_index=0,
        make_master_device_default=False,
        cluster_device_filters=cluster_device_filters(jobs))


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

    # -- variable placement --------------------------------------------------
    def _next_ps_device(self):
        with self._lock:
            return _ps_device(next(self._next_ps) % self._num_ps)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        if colocate_with is not None:
            # Optimizer slots and the like: same ps as their variable, never split.
            with tf.device(colocate_with.device):
                return next_creator(**kwargs)
        if self._partitioner is not None:
            from keras_ps import sharded_variable  # avoids an import cycle

            created = sharded_variable.maybe_create_sharded(
                self, next_creator, self._partitioner, kwargs)
            if created is not None:
                return created
        with tf.device(self._next_ps_device()):
            return next_creator(**kwargs)

    def _create_shard(self, next_creator, kwargs):
        with tf.device(self._next_ps_device()):
            return next_creator(**kwargs)

    def _allow_variable_partition(self):
        return True

    def _validate_colocate_with_variable(self, colocate_with_variable):
        pass

    # -- replica plumbing: one replica per worker, updates are local ---------
    def _call_for_each_replica(self, fn, args, kwargs):
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
        from keras_ps.coordinator.values import PerWorkerValues

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
        return tuple(_ps_device(i) for i in range(self._num_ps))

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
        return dataset_fn(self._container_strategy().input_context())

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(tf.distribute.experimental.ValueContext(0, 1))
