"""Keras 3 Model.fit / evaluate / predict on the shared real cluster."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def fit_strategy(cluster, strategy):
    # A strategy of its own on the shared cluster (the connection is reused).
    return keras_ps.ParameterServerStrategy(cluster.resolver)


def _data(n=1024, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x.sum(1, keepdims=True) > 0).astype("float32")
    return x, y


def _network():
    return keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid")])


def _local_copy(model):
    local = _network()
    local.set_weights(model.get_weights())
    return local


def _model(strategy, steps_per_execution=5, metrics=("accuracy",)):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _network()
        model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy",
                      metrics=list(metrics),
                      steps_per_execution=steps_per_execution)
    return model


def _creator(x, y, seen=None):
    def dataset_fn(context):
        if seen is not None:
            seen.append((context.input_pipeline_id, context.num_input_pipelines))
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        return ds.shuffle(256).batch(32).repeat()
    return keras_ps.DatasetCreator(dataset_fn)


def test_fit_dataset_creator_trains_on_workers(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy)
    seen = []
    history = model.fit(_creator(x, y, seen), epochs=3, steps_per_epoch=20,
                        verbose=0)
    assert history.epoch == [0, 1, 2]
    assert history.history["accuracy"][-1] > 0.9
    assert history.history["loss"][-1] < history.history["loss"][0]
    # 3 epochs x 20 steps, each counted once: concurrent workers' updates of
    # the ps counter are atomic (Keras' own assign_add would lose some).
    assert int(model.optimizer.iterations.numpy()) == 60
    # Every variable lives on a ps; dataset_fn saw each worker's context.
    assert all("/job:ps/" in v.value.device for v in model.variables)
    assert sorted(seen) == [(0, 2), (1, 2)]
    assert model.distribute_strategy is fit_strategy


def test_fit_remainder_execution_and_dataset_input(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy, steps_per_execution=4)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    # 10 steps per epoch at 4 per execution: 4 + 4 + 2.
    model.fit(dataset, epochs=2, steps_per_epoch=10, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 20


def test_fit_numpy_with_validation_and_callbacks(fit_strategy, tmp_path):
    x, y = _data()
    vx, vy = _data(256, seed=1)
    model = _model(fit_strategy, steps_per_execution=2)
    batch_losses = []

    class BatchLogger(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batch_losses.append((batch, logs["loss"]))

    ckpt = str(tmp_path / "ckpt-{epoch}.weights.h5")
    log_dir = str(tmp_path / "tb")
    history = model.fit(
        x, y, batch_size=32, epochs=3, steps_per_epoch=8,
        validation_data=(vx, vy), verbose=0,
        callbacks=[BatchLogger(),
                   keras.callbacks.TensorBoard(log_dir, update_freq=2),
                   keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True),
                   keras.callbacks.EarlyStopping("val_loss", patience=5)])
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(history.history["val_accuracy"]) == 3
    assert all(0.0 <= a <= 1.0 for a in history.history["val_accuracy"])
    # Batch-level logs are real numbers: 4 executions per epoch x 3 epochs.
    assert [b for b, _ in batch_losses] == [1, 3, 5, 7] * 3
    assert all(isinstance(l, float) and np.isfinite(l) for _, l in batch_losses)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["ckpt-1.weights.h5", "ckpt-2.weights.h5", "ckpt-3.weights.h5", "tb"])
    # TensorBoard wrote batch-level scalars (update_freq=2), which TF's
    # native parameter-server path refuses to do.
    tags = set()
    for path in glob.glob(os.path.join(log_dir, "train", "events.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(v.tag for v in event.summary.value)
    assert "batch_loss" in tags and "epoch_loss" in tags


def test_steps_per_epoch_is_required(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy)
    with pytest.raises(ValueError, match="steps_per_epoch.*required.*steps_per_epoch=None"):
        model.fit(_creator(x, y), epochs=1)


def test_bad_inputs_name_the_problem(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy)
    with pytest.raises(ValueError, match="class_weight"):
        model.fit(x, y, steps_per_epoch=2, class_weight={0: 1.0, 1: 2.0})
    with pytest.raises(ValueError, match="y and sample_weight must be None"):
        model.fit(_creator(x, y), y, steps_per_epoch=2)
    with pytest.raises(TypeError, match="DatasetCreator needs a callable"):
        keras_ps.DatasetCreator("not a function")
    with pytest.raises(ValueError, match="steps_per_epoch` must be a positive"):
        model.fit(_creator(x, y), steps_per_epoch=0)


class _CountExamples(keras.metrics.Metric):
    def __init__(self, name="examples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

    def result(self):
        return self.count


@pytest.mark.parametrize("source", ["arrays", "from_tensor_slices", "range"])
def test_exact_evaluation_counts_each_example_once(fit_strategy, source):
    x, y = _data(1001)
    model = _model(fit_strategy, metrics=("accuracy", _CountExamples()))
    if source == "arrays":
        logs = model.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    elif source == "from_tensor_slices":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(7)
        logs = model.evaluate(ds, verbose=0, return_dict=True)
    else:
        ds = tf.data.Dataset.range(1001).map(
            lambda i: (tf.fill([4], tf.cast(i % 3, "float32") - 1.0),
                       tf.reshape(tf.cast(i % 3 == 2, "float32"), [1]))).batch(7)
        logs = model.evaluate(ds, verbose=0, return_dict=True)
    assert logs["examples"] == 1001.0
    # The same numbers as Keras computes on one machine.
    if source == "arrays":
        local = _local_copy(model)
        local.compile(loss="binary_crossentropy", metrics=["accuracy"])
        expected = local.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
        assert logs["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
        assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-4)


def test_exact_evaluation_with_regularized_weights(fit_strategy):
    x, y = _data(300)
    with fit_strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(1, activation="sigmoid",
                               kernel_regularizer=keras.regularizers.L2(0.1))])
        model.compile("sgd", "binary_crossentropy",
                      metrics=[_CountExamples()])
    logs = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert logs["examples"] == 300.0
    local = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(1, activation="sigmoid",
                           kernel_regularizer=keras.regularizers.L2(0.1))])
    local.set_weights(model.get_weights())
    local.compile("sgd", "binary_crossentropy")
    expected = local.evaluate(x, y, batch_size=32, verbose=0)
    assert logs["loss"] == pytest.approx(expected, rel=1e-4)


def test_evaluate_with_steps_and_infinite_data_error(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy, metrics=("accuracy", _CountExamples()))
    logs = model.evaluate(_creator(x, y), steps=6, verbose=0, return_dict=True)
    assert logs["examples"] == 6 * 32  # 6 batches of 32 (executions of 5 + 1)
    with pytest.raises(ValueError, match="finite dataset"):
        model.evaluate(_creator(x, y), verbose=0)
    assert isinstance(model.evaluate(x, y, verbose=0), list)


def test_empty_evaluation_data_gives_no_metrics_and_a_warning(fit_strategy,
                                                             caplog):
    """Keras returns no metrics for data with no batch; keras_ps does the
    same and warns, never the metrics' initial values (a loss of 0)."""
    import logging

    x, y = _data(64)
    model = _model(fit_strategy)
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).filter(
        lambda a, b: False)
    caplog.set_level(logging.WARNING,
                     logger="keras_ps.training.exact_evaluation")
    assert model.evaluate(empty, verbose=0, return_dict=True) == {}
    assert model.evaluate(empty, verbose=0) == []
    assert caplog.text.count("evaluate evaluated no batch: the data is "
                             "empty") == 2
    assert "check the evaluation data or fit's validation_data" in caplog.text

    caplog.clear()
    stopper = keras.callbacks.EarlyStopping("val_loss", patience=0)
    history = model.fit(x, y, epochs=3, steps_per_epoch=2, verbose=0,
                        validation_data=empty, callbacks=[stopper])
    assert sorted(history.history) == ["accuracy", "loss"]
    # A val_loss of 0 every epoch would have stopped it after the second.
    assert len(history.history["loss"]) == 3
    assert caplog.text.count("evaluate evaluated no batch") == 3


def test_predict_matches_local_model(fit_strategy):
    x, _ = _data(100)
    model = _model(fit_strategy)
    local = _local_copy(model)
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               local.predict(x, verbose=0), rtol=1e-5)


def test_custom_train_step_and_metric(fit_strategy):
    x, y = _data()

    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, activation="sigmoid")
            self.steps_seen = keras.metrics.Sum(name="steps_seen")

        def call(self, inputs):
            return self.dense(inputs)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.steps_seen.update_state(1.0)
            return {"loss": loss, "steps_seen": self.steps_seen.result()}

        @property
        def metrics(self):
            return [self.steps_seen]

    with fit_strategy.scope():
        model = Custom()
        model.build((None, 4))
        model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy",
                      steps_per_execution=3)
    history = model.fit(_creator(x, y), epochs=2, steps_per_epoch=9, verbose=0)
    assert history.history["steps_seen"] == [9.0, 9.0]


def test_plain_model_keeps_keras_fit():
    # A model built outside any keras_ps strategy takes Keras' own path.
    x, y = _data(64)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    history = model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert len(history.history["loss"]) == 1


def test_repeated_fit_releases_its_packed_functions(fit_strategy):
    import gc

    import psutil

    coordinator = keras_ps.ClusterCoordinator(fit_strategy)
    x, y = _data()
    process = psutil.Process()

    def fit_once():
        model = _model(fit_strategy, steps_per_execution=2)
        model.fit(_creator(x, y), epochs=1, steps_per_epoch=8, verbose=0)
        del model
        gc.collect()

    for _ in range(2):  # warm-up: TF's and Keras' own caches fill
        fit_once()
    held, rss = len(coordinator._packing), process.memory_info().rss
    for _ in range(8):
        fit_once()
    # Each fit traced new step functions; the finished fits' are released.
    assert len(coordinator._packing) <= held
    grown_mb = (process.memory_info().rss - rss) / 2**20
    print(f"RSS grew {grown_mb:.1f} MB over 8 fits")
    assert grown_mb < 100


def _count_traces(model):
    """Counts the traces of the model's train and test steps (a step's Python
    runs only while a tf.function traces it)."""
    traced = {"train": 0, "test": 0}
    keras_train_step, keras_test_step = model.train_step, model.test_step

    def train_step(data):
        traced["train"] += 1
        return keras_train_step(data)

    def test_step(data):
        traced["test"] += 1
        return keras_test_step(data)

    model.train_step, model.test_step = train_step, test_step
    return traced


def test_later_fit_and_evaluate_calls_trace_nothing_new(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy, steps_per_execution=4)
    traced = _count_traces(model)
    data = _creator(x, y)
    model.fit(data, epochs=1, steps_per_epoch=8, verbose=0)
    model.evaluate(data, steps=8, verbose=0)
    after_first = dict(traced)
    assert after_first["train"] > 0 and after_first["test"] > 0
    # Later calls, with the same input object or a new one of the same
    # structure, run the steps traced by the first.
    model.fit(data, epochs=2, steps_per_epoch=8, verbose=0)
    history = model.fit(_creator(x, y), epochs=1, steps_per_epoch=8,
                        verbose=0)
    model.evaluate(_creator(x, y), steps=8, verbose=0)
    assert traced == after_first
    assert int(model.optimizer.iterations.numpy()) == 32
    assert history.history["accuracy"][-1] > 0.8


def test_changed_input_or_compile_traces_again(fit_strategy):
    x, y = _data()
    model = _model(fit_strategy, steps_per_execution=4)
    traced = _count_traces(model)
    model.fit(_creator(x, y), epochs=1, steps_per_epoch=8, verbose=0)
    before = traced["train"]

    # Batches with sample weights: a new input structure is traced for.
    def weighted(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y, np.ones(len(x), "float32")))
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.batch(32).repeat()

    model.fit(keras_ps.DatasetCreator(weighted), epochs=1, steps_per_epoch=8,
              verbose=0)
    assert traced["train"] > before
    assert int(model.optimizer.iterations.numpy()) == 16

    # A new compile (here a new optimizer) makes new steps, as Keras resets
    # its `train_function`: the new optimizer is the one that trains.
    old_optimizer = model.optimizer
    before = traced["train"]
    with fit_strategy.scope():
        model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy",
                      metrics=["accuracy"], steps_per_execution=4)
    model.fit(_creator(x, y), epochs=1, steps_per_epoch=8, verbose=0)
    assert traced["train"] > before
    assert int(model.optimizer.iterations.numpy()) == 8
    assert int(old_optimizer.iterations.numpy()) == 16


def test_a_one_step_function_is_not_traced_again_at_the_switch(
        fit_strategy, monkeypatch):
    # One step per execution has no loop to write out: past
    # KERAS_PS_UNROLL_AFTER executions, the same function goes on.
    monkeypatch.setenv("KERAS_PS_UNROLL_STEPS", "5")
    monkeypatch.setenv("KERAS_PS_UNROLL_AFTER", "1")
    x, y = _data()
    model = _model(fit_strategy, steps_per_execution=1)
    traced = _count_traces(model)
    model.fit(_creator(x, y), epochs=1, steps_per_epoch=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert traced["train"] == 1, traced


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "lazy_adam"])
def test_unrolled_steps_give_the_loops_results(fit_strategy, monkeypatch,
                                               optimizer):
    # Every batch is the whole data, so the result does not depend on which
    # worker runs which execution. The same steps give the same weights: in
    # a tf.while_loop; written out (KERAS_PS_UNROLL_STEPS=4); 3 written out
    # in a loop of one iteration with the fourth after it; and the default
    # way, the loop for a count's first executions (here 2), then written
    # out (the switch happens inside the fit call).
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 50, size=(128, 3))
    y = (ids.sum(1, keepdims=True) % 2).astype("float32")

    def creator(context):
        return tf.data.Dataset.from_tensor_slices((ids, y)).batch(128).repeat()

    weights, traces = [], []
    for unroll, after in (("0", "0"), ("4", "0"), ("3", "0"), ("4", "2")):
        monkeypatch.setenv("KERAS_PS_UNROLL_STEPS", unroll)
        monkeypatch.setenv("KERAS_PS_UNROLL_AFTER", after)
        keras.utils.set_random_seed(7)
        with fit_strategy.scope():
            model = keras.Sequential([
                keras.Input((3,), dtype="int64"), keras.layers.Embedding(50, 4),
                keras.layers.Flatten(), keras.layers.Dense(1, activation="sigmoid")])
            model.compile(
                keras_ps.optimizers.LazyAdam() if optimizer == "lazy_adam"
                else optimizer, "binary_crossentropy", metrics=["accuracy"],
                steps_per_execution=4)
        traced = _count_traces(model)
        model.fit(keras_ps.DatasetCreator(creator), epochs=3, steps_per_epoch=4,
                  verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 12
        weights.append(model.get_weights())
        traces.append(traced["train"])
    # The loop traces the step twice (the first step, the loop's body);
    # written out, once per step; switching, both.
    assert traces[1] == 2 * traces[0], traces
    assert traces[3] == traces[0] + traces[1], traces
    for looped, *unrolled in zip(*weights):
        for each in unrolled:
            np.testing.assert_allclose(each, looped, rtol=1e-6, atol=1e-7)
