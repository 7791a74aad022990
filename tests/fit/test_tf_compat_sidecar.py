"""keras_ps.SidecarEvaluator on checkpoints written the TF way
(tf.train.CheckpointManager), from training on the shared real cluster."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps.sidecar import evaluator as evaluation
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(240)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, x.sum(1, keepdims=True)


def _eval_model():
    model = keras.Sequential([keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1)])  # no Input: unbuilt
    model.compile(loss="mse", metrics=["mae"])
    return model


@pytest.fixture(scope="module")
def sharding_strategy(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


def test_evaluator_reads_tf_train_checkpoints_into_an_unbuilt_model(
        sharding_strategy, tmp_path):
    keras.utils.set_random_seed(0)
    with sharding_strategy.scope():
        model = keras.Sequential([keras.Input((3,)),
                                  keras.layers.Dense(4, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=6, verbose=0)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer),
        str(tmp_path), max_to_keep=2)
    manager.save()

    eval_model = _eval_model()
    export = keras_ps.callbacks.SidecarEvaluatorModelExport(
        str(tmp_path / "best-{step}.keras"), monitor="loss", mode="min")
    sidecar = keras_ps.SidecarEvaluator(eval_model, data=_data(seed=1),
                                        checkpoint_dir=str(tmp_path),
                                        max_evaluations=1, poll_interval=0.05,
                                        timeout=60, callbacks=[export])
    (made,) = sidecar.start()
    assert made.checkpoint.step == 6 and made.checkpoint.epoch is None
    assert (tmp_path / "best-6.keras").exists()
    assert int(eval_model.optimizer.iterations.numpy()) == 6
    # Each kernel is split in 2 on the ps; read whole (concatenated).
    assert len(model.layers[0].kernel.variables) == 2
    trained = [np.asarray(w) for layer in model.layers
               for w in (layer.kernel, layer.bias)]
    for full, restored in zip(trained, eval_model.get_weights(), strict=True):
        np.testing.assert_array_equal(full, restored)
    local = _eval_model()
    local.build((None, 3))
    local.set_weights(trained)
    expected = local.evaluate(*_data(seed=1), verbose=0, return_dict=True)
    assert made.metrics["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_keras_ps_checkpoints_still_read(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0,
              callbacks=[keras_ps.callbacks.SidecarCheckpoint(str(tmp_path))])
    eval_model = keras.Sequential([keras.layers.Dense(1)])
    eval_model.compile(loss="mse")
    (made,) = keras_ps.SidecarEvaluator(
        eval_model, _data(), str(tmp_path), poll_interval=0.05,
        timeout=60).start()
    assert made.checkpoint.final and made.checkpoint.step == 4
    np.testing.assert_array_equal(eval_model.get_weights()[0],
                                  model.get_weights()[0])


def test_tf_checkpoint_without_iterations_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                               str(tmp_path), max_to_keep=1).save()
    sidecar = keras_ps.SidecarEvaluator(
        _eval_model(), _data(), str(tmp_path), max_evaluations=1,
        poll_interval=0.05, timeout=60)
    with pytest.raises(evaluation.CheckpointMismatchError, match=(
            r"(?s)holds no optimizer iterations.*Received: checkpoint=.*"
            r"ckpt-1'\. Fix: save tf.train.Checkpoint\(model=model, "
            r"optimizer=model.optimizer\)")):
        sidecar.start()


def test_tf_checkpoint_of_another_model_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer),
        str(tmp_path), max_to_keep=1).save()
    sidecar = keras_ps.SidecarEvaluator(
        _eval_model(), _data(), str(tmp_path), max_evaluations=1,
        poll_interval=0.05, timeout=60)
    with pytest.raises(evaluation.CheckpointMismatchError,
                       match=r"(?s)does not fit the evaluator's model.*Fix:"):
        sidecar.start()


def test_unbuilt_model_without_usable_data_is_refused(tmp_path):
    empty = tf.data.Dataset.from_tensor_slices(
        (np.zeros((0, 3), "float32"), np.zeros((0, 1), "float32"))).batch(4)
    with pytest.raises(ValueError, match=(
            r"(?s)not built, and no batch could be taken from `data`.*"
            r"Received: an unbuilt Sequential and data of type .*Fix:")):
        keras_ps.SidecarEvaluator(_eval_model(), empty, str(tmp_path))


@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
def test_uncompiled_model_is_refused_at_construction(tmp_path, built):
    """A documented difference: TF's evaluator starts with an uncompiled
    model and fails in `start()`, once a checkpoint appears ("Nothing to
    load." for an unbuilt model, or a missing `iterations`). keras_ps
    refuses at construction, before waiting for any checkpoint: an
    uncompiled model has no loss or metrics to evaluate."""
    layers = [keras.Input((3,))] if built else []
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    assert not any(os.scandir(tmp_path))  # no checkpoint yet
    with pytest.raises(ValueError, match=(
            r"SidecarEvaluator's model is not compiled\. Received: "
            r"model='sequential[_0-9]*'\. Fix: model\.compile\(loss=")):
        keras_ps.SidecarEvaluator(model, _data(), str(tmp_path))
