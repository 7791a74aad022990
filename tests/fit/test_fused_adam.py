"""Adam updates of ps variables use TF's fused ResourceApplyAdam kernel
(keras_ps._keras.optimizers; `fused_adam` on the strategy).
These tests pin that the fused path is taken and that it computes what Keras'
own Adam computes, step by step, for dense and sparse (embedding) gradients;
a Keras upgrade that changes Adam's formula fails here."""

import collections
import threading

import numpy as np
import pytest
import tensorflow as tf

import keras

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 12, 3
STEPS = 4
UNIQUE_IDS = [1, 4, 7, 11]
REPEATED_IDS = [1, 4, 4, 7, 11, 1]


def _train(optimizer, table, kernel, ids, densify=False):
    """STEPS updates: a sparse gradient for `table` (the rows `ids` gathered,
    as an embedding lookup does; dense if `densify`) and a dense one for
    `kernel`. Returns the traced function's op types and the final values."""
    ids = tf.constant(ids, tf.int32)

    @tf.function
    def step(scale):
        with tf.GradientTape() as tape:
            rows = tf.gather(table.value, ids)
            loss = tf.reduce_sum(tf.sin(rows * scale)) + \
                tf.reduce_sum(tf.sin(kernel.value * scale))
        grads = tape.gradient(loss, [table.value, kernel.value])
        assert isinstance(grads[0], tf.IndexedSlices)
        if densify:
            grads[0] = tf.convert_to_tensor(grads[0])
        optimizer.apply(grads, [table, kernel])

    for i in range(STEPS):
        step(tf.constant(1.0 + i))
    ops = collections.Counter(op.type for op in step.get_concrete_function(
        tf.constant(1.0)).graph.get_operations())
    assert int(optimizer.iterations.numpy()) == STEPS
    return ops, table.numpy(), kernel.numpy()


def _initial_values(seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(ROWS, DIM)).astype("float32"),
            rng.normal(size=(DIM, 2)).astype("float32"))


def _keras_reference(init, ids, densify=False, **options):
    """Plain Keras Adam on local variables (never fused)."""
    table, kernel = keras.Variable(init[0]), keras.Variable(init[1])
    ops, *values = _train(keras.optimizers.Adam(0.1, **options), table,
                          kernel, ids, densify)
    assert "ResourceApplyAdam" not in ops
    return values


def _on_ps(strategy, init, ids, **options):
    with strategy.scope():
        table, kernel = keras.Variable(init[0]), keras.Variable(init[1])
        optimizer = keras.optimizers.Adam(0.1, **options)
        optimizer.build([table, kernel])
    assert "/job:ps/" in table.value.device
    return _train(optimizer, table, kernel, ids)


def _assert_same(actual, expected):
    for a, e in zip(actual, expected):
        # Float rounding differs (one kernel vs separate ops): about 3e-6.
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [
    {}, {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-3},
    {"weight_decay": 0.1}, {"clipnorm": 0.5}])
def test_fused_adam_matches_keras_adam(strategy, options):
    init = _initial_values(0)
    ops, *values = _on_ps(strategy, init, UNIQUE_IDS, **options)
    assert ops["ResourceApplyAdam"] == 2
    # beta_1^t and beta_2^t made once per step, shared by both variables.
    assert ops["Pow"] == 2
    _assert_same(values, _keras_reference(init, UNIQUE_IDS, **options))
    assert not np.allclose(values[0], init[0])


def test_fused_adam_sums_repeated_rows_before_squaring(strategy):
    # The documented difference: with an id twice in the batch, the fused
    # update equals Keras' Adam given the summed (dense) gradient, and
    # differs from Keras' Adam given the sparse one.
    init = _initial_values(1)
    ops, *values = _on_ps(strategy, init, REPEATED_IDS)
    assert "ResourceApplyAdam" in ops
    _assert_same(values, _keras_reference(init, REPEATED_IDS, densify=True))
    keras_sparse = _keras_reference(init, REPEATED_IDS)
    assert np.abs(values[0] - keras_sparse[0]).max() > 1e-3


def test_fused_adam_false_runs_keras_update(strategy):
    init = _initial_values(2)
    strategy._fused_adam = False  # the shared strategy: restored below
    try:
        ops, *values = _on_ps(strategy, init, REPEATED_IDS)
    finally:
        strategy._fused_adam = True
    assert "ResourceApplyAdam" not in ops
    _assert_same(values, _keras_reference(init, REPEATED_IDS))


def test_amsgrad_keeps_keras_update(strategy):
    init = _initial_values(3)
    ops, *values = _on_ps(strategy, init, REPEATED_IDS, amsgrad=True)
    assert "ResourceApplyAdam" not in ops
    _assert_same(values, _keras_reference(init, REPEATED_IDS, amsgrad=True))


def test_concurrent_traces_share_no_tensors(strategy, monkeypatch):
    # The coordinator's worker threads trace packed steps at the same time,
    # and the per-step scalars are shared between the variables of one trace.
    # Thread "a" stops inside its apply; thread "b" runs an apply of its own
    # and stops right after making its scalars; "a" then goes on: reusing b's
    # scalars (another graph's tensors) would fail with "out of scope".
    from keras_ps._keras import per_apply

    with strategy.scope():
        table = keras.Variable(np.ones((ROWS, DIM), "float32"))
        kernel = keras.Variable(np.ones((DIM, 2), "float32"))
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build([table, kernel])
    a_waiting, b_made_scalars = threading.Event(), threading.Event()
    a_done = threading.Event()
    make_scalars = per_apply.adam_scalars

    def paced(opt, dtype, learning_rate, device):
        name = threading.current_thread().name
        if name == "a" and not a_waiting.is_set():
            a_waiting.set()
            assert b_made_scalars.wait(30)
        scalars = make_scalars(opt, dtype, learning_rate, device)
        if name == "b" and not b_made_scalars.is_set():
            b_made_scalars.set()
            assert a_done.wait(30)
        return scalars

    monkeypatch.setattr(per_apply, "adam_scalars", paced)
    errors = []

    def trace():
        if threading.current_thread().name == "b":
            assert a_waiting.wait(30)

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(table.value) * x + \
                    tf.reduce_sum(kernel.value) * x
            grads = tape.gradient(loss, [table.value, kernel.value])
            optimizer.apply(grads, [table, kernel])
        try:
            step(tf.constant(1.0))  # a foreign tensor fails when it runs
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            if threading.current_thread().name == "a":
                a_done.set()

    threads = [threading.Thread(target=trace, name=n) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert a_waiting.is_set() and b_made_scalars.is_set() and a_done.is_set()
    assert not errors, errors[0]
