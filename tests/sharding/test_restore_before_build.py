"""A checkpoint restored before the optimizer is built fills its slots.

The restart of TF's ClusterCoordinator guide: make the model and optimizer
under `strategy.scope()`, `tf.train.Checkpoint(...).restore(path)`, then
train. The optimizer builds after the restore (by `optimizer.build`, at the
first scheduled step, or in `Model.fit`), and its slots must hold what was
saved, as in plain Keras, whatever the restoring strategy's partitioner:
the same shards, another number of shards, some weights split and some
not, or none.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ps
from keras_ps.partitioners import FixedShardsPartitioner, MinSizePartitioner

pytestmark = pytest.mark.timeout(300)

X = np.array([[1, 2, 9], [0, 5, 5], [7, 3, 1], [4, 4, 8]], np.int32)
Y = np.linspace(-1, 1, 4 * 3 * 2).reshape(4, 3, 2).astype(np.float32)

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05, name="opt"),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05, name="opt"),
    "lazy_adam": lambda: keras_ps.optimizers.LazyAdam(0.05, name="opt"),
}
# How the restoring strategy splits the Embedding (10 x 4), the Dense kernel
# (4 x 2) and its bias (2): as the saving one (2 shards each), in 3 shards,
# the Embedding only (MinSize: 2 shards of 80 bytes; kernel and bias are too
# small to split), or not at all.
TARGETS = {
    "two_shards": FixedShardsPartitioner(2),
    "three_shards": FixedShardsPartitioner(3),
    "min_size": MinSizePartitioner(64, max_shards=3),
    "unpartitioned": None,
}


def make_model(optimizer):
    """Embedding (sparse gradients) + Dense, seeded, compiled, optimizer not built."""
    model = keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(
            10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=3),
            name="emb"),
        keras.layers.Dense(
            2, kernel_initializer=keras.initializers.GlorotUniform(seed=4),
            bias_initializer=keras.initializers.RandomNormal(seed=5), name="out"),
    ], name="net")
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    return model


def by_weight(variables):
    """{path with the shard suffix dropped: full array}, shards joined in order."""
    parts = {}
    for v in variables:
        parts.setdefault(re.sub(r"_part_\d+", "", v.path), []).append(v.numpy())
    return {path: np.concatenate(p) if p[0].ndim else p[0]
            for path, p in parts.items()}


def state(model):
    return {**by_weight(model.optimizer.variables), **by_weight(model.weights)}


def dataset_fn(context=None):
    del context
    return tf.data.Dataset.from_tensors((X, Y)).repeat()


def train(model, coordinator, steps):
    """`model.train_step` in a tf.function, scheduled one step at a time."""
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        return model.train_step(next(it))["loss"]

    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,)).fetch()


@pytest.fixture(scope="module")
def strategies(cluster, strategy):
    return {name: keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=partitioner)
        for name, partitioner in TARGETS.items()}


@pytest.fixture(scope="module")
def saved(strategies, coordinator, tmp_path_factory):
    """optimizer name -> (checkpoint path, state saved, state one step later)
    of a model trained 3 steps in 2 shards (made on first use)."""
    made = {}

    def get(optimizer):
        if optimizer not in made:
            with strategies["two_shards"].scope():
                model = make_model(optimizer)
                model.optimizer.build(model.trainable_variables)
            train(model, coordinator, 3)
            path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
                str(tmp_path_factory.mktemp(optimizer) / "ckpt"))
            at_save = state(model)
            train(model, coordinator, 1)
            made[optimizer] = (path, at_save, state(model))
        return made[optimizer]

    return get


def restored_model(strategy, optimizer, path):
    """The guide's restart: model and optimizer under the scope, then the
    restore, before the optimizer is built."""
    with strategy.scope():
        model = make_model(optimizer)
    assert not model.optimizer.built
    status = tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
    return model, status


def assert_states_equal(actual, expected, exact):
    assert sorted(actual) == sorted(expected)
    for path, value in expected.items():
        if exact:
            np.testing.assert_array_equal(actual[path], value, err_msg=path)
        else:
            np.testing.assert_allclose(actual[path], value, rtol=1e-5,
                                       atol=1e-6, err_msg=path)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_build_after_restore_gives_the_saved_slots(saved, strategies, optimizer,
                                                    target):
    path, at_save, _ = saved(optimizer)
    model, status = restored_model(strategies[target], optimizer, path)
    with strategies[target].scope():
        model.optimizer.build(model.trainable_variables)
    status.assert_existing_objects_matched()
    slots = [p for p in at_save if re.search(
        r"_(momentum|velocity|accumulator|row_step)$", p)]
    assert len(slots) == {"adam": 6, "adagrad": 3, "lazy_adam": 9}[optimizer]
    assert all(np.any(at_save[p] != 0) for p in slots)
    assert_states_equal(state(model), at_save, exact=True)


def guide_step(model, strategy, coordinator):
    """One step as TF's ClusterCoordinator guide writes it: `strategy.run`
    of a replica function that applies the gradients, scheduled."""
    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(Y, model(X)))
            variables = model.trainable_variables
            model.optimizer.apply_gradients(
                zip(tape.gradient(loss, variables), variables))

        strategy.run(replica_fn)

    coordinator.schedule(step)
    coordinator.join()


@pytest.mark.parametrize("target", ["three_shards", "min_size", "unpartitioned"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_first_scheduled_step_after_restore_continues_the_saved_run(
        saved, strategies, coordinator, optimizer, target):
    path, _, one_step_later = saved(optimizer)
    model, _ = restored_model(strategies[target], optimizer, path)
    guide_step(model, strategies[target], coordinator)  # builds the optimizer
    assert int(model.optimizer.iterations.numpy()) == 4
    assert_states_equal(state(model), one_step_later, exact=False)


@pytest.mark.parametrize("target", ["two_shards", "min_size", "unpartitioned"])
@pytest.mark.parametrize("optimizer", ["adam", "lazy_adam"])
def test_fit_after_restore_continues_the_saved_run(saved, strategies, optimizer,
                                                   target):
    path, _, one_step_later = saved(optimizer)
    model, _ = restored_model(strategies[target], optimizer, path)
    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=1,
              verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert_states_equal(state(model), one_step_later, exact=False)
