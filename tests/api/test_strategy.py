import pytest
import tensorflow as tf

import keras_ps
from keras_ps.errors import ClusterConfigError

pytestmark = pytest.mark.timeout(120)


def test_round_robin_placement_seed_example(strategy):
    # The seed documentation's assertions, with 3 ps.
    v1 = tf.Variable(initial_value=0.0)
    with strategy.scope():
        v2 = tf.Variable(initial_value=1.0)
        v3 = tf.Variable(initial_value=2.0)
        v4 = tf.Variable(initial_value=3.0)
        v5 = tf.Variable(initial_value=4.0)
    assert v1.device == "/job:chief/replica:0/task:0/device:CPU:0"
    # Other tests may have created variables first: check the rotation.
    first = int(v2.device.split("task:")[1].split("/")[0])
    assert [v.device for v in (v2, v3, v4, v5)] == [
        f"/job:ps/replica:0/task:{(first + k) % 3}/device:CPU:0"
        for k in range(4)]
    assert v5.device == v2.device
    assert v5.numpy() == 4.0


def test_evaluator_in_cluster_spec_is_ignored(strategy, coordinator):
    # The shared strategy's spec lists an evaluator that no process serves.
    assert "evaluator" not in strategy.cluster_spec
    with strategy.scope():
        v = tf.Variable(0)

    @tf.function
    def fn():
        v.assign_add(1)
        return v.read_value()

    coordinator.schedule(fn)
    coordinator.join()
    assert v.numpy() == 1


def test_optimizer_slots_colocated(strategy):
    import keras

    with strategy.scope():
        var = keras.Variable(tf.ones([4]))
        optimizer = keras.optimizers.Adam()
        optimizer.build([var])
    slots = [v for v in optimizer.variables if v.shape == (4,)]
    assert slots, optimizer.variables
    for slot in slots:
        assert slot.value.device == var.value.device


def test_strategy_api(strategy):
    assert strategy.num_replicas_in_sync == 1
    assert strategy.experimental_local_results(3) == (3,)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert value == 1
    assert strategy.reduce(tf.distribute.ReduceOp.SUM, tf.constant(2.0),
                           axis=None).numpy() == 2.0


def test_resolver_without_ps_job():
    resolver = keras_ps.cluster.resolver_from_spec(
        {"worker": ["localhost:1111"]})
    with pytest.raises(ClusterConfigError, match="no 'ps' job"):
        keras_ps.ParameterServerStrategy(resolver)


def test_resolver_without_worker_job():
    resolver = keras_ps.cluster.resolver_from_spec({"ps": ["localhost:1111"]})
    with pytest.raises(ClusterConfigError, match="no 'worker' job"):
        keras_ps.ParameterServerStrategy(resolver)


def test_unknown_task_name():
    with pytest.raises(ClusterConfigError, match="'trainer'"):
        keras_ps.cluster.resolver_from_spec(
            {"ps": ["localhost:1"], "trainer": ["localhost:2"]})


def test_not_a_resolver():
    with pytest.raises(TypeError, match="cluster resolver"):
        keras_ps.ParameterServerStrategy({"ps": ["localhost:1"]})
