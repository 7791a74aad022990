"""keras_ps.ShardedVariable used as TF's own sharded variable is, on the
shared real cluster (each variable split over its 3 ps)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps import _tf_adapter
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(180)

VALUES = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)


@pytest.fixture(scope="module")
def sharded_strategy(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(3))


@pytest.fixture
def table(sharded_strategy):
    with sharded_strategy.scope():
        v = tf.Variable(VALUES, name="table")
    assert isinstance(v, keras_ps.ShardedVariable)
    assert [int(s.shape[0]) for s in v.variables] == [4, 3, 3]
    assert len({s.device for s in v.variables}) == 3
    return v


def _op_types(fn, *args):
    graph = fn.get_concrete_function(*args).graph
    return [op.type for op in graph.get_operations()]


# -- the embedding lookups: one gather per shard, never the whole table ----------
@pytest.mark.parametrize("api", ["v2", "v1"])
def test_embedding_lookup_gathers_rows_per_shard(table, api):
    lookup_api = (tf.nn.embedding_lookup if api == "v2"
                  else tf.compat.v1.nn.embedding_lookup)

    @tf.function
    def lookup(ids):
        return lookup_api(table, ids)

    ids = tf.constant([[9, 0], [4, 4]])
    np.testing.assert_array_equal(lookup(ids).numpy(), VALUES[[[9, 0], [4, 4]]])
    ops = _op_types(lookup, ids)
    assert ops.count("ResourceGather") == 3
    assert "ReadVariableOp" not in ops  # no shard is read whole


def test_embedding_lookup_max_norm_and_gradient(table):
    ids = tf.constant([9, 1])
    expected = VALUES[[9, 1]]
    norms = np.linalg.norm(expected, axis=1, keepdims=True)
    clipped = expected * np.minimum(1.0, 5.0 / norms)
    np.testing.assert_allclose(
        tf.nn.embedding_lookup(table, ids, max_norm=5.0).numpy(), clipped,
        rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids))
    grads = tape.gradient(loss, table.variables)
    # Row 1 is on shard 0, row 9 on shard 2: sparse gradients per shard.
    assert all(isinstance(g, tf.IndexedSlices) for g in grads)
    dense = [tf.convert_to_tensor(g).numpy() for g in grads]
    assert dense[0][1].tolist() == [1, 1, 1] and dense[0].sum() == 3
    assert dense[1].sum() == 0
    assert dense[2][9 - 7].tolist() == [1, 1, 1] and dense[2].sum() == 3


@pytest.mark.parametrize("api", ["embedding_lookup_sparse",
                                 "safe_embedding_lookup_sparse"])
def test_sparse_lookups_gather_rows_per_shard(table, api):
    sparse_ids = tf.sparse.from_dense(
        tf.constant([[1, 0, 9], [0, 4, 0]], tf.int64))
    fn = getattr(tf.nn, api)

    @tf.function
    def lookup(sp):
        return fn(table, sp, None, combiner="sum")

    np.testing.assert_array_equal(
        lookup(sparse_ids).numpy(),
        np.stack([VALUES[[1, 9]].sum(0), VALUES[4]]))
    ops = _op_types(lookup, sparse_ids)
    assert ops.count("ResourceGather") == 3
    assert "ReadVariableOp" not in ops


def test_safe_lookup_refuses_shards_not_split_div(sharded_strategy):
    uneven = keras_ps.ShardedVariable(
        [tf.Variable(VALUES[:2]), tf.Variable(VALUES[2:])])
    sparse_ids = tf.sparse.from_dense(tf.constant([[1, 9]], tf.int64))
    with pytest.raises(ValueError, match=(
            r"(?s)\"div\" strategy, which needs shards of \[5, 5\] rows\. "
            r"Received: .* shards of \[2, 8\] rows\. Create it with a "
            r"keras_ps partitioner")):
        tf.nn.safe_embedding_lookup_sparse(uneven, sparse_ids, None)
    # The dense lookup routes by row offsets, so any split is fine.
    np.testing.assert_array_equal(
        tf.nn.embedding_lookup(uneven, [9, 1]).numpy(), VALUES[[9, 1]])


# -- variable methods --------------------------------------------------------------
@pytest.mark.parametrize("method, update", [
    ("scatter_add", lambda a, i, x: np.add.at(a, i, x)),
    ("scatter_sub", lambda a, i, x: np.subtract.at(a, i, x)),
    ("scatter_mul", lambda a, i, x: np.multiply.at(a, i, x)),
    ("scatter_div", lambda a, i, x: np.divide.at(a, i, x)),
    ("scatter_min", lambda a, i, x: np.minimum.at(a, i, x)),
    ("scatter_max", lambda a, i, x: np.maximum.at(a, i, x)),
    ("scatter_update", lambda a, i, x: a.__setitem__(i, x)),
    ("batch_scatter_update", lambda a, i, x: a.__setitem__(i, x)),
])
def test_scatter_methods(table, method, update):
    indices = np.array([9, 0, 5])
    delta = np.array([[2, 40, 0.5], [3, 3, 3], [7, -1, 100]], np.float32)
    result = getattr(table, method)(
        tf.IndexedSlices(tf.constant(delta), tf.constant(indices)),
        name=f"my_{method}")
    assert result is table
    expected = VALUES.copy()
    update(expected, indices, delta)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)


def test_scatter_names_each_shard_op(table):
    @tf.function
    def scatter():
        table.scatter_add(tf.IndexedSlices(tf.ones([1, 3]), tf.constant([9])),
                          name="my_update")

    names = [op.name for op in
             scatter.get_concrete_function().graph.get_operations()]
    assert any(n.startswith("my_update/part_2") for n in names), names


def test_sparse_read_keeps_the_order_of_indices(table):
    np.testing.assert_array_equal(table.sparse_read([9, 1, 5]).numpy(),
                                  VALUES[[9, 1, 5]])


@pytest.mark.parametrize("spec", [
    slice(1, 3), (slice(None), 0), slice(None, None, -3), slice(8, 2, -2),
    slice(3, 9, 4), slice(5, 5), -1, 4, (7, 2), Ellipsis, (Ellipsis, 1),
    (slice(2, 8), slice(0, 2)), (np.newaxis, 2)],
    ids=lambda s: repr(s).replace(" ", ""))
def test_slicing_matches_numpy(table, spec):
    np.testing.assert_array_equal(table[spec].numpy(), VALUES[spec])


def test_slicing_reads_only_the_shards_it_needs(table):
    @tf.function
    def rows():
        return table[1:3]

    # Rows 1-2 are all on shard 0: one read, of that shard only.
    graph = rows.get_concrete_function().graph
    reads = [op for op in graph.get_operations()
             if op.type in ("ReadVariableOp", "ResourceGather",
                            "ResourceStridedSliceAssign", "StridedSlice")]
    captured = {t.name for op in graph.get_operations()
                if op.type == "ReadVariableOp" for t in op.inputs}
    assert len(captured) == 1, reads


def test_slicing_errors(table):
    with pytest.raises(IndexError, match=r"out of bounds for axis 0 of "
                                         r"ShardedVariable 'table', which has "
                                         r"10 rows\. Received: index=10\. "
                                         r"Use an index in \[-10, 9\]"):
        table[10]
    with pytest.raises(TypeError, match=r"cannot be indexed by a tensor.*"
                                        r"Use tf.nn.embedding_lookup"):
        table[tf.constant(1)]
    mask = VALUES[:, 0] > 10
    np.testing.assert_array_equal(table[mask].numpy(), VALUES[mask])


def test_operators_and_shape(table):
    ones = tf.ones([3, 2])
    np.testing.assert_array_equal((table + 1).numpy(), VALUES + 1)
    np.testing.assert_array_equal((1 - table).numpy(), 1 - VALUES)
    np.testing.assert_array_equal((table * 2).numpy(), VALUES * 2)
    np.testing.assert_allclose((table / 4).numpy(), VALUES / 4)
    np.testing.assert_array_equal((-table).numpy(), -VALUES)
    np.testing.assert_array_equal((table @ ones).numpy(), VALUES @ np.ones((3, 2)))
    np.testing.assert_allclose((table ** 2).numpy(), VALUES ** 2, rtol=1e-6)
    np.testing.assert_array_equal((table < 5).numpy(), VALUES < 5)
    assert isinstance(table.shape, tf.TensorShape)
    assert table.shape == tf.TensorShape([10, 3])
    # Identity, not element-wise: keeps sharded weights usable in lists/dicts.
    assert (table == table) is True and (table != table) is False


# -- tf.function arguments, tf.Module, SavedModel ------------------------------------
def test_tf_function_argument_traces_once(table):
    traces = []

    @tf.function
    def total(v):
        traces.append(1)
        return tf.reduce_sum(tf.nn.embedding_lookup(v, [0, 9]))

    first = total(table).numpy()
    table.assign_add(tf.ones_like(VALUES))
    second = total(table).numpy()
    third = total(table).numpy()
    assert len(traces) == 1
    assert first == VALUES[[0, 9]].sum()
    assert second == third == VALUES[[0, 9]].sum() + 6
    assert "ResourceGather" in _op_types(total, table)


def test_module_lists_the_shards(table):
    module = tf.Module()
    module.table = table
    assert [id(v) for v in module.variables] == [id(v) for v in table.variables]
    assert len(module.trainable_variables) == 3


class _Lookup(tf.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def lookup(self, ids):
        return tf.nn.embedding_lookup(self.table, ids)


def test_saved_model_of_a_module_holding_one(table, tmp_path):
    tf.saved_model.save(_Lookup(table), str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    np.testing.assert_array_equal(
        loaded.lookup(tf.constant([9, 0, 5], tf.int64)).numpy(),
        VALUES[[9, 0, 5]])


def test_saved_model_and_export_of_a_keras_model(sharded_strategy, tmp_path):
    with sharded_strategy.scope():
        model = keras.Sequential([keras.Input((2,), dtype="int32"),
                                  keras.layers.Embedding(12, 3),
                                  keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
    assert len(model.layers[0].embeddings.variables) == 3
    x = np.array([[1, 11], [5, 0]], np.int32)
    tf.saved_model.save(model, str(tmp_path / "saved"))
    model.export(str(tmp_path / "exported"), verbose=False)
    restored = tf.saved_model.load(str(tmp_path / "exported"))
    served = restored.serve(x)
    np.testing.assert_allclose(served.numpy(), model(x).numpy(), rtol=1e-6)


def test_checkpoint_still_holds_one_full_tensor(table, tmp_path):
    path = tf.train.Checkpoint(table=table).write(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))[
        "table/.ATTRIBUTES/VARIABLE_VALUE"] == [10, 3]
    assert len(tf.train.list_variables(path)) == 2  # and the object graph


# -- constructor checks (bad inputs) ------------------------------------------------
@pytest.mark.parametrize("variables, error, pattern", [
    (None, TypeError, r"needs a list of tf.Variable shards.*Received: "
                      r"variables=None\. Pass e\.g\."),
    ([], ValueError, r"at least one shard\. Received: variables=\[\]\. Pass "
                     r"a non-empty list"),
    ([np.zeros((2, 3))], TypeError, r"(?s)must be a tf.Variable\. Received: an "
                                    r"element of type ndarray.*Create each"),
    ("lookup", TypeError, r"Received: variables='lookup'"),
], ids=["sharded_variable_none", "sharded_variable_empty",
        "sharded_variable_not_variables", "sharded_variable_a_string"])
def test_constructor_refuses_bad_shards(variables, error, pattern):
    with pytest.raises(error, match=pattern):
        keras_ps.ShardedVariable(variables)


def test_constructor_refuses_mismatched_shards():
    with pytest.raises(ValueError, match=r"agree on dtype and on every axis "
                                         r"but the first\. Received: shapes "
                                         r"\[\(2, 3\), \(2, 4\)\].*Split"):
        keras_ps.ShardedVariable([tf.Variable(tf.zeros([2, 3])),
                                  tf.Variable(tf.zeros([2, 4]))])


def test_tf_internals_overridden_still_exist():
    for name in _tf_adapter.TRACKABLE_HOOKS:
        assert callable(getattr(tf.__internal__.tracking.Trackable, name)), name
    for name in _tf_adapter.TYPE_SPEC_HOOKS:
        assert hasattr(tf.TypeSpec, name), name
    assert issubclass(keras_ps.ShardedVariable, tf.__internal__.CompositeTensor)
