"""Sharded Keras 3 weights on the real multi-process cluster."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ps
from keras_ps.partitioners import FixedShardsPartitioner, MinSizePartitioner

pytestmark = pytest.mark.timeout(240)

X = np.array([[1, 2, 9], [0, 5, 5], [7, 3, 1], [4, 4, 8]], np.int32)
Y = np.linspace(-1, 1, 4 * 3 * 2).reshape(4, 3, 2).astype(np.float32)


@pytest.fixture(scope="module")
def three_shards(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(3))


def make_model(optimizer="adam"):
    """Embedding (sharded lookup) + Dense (kernel read by conversion), seeded."""
    model = keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(
            10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=3)),
        keras.layers.Dense(
            2, kernel_initializer=keras.initializers.GlorotUniform(seed=4),
            bias_initializer=keras.initializers.RandomNormal(seed=5)),
    ])
    model.compile(optimizer=keras.optimizers.get(optimizer), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def train(model, coordinator, steps):
    """`model.train_step` in a tf.function, run on workers one step at a time."""
    def dataset_fn():
        return tf.data.Dataset.from_tensors((X, Y)).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        return model.train_step(next(it))["loss"]

    losses = [coordinator.schedule(step, args=(iterator,)).fetch()
              for _ in range(steps)]
    return losses


def full_weights(model):
    """One array per logical weight (sharded weights concatenated)."""
    out = []
    for layer in model.layers:
        for attr in ("_embeddings", "_kernel", "bias"):
            value = getattr(layer, attr, None)
            if value is not None:
                out.append(np.asarray(value.numpy()))
    return out


def test_seed_partition_examples(cluster, strategy):
    min_size = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=2))
    with min_size.scope():
        layer = keras.layers.Embedding(input_dim=1024, output_dim=1024)
        layer.build()
    assert [tuple(w.shape) for w in layer.weights] == [(512, 1024)] * 2
    table = layer.embeddings
    assert isinstance(table, keras_ps.ShardedVariable)
    assert len(table.variables) == 2
    assert table.variables[0].device != table.variables[1].device
    assert all("/job:ps/" in v.device for v in table.variables)

    fixed = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(num_shards=2))
    with fixed.scope():
        layer = keras.layers.Embedding(8, 16384)
        layer.build()
    assert len(layer.embeddings.variables) == 2
    assert [tuple(w.shape) for w in layer.weights] == [(4, 16384)] * 2
    assert [w.path for w in layer.weights] == [
        f"{layer.name}/embeddings_part_0", f"{layer.name}/embeddings_part_1"]


def test_keras_variables_are_never_split(two_shards):
    with two_shards.scope():
        metric = keras.metrics.MeanSquaredError()
        raw = keras.Variable(np.zeros((6, 3), np.float32))
    for variable in list(metric.variables) + [raw]:
        assert isinstance(variable.value, tf.Variable)
        assert not isinstance(variable.value, keras_ps.ShardedVariable)
    assert "/job:ps/" in raw.value.device


def test_lookup_gathers_rows_per_shard_and_sparse_gradients(two_shards):
    with two_shards.scope():
        layer = keras.layers.Embedding(1000, 8)
        layer.build()

    @tf.function
    def lookup(ids):
        return layer(ids)

    graph = lookup.get_concrete_function(tf.TensorSpec([None, 3], tf.int32)).graph
    ops = graph.get_operations()
    gathers = [op for op in ops if op.type == "ResourceGather"]
    assert len(gathers) == 2  # one per shard
    assert not [op for op in ops if op.type == "ReadVariableOp"]  # no full read
    for op in ops:  # any concat only builds shapes, never the table
        if op.type == "ConcatV2":
            assert op.outputs[0].dtype.is_integer
    ids = np.array([[0, 999, 500], [499, 1, -1]], np.int32)
    expected = layer.embeddings.numpy()[ids]
    np.testing.assert_allclose(layer(ids).numpy(), expected)
    with tf.GradientTape() as tape:
        out = layer(ids)
    grads = tape.gradient(out, layer.trainable_weights)
    assert [type(g) for g in grads] == [tf.IndexedSlices] * 2


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad", "rmsprop"])
def test_train_step_updates_each_shard_on_its_ps(two_shards, coordinator, optimizer):
    with two_shards.scope():
        model = make_model(optimizer)
    before = [w.numpy().copy() for w in model.trainable_weights]
    losses = train(model, coordinator, 3)
    assert np.all(np.isfinite(losses))
    shards = [w for layer in model.layers for w in layer.weights]
    assert len(shards) == 6  # embeddings, kernel and bias, 2 shards each
    for w, old in zip(model.trainable_weights, before):
        assert not np.allclose(w.numpy(), old), w.path
    devices = {w.path: w.value.device for w in shards}
    for i in range(len(devices) // 2):
        pair = list(devices.values())[2 * i: 2 * i + 2]
        assert pair[0] != pair[1]
    slots = [v for v in model.optimizer.variables if "_part_" in v.path]
    assert slots or optimizer == "sgd"
    for slot in slots:
        owner = next(p for p in devices if p.replace("/", "_") in slot.path)
        assert slot.value.device == devices[owner], slot.path


def test_numerical_equivalence_with_unpartitioned(strategy, two_shards, coordinator):
    # Steps run one at a time on the workers through the coordinator; every
    # step sees the same batch, so the result does not depend on the worker.
    with strategy.scope():
        plain = make_model("adam")
    with two_shards.scope():
        sharded = make_model("adam")
    np.testing.assert_array_equal(sharded(X).numpy(), plain(X).numpy())
    plain_losses = train(plain, coordinator, 5)
    sharded_losses = train(sharded, coordinator, 5)
    np.testing.assert_allclose(sharded_losses, plain_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(full_weights(sharded), full_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert isinstance(sharded.layers[1].kernel, keras_ps.ShardedVariable)
    np.testing.assert_allclose(sharded(X).numpy(), plain(X).numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def trained(two_shards, coordinator, tmp_path_factory):
    """A trained 2-shard model saved three ways."""
    with two_shards.scope():
        model = make_model("adam")
    train(model, coordinator, 3)
    root = tmp_path_factory.mktemp("saved")
    paths = {"keras": str(root / "m.keras"), "h5": str(root / "w.weights.h5")}
    model.save(paths["keras"])
    model.save_weights(paths["h5"])
    paths["ckpt"] = tf.train.Checkpoint(model=model).write(str(root / "ckpt"))
    return model, paths


def slot_values(model):
    """Adam's slots as full arrays, in the optimizer's order (shards joined)."""
    from keras_ps.tables import _sharded_weights

    return [np.asarray(v.numpy()) for v in
            _sharded_weights.collapse(model.optimizer.variables)]


def test_checkpoint_keys_match_a_plain_model(trained, tmp_path):
    model, paths = trained
    plain = make_model("adam")
    plain_path = tf.train.Checkpoint(model=plain).write(str(tmp_path / "plain"))
    keys = dict(tf.train.list_variables(paths["ckpt"]))
    assert keys == dict(tf.train.list_variables(plain_path))
    assert keys["model/optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"] == [10, 4]


@pytest.mark.parametrize("target", ["plain", "three_shards"])
def test_saved_model_loads_elsewhere(trained, three_shards, target):
    model, paths = trained
    expected = model(X).numpy()
    scope = three_shards.scope() if target == "three_shards" else _no_scope()
    with scope:
        loaded = keras.models.load_model(paths["keras"])
        rebuilt = make_model("adam")
        restored = make_model("adam")
    rebuilt.load_weights(paths["h5"])
    tf.train.Checkpoint(model=restored).read(paths["ckpt"]).assert_consumed()
    for other in (loaded, rebuilt, restored):
        table = other.layers[0]._embeddings
        if target == "plain":
            assert not isinstance(table, keras_ps.ShardedVariable)
        else:
            assert len(table.variables) == 3
        np.testing.assert_allclose(other(X).numpy(), expected, rtol=1e-6)
    for other in (loaded, restored):  # optimizer state too
        for a, b in zip(slot_values(other), slot_values(model)):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_plain_checkpoint_loads_into_sharded(two_shards, tmp_path):
    plain = make_model("adam")
    plain.layers[0].embeddings.assign(np.arange(40, dtype=np.float32).reshape(10, 4))
    path = tf.train.Checkpoint(model=plain).write(str(tmp_path / "plain"))
    plain.save(str(tmp_path / "plain.keras"))
    with two_shards.scope():
        sharded = make_model("adam")
        from_keras = keras.models.load_model(str(tmp_path / "plain.keras"))
    tf.train.Checkpoint(model=sharded).read(path).assert_consumed()
    for other in (sharded, from_keras):
        assert len(other.layers[0].embeddings.variables) == 2
        np.testing.assert_allclose(other(X).numpy(), plain(X).numpy(), rtol=1e-6)


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("spec, problem", [
    (2, "not a list"),
    ([2], "has 1 entries"),
    ([0, 1], "not an integer >= 1"),
    ([-1, 1], "not an integer >= 1"),
    ([1, 2], "partitions axis 1"),
])
def test_bad_partitioner_results_name_the_weight(cluster, strategy, spec, problem):
    bad = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=lambda shape, dtype, axis=0: spec)
    with bad.scope():
        layer = keras.layers.Embedding(6, 4, name="bad_table")
        with pytest.raises(ValueError, match=problem) as info:
            layer.build()
    message = str(info.value)
    assert "bad_table/embeddings" in message and "(6, 4)" in message
    assert repr(spec) in message


# -- subclassed models under a partitioner ---------------------------------------
class TwoDense(keras.Model):
    """Layers as attributes and a `call`, no `build()`: Keras builds it by
    tracing `call` in a stateless scope."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.hidden(x))


class Recommender(keras.Model):
    def __init__(self):
        super().__init__()
        self.items = keras.layers.Embedding(10000, 32)
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(keras.ops.mean(self.items(ids), axis=1))


SUBCLASS_STEPS = 2
_rng = np.random.default_rng(0)
SUBCLASS_DATA = {
    "dense": (_rng.normal(size=(16, 3)).astype("float32"),
              _rng.normal(size=(16, 1)).astype("float32")),
    "embedding": (_rng.integers(0, 10000, size=(16, 2)).astype("int32"),
                  _rng.normal(size=(16, 1)).astype("float32")),
}
SUBCLASSES = {"dense": TwoDense, "embedding": Recommender}
# model.weights as a plain model lists them, then under the partitioner.
PLAIN_WEIGHTS = {"dense": ["kernel", "bias", "kernel", "bias"],
                 "embedding": ["embeddings", "kernel", "bias"]}
SHARDED_WEIGHTS = {
    "dense": ["kernel_part_0", "kernel_part_1", "bias_part_0", "bias_part_1",
              "kernel_part_0", "kernel_part_1", "bias"],  # bias (1,): 1 row
    "embedding": ["embeddings_part_0", "embeddings_part_1", "kernel", "bias"],
}


@pytest.fixture(scope="module")
def min_size(cluster, strategy):
    """The TF tutorial's partitioner: 10000 x 32 floats in 2 shards, the
    Dense head whole."""
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=2))


def subclassed(kind, build, strategies, callbacks=(), epochs=1):
    """A subclassed model made under its partitioner, built by calling it
    (`build="call"`) or left to `fit` (`build="fit"`), then fit; and fit's
    History."""
    x, y = SUBCLASS_DATA[kind]
    with strategies[kind].scope():
        model = SUBCLASSES[kind]()
        if build == "call":
            model(x[:1])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    history = model.fit(x, y, batch_size=8, epochs=epochs,
                        steps_per_epoch=SUBCLASS_STEPS, verbose=0,
                        callbacks=list(callbacks))
    return model, history


def plain_twin(kind):
    """The same class, built without any strategy."""
    model = SUBCLASSES[kind]()
    model(SUBCLASS_DATA[kind][0][:1])
    return model


SUBCLASS_CASES = [(kind, build) for kind in ("dense", "embedding")
                  for build in ("call", "fit")]


@pytest.fixture(scope="module", params=SUBCLASS_CASES,
                ids=[f"{k}-built_by_{b}" for k, b in SUBCLASS_CASES])
def trained_subclass(request, two_shards, min_size):
    kind, build = request.param
    model, _ = subclassed(kind, build,
                          {"dense": two_shards, "embedding": min_size})
    return kind, model


def test_subclassed_model_has_the_weights_of_a_plain_model(trained_subclass):
    kind, model = trained_subclass
    assert [w.name for w in plain_twin(kind).weights] == PLAIN_WEIGHTS[kind]
    assert [w.name for w in model.weights] == SHARDED_WEIGHTS[kind]
    assert model.trainable_weights == model.weights
    # Every weight the model lists is a shard its layers compute with.
    used = {id(v) for layer in model.layers for w in
            (getattr(layer, a, None) for a in ("_kernel", "bias", "_embeddings"))
            if w is not None for v in getattr(w, "variables", [w.value])}
    assert {id(w.value) for w in model.weights} == used
    # Adam: its iterations and learning rate, then two slots per shard.
    slots = [v.name for v in model.optimizer.variables][2:]
    assert sorted(slots) == sorted(
        f"{w.path.replace('/', '_')}_{slot}" for w in model.trainable_weights
        for slot in ("momentum", "velocity"))


def test_subclassed_model_weights_file_loads_both_ways(trained_subclass,
                                                       two_shards, min_size,
                                                       tmp_path):
    kind, model = trained_subclass
    x, _ = SUBCLASS_DATA[kind]
    expected = model.predict(x, verbose=0)
    model.save_weights(str(tmp_path / "sharded.weights.h5"))
    plain = plain_twin(kind)
    plain.load_weights(str(tmp_path / "sharded.weights.h5"))
    np.testing.assert_allclose(plain(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    with {"dense": two_shards, "embedding": min_size}[kind].scope():
        again = SUBCLASSES[kind]()
        again(x[:1])
    again.load_weights(str(tmp_path / "plain.weights.h5"))
    np.testing.assert_allclose(again.predict(x, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)
    model.load_weights(str(tmp_path / "sharded.weights.h5"))  # its own file
    np.testing.assert_allclose(model.predict(x, verbose=0), expected,
                               rtol=1e-6, atol=1e-6)


def test_subclassed_model_exports(trained_subclass, tmp_path):
    kind, model = trained_subclass
    x, _ = SUBCLASS_DATA[kind]
    model.export(str(tmp_path / "export"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(loaded.serve(x).numpy(), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


class _WeightsAtStart(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = [w.numpy() for w in self.model.weights]


@pytest.mark.parametrize("kind, build", SUBCLASS_CASES,
                         ids=[f"{k}-built_by_{b}" for k, b in SUBCLASS_CASES])
def test_subclassed_model_resumes_from_its_backup(kind, build, two_shards,
                                                  min_size, tmp_path):
    strategies = {"dense": two_shards, "embedding": min_size}
    directory = str(tmp_path / "backup")
    first, _ = subclassed(kind, build, strategies, epochs=2, callbacks=[
        keras_ps.callbacks.BackupAndRestore(directory, delete_checkpoint=False)])
    # A new model, as a rerun of the program makes: it resumes after epoch 1.
    start = _WeightsAtStart()
    second, history = subclassed(kind, build, strategies, epochs=3, callbacks=[
        keras_ps.callbacks.BackupAndRestore(directory), start])
    assert history.epoch == [2]
    assert int(second.optimizer.iterations.numpy()) == 3 * SUBCLASS_STEPS
    for restored, saved in zip(start.weights, first.weights):
        np.testing.assert_array_equal(restored, saved.numpy())
