"""Row-wise updates of sparse gradients on the ps (keras_ps.tables._rowwise, the
row-wise section of keras_ps._keras.optimizers) and keras_ps.optimizers.LazyAdam,
on the shared real multi-process cluster.

- SGD, Adagrad and Ftrl take the row-wise path by themselves and end with the
  weights Keras' own optimizer gives on the dense gradient.
- LazyAdam matches a numpy reference, touched and untouched rows alike.
- Lookups send each distinct row once; the optimizer sees each row once.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ps
from keras_ps import _native
from keras_ps.tables import _rowwise
from keras_ps._keras import optimizers as hooks

pytestmark = pytest.mark.timeout(240)

ROWS, DIM = 10, 3  # two shards: rows 0-4 and 5-9
# Per step, ids for the two inputs that share the table: repeats (3, 3, 3),
# ids on both sides of the shard boundary (4 | 5), rows never touched (0, 8).
BATCHES = [
    ([[3, 3], [4, 5]], [[5, 3], [9, 1]]),
    ([[1, 4], [4, 4]], [[6, 6], [2, 5]]),
    ([[7, 3], [5, 5]], [[4, 9], [3, 3]]),
    ([[2, 2], [6, 1]], [[5, 4], [7, 7]]),
]
TARGETS = np.linspace(-1.0, 1.0, 2).reshape(2, 1).astype("float32")
UNTOUCHED = [0, 8]


def make_model(make_optimizer):
    """Two int inputs sharing one Embedding, concatenated into a Dense."""
    a = keras.Input((2,), dtype="int32", name="a")
    b = keras.Input((2,), dtype="int32", name="b")
    table = keras.layers.Embedding(
        ROWS, DIM, embeddings_initializer=keras.initializers.RandomUniform(
            -1, 1, seed=3), name="table")
    x = keras.layers.Concatenate()([keras.layers.Flatten()(table(a)),
                                    keras.layers.Flatten()(table(b))])
    out = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(seed=4))(x)
    model = keras.Model([a, b], out)
    model.optimizer_ = make_optimizer()
    model.optimizer_.build(model.trainable_variables)
    return model


def table_values(model):
    return np.asarray(model.get_layer("table").embeddings.numpy())


def step_fn(model, id_dtype, densify):
    @tf.function
    def step(a, b):
        a, b = tf.cast(a, id_dtype), tf.cast(b, id_dtype)
        weights = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model([a, b]) - TARGETS))
        grads = tape.gradient(loss, weights)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        model.optimizer_.apply(grads, weights)
        return loss
    return step


def train_on_cluster(model, coordinator, id_dtype):
    step = step_fn(model, id_dtype, densify=False)
    for a, b in BATCHES:
        coordinator.schedule(step, args=(tf.constant(a), tf.constant(b))).fetch()


def train_plain(model, id_dtype):
    """Keras' own optimizer on the dense gradient, no strategy."""
    step = step_fn(model, id_dtype, densify=True)
    for a, b in BATCHES:
        step(tf.constant(a), tf.constant(b))


class Spy:
    """Counts calls of a keras_ps.tables._rowwise function (made while tracing)."""

    def __init__(self, monkeypatch, name):
        self.calls = 0
        original = getattr(_rowwise, name)

        def spy(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(_rowwise, name, spy)


OPTIMIZERS = {
    "sgd": ("sgd", lambda: keras.optimizers.SGD(0.1)),
    # epsilon large enough that its place (inside the square root) matters.
    "adagrad": ("adagrad", lambda: keras.optimizers.Adagrad(
        0.3, initial_accumulator_value=0.05, epsilon=0.1)),
    "ftrl": ("ftrl", lambda: keras.optimizers.Ftrl(
        0.3, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
        beta=0.1)),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["one_table", "two_shards"])
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_rowwise_equals_keras_dense_result(kind, id_dtype, sharded, strategy,
                                           two_shards, coordinator, monkeypatch):
    function, make_optimizer = OPTIMIZERS[kind]
    spy = Spy(monkeypatch, function)
    keras.utils.set_random_seed(0)
    plain = make_model(make_optimizer)
    initial = table_values(plain)
    train_plain(plain, id_dtype)
    with (two_shards if sharded else strategy).scope():
        keras.utils.set_random_seed(0)
        model = make_model(make_optimizer)
    if sharded:
        assert len(model.get_layer("table").weights) == 2
    np.testing.assert_array_equal(table_values(model), initial)
    with _no_dense_warning():
        train_on_cluster(model, coordinator, id_dtype)
    assert spy.calls == (2 if sharded else 1)  # one trace, one call per shard
    np.testing.assert_allclose(table_values(model), table_values(plain),
                               rtol=1e-5, atol=1e-6)
    for attr in ("kernel", "bias"):  # the Dense (its kernel is sharded too)
        np.testing.assert_allclose(
            tf.convert_to_tensor(getattr(model.layers[-1], attr)).numpy(),
            getattr(plain.layers[-1], attr).numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(table_values(model), initial)


class _no_dense_warning:
    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        dense = [r for r in self.records
                 if issubclass(r.category, hooks.DenseUpdateWarning)]
        assert not dense, dense[0].message


def test_options_that_move_every_row_keep_keras_update_and_warn(
        strategy, coordinator, monkeypatch):
    spy = Spy(monkeypatch, "sgd")
    keras.utils.set_random_seed(0)
    plain = make_model(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    train_plain(plain, tf.int32)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = make_model(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.warns(hooks.DenseUpdateWarning, match="momentum=0.9"):
        train_on_cluster(model, coordinator, tf.int32)
    assert spy.calls == 0
    np.testing.assert_allclose(table_values(model), table_values(plain),
                               rtol=1e-5, atol=1e-6)


# -- LazyAdam against numpy --------------------------------------------------------------
def lazy_adam_reference(table, kernel, steps, lr=0.05, b1=0.9, b2=0.999, eps=1e-7):
    """numpy LazyAdam for the table (documented formula), Adam for the kernel.

    steps: list of (ids, c, d): the table's gradient is c per use of a row
    (repeats add), the kernel's is d."""
    table, kernel = table.astype(np.float64), kernel.astype(np.float64)
    m, v = np.zeros_like(table), np.zeros_like(table)
    km, kv = np.zeros_like(kernel), np.zeros_like(kernel)
    last = np.zeros(len(table), np.int64)
    for t, (ids, c, d) in enumerate(steps, start=1):
        alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        grad = np.zeros_like(table)
        np.add.at(grad, np.asarray(ids, np.int64).ravel(), c)
        rho = b1 / np.sqrt(b2)
        for r in np.unique(np.asarray(ids, np.int64)):
            k = t - last[r]
            skipped = sum(rho ** i for i in range(1, k))
            table[r] -= alpha * skipped * m[r] / (np.sqrt(v[r]) + eps)
            m[r] = b1 ** k * m[r] + (1 - b1) * grad[r]
            v[r] = b2 ** k * v[r] + (1 - b2) * grad[r] ** 2
            table[r] -= alpha * m[r] / (np.sqrt(v[r]) + eps)
            last[r] = t
        km = b1 * km + (1 - b1) * d
        kv = b2 * kv + (1 - b2) * d ** 2
        kernel -= alpha * km / (np.sqrt(kv) + eps)
    return table, kernel, m, v, last


LAZY_STEPS = [([1, 4, 4, 5], 1.0, 0.5), ([5, 6], -2.0, 0.25), ([], 3.0, -1.0),
              ([1, 9, 9, 9], 0.5, 1.0), ([4], 1.5, 0.5)]


def test_lazy_adam_second_update_at_the_same_step_is_one_adam_step():
    # Two workers that read `iterations` before either added 1 apply at the
    # same step t. Dense Adam decays the moments at each apply; LazyAdam's
    # second update of a shared row must too, and must not move the row back
    # (k = t - last = 0 would give a drift of minus one step).
    from keras_ps.tables import _rowwise
    lr, b1, b2, eps, t = 0.05, 0.9, 0.999, 1e-7, 3
    rng = np.random.default_rng(1)
    table0 = rng.normal(size=(4, 2))
    m0, v0 = rng.uniform(0.1, 1, (4, 2)), rng.uniform(0.1, 1, (4, 2))
    table, m, v = (tf.Variable(x, dtype=tf.float64) for x in (table0, m0, v0))
    last = tf.Variable([0, t, 0, 0], dtype=tf.int64)  # row 1: updated at t
    g = np.array([[0.5, -1.0]])
    _rowwise.lazy_adam(table, m, v, last, tf.IndexedSlices(
        tf.constant(g), tf.constant([1], tf.int64), tf.constant([4, 2])),
        tf.constant(t, tf.int64), lr, b1, b2, eps)

    alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    want_m = b1 * m0[1] + (1 - b1) * g[0]
    want_v = b2 * v0[1] + (1 - b2) * g[0] ** 2
    want_row = table0[1] - alpha * want_m / (np.sqrt(want_v) + eps)
    # (The betas reach the update as float32, as Keras passes them: 1e-7
    # relative. Counting the second update as no step would be off by 10%.)
    np.testing.assert_allclose(m.numpy()[1], want_m, rtol=1e-6)
    np.testing.assert_allclose(v.numpy()[1], want_v, rtol=1e-6)
    np.testing.assert_allclose(table.numpy()[1], want_row, rtol=1e-6)
    np.testing.assert_array_equal(last.numpy(), [0, t, 0, 0])
    # The other rows are untouched.
    np.testing.assert_array_equal(table.numpy()[[0, 2, 3]], table0[[0, 2, 3]])


def test_lazy_adam_update_at_an_earlier_step_keeps_the_rows_later_step():
    # Worker A read t = 5 from `iterations` and worker B, after A's
    # increment, t = 6; B's update reached the row first. A's update then
    # counts as one step (k = 1) and must leave the row's step at 6: set
    # back to 5, the row's update at step 7 would count a skipped step (a
    # drift of one more momentum step, one more decay) that never happened.
    from keras_ps.tables import _rowwise
    lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-7
    rng = np.random.default_rng(2)
    table0 = rng.normal(size=(3, 2))
    m0, v0 = rng.uniform(0.1, 1, (3, 2)), rng.uniform(0.1, 1, (3, 2))
    table, m, v = (tf.Variable(x, dtype=tf.float64) for x in (table0, m0, v0))
    last = tf.Variable([0, 6, 0], dtype=tf.int64)  # row 1: B's update at 6
    g = np.array([[0.5, -1.0]])

    def update(t):
        _rowwise.lazy_adam(table, m, v, last, tf.IndexedSlices(
            tf.constant(g), tf.constant([1], tf.int64), tf.constant([3, 2])),
            tf.constant(t, tf.int64), lr, b1, b2, eps)

    update(5)  # A's, late
    np.testing.assert_array_equal(last.numpy(), [0, 6, 0])
    m1, v1, row1 = m.numpy()[1], v.numpy()[1], table.numpy()[1]
    np.testing.assert_allclose(m1, b1 * m0[1] + (1 - b1) * g[0], rtol=1e-6)
    update(7)  # the row's next update: one step after 6, no drift
    alpha = lr * np.sqrt(1 - b2 ** 7) / (1 - b1 ** 7)
    want_m = b1 * m1 + (1 - b1) * g[0]
    want_v = b2 * v1 + (1 - b2) * g[0] ** 2
    np.testing.assert_allclose(m.numpy()[1], want_m, rtol=1e-6)
    np.testing.assert_allclose(v.numpy()[1], want_v, rtol=1e-6)
    np.testing.assert_allclose(
        table.numpy()[1], row1 - alpha * want_m / (np.sqrt(want_v) + eps),
        rtol=1e-6)
    np.testing.assert_array_equal(last.numpy(), [0, 7, 0])


def test_lazy_adam_dense_update_at_an_earlier_step_keeps_the_rows_later_steps():
    # A weight's dense gradient updates every row at step t: each row's step
    # becomes t, unless another worker's later step already reached it (a
    # row of this weight updated sparsely at step 9 stays at 9).
    optimizer = keras_ps.optimizers.LazyAdam(0.1)
    weight = keras.Variable(np.ones((3, 2), "float32"))
    optimizer.build([weight])
    steps = optimizer._row_steps[optimizer._get_variable_index(weight)]
    steps.assign([0, 9, 0])
    optimizer.apply([tf.ones((3, 2))], [weight])  # step 1
    np.testing.assert_array_equal(steps.numpy(), [1, 9, 1])


def _op_types(concrete_function):
    """The op types of a traced function and of every function it calls."""
    graph_def = concrete_function.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return types


# The kernels of keras_ps/_native (the shared cluster's tasks load them), and
# the same update made of TF's ops, which runs where they cannot be built.
@pytest.mark.parametrize("kernels", ["native", "tf_ops"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one_table", "two_shards"])
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
def test_lazy_adam_matches_numpy_reference(sharded, id_dtype, kernels, strategy,
                                           two_shards, coordinator, monkeypatch):
    if kernels == "tf_ops":
        monkeypatch.setenv("KERAS_PS_NATIVE", "0")
    rng = np.random.default_rng(0)
    init_table = rng.normal(size=(ROWS, DIM)).astype("float32")
    init_kernel = rng.normal(size=(DIM, 2)).astype("float32")
    with (two_shards if sharded else strategy).scope():
        layer = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=(
            keras.initializers.Constant(init_table)))
        layer.build()
        kernel = keras.Variable(init_kernel, name="kernel")
        optimizer = keras_ps.optimizers.LazyAdam(0.05)
        weights = layer.trainable_variables + [kernel]
        optimizer.build(weights)
    assert len(layer.trainable_variables) == (2 if sharded else 1)

    @tf.function
    def step(ids, c, d):
        with tf.GradientTape() as tape:
            rows = layer(tf.cast(ids, id_dtype))
            loss = tf.reduce_sum(rows) * c + tf.reduce_sum(kernel.value) * d
        grads = tape.gradient(loss, [w.value for w in weights])
        optimizer.apply(grads, weights)

    for ids, c, d in LAZY_STEPS:
        coordinator.schedule(step, args=(
            tf.constant(ids, tf.int64), tf.constant(c), tf.constant(d))).fetch()
    fused = "KerasPsLazyAdamRows" in _op_types(step.get_concrete_function(
        tf.TensorSpec([4], tf.int64), tf.TensorSpec([], tf.float32),
        tf.TensorSpec([], tf.float32)))
    assert fused == (kernels == "native")
    want_table, want_kernel, want_m, want_v, want_last = lazy_adam_reference(
        init_table, init_kernel, LAZY_STEPS)
    got_table = np.asarray(layer.embeddings.numpy())
    np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-6)
    # Untouched rows never move; touched rows did.
    np.testing.assert_array_equal(got_table[UNTOUCHED], init_table[UNTOUCHED])
    assert not np.allclose(got_table[[1, 4, 5, 6, 9]], init_table[[1, 4, 5, 6, 9]])
    shards = layer.trainable_variables
    got_m = np.concatenate([optimizer._momentums[optimizer._get_variable_index(s)]
                            .numpy() for s in shards])
    got_v = np.concatenate([optimizer._velocities[optimizer._get_variable_index(s)]
                            .numpy() for s in shards])
    got_last = np.concatenate([optimizer._row_steps[optimizer._get_variable_index(s)]
                               .numpy() for s in shards])
    np.testing.assert_allclose(got_m, want_m, rtol=1e-5, atol=1e-7)
    # (1 - beta_2) = 0.001 in float32: about 1e-5 relative rounding.
    np.testing.assert_allclose(got_v, want_v, rtol=1e-4, atol=1e-9)
    np.testing.assert_array_equal(got_last, want_last)
    assert int(optimizer.iterations.numpy()) == len(LAZY_STEPS)


def test_lazy_adam_kernel_agrees_with_tf_ops_after_long_gaps():
    """The kernel's rows last updated 1 to 200 steps before (it looks up the
    factors of up to 64 steps, computes longer gaps), and rows updated twice
    at one step, against the update made of TF's ops, in this process."""
    kernels = _native.library()
    assert kernels is not None, "keras_ps' C++ kernels did not build here"
    rng = np.random.default_rng(2)
    rows, dim, step = 8, 5, 200
    last = np.array([0, 1, 136, 137, 150, 199, 200, 90], np.int64)  # k: 200..1
    start = [rng.normal(size=(rows, dim)).astype("float32"),
             (0.1 * rng.normal(size=(rows, dim))).astype("float32"),
             rng.uniform(0.01, 0.2, size=(rows, dim)).astype("float32")]
    ids = tf.constant([6, 0, 2, 3, 1, 4, 5], tf.int64)  # row 7 is not updated
    grad = tf.constant(rng.normal(size=(7, dim)).astype("float32"))
    results = {}
    for name, use in (("native", kernels), ("tf_ops", None)):
        var, m, v = (tf.Variable(x) for x in start)
        last_step = tf.Variable(last)
        _rowwise.lazy_adam(var, m, v, last_step, tf.IndexedSlices(grad, ids),
                           step, 0.05, 0.9, 0.999, 1e-7, kernels=use)
        results[name] = [x.numpy() for x in (var, m, v, last_step)]
    for got, want in zip(results["native"], results["tf_ops"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(results["native"][3],
                                  [200, 200, 200, 200, 200, 200, 200, 90])
    np.testing.assert_array_equal(results["native"][0][7], start[0][7])
    assert not np.allclose(results["native"][0][:7], start[0][:7])


@pytest.mark.parametrize("sharded", [False, True], ids=["one_table", "two_shards"])
def test_adagrad_kernel_agrees_with_tf_ops(sharded, strategy, two_shards,
                                           coordinator, monkeypatch):
    """Keras' Adagrad on a ps table: keras_ps' C++ kernel and the update made
    of TF's ops (KERAS_PS_NATIVE=0) leave the same table and accumulator to
    float rounding.
    (test_rowwise_equals_keras_dense_result checks the kernel against Keras'
    own dense update.)"""
    rng = np.random.default_rng(1)
    init_table = rng.normal(size=(ROWS, DIM)).astype("float32")
    results = {}
    for kernels in ("native", "tf_ops"):
        if kernels == "tf_ops":
            monkeypatch.setenv("KERAS_PS_NATIVE", "0")
        with (two_shards if sharded else strategy).scope():
            layer = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=(
                keras.initializers.Constant(init_table)))
            layer.build()
            optimizer = keras.optimizers.Adagrad(
                0.3, initial_accumulator_value=0.05, epsilon=0.1)
            optimizer.build(layer.trainable_variables)

        @tf.function
        def step(ids, c):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(layer(ids))) * c
            grads = tape.gradient(loss, [w.value for w in layer.trainable_variables])
            optimizer.apply(grads, layer.trainable_variables)

        for ids, c, _ in LAZY_STEPS:
            coordinator.schedule(step, args=(
                tf.constant(ids, tf.int64), tf.constant(c))).fetch()
        fused = "KerasPsAdagradRows" in _op_types(step.get_concrete_function(
            tf.TensorSpec([4], tf.int64), tf.TensorSpec([], tf.float32)))
        assert fused == (kernels == "native")
        shards = layer.trainable_variables
        results[kernels] = (
            np.asarray(layer.embeddings.numpy()),
            np.concatenate([optimizer._accumulators[optimizer._get_variable_index(s)]
                            .numpy() for s in shards]))
    # In a tf.function TF rewrites `x / sqrt(y)` as `x * rsqrt(y)`, and its
    # vector rsqrt is approximate (a few units in the last place, depending on
    # the CPU: on one with AVX-512 it differs from x / sqrt(y) in 45% of
    # random floats), where the kernel divides by an IEEE square root. A row
    # the updates move to near zero keeps that absolute error: on such a CPU
    # one value came out -0.01057545 against the kernel's -0.01057547 (the
    # IEEE result), 1.4e-6 apart relatively. So each value is compared within
    # four units in the last place of the magnitudes that made it: the
    # initial value and the updates' sum. The table's value then makes the
    # next step's gradient, so the accumulator too is compared within four
    # units in its last place.
    moved = np.abs(init_table) + np.abs(init_table - results["native"][0])
    np.testing.assert_array_less(
        np.abs(results["native"][0] - results["tf_ops"][0]), 4 * np.spacing(moved))
    np.testing.assert_array_less(
        np.abs(results["native"][1] - results["tf_ops"][1]),
        4 * np.spacing(results["native"][1]))
    np.testing.assert_array_equal(results["native"][0][UNTOUCHED], init_table[UNTOUCHED])
    assert not np.allclose(results["native"][0], init_table)


def test_lazy_adam_under_model_fit_with_shared_table(two_shards):
    """LazyAdam as a compiled model's optimizer: Model.fit on the cluster,
    two inputs sharing a sharded table; rows no batch uses keep their value."""
    with two_shards.scope():
        keras.utils.set_random_seed(0)
        model = make_model(lambda: keras.optimizers.SGD())  # optimizer_ unused
        model.compile(keras_ps.optimizers.LazyAdam(0.05), "mse",
                      steps_per_execution=2)
    initial = table_values(model)
    ids = np.array([a for a, _ in BATCHES], np.int32).reshape(-1, 2)
    other = np.array([b for _, b in BATCHES], np.int32).reshape(-1, 2)
    y = np.tile(TARGETS, (len(ids) // 2, 1))

    def dataset_fn(context):
        del context
        return tf.data.Dataset.from_tensor_slices(
            ((ids, other), y)).batch(2).repeat()

    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=4,
              verbose=0)
    after = table_values(model)
    np.testing.assert_array_equal(after[UNTOUCHED], initial[UNTOUCHED])
    used = sorted(set(ids.ravel()) | set(other.ravel()))
    assert np.all(np.any(after[used] != initial[used], axis=1))
    assert int(model.optimizer.iterations.numpy()) == 8
    predictions = model.predict((ids[:2], other[:2]), verbose=0)
    assert predictions.shape == (2, 1) and np.all(np.isfinite(predictions))


# -- lookups: each distinct row once -------------------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["one_table", "two_shards"])
def test_lookup_gradient_has_each_row_once(sharded, strategy, two_shards):
    with (two_shards if sharded else strategy).scope():
        layer = keras.layers.Embedding(ROWS, DIM)
        layer.build()
    ids = tf.constant([[4, 5, 4], [5, 5, 0]], tf.int32)
    weights = [w.value for w in layer.trainable_variables]
    with tf.GradientTape() as tape:
        out = layer(ids)
        loss = tf.reduce_sum(out * tf.reshape(tf.range(18, dtype=tf.float32), (2, 3, 3)))
    grads = tape.gradient(loss, weights)
    full = np.asarray(layer.embeddings.numpy())
    np.testing.assert_array_equal(out.numpy(), full[ids.numpy()])
    dense_want = np.zeros((ROWS, DIM), np.float32)
    np.add.at(dense_want, ids.numpy().ravel(), np.arange(18).reshape(6, 3))
    offset = 0
    for grad, weight in zip(grads, weights):
        assert isinstance(grad, tf.IndexedSlices)
        indices = grad.indices.numpy()
        assert len(set(indices.tolist())) == len(indices)  # each row once
        dense = tf.convert_to_tensor(grad).numpy()
        rows = weight.shape[0]
        np.testing.assert_allclose(dense, dense_want[offset:offset + rows])
        offset += rows


def test_sharded_lookup_gradient_is_not_summed_again(two_shards):
    # Its rows are distinct already: the update skips the summing of repeats
    # (a unique and a segment sum of every row on the ps) and gets the same
    # rows and values.
    with two_shards.scope():
        layer = keras.layers.Embedding(ROWS, DIM)
        layer.build()
    weights = [w.value for w in layer.trainable_variables]
    ids = tf.constant([[4, 5, 4], [5, 9, 0]], tf.int32)
    scale = tf.reshape(tf.range(18, dtype=tf.float32), (2, 3, 3))

    @tf.function
    def summed():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids) * scale)
        results = []
        for grad in tape.gradient(loss, weights):
            uniques = _count_ops("Unique")
            values, indices = _rowwise.deduplicate(grad)
            assert _count_ops("Unique") == uniques, "repeats summed again"
            plain = tf.IndexedSlices(tf.identity(grad.values),
                                     tf.identity(grad.indices) + 0)
            want_values, want_indices = _rowwise.deduplicate(plain)
            assert _count_ops("Unique") == uniques + 1  # unknown indices: summed
            results.append((values, indices, want_values, want_indices))
        return results

    for values, indices, want_values, want_indices in summed():
        np.testing.assert_array_equal(indices.numpy(), want_indices.numpy())
        np.testing.assert_array_equal(values.numpy(), want_values.numpy())


def _count_ops(op_type):
    graph = tf.compat.v1.get_default_graph()
    return sum(op.type == op_type for op in graph.get_operations())


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "ftrl", "lazy_adam"])
def test_empty_batch_changes_nothing(kind, strategy, coordinator):
    make = {"sgd": lambda: keras.optimizers.SGD(0.1),
            "adagrad": lambda: keras.optimizers.Adagrad(0.1),
            "ftrl": lambda: keras.optimizers.Ftrl(0.1),
            "lazy_adam": lambda: keras_ps.optimizers.LazyAdam(0.1)}[kind]
    with strategy.scope():
        layer = keras.layers.Embedding(ROWS, DIM)
        layer.build()
        optimizer = make()
        optimizer.build(layer.trainable_variables)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids))
        weights = layer.trainable_variables
        optimizer.apply(tape.gradient(loss, [w.value for w in weights]), weights)

    # Ftrl's first step is Keras' dense one (see the hook); the second is
    # row-wise, as every later step is.
    coordinator.schedule(step, args=(tf.constant([1, 2], tf.int64),)).fetch()
    before = np.asarray(layer.embeddings.numpy())
    slots = [v for v in optimizer.variables if "iteration" not in v.name]
    assert len(slots) >= (2 if kind != "sgd" else 1)
    old = [v.numpy() for v in slots]
    coordinator.schedule(step, args=(tf.zeros([0], tf.int64),)).fetch()
    np.testing.assert_array_equal(layer.embeddings.numpy(), before)
    for slot, value in zip(slots, old):
        np.testing.assert_array_equal(slot.numpy(), value)
    assert int(optimizer.iterations.numpy()) == 2
