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
from keras_ps.tables import _blockwise_init
from keras_ps.tables import _sharded_weights
from keras_ps.tables import sharded_variable
from keras_ps._keras import initializers as keras_initializers
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(240)


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


# -- initialisation in row blocks on the ps -----------------------------------------
@pytest.fixture
def small_blocks(monkeypatch):
    """Variables of 16+ bytes made in blocks of 3 rows of 4 float32."""
    monkeypatch.setattr(_blockwise_init, "BLOCKWISE_MIN_BYTES", 16)
    monkeypatch.setattr(_blockwise_init, "BLOCK_BYTES", 3 * 4 * 4)


def _embedding(strategy, initializer, rows=10):
    with strategy.scope():
        layer = keras.layers.Embedding(rows, 4, embeddings_initializer=initializer)
        layer.build()
    return layer


def test_blockwise_initialisation_draws_each_block(small_blocks, strategy):
    layer = _embedding(strategy, keras.initializers.Constant(0.25))
    np.testing.assert_array_equal(layer.embeddings.numpy(), np.full((10, 4), 0.25))
    assert "/job:ps/" in layer.embeddings.value.device

    # A seeded random initializer: block i (rows 3i..3i+2) is drawn with
    # block_seed(seed, i); blocks differ; a rerun gives the same numbers.
    layer = _embedding(strategy, keras.initializers.RandomUniform(seed=5))
    value = layer.embeddings.numpy()
    for index, start in enumerate(range(0, 10, 3)):
        rows = min(3, 10 - start)
        want = keras.initializers.RandomUniform(
            seed=keras_initializers.block_seed(5, index))((rows, 4))
        np.testing.assert_array_equal(value[start:start + rows], want.numpy())
    assert not np.array_equal(value[0:3], value[3:6])
    again = _embedding(strategy, keras.initializers.RandomUniform(seed=5))
    np.testing.assert_array_equal(again.embeddings.numpy(), value)

    # Glorot's numbers depend on the whole shape: Keras' own path.
    layer = _embedding(strategy, keras.initializers.GlorotUniform(seed=3))
    np.testing.assert_array_equal(
        layer.embeddings.numpy(),
        keras.initializers.GlorotUniform(seed=3)((10, 4)).numpy())


def test_blockwise_initialisation_of_optimizer_slots(small_blocks, strategy):
    layer = _embedding(strategy, "zeros")
    with strategy.scope():
        optimizer = keras.optimizers.Adagrad(initial_accumulator_value=0.5)
        optimizer.build(layer.trainable_variables)
    (accumulator,) = [v for v in optimizer.variables if v.shape == (10, 4)]
    np.testing.assert_array_equal(accumulator.numpy(), np.full((10, 4), 0.5))
    assert accumulator.value.device == layer.embeddings.value.device


def test_unseeded_shards_do_not_start_equal(two_shards, monkeypatch):
    # Keras gives an unseeded initializer one fixed int seed: each shard of
    # equal shape must still draw its own numbers.
    monkeypatch.setattr(_sharded_weights, "SLICED_INIT_MAX_BYTES", 0)
    layer = _embedding(two_shards, keras.initializers.RandomUniform(), rows=8)
    first, second = (v.numpy() for v in layer.embeddings.variables)
    assert not np.array_equal(first, second)


def _peak_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def test_large_variable_costs_its_ps_one_copy(cluster, strategy):
    """A 512 MB table with Keras' Constant initializer (ones times the value:
    two temporaries of the table's size, then TF's copy into the variable)
    raises its ps' peak RSS by little more than the table (made whole: 2.1x;
    the bound leaves room for the ps' other allocations in the meantime)."""
    size_mb = 2 * _blockwise_init.BLOCKWISE_MIN_BYTES / 2**20
    rows = int(size_mb * 2**20) // (64 * 4)
    with strategy.scope():
        probe = keras.layers.Embedding(8, 64)
        probe.build()
    # The next variable goes to the next ps in turn.
    task = (int(probe.embeddings.value.device.split("task:")[1].split("/")[0])
            + 1) % len(cluster.spec["ps"])
    pid = cluster.pid("ps", task)
    _reset_peak(pid)
    before = _peak_mb(pid)
    with strategy.scope():
        layer = keras.layers.Embedding(
            rows, 64, embeddings_initializer=keras.initializers.Constant(0.1))
        layer.build()
    assert f"task:{task}/" in layer.embeddings.value.device
    growth = _peak_mb(pid) - before
    head = layer.embeddings.value[:2].numpy()
    np.testing.assert_allclose(head, np.full((2, 64), 0.1, np.float32))
    del layer
    assert growth <= 1.5 * size_mb, (growth, size_mb)
