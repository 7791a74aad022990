"""Adam updates of ps variables use TF's fused ResourceApplyAdam kernel
(keras_ps._keras_adapter, "one fused kernel"; `fused_adam` on the strategy).
These tests pin that the fused path is taken and that it computes what Keras'
own Adam computes, step by step, for dense and sparse (embedding) gradients;
a Keras upgrade that changes Adam's formula fails here."""

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
    ops = {op.type for op in step.get_concrete_function(
        tf.constant(1.0)).graph.get_operations()}
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
    assert "ResourceApplyAdam" in ops
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
