"""A SavedModel of sharded variables, as TF's own sharded variable gives:
served by a plain TF process that cannot import keras_ps, and loaded back
with or without a strategy, into any number of shards. On the shared real
cluster (2 workers, 3 ps)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(300)

VALUES = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
IDS = np.array([9, 0, 5, 9], np.int64)

# Run in a fresh interpreter where `import keras_ps` fails, as on a serving
# host where keras_ps is not installed.
_PLAIN_TF_SERVER = r"""
import sys
sys.modules["keras_ps"] = None  # any import of keras_ps raises ImportError
import json
import numpy as np
import tensorflow as tf

path, kind, x_file, out_file = sys.argv[1:]
loaded = tf.saved_model.load(path)
x = tf.constant(np.load(x_file))
if kind == "export":
    y = loaded.serve(x)
else:
    signature = loaded.signatures["serving_default"]
    (y,) = signature(tf.constant(x)).values()
np.save(out_file, np.asarray(y))
print(json.dumps({"keras_ps_loaded": any(
    m == "keras_ps" or m.startswith("keras_ps.")
    for m, mod in sys.modules.items() if mod is not None)}))
"""


def _serve_without_keras_ps(path, kind, x, tmp_path):
    np.save(tmp_path / "x.npy", x)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-c", _PLAIN_TF_SERVER, str(path), kind,
         str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "keras_ps_loaded": False}
    return np.load(tmp_path / "y.npy")


@pytest.fixture(scope="module")
def three_shards(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(3))


@pytest.fixture(scope="module")
def two_shards(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


@pytest.fixture(scope="module")
def plain_strategy(cluster, strategy):
    return keras_ps.ParameterServerStrategy(cluster.resolver)


@pytest.fixture(scope="module")
def trained(three_shards, coordinator):
    """A Keras model with a sharded embedding, trained with Model.fit."""
    with three_shards.scope():
        model = keras.Sequential([
            keras.Input((2,), dtype="int32"),
            keras.layers.Embedding(30, 4), keras.layers.Flatten(),
            keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.5), "mse")
    assert len(model.layers[0].embeddings.variables) == 3
    before = model.layers[0].embeddings.numpy().copy()

    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        x = rng.integers(0, 30, size=(64, 2)).astype("int32")
        y = rng.normal(size=(64, 1)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()

    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=6, verbose=0)
    assert not np.allclose(model.layers[0].embeddings.numpy(), before)
    return model


@pytest.mark.parametrize("kind", ["export", "saved_model_save"])
def test_keras_model_served_by_plain_tf_without_keras_ps(trained, kind,
                                                         tmp_path):
    x = np.array([[1, 29], [5, 0], [17, 17]], np.int32)
    expected = trained(x).numpy()
    path = tmp_path / "model"
    if kind == "export":
        trained.export(str(path), verbose=False)
    else:
        tf.saved_model.save(trained, str(path))
    served = _serve_without_keras_ps(path, kind, x, tmp_path)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


class _Lookup(tf.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def lookup(self, ids):
        return tf.nn.embedding_lookup(self.table, ids)


@pytest.fixture(scope="module")
def saved_module(three_shards, tmp_path_factory):
    with three_shards.scope():
        table = tf.Variable(VALUES, name="table")
    assert len(table.variables) == 3
    path = str(tmp_path_factory.mktemp("module"))
    tf.saved_model.save(_Lookup(table), path)
    return path, table


def test_module_saves_one_full_variable(saved_module):
    path, table = saved_module
    # Each row once, as TF's sharded variable saves it (no shard children).
    assert dict(tf.train.list_variables(os.path.join(
        path, "variables", "variables"))) == {
            "_CHECKPOINTABLE_OBJECT_GRAPH": [],
            "table/.ATTRIBUTES/VARIABLE_VALUE": [10, 3]}
    # The trained variable is left as it was: shards, read and updated.
    assert len(table.variables) == 3
    table.assign_add(tf.zeros_like(VALUES))
    np.testing.assert_array_equal(table.numpy(), VALUES)


def test_module_loads_as_a_plain_variable_without_a_strategy(saved_module):
    path, _ = saved_module
    loaded = tf.saved_model.load(path)
    assert isinstance(loaded.table, tf.Variable)
    np.testing.assert_array_equal(loaded.table.numpy(), VALUES)
    np.testing.assert_array_equal(loaded.lookup(IDS).numpy(), VALUES[IDS])


def test_module_loads_on_a_ps_under_a_strategy_without_partitioner(
        saved_module, plain_strategy):
    path, _ = saved_module
    with plain_strategy.scope():
        loaded = tf.saved_model.load(path)
    assert "/job:ps/" in loaded.table.device
    np.testing.assert_array_equal(loaded.lookup(IDS).numpy(), VALUES[IDS])


@pytest.mark.parametrize("shards", [2, 3])
def test_module_loads_resharded_under_a_partitioner(saved_module, shards,
                                                    two_shards, three_shards):
    path, _ = saved_module
    with (two_shards if shards == 2 else three_shards).scope():
        loaded = tf.saved_model.load(path)
    assert isinstance(loaded.table, keras_ps.ShardedVariable)
    assert len(loaded.table.variables) == shards
    assert len({v.device for v in loaded.table.variables}) == shards
    np.testing.assert_array_equal(loaded.table.numpy(), VALUES)
    # TF's loaded function raises here ("a loaded non-Keras model"); this
    # one reads a copy of the shards' value, made at each call.
    np.testing.assert_array_equal(loaded.lookup(IDS).numpy(), VALUES[IDS])
    loaded.table.assign(VALUES * 2)
    np.testing.assert_array_equal(loaded.lookup(IDS).numpy(),
                                  VALUES[IDS] * 2)


class _Scorer(tf.Module):
    """Reads a table and a kernel; `bump` also writes the table."""

    def __init__(self):
        super().__init__()
        self.table = tf.Variable(VALUES, name="table")
        self.kernel = tf.Variable(np.linspace(-1, 1, 6, dtype=np.float32)
                                  .reshape(3, 2), name="kernel")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def score(self, ids):
        return tf.matmul(tf.nn.embedding_lookup(self.table, ids), self.kernel)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def bump(self, ids):
        self.table.scatter_add(tf.IndexedSlices(
            tf.ones([tf.size(ids), 3]), ids))
        return tf.constant(0)


def _gradients(score, ids, variables):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(score(ids) ** 2)
    return [tf.convert_to_tensor(g).numpy()
            for g in tape.gradient(loss, variables)]


def test_loaded_function_under_a_partitioner_serves_and_trains_the_shards(
        two_shards, tmp_path):
    module = _Scorer()
    expected = module.score(IDS).numpy()
    expected_gradients = _gradients(module.score, IDS,
                                    [module.table, module.kernel])
    tf.saved_model.save(module, str(tmp_path))
    with two_shards.scope():
        loaded = tf.saved_model.load(str(tmp_path))
    assert len(loaded.table.variables) == len(loaded.kernel.variables) == 2
    np.testing.assert_allclose(loaded.score(IDS).numpy(), expected, rtol=1e-6)
    # Inside a tf.function too.
    twice = tf.function(lambda ids: loaded.score(ids) * 2)
    np.testing.assert_allclose(twice(IDS).numpy(), expected * 2, rtol=1e-6)
    # The gradient reaches each shard: together, the unsharded gradient.
    shards = loaded.table.variables + loaded.kernel.variables
    gradients = _gradients(loaded.score, IDS, shards)
    np.testing.assert_allclose(np.concatenate(gradients[:2]),
                               expected_gradients[0], rtol=1e-6)
    np.testing.assert_allclose(np.concatenate(gradients[2:]),
                               expected_gradients[1], rtol=1e-6)
    # A function that writes a sharded variable cannot: a clear error.
    with pytest.raises(keras_ps.errors.LoadedFunctionError) as raised:
        loaded.bump(IDS)
    assert isinstance(raised.value, ValueError)
    for needle in ("'bump'", "writes the variable 'table'",
                   "outside strategy.scope()", "without variable_partitioner"):
        assert needle in str(raised.value)
    np.testing.assert_array_equal(loaded.table.numpy(), VALUES)


@pytest.mark.parametrize("shard_config", [(3, 2), (2, 3), (3, 1), (1, 3)],
                         ids=lambda c: f"{c[0]}_to_{c[1]}")
def test_variable_saved_and_loaded_with_other_shard_counts(
        shard_config, plain_strategy, two_shards, three_shards, tmp_path):
    by_count = {1: plain_strategy, 2: two_shards, 3: three_shards}
    with by_count[shard_config[0]].scope():
        variable = tf.Variable([1., 2., 3., 4., 5., 6.])
    tf.saved_model.save(variable, str(tmp_path))
    with by_count[shard_config[1]].scope():
        loaded = tf.saved_model.load(str(tmp_path))
    if shard_config[1] > 1:
        assert len(loaded.variables) == shard_config[1]
    np.testing.assert_array_equal(tf.convert_to_tensor(loaded).numpy(),
                                  [1., 2., 3., 4., 5., 6.])


# -- Keras models loaded under the strategy ------------------------------------
X = np.array([[1, 29], [5, 0], [17, 17]], np.int32)


def _save(model, kind, path):
    if kind == "export":
        model.export(str(path), verbose=False)
    else:
        tf.saved_model.save(model, str(path))


def _loaded_weights(loaded, kind):
    """The loaded variables of `_keras_model()`'s weights, in their order."""
    if kind == "export":
        return list(loaded.variables)
    return [loaded._layers[1]._embeddings, loaded._layers[3]._kernel,
            loaded._layers[3].bias]


def _serve(loaded, kind, x):
    if kind == "export":
        return loaded.serve(x).numpy()
    (y,) = loaded.signatures["serving_default"](inputs=tf.constant(x)).values()
    return y.numpy()


def _keras_model():
    return keras.Sequential([
        keras.Input((2,), dtype="int32"), keras.layers.Embedding(30, 4),
        keras.layers.Flatten(), keras.layers.Dense(3)])


@pytest.fixture(scope="module")
def min_size(cluster, strategy):
    # 480-byte embedding in 3 shards of 160 bytes; the 96-byte kernel whole.
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=keras_ps.partitioners.
        MinSizePartitioner(min_shard_bytes=128, max_shards=3))


@pytest.mark.parametrize("kind", ["export", "saved_model_save"])
@pytest.mark.parametrize("partitioner", ["fixed_2", "min_size"])
def test_plain_keras_model_loads_sharded_on_ps_under_a_partitioner(
        kind, partitioner, two_shards, min_size, plain_strategy, tmp_path):
    model = _keras_model()  # no strategy: its weights are on the coordinator
    expected = model(X).numpy()
    _save(model, kind, tmp_path / "model")
    with (two_shards if partitioner == "fixed_2" else min_size).scope():
        loaded = tf.saved_model.load(str(tmp_path / "model"))
    weights = _loaded_weights(loaded, kind)
    shards = [2, 2, 2] if partitioner == "fixed_2" else [3, 1, 1]
    for variable, weight, count in zip(weights, model.weights, shards):
        np.testing.assert_array_equal(np.asarray(tf.convert_to_tensor(
            variable)), weight.numpy())
        parts = (variable.variables
                 if isinstance(variable, keras_ps.ShardedVariable)
                 else [variable])
        assert len(parts) == count, variable
        assert all("/job:ps/" in v.device for v in parts)
        assert len({v.device for v in parts}) == count
    # TF's strategy loads the same, but its functions raise ("a loaded
    # non-Keras model"; a signature: "Item 1 is type: NoneType").
    np.testing.assert_allclose(_serve(loaded, kind, X), expected, rtol=1e-6)
    with plain_strategy.scope():
        loaded = tf.saved_model.load(str(tmp_path / "model"))
    assert all("/job:ps/" in v.device for v in _loaded_weights(loaded, kind))
    np.testing.assert_allclose(_serve(loaded, kind, X), expected, rtol=1e-6)


@pytest.mark.parametrize("kind", ["export", "saved_model_save"])
def test_keras_ps_model_with_sharded_weights_loads_under_a_partitioner(
        trained, kind, two_shards, plain_strategy, tmp_path):
    """A model trained with 3 shards: each shard a variable of its
    SavedModel. `tf.saved_model.load` under a partitioner failed inside
    load() with "Item 0 is type: NoneType" (the SavedModel held a save
    function reading the shards, which loaded sharded)."""
    expected = trained(X).numpy()
    shards = [v.numpy() for v in trained.layers[0].embeddings.variables]
    _save(trained, kind, tmp_path / "model")
    with two_shards.scope():
        loaded = tf.saved_model.load(str(tmp_path / "model"))
    if kind == "export":
        loaded_shards = list(loaded.variables)[:3]
    else:
        loaded_shards = [getattr(loaded._layers[1]._embeddings, f"part_{i}")
                         for i in range(3)]
    for variable, value in zip(loaded_shards, shards):
        assert isinstance(variable, keras_ps.ShardedVariable)
        assert all("/job:ps/" in v.device for v in variable.variables)
        np.testing.assert_array_equal(variable.numpy(), value)
    np.testing.assert_allclose(_serve(loaded, kind, X), expected,
                               rtol=1e-5, atol=1e-6)
    with plain_strategy.scope():
        loaded = tf.saved_model.load(str(tmp_path / "model"))
    np.testing.assert_allclose(_serve(loaded, kind, X), expected,
                               rtol=1e-5, atol=1e-6)


def test_a_large_loaded_copy_is_named_in_a_warning(two_shards, tmp_path,
                                                   monkeypatch, caplog):
    """Each call copies a variable loaded sharded whole: from a size on, the
    load says so, naming the function, the variable and the fix."""
    from keras_ps.tables import _saved_model
    module = _Scorer()
    tf.saved_model.save(module, str(tmp_path))
    # The table is 120 bytes and the kernel 24: only the table is "large".
    monkeypatch.setattr(_saved_model, "_LARGE_COPY_BYTES", 100)
    with caplog.at_level("WARNING", logger=_saved_model.logger.name):
        with two_shards.scope():
            loaded = tf.saved_model.load(str(tmp_path))
    np.testing.assert_allclose(loaded.score(IDS).numpy(),
                               module.score(IDS).numpy(), rtol=1e-6)
    warned = [r.getMessage() for r in caplog.records
              if "copies its whole value" in r.getMessage()]
    assert warned and all("'table'" in m for m in warned), warned
    assert any("'score'" in m for m in warned), warned
    assert "without a variable_partitioner" in warned[0]
    assert not any("'kernel'" in m for m in warned), warned


def test_a_pinned_ps_this_cluster_lacks_is_not_used(two_shards):
    """A keras_ps SavedModel pins each shard's read to its ps; loaded on a
    cluster without that task, the copy goes to this process instead."""
    from keras_ps.tables import _saved_model
    assert _saved_model._task_exists("/job:ps/task:0")
    assert _saved_model._task_exists("/job:ps/replica:0/task:2/device:CPU:0")
    assert not _saved_model._task_exists("/job:ps/task:7")
    assert not _saved_model._task_exists("/job:evaluator/task:0")
