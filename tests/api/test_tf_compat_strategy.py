"""ParameterServerStrategy given TF user code: what TF's strategy refuses,
warns about or handles, on the shared real cluster (2 workers, 3 ps)."""

import functools
import logging

import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps.errors import ClusterConfigError
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def sharded_strategy(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


def _resolver(spec, **kwargs):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), rpc_layer="grpc", **kwargs)


# -- refused as TF refuses (bad inputs) ---------------------------------------------
@pytest.mark.parametrize("extra, kwargs, pattern", [
    ({"chief": ["localhost:1", "localhost:2"]}, {},
     r"at most one chief.*Received: chief=\['localhost:1', 'localhost:2'\]\. "
     r"List one chief address"),
    ({}, {"task_type": "trainer", "task_id": 0},
     r"task type is not a cluster role\. Received: task_type='trainer'\. Use "
     r"one of chief, ps, worker, evaluator"),
], ids=["strategy_two_chiefs", "strategy_unknown_task_type"])
def test_strategy_refuses_cluster_tf_refuses(cluster, strategy, extra, kwargs,
                                             pattern):
    spec = {**cluster.spec, **extra}
    with pytest.raises(ClusterConfigError, match=pattern):
        keras_ps.ParameterServerStrategy(_resolver(spec, **kwargs))


def test_strategy_accepts_one_chief_and_chief_task_type(cluster, strategy):
    spec = {**cluster.spec, "chief": ["localhost:1"]}
    # The connection made by the shared strategy is reused only for the same
    # jobs, so this checks the arguments without connecting anew.
    from keras_ps.strategy import strategy as strategy_lib

    strategy_lib._check_resolver(
        _resolver(spec, task_type="chief", task_id=0),
        {job: list(tasks) for job, tasks in spec.items()})


# -- datasets from distribute_datasets_from_function ---------------------------------
def _dataset_fn(context):
    return tf.data.Dataset.from_tensors(
        tf.constant(context.input_pipeline_id, tf.int64)).repeat()


@tf.function
def _take(iterator):
    return next(iterator)


def test_distributed_dataset_iterated_on_the_coordinator_is_refused(strategy):
    distributed = strategy.distribute_datasets_from_function(_dataset_fn)
    with pytest.raises(TypeError, match=(
            r"lives on the workers; it cannot be iterated on the coordinator\."
            r" Received: iteration of distribute_datasets_from_function\("
            r"_dataset_fn\).*Pass it to coordinator.create_per_worker_dataset")):
        for _ in distributed:
            pass


def test_distributed_dataset_through_the_coordinator(strategy, coordinator):
    direct = coordinator.create_per_worker_dataset(
        strategy.distribute_datasets_from_function(_dataset_fn))

    def per_worker_dataset_fn():  # TF's tutorial pattern
        return strategy.distribute_datasets_from_function(_dataset_fn)

    tutorial = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    for per_worker in (direct, tutorial):
        iterator = iter(per_worker)
        results = [coordinator.schedule(_take, args=(iterator,))
                   for _ in range(8)]
        coordinator.join()
        # Each worker reads its own pipeline: ids 0 and 1 only.
        assert {int(r.fetch()) for r in results} <= {0, 1}
        assert len(results) == 8


# -- TF's warning for run/reduce outside schedule -----------------------------------
def test_run_and_reduce_outside_schedule_warn(strategy, coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="keras_ps.strategy")
    assert strategy.run(lambda: tf.constant(2)).numpy() == 2
    assert strategy.reduce("SUM", tf.constant(3), axis=None).numpy() == 3
    warned = [r.getMessage() for r in caplog.records
              if "outside ClusterCoordinator.schedule" in r.getMessage()]
    assert [m.split(" was called")[0] for m in warned] == [
        "keras_ps.ParameterServerStrategy.run",
        "keras_ps.ParameterServerStrategy.reduce"]
    caplog.clear()

    @tf.function
    def scheduled():
        value = strategy.run(lambda: tf.constant(4))
        return strategy.reduce("SUM", value, axis=None)

    assert coordinator.schedule(scheduled).fetch() == 4
    assert not [r for r in caplog.records
                if "outside ClusterCoordinator.schedule" in r.getMessage()]


# -- variables: in a tf.function, partitioners, initializers, creator scopes -------
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "partitioned"])
def test_variables_created_inside_tf_function(strategy, sharded_strategy,
                                              sharded):
    s = sharded_strategy if sharded else strategy

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.table = None

        @tf.function
        def __call__(self, x):
            if self.table is None:  # created on the first trace only
                with s.scope():
                    self.table = tf.Variable(
                        tf.reshape(tf.range(8, dtype=tf.float32), [4, 2]))
            return tf.matmul(x, self.table)

    model = Model()
    x = tf.ones([1, 4])
    np.testing.assert_array_equal(model(x).numpy(), [[12, 16]])
    shards = model.table.variables if sharded else [model.table]
    assert isinstance(model.table, keras_ps.ShardedVariable) == sharded
    assert len(shards) == (2 if sharded else 1)
    assert all("/job:ps/" in v.device for v in shards)
    model.table.assign(tf.ones([4, 2]))
    np.testing.assert_array_equal(model(x).numpy(), [[4, 4]])


class PartitionAwareIdentity:
    """Like TF's test initializer: refuses to build the whole value."""

    def __init__(self):
        self.calls = []

    def __call__(self, shape, dtype, **kwargs):
        if "partition_shape" not in kwargs:
            raise AssertionError("asked for the whole value")
        self.calls.append((tuple(kwargs["partition_offset"]),
                           tuple(kwargs["partition_shape"])))
        return tf.slice(tf.eye(*shape, dtype=dtype), kwargs["partition_offset"],
                        kwargs["partition_shape"])


def test_partition_aware_initializer_gets_each_shard(sharded_strategy):
    init = PartitionAwareIdentity()
    with sharded_strategy.scope():
        v = tf.Variable(functools.partial(init, shape=(5, 5), dtype=tf.float32),
                        shape=(5, 5), dtype=tf.float32)
    assert isinstance(v, keras_ps.ShardedVariable)
    assert init.calls == [((0, 0), (3, 5)), ((3, 0), (2, 5))]
    np.testing.assert_array_equal(v.numpy(), np.eye(5))


def test_plain_callable_initializer_runs_once(sharded_strategy):
    calls = []

    def initial_value():
        calls.append(1)
        return tf.reshape(tf.range(12, dtype=tf.float32), [6, 2])

    with sharded_strategy.scope():
        v = tf.Variable(initial_value, shape=(6, 2), dtype=tf.float32)
    assert len(v.variables) == 2 and len(calls) == 1
    np.testing.assert_array_equal(v.numpy(), np.arange(12).reshape(6, 2))


@pytest.mark.parametrize("kwargs", [{}, {"shape": (6, 2)}, {"dtype": "float32"}],
                         ids=["no_shape_no_dtype", "no_dtype", "no_shape"])
def test_partitioner_when_shape_or_dtype_not_given(sharded_strategy, kwargs):
    # TF's strategy calls the initializer first and splits by its value.
    calls = []

    def initial_value():
        calls.append(1)
        return tf.ones([6, 2])

    with sharded_strategy.scope():
        v = tf.Variable(initial_value, **kwargs)
    assert isinstance(v, keras_ps.ShardedVariable)
    assert [tuple(s.shape) for s in v.variables] == [(3, 2), (3, 2)]
    assert len(calls) == 1
    np.testing.assert_array_equal(v.numpy(), np.ones([6, 2]))


def test_partitioner_leaves_scalars_whole(sharded_strategy):
    with sharded_strategy.scope():
        scalar = tf.Variable(lambda: tf.constant(1.0))
    assert not isinstance(scalar, keras_ps.ShardedVariable)
    assert "/job:ps/" in scalar.device and scalar.numpy() == 1.0


def test_user_creator_scope_inside_strategy_scope(sharded_strategy):
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(kwargs.get("name"))
        kwargs["trainable"] = False
        # As with TF's strategy, the strategy's placement wins over this.
        with tf.device("/job:worker/task:0"):
            return next_creator(**kwargs)

    with sharded_strategy.scope():
        with tf.variable_creator_scope(creator):
            table = tf.Variable(tf.ones([4, 2]), name="table")
            scalar = tf.Variable(1.0, name="scalar")
    assert seen == ["table", "scalar"]  # once per logical variable
    assert isinstance(table, keras_ps.ShardedVariable)
    shards = table.variables
    assert all("/job:ps/" in v.device for v in shards + [scalar])
    assert len({v.device for v in shards}) == 2
    assert not any(v.trainable for v in shards + [scalar])
