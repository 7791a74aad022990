"""A step moves each ps' small dense weights as one tensor per ps each way
(KERAS_PS_GROUP_TRANSFERS, on by default) and trains exactly as with one
tensor per weight."""

import numpy as np
import pytest

import keras
import tensorflow as tf

import keras_ps
from keras_ps.tables import _grouped_transfers
from keras_ps.tables import _held_adds


@pytest.fixture(scope="module")
def sharded_strategy(cluster):
    # Splits every weight over 2 ps, as the benchmarks' model does.
    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=keras_ps.partitioners.FixedShardsPartitioner(2))


def _data():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 60, size=(128, 3))
    y = (ids.sum(1, keepdims=True) % 2).astype("float32")
    return ids, y


def _fit(strategy, optimizer, monkeypatch, group):
    monkeypatch.setenv("KERAS_PS_GROUP_TRANSFERS", group)
    ids, y = _data()

    def creator(context):
        # Every batch is the whole data and each epoch is one execution:
        # the result does not depend on which worker runs it.
        return tf.data.Dataset.from_tensor_slices((ids, y)).batch(128).repeat()

    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((3,), dtype="int64"), keras.layers.Embedding(60, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid",
                               kernel_constraint=keras.constraints.MaxNorm(0.5))])
        model.compile(keras_ps.optimizers.LazyAdam() if optimizer == "lazy_adam"
                      else keras.optimizers.get(optimizer), "binary_crossentropy",
                      metrics=["accuracy"], steps_per_execution=4)
    history = model.fit(keras_ps.DatasetCreator(creator), epochs=3,
                        steps_per_epoch=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 12
    evaluated = model.evaluate(keras_ps.DatasetCreator(creator), steps=2,
                               verbose=0, return_dict=True)
    return model.get_weights(), history.history["loss"], evaluated


class _Spy:
    """Records what the step's traces grouped (the real functions run)."""

    def __init__(self, monkeypatch):
        self.read_groups, self.moved, self.held = [], [], []
        self.rows_with_group = []
        # rider name -> [(its ps, ps it rode to, the device of its copy)]
        self.landed = {}
        read_group, to_ps = (_grouped_transfers._read_group,
                             _grouped_transfers.gradients_to_ps)
        with_group = _grouped_transfers._StepReads.gather_with_group
        defer_add = _held_adds.defer_add

        def spy_read_group(group, passengers=()):
            self.read_groups.append([v.device for v in group])
            return read_group(group, passengers)

        def spy_with_group(reads, table, rows):
            gathered = with_group(reads, table, rows)
            if gathered is not None:
                # The group read with these rows: the table's ps' last read.
                group = reads._groups[reads._by_ps[(table.device, table.dtype)]]
                self.read_groups.append([table.device] + [v.device for v in group])
                self.rows_with_group.append(table.device)
            return gathered

        def spy_defer_add(variable, value):
            held = defer_add(variable, value)
            if held:
                self.held.append(variable.device)
            return held

        def spy_to_ps(grads, variables, riders=None):
            moved, landed = to_ps(grads, variables, riders)
            self.moved.extend(
                (v.device, m.device) for g, v, m in zip(grads, variables, moved)
                if m is not g)
            for device, values in landed.items():
                for name, value in values.items():
                    self.landed.setdefault(name, []).append(
                        (riders[name][1], device, value.device))
            return moved, landed

        monkeypatch.setattr(_grouped_transfers, "_read_group", spy_read_group)
        monkeypatch.setattr(_grouped_transfers._StepReads, "gather_with_group",
                            spy_with_group)
        monkeypatch.setattr(_held_adds, "defer_add", spy_defer_add)
        monkeypatch.setattr(_grouped_transfers, "gradients_to_ps", spy_to_ps)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "sgd", "lazy_adam"])
@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_grouped_steps_train_as_one_tensor_per_weight(
        cluster, strategy, sharded_strategy, monkeypatch, optimizer, sharded):
    on = sharded_strategy if sharded else strategy
    spy = _Spy(monkeypatch)
    plain = _fit(on, optimizer, monkeypatch, "0")
    assert spy.read_groups == [] and spy.moved == [] and spy.held == []
    grouped = _fit(on, optimizer, monkeypatch, "1")

    # Grouping happened: reads of several weights from one ps at once (and
    # the embedding's rows with them), gradients split on their ps, and the
    # metrics' additions held for one transfer.
    assert spy.read_groups, "no read was grouped"
    for devices in spy.read_groups:
        assert len(devices) >= 2 and len(set(devices)) == 1, devices
    assert spy.moved, "no gradient was grouped"
    # loss total and count, accuracy total and count: each step's, in train
    # and evaluate.
    assert len(spy.held) >= 4, spy.held
    if sharded:
        # Each ps holds a table shard and MLP shards: its rows ride with them.
        assert len(set(spy.rows_with_group)) == 2, spy.rows_with_group
    for variable_device, grad_device in spy.moved:
        assert grad_device == variable_device, (grad_device, variable_device)
    if sharded:
        # The learning rate, read with its ps' weights, rode to the other ps
        # with that ps' gradients: no message of its own from its ps. So did
        # Adam's step count, which the other optimizers do not read.
        riding = ["learning_rate"] + (
            ["iterations"] if optimizer in ("adam", "lazy_adam") else [])
        assert sorted(spy.landed) == sorted(riding), spy.landed
        for name in riding:
            for home, device, value_device in spy.landed[name]:
                assert device != home and value_device == device, (
                    name, home, device, value_device)

    # The same training, step for step: weights, losses, evaluation.
    for want, got in zip(plain[0], grouped[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grouped[1], plain[1], rtol=1e-5)
    assert grouped[2].keys() == plain[2].keys()
    for key in plain[2]:
        np.testing.assert_allclose(grouped[2][key], plain[2][key], rtol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unroll", ["0", "4", "3"],
                         ids=["loop", "written_out", "3_per_iteration"])
def test_steps_read_the_metrics_once_and_log_what_every_step_would(
        monkeypatch, unroll):
    # A plain (local) model: the step functions' logic alone. Four steps of
    # one scheduled function against four calls of Keras' own train_step.
    from keras_ps._keras import grouped_reads
    from keras_ps.training import _step_functions

    monkeypatch.setenv("KERAS_PS_UNROLL_STEPS", unroll)
    monkeypatch.setenv("KERAS_PS_UNROLL_AFTER", "0")  # from the first call
    ids, y = _data()
    x = ids.astype("float32") / 60.0
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def model():
        keras.utils.set_random_seed(3)
        built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1, activation="sigmoid")])
        built.compile("adagrad", "binary_crossentropy", metrics=["accuracy"])
        return built

    plain = model()
    step = tf.function(plain.train_step)
    for batch in batches:
        want = step(batch)

    packed = model()
    assert grouped_reads.logs_are_metric_results(packed, "train_step")
    function = _step_functions.StepFunctions(packed, "train_step").get(4)
    got = function(iter(batches))

    assert set(got) == set(want) == {"loss", "accuracy"}
    for key in want:
        np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), rtol=1e-6)
    for a, b in zip(packed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # The skipped results were skipped in the steps only.
    assert packed.get_metrics_result().keys() == {"loss", "accuracy"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("unroll", ["0", "2"], ids=["loop", "2_per_iteration"])
def test_the_loop_carries_metric_additions_to_one_transfer_per_execution(
        strategy, monkeypatch, unroll):
    # The steps' metric additions are summed on the worker across the loop's
    # iterations and cross once, after it: no held addition is made inside a
    # loop body (there, each iteration would send one tensor per ps).
    monkeypatch.setenv("KERAS_PS_UNROLL_STEPS", unroll)
    monkeypatch.setenv("KERAS_PS_UNROLL_AFTER", "0")  # from the first call
    made = []  # (graph, held additions made there)
    flush = _held_adds.flush_adds

    def spy_flush():
        held = getattr(_held_adds._local, "adds", None)
        if held is not None and held.adds:
            made.append((tf.compat.v1.get_default_graph().name,
                         len(held.adds)))
        flush()

    monkeypatch.setattr(_held_adds, "flush_adds", spy_flush)
    _fit(strategy, "adagrad", monkeypatch, "1")
    assert made, "no metric addition was held"
    in_loops = [name for name, _ in made if "while_body" in name]
    assert not in_loops, made


def _reads_of(graph, handle_placeholder):
    """How many ReadVariableOps of the traced graph read the captured
    variable `handle_placeholder`."""
    return sum(1 for op in graph.get_operations()
               if op.type == "ReadVariableOp"
               and op.inputs[0] is handle_placeholder)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "lazy_adam"])
def test_an_apply_reads_the_learning_rate_and_the_step_once(
        sharded_strategy, optimizer):
    # Keras hands the learning-rate variable to every variable's update, and
    # Adam and LazyAdam read `iterations` in each: every read is a message
    # from the ps holding it to the ps of the update. One apply reads each
    # of them once, whatever the number of weights and ps.
    with sharded_strategy.scope():
        weights = [keras.Variable(np.ones(shape, "float32"))
                   for shape in ((64, 8), (8, 8), (8,), (8, 1), (1,))]
        opt = (keras_ps.optimizers.LazyAdam(0.1) if optimizer == "lazy_adam"
               else keras.optimizers.get({"class_name": optimizer,
                                          "config": {"learning_rate": 0.1}}))
        opt.build(weights)
    devices = {w.value.device for w in weights
               if isinstance(w.value, tf.Variable)}
    devices |= {s.device for w in weights
                for s in getattr(w.value, "variables", ())}
    assert len({d for d in devices if "/job:ps/" in d}) >= 2, devices

    @tf.function
    def apply():
        opt.apply([tf.ones(w.shape) for w in weights], weights)

    graph = apply.get_concrete_function().graph
    inner = {id(outer): inner for outer, inner in graph.captures}

    def placeholder(variable):
        handle = getattr(variable, "handle", None)
        if handle is None:  # a Keras variable
            handle = variable.value.handle
        return inner[id(handle)]

    assert _reads_of(graph, placeholder(opt._learning_rate)) == 1
    if optimizer != "adagrad":
        assert _reads_of(graph, placeholder(opt.iterations)) == 1
    apply()  # and it runs
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.timeout(120)
def test_a_constant_added_to_a_ps_variable_is_made_on_that_ps(strategy):
    # `optimizer.iterations.assign_add(1)` at every step: a constant made on
    # the worker would be a message to the ps per step (inside the steps'
    # loop TF does not fold it away).
    with strategy.scope():
        counter = keras.Variable(0, dtype="int64", trainable=False)
    device = counter.value.device
    assert "/job:ps/" in device

    @tf.function
    def add():
        counter.assign_add(1)

    graph = add.get_concrete_function().graph
    adds = [op for op in graph.get_operations()
            if op.type == "AssignAddVariableOp"]
    assert len(adds) == 1
    value_op = adds[0].inputs[1].op
    assert tf.DeviceSpec.from_string(value_op.device) == \
        tf.DeviceSpec.from_string(device), (value_op.type, value_op.device)
    add()
    add()
    assert int(counter.numpy()) == 2


@pytest.mark.timeout(180)
def test_a_learning_rate_set_between_epochs_reaches_every_ps(
        sharded_strategy, monkeypatch):
    # The rate rides from its ps to the other with the gradients: the value
    # it carries must be the one set by the callback, on both ps. SGD at a
    # rate of 0 leaves every weight (every shard, on either ps) unchanged.
    monkeypatch.setenv("KERAS_PS_GROUP_TRANSFERS", "1")
    ids, y = _data()

    def creator(context):
        return tf.data.Dataset.from_tensor_slices((ids, y)).batch(32).repeat()

    with sharded_strategy.scope():
        model = keras.Sequential([
            keras.Input((3,), dtype="int64"), keras.layers.Embedding(60, 4),
            keras.layers.Flatten(), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy",
                      steps_per_execution=2)
    initial = model.get_weights()
    at_epoch_end = []
    model.fit(
        keras_ps.DatasetCreator(creator), epochs=3, steps_per_epoch=4,
        verbose=0, callbacks=[
            keras.callbacks.LearningRateScheduler(
                lambda epoch: 0.5 if epoch == 0 else 0.0),
            keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs:
                                           at_epoch_end.append(
                                               model.get_weights()))])
    assert int(model.optimizer.iterations.numpy()) == 12
    assert float(model.optimizer.learning_rate.numpy()) == 0.0
    first, _, third = at_epoch_end
    # The first epoch trained every weight; the later ones moved none.
    for start, trained in zip(initial, first):
        assert not np.array_equal(trained, start)
    for before, after in zip(first, third):
        np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_step_count_crosses_in_a_float_tensor_exactly(dtype):
    # The step count rides in a ps' float tensor as its bytes: joined with
    # floats, split again and turned back, every int64 comes back the same,
    # including counts no float of that dtype holds exactly.
    counts = [0, 1, 7, 2**24 + 1, 2**53 + 1, 2**62 + 3, -1]
    floats = tf.constant([0.5, -2.0, float("nan")], dtype)

    @tf.function
    def round_trip(count):
        bits = _grouped_transfers.as_bits(count, tf.as_dtype(dtype))
        flat = _grouped_transfers._joined([floats, bits, floats])
        pieces = _grouped_transfers._split(
            flat, [3, _grouped_transfers._bits_size(tf.as_dtype(dtype)), 3])
        return _grouped_transfers.from_bits(pieces[1])

    for count in counts:
        got = round_trip(tf.constant(count, tf.int64))
        assert got.dtype == tf.int64 and int(got.numpy()) == count, (count, got)
