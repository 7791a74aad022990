"""What changes for large sharded weights (above the size thresholds, lowered
here so small tables take the large-table paths), on the shared real cluster:
initialisation shard by shard on each ps, and checkpoints with one slice per
shard that load both ways with plain Keras variables."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ps
from keras_ps import _sharded_weights
from keras_ps import sharded_variable
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two_shards(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


@pytest.fixture(scope="module")
def three_shards(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(3))


def test_large_weight_initialised_per_shard(two_shards, monkeypatch):
    monkeypatch.setattr(_sharded_weights, "SLICED_INIT_MAX_BYTES", 0)
    with two_shards.scope():
        layer = keras.layers.Embedding(8, 4, embeddings_initializer=(
            keras.initializers.RandomUniform(seed=5)))
        layer.build()
    shards = [v.numpy() for v in layer.embeddings.variables]
    assert [s.shape for s in shards] == [(4, 4), (4, 4)]
    # Each shard is the initializer at its own shape, with seed + index.
    np.testing.assert_array_equal(
        shards[0], keras.initializers.RandomUniform(seed=5)((4, 4)).numpy())
    np.testing.assert_array_equal(
        shards[1], keras.initializers.RandomUniform(seed=6)((4, 4)).numpy())
    assert [v.device for v in layer.embeddings.variables] != [
        layer.embeddings.variables[0].device] * 2


@pytest.fixture
def sliced(monkeypatch):
    monkeypatch.setattr(sharded_variable, "SLICED_SAVE_MIN_BYTES", 0)


def test_sliced_checkpoint_round_trips(sliced, two_shards, three_shards, tmp_path):
    with two_shards.scope():
        layer = keras.layers.Embedding(10, 3)
        layer.build()
    assert type(layer.embeddings).__name__ == "_SlicedShardedWeight"
    want = layer.embeddings.numpy()
    path = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "c"))
    # One key, the full shape, as a plain layer writes it.
    assert dict(tf.train.list_variables(path))[
        "layer/_embeddings/.ATTRIBUTES/VARIABLE_VALUE"] == [10, 3]
    # Each ps wrote its own slice (plus the coordinator's file).
    assert len([f for f in os.listdir(tmp_path) if ".data-" in f]) == 3
    layer.embeddings.assign(np.zeros((10, 3), np.float32))
    tf.train.Checkpoint(layer=layer).read(path).assert_consumed()
    np.testing.assert_array_equal(layer.embeddings.numpy(), want)

    plain = keras.layers.Embedding(10, 3)
    plain.build()
    tf.train.Checkpoint(layer=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.embeddings.numpy(), want)

    with three_shards.scope():
        other = keras.layers.Embedding(10, 3)
        other.build()
    tf.train.Checkpoint(layer=other).read(path).assert_consumed()
    np.testing.assert_array_equal(other.embeddings.numpy(), want)

    plain.embeddings.assign(want * 2)
    plain_path = tf.train.Checkpoint(layer=plain).write(str(tmp_path / "p"))
    tf.train.Checkpoint(layer=layer).read(plain_path).assert_consumed()
    np.testing.assert_array_equal(layer.embeddings.numpy(), want * 2)


def test_sliced_checkpoint_with_lazy_adam_slots(sliced, two_shards, tmp_path):
    with two_shards.scope():
        layer = keras.layers.Embedding(10, 3)
        layer.build()
        optimizer = keras_ps.optimizers.LazyAdam(0.1)
        optimizer.build(layer.trainable_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(tf.constant([1, 7, 7])))
        weights = layer.trainable_variables
        optimizer.apply(tape.gradient(loss, [w.value for w in weights]), weights)

    step()
    checkpoint = tf.train.Checkpoint(layer=layer, optimizer=optimizer)
    saved = [v.numpy() for v in optimizer.variables] + [layer.embeddings.numpy()]
    path = checkpoint.write(str(tmp_path / "c"))
    keys = dict(tf.train.list_variables(path))
    # Slots under one key each, full shape (the row step too).
    assert sorted(shape for key, shape in keys.items() if "optimizer/" in key
                  and shape) == [[10], [10, 3], [10, 3]]
    step()
    checkpoint.read(path).assert_consumed()
    restored = [v.numpy() for v in optimizer.variables] + [layer.embeddings.numpy()]
    for a, b in zip(restored, saved):
        np.testing.assert_array_equal(a, b)
