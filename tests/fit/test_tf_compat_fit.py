"""TF user code around Model.fit that keras_ps runs as TF's strategy does,
on the shared real cluster (2 workers, 3 ps): compile() outside the scope,
a lazily built model under a partitioner, steps_per_epoch=-1."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps.tables import _sharded_weights
from keras_ps.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def plain_strategy(cluster, strategy):
    return keras_ps.ParameterServerStrategy(cluster.resolver)


@pytest.fixture(scope="module")
def sharding_strategy(cluster, strategy):
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


def _creator(out_dim=1):
    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        x = rng.normal(size=(64, 4)).astype("float32")
        y = rng.normal(size=(64, out_dim)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    return keras_ps.DatasetCreator(dataset_fn)


def _devices(model):
    variables = list(model.optimizer.variables) + list(model.metrics_variables)
    return {v.path: v.value.device for v in variables}


@pytest.mark.parametrize("kind", ["sgd", "adam", "loss_scale_sgd"])
@pytest.mark.parametrize("compile_in_scope", [False, True],
                         ids=["compile_outside_scope", "compile_in_scope"])
def test_optimizer_and_metric_state_on_ps_whatever_the_compile_scope(
        plain_strategy, compile_in_scope, kind):
    with plain_strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    # Made outside the scope, as in `model.compile(keras.optimizers.SGD(), ...)`.
    optimizer = (keras.optimizers.Adam(0.01) if kind == "adam"
                 else keras.optimizers.SGD(0.01))
    loss_scale = kind == "loss_scale_sgd"
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    mae = keras.metrics.MeanAbsoluteError()
    if compile_in_scope:
        with plain_strategy.scope():
            model.compile(optimizer, "mse", metrics=[mae])
    else:
        model.compile(optimizer, "mse", metrics=[mae])
    model.fit(_creator(), epochs=10, steps_per_epoch=10, verbose=0)
    # Each of the 100 steps adds 1 on its worker; 2 workers race on it.
    assert int(model.optimizer.iterations.numpy()) == 100
    assert model.optimizer is optimizer
    devices = _devices(model)
    expected = [optimizer.iterations, *model._loss_tracker.variables,
                *mae.variables]
    if loss_scale:
        expected += [optimizer.inner_optimizer.iterations,
                     optimizer.dynamic_scale]
    if kind == "adam":  # slots made in fit, beside their weights
        expected += [*optimizer._momentums, *optimizer._velocities]
        for slot, weight in zip(optimizer._momentums, model.trainable_weights):
            assert slot.value.device == weight.value.device
    assert {v.path for v in expected} <= set(devices)
    off_ps = {p: d for p, d in devices.items() if "/job:ps/" not in d}
    assert off_ps == {}
    # The metric the user made outside the scope counts every example of
    # the last epoch (metrics restart each epoch).
    assert float(mae.variables[1].numpy()) == 10 * 8


def test_optimizer_built_off_the_ps_is_refused(plain_strategy):
    local = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(local.trainable_variables)  # slots on the coordinator
    with plain_strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"(?s)built .*outside "
                       r"strategy.scope\(\).*Received: optimizer='adam[_0-9]*' "
                       r"with .* on /job:chief.*"
                       r"Pass compile\(\) a new optimizer"):
        model.compile(optimizer, "mse")


def test_lazily_built_model_under_partitioner_fits(sharding_strategy):
    keras.utils.set_random_seed(1)
    with sharding_strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10)])  # no Input: unbuilt
        model.compile("sgd", "mse")
    assert not model.built
    model.fit(_creator(out_dim=10), epochs=1, steps_per_epoch=5, verbose=0)
    kernel = model.layers[0].kernel
    assert isinstance(kernel, _sharded_weights.ShardedWeight)
    assert tuple(kernel.shape) == (4, 10)
    assert len({v.device for v in kernel.variables}) == 2
    assert int(model.optimizer.iterations.numpy()) == 5
    # Trained: the shards' slot-free SGD updates reached both shards.
    before = keras.Sequential([keras.layers.Dense(10)])
    keras.utils.set_random_seed(1)
    before.build((None, 4))
    assert not np.allclose(kernel.numpy(), before.layers[0].kernel.numpy())


@pytest.mark.parametrize("method, arg", [("fit", "steps_per_epoch"),
                                         ("evaluate", "steps")],
                         ids=["fit_steps_per_epoch_minus_one",
                              "evaluate_steps_minus_one"])
def test_run_until_data_ends_is_refused_with_the_reason(plain_strategy,
                                                         method, arg):
    with plain_strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")

    def finite(context):
        x = np.zeros((16, 4), "float32")
        return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)

    with pytest.raises(ValueError, match=(
            rf"(?s)`{arg}=-1` \(run until the data runs out\) is not supported"
            rf".*different step.*Received: {arg}=-1\. Pass {arg}=<number")):
        getattr(model, method)(keras_ps.DatasetCreator(finite), verbose=0,
                               **{arg: -1})


def test_run_until_data_ends_with_sharded_input(plain_strategy):
    """`steps_per_epoch=-1` with dynamic data shards: the coordinator hands
    out the shards and knows when the last is done, so the epoch ends where
    the data ends, every record trained on once (and twice for 2 epochs)."""
    with plain_strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    data = keras_ps.ShardedInput((x, x[:, :1]), batch_size=4,
                                 records_per_shard=10, seed=1)
    history = model.fit(data, epochs=2, steps_per_epoch=-1, verbose=0)
    assert history.history["records_trained"] == [40, 40]
    # 4 shards of 10 records, batches of 4: 3 steps a shard (4, 4, 2).
    assert int(model.optimizer.iterations.numpy()) == 2 * 4 * 3
    with pytest.raises(ValueError, match=r"takes no steps_per_epoch\. "
                                         r"Received: steps_per_epoch=5\..*"
                                         r"or pass -1"):
        model.fit(data, steps_per_epoch=5, verbose=0)


def _one_weight_model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return model


def test_dataset_creator_takes_tf_input_options(plain_strategy):
    # TF's signature: DatasetCreator(dataset_fn, input_options=None).
    creator = _creator()
    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    model = _one_weight_model(plain_strategy)
    model.fit(keras_ps.DatasetCreator(creator.dataset_fn, input_options=options),
              epochs=1, steps_per_epoch=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    with pytest.raises(TypeError, match=r"input_options=\{'fetch': False\}"):
        keras_ps.DatasetCreator(creator.dataset_fn, input_options={"fetch": False})


def test_tf_keras_dataset_creator_is_taken_as_keras_ps_own(plain_strategy):
    # Code moving off tf_keras may still make tf_keras' DatasetCreator
    # (tf.keras.utils.experimental.DatasetCreator before Keras 3).
    tf_keras = pytest.importorskip(
        "tf_keras", reason="tf_keras is installed with the [benchmark] extras")
    creator = tf_keras.utils.experimental.DatasetCreator(_creator().dataset_fn)
    model = _one_weight_model(plain_strategy)
    model.fit(creator, epochs=1, steps_per_epoch=4, verbose=0,
              validation_data=creator, validation_steps=2)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert np.isfinite(model.evaluate(creator, steps=2, verbose=0))
