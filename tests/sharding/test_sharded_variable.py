import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps.partitioners import FixedShardsPartitioner, MinSizePartitioner

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sharded_strategy(cluster, strategy):
    # Same cluster as the shared strategy: the connection is reused.
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(3))


def test_seed_partition_examples(cluster, strategy):
    s = keras_ps.ParameterServerStrategy(
        cluster.resolver,
        variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10,
                                                max_shards=2))
    with s.scope():
        v = tf.Variable(tf.zeros([1024, 1024]))
    assert isinstance(v, keras_ps.ShardedVariable)
    assert [tuple(x.shape) for x in v.variables] == [(512, 1024), (512, 1024)]
    assert v.variables[0].device != v.variables[1].device


def test_div_partition_and_placement(sharded_strategy):
    values = np.arange(13 * 2, dtype=np.float32).reshape(13, 2)
    with sharded_strategy.scope():
        v = tf.Variable(values, name="table")
        small = tf.Variable(1.0)  # scalars are never split
    assert not isinstance(small, keras_ps.ShardedVariable)
    assert [x.shape[0] for x in v.variables] == [5, 4, 4]
    assert len({x.device for x in v.variables}) == 3
    np.testing.assert_array_equal(tf.convert_to_tensor(v).numpy(), values)


def test_lookup_assign_scatter(sharded_strategy):
    values = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    with sharded_strategy.scope():
        v = tf.Variable(values)
    ids = tf.constant([[9, 0], [4, 4]])
    np.testing.assert_array_equal(v.embedding_lookup(ids).numpy(),
                                  values[[[9, 0], [4, 4]]])
    v.assign_add(np.ones_like(values))
    v.scatter_add(tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 9])))
    expected = values + 1
    expected[[0, 9]] += 1
    np.testing.assert_array_equal(v.numpy(), expected)
    v.scatter_update(tf.IndexedSlices(tf.zeros([1, 3]), tf.constant([5])))
    expected[5] = 0
    np.testing.assert_array_equal(v.numpy(), expected)


def test_checkpoint_restores_into_other_shard_count_and_plain(
        cluster, sharded_strategy, tmp_path):
    values = np.random.RandomState(0).rand(11, 4).astype(np.float32)
    with sharded_strategy.scope():
        v = tf.Variable(values)
    path = tf.train.Checkpoint(table=v).write(str(tmp_path / "ckpt"))
    two = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
    with two.scope():
        w = tf.Variable(tf.zeros([11, 4]))
    assert len(w.variables) == 2
    tf.train.Checkpoint(table=w).read(path).assert_consumed()
    np.testing.assert_array_equal(w.numpy(), values)
    plain = tf.Variable(tf.zeros([11, 4]))
    tf.train.Checkpoint(table=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), values)


def test_bad_partitioner_result(cluster, strategy):
    s = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=lambda shape, dtype: [2, 2])
    with pytest.raises(ValueError, match="partitions axis 1"):
        with s.scope():
            tf.Variable(tf.zeros([4, 4]), name="bad")
