"""Pins every Keras internal that keras_ps._keras touches.

A Keras upgrade that moves or changes one of them fails here, loudly, before
any cluster test runs. No cluster needed.
"""

import inspect
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ps  # noqa: F401
import keras_ps.training  # noqa: F401  (installs every hook; no cluster needed)
from keras_ps.tables import _row_chunks
from keras_ps.tables import _sharded_weights
from keras_ps.tables import partitioners
from keras_ps.tables import sharded_variable
from keras_ps._keras import atomic_updates as keras_atomic_updates
from keras_ps._keras import fit_routing
from keras_ps._keras import grouped_reads as keras_grouped_reads
from keras_ps import _keras as hooks
from keras_ps._keras import optimizers as keras_optimizers
from keras_ps._keras import saving as keras_saving
from keras_ps._keras import sharding as keras_sharding
from keras_ps.partitioners import FixedShardsPartitioner


# -- sharded layer weights ---------------------------------------------------------
_EXPECTED_SHARDING_SIGNATURES = {
    "add_weight": ["self", "args", "shape", "initializer", "dtype", "trainable",
                   "autocast", "regularizer", "constraint", "aggregation",
                   "overwrite_with_gradient", "name"],
    "_initialize": ["self", "value"],
    "take": ["x", "indices", "axis"],
    "_save_state": ["saveable", "weights_store", "assets_store", "inner_path",
                    "visited_saveables"],
    "_load_state": ["saveable", "weights_store", "assets_store", "inner_path",
                    "skip_mismatch", "visited_saveables", "failed_saveables",
                    "error_msgs"],
    "add_variable_from_reference": ["self", "reference_variable", "name",
                                    "initializer"],
    "_trackable_children": ["self", "save_type", "kwargs"],
    "_track_variable": ["self", "variable"],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("owner, name", keras_sharding.SHARDING_TARGETS,
                          ids=[n for _, n in keras_sharding.SHARDING_TARGETS])
def test_sharding_hook_targets_exist_with_expected_signature(owner, name):
    hooked = getattr(owner, name)
    original = hooks.original(owner, name)
    assert original is not hooked, f"{name} is not hooked"
    params = list(inspect.signature(original).parameters)
    assert params == _EXPECTED_SHARDING_SIGNATURES[name]


@pytest.mark.timeout(60)
def test_sharding_keras_internals_used_by_the_hooks():
    from keras.src import backend
    from keras.src.backend.tensorflow import core

    # ops.take dispatches through the module attribute we replace.
    assert backend.numpy is keras_sharding.TF_NUMPY_MODULE
    # Every keras.Variable's tf.Variable is made by _initialize.
    assert issubclass(keras.Variable, core.Variable)
    # The lists Keras' saving code counts, on a layer and an optimizer.
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    for attr in keras_sharding.LAYER_STATE_LISTS:
        assert isinstance(layer.__dict__[attr], list)
    optimizer = keras.optimizers.Adam()
    optimizer.build(layer.trainable_variables)
    for attr in keras_sharding.OPTIMIZER_STATE_LISTS:
        assert isinstance(optimizer.__dict__[attr], list)
    assert isinstance(optimizer, keras_sharding.OPTIMIZER_CLASS)
    # The optimizer's variable lists are checkpoint dependencies.
    children = optimizer._trackable_children("checkpoint")
    assert "_trainable_variables" in children and "_variables" in children
    # Every optimizer variable is appended to `_variables` (the list a
    # checkpoint restores by index) through `_track_variable`.
    tracked = []
    with mock.patch.object(keras_sharding.OPTIMIZER_CLASS, "_track_variable",
                           lambda self, v: tracked.append(v)):
        slot = optimizer.add_variable_from_reference(layer.kernel, "m")
    assert tracked == [slot] and optimizer.variables[-1] is not slot
    assert children["_variables"] is optimizer._variables


def _local_weight(rows=(2, 3), cols=3):
    shards = [keras.Variable(np.full((r, cols), i, np.float32))
              for i, r in enumerate(rows)]
    return shards, _sharded_weights.ShardedWeight(
        shards, [s.value for s in shards], "layer/w")


@pytest.mark.timeout(60)
def test_sharding_collapse_and_checkpoint_list():
    shards, weight = _local_weight()
    other = keras.Variable(1.0)
    assert _sharded_weights.collapse([other, shards[0], shards[1]]) == [other, weight]
    assert _sharded_weights.collapse([shards[1]]) == [shards[1]]  # incomplete
    children = _sharded_weights.collapse_children({"l": [shards[0], shards[1]]})
    assert children["l"]._trackable_children() == {"0": weight}
    same = [shards[0], shards[1]]
    first = _sharded_weights.collapse_children({"l": same})["l"]
    # A checkpoint walks children several times: the same list, the same child.
    assert _sharded_weights.collapse_children({"l": same})["l"] is first


@pytest.mark.timeout(60)
def test_sharding_collapsed_attributes_restores_lists():
    shards, weight = _local_weight()
    layer = keras.layers.Layer()
    original = layer.__dict__["_trainable_variables"]
    original.extend(shards)
    with _sharded_weights.collapsed_attributes(layer, keras_sharding.LAYER_STATE_LISTS):
        assert layer._trainable_variables == [weight]
    assert layer.__dict__["_trainable_variables"] is original


@pytest.mark.timeout(60)
def test_sharding_take_hook_gathers_rows():
    _, weight = _local_weight()
    table = np.concatenate([np.zeros((2, 3)), np.ones((3, 3))]).astype(np.float32)
    ids = np.array([[4, 0], [-1, 2]])
    got = keras.ops.take(weight, ids, axis=0)
    np.testing.assert_array_equal(got.numpy(), table[ids])
    plain = keras.ops.take(tf.constant(table), ids, axis=0)  # Keras' own path
    np.testing.assert_array_equal(plain.numpy(), table[ids])


@pytest.mark.timeout(60)
def test_sharding_add_sharded_weight_slices_one_initializer():
    layer = keras.layers.Dense(3)
    keras_add_weight = hooks.original(
        keras_sharding.LAYER_CLASS, "add_weight").__get__(layer)
    init = keras.initializers.RandomUniform(seed=7)
    weight = _sharded_weights.add_sharded_weight(
        layer, keras_add_weight, FixedShardsPartitioner(2), "/cpu:0", shape=(5, 3),
        initializer=init, name="k")
    assert [tuple(w.shape) for w in layer.weights] == [(3, 3), (2, 3)]
    assert [w.name for w in layer.weights] == ["k_part_0", "k_part_1"]
    np.testing.assert_array_equal(weight.numpy(), init((5, 3)).numpy())
    np.testing.assert_array_equal(np.asarray(weight), weight.numpy())
    scalar = _sharded_weights.add_sharded_weight(
        layer, keras_add_weight, FixedShardsPartitioner(2), "/cpu:0", shape=(), name="s")
    assert isinstance(scalar, keras.Variable)



@pytest.mark.timeout(60)
def test_sharding_shards_are_made_eagerly_in_a_stateless_scope():
    from keras.src import backend
    from keras.src.backend.common import global_state

    # Keras builds a model without build() by tracing call in a StatelessScope,
    # which it keeps under this global attribute.
    seen = []
    backend.compute_output_spec(lambda: seen.append(
        global_state.get_global_attribute(
            keras_sharding.STATELESS_SCOPE_ATTRIBUTE)))
    assert isinstance(seen[0], keras.StatelessScope)
    layer = keras.layers.Dense(3)
    keras_add_weight = hooks.original(
        keras_sharding.LAYER_CLASS, "add_weight").__get__(layer)
    with keras.StatelessScope() as scope:
        weight = _sharded_weights.add_sharded_weight(
            layer, keras_add_weight, FixedShardsPartitioner(2), "/cpu:0",
            shape=(5, 3), initializer="ones", name="k",
            eager_scope=keras_sharding._outside_stateless_scope)
        assert global_state.get_global_attribute(
            keras_sharding.STATELESS_SCOPE_ATTRIBUTE) is scope
    assert [w.name for w in layer.weights] == ["k_part_0", "k_part_1"]
    assert [id(w.value) for w in layer.weights] == [
        id(v) for v in weight.variables]
    np.testing.assert_array_equal(weight.numpy(), np.ones((5, 3)))

@pytest.mark.timeout(60)
def test_sharding_slots_group_once_complete():
    shards, weight = _local_weight()
    slots = [keras.Variable(np.zeros(s.shape, np.float32)) for s in shards]
    _sharded_weights.group_slot(slots[0], shards[0], "momentum")
    assert _sharded_weights.shard_of(slots[0]) is None
    _sharded_weights.group_slot(slots[1], shards[1], "momentum")
    group, index = _sharded_weights.shard_of(slots[1])
    assert index == 1 and group.path == "layer/w_momentum"
    assert tuple(group.shape) == (5, 3)


@pytest.mark.timeout(60)
def test_sharding_no_partitioning_switch():
    assert partitioners.partitioning_allowed()
    with partitioners.no_partitioning():
        with partitioners.no_partitioning():
            assert not partitioners.partitioning_allowed()
        assert not partitioners.partitioning_allowed()
    assert partitioners.partitioning_allowed()
    seen = []
    initialize = hooks.original(keras.Variable, "_initialize")

    def spy(self, value):
        seen.append(partitioners.partitioning_allowed())
        return initialize(self, value)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(keras.Variable, "_initialize",
                   keras_sharding._unpartitioned_initialize(spy))
        keras.Variable(1.0)
    assert seen == [False]


# -- Keras weights files, a block of rows at a time ------------------------------------
_EXPECTED_SAVING_SIGNATURES = {
    "__setitem__": ["self", "key", "value"],
    "__getitem__": ["self", "key"],
    "save_own_variables": ["self", "store"],
    "is_memory_sufficient": ["model"],
    "assign": ["self", "value"],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("owner, name", keras_saving.SAVING_TARGETS,
                          ids=[n for _, n in keras_saving.SAVING_TARGETS])
def test_saving_hook_targets_exist_with_expected_signature(owner, name):
    original = hooks.original(owner, name)
    assert original is not getattr(owner, name), f"{name} is not hooked"
    assert list(inspect.signature(original).parameters) == \
        _EXPECTED_SAVING_SIGNATURES[name]


@pytest.mark.timeout(60)
def test_saving_keras_internals_used_by_the_hooks(tmp_path):
    from keras.src.saving import saving_lib

    # What the store's hooks read and call.
    store = saving_lib.H5IOStore(str(tmp_path / "s.weights.h5"), mode="w")
    store.make("layers/x")
    assert store.mode == "w" and store._h5_entry_initialized is False
    store._create_h5_group(store._h5_entry_path)
    assert store._h5_entry_group.name == "/layers/x/vars"
    store.close()
    assert callable(saving_lib.safe_get_h5_dataset)
    # model.save streams the h5 through a file when memory is "insufficient";
    # load_model then extracts it instead of reading it into memory.
    save = inspect.getsource(saving_lib._save_model_to_fileobj)
    assert "is_memory_sufficient(model)" in save
    assert "zf.write(weights_file_path.name, _VARS_FNAME_H5)" in save
    load = inspect.getsource(saving_lib._load_model_from_fileobj)
    assert "is_memory_sufficient(model)" in load and "zf.extract(" in load
    # Keras saves optimizer state as `variable.numpy()` of each variable.
    assert "variable.numpy()" in inspect.getsource(
        hooks.original(keras_saving.OPTIMIZER_CLASS, "save_own_variables"))
    assert issubclass(keras.Variable, keras_saving.VARIABLE_CLASS)


@pytest.mark.timeout(60)
def test_saving_streams_a_sharded_weight_by_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_PS_SAVE_CHUNK_BYTES", "24")  # 2 rows of 3
    from keras.src.saving import saving_lib

    _, weight = _local_weight()
    want = weight.numpy()
    writes = []
    write_rows = _row_chunks.read_rows
    monkeypatch.setattr(_row_chunks, "read_rows", lambda v, a, b: writes.append(
        (a, b)) or write_rows(v, a, b))
    path = str(tmp_path / "w.weights.h5")
    store = saving_lib.H5IOStore(path, mode="w")
    store.make("w")["0"] = weight
    store.close()
    assert writes == [(0, 2), (0, 2), (2, 3)]  # shards of 2 and 3 rows
    weight.assign(np.zeros((5, 3), np.float32))
    store = saving_lib.H5IOStore(path, mode="r")
    with _row_chunks.rows_for_reads(True):
        rows = store.get("w")["0"]
    assert isinstance(rows, _row_chunks.DatasetRows) and rows.shape == (5, 3)
    weight.assign(rows)
    np.testing.assert_array_equal(weight.numpy(), want)
    np.testing.assert_array_equal(np.asarray(rows), want)
    assert isinstance(store.get("w")["0"], np.ndarray)  # outside: Keras' own
    with _row_chunks.rows_for_reads(True), pytest.raises(
            ValueError, match=r"must match.*variable.shape=\(4, 3\)"):
        _local_weight(rows=(2, 2))[1].assign(store.get("w")["0"])
    store.close()


# -- optimizer updates on the ps ------------------------------------------------------
def params(fn):
    """The parameter names of Keras' own function behind a hook."""
    fn = getattr(fn, "__keras_ps_original__", fn)
    return list(inspect.signature(fn).parameters)


@pytest.mark.timeout(60)
def test_fused_adam_keras_internals():
    adam = keras_optimizers.ADAM_CLASS
    assert adam is keras.optimizers.Adam
    assert params(adam.update_step) == [
        "self", "gradient", "variable", "learning_rate"]
    assert params(adam._backend_update_step) == [
        "self", "grads", "trainable_variables", "learning_rate"]
    var = keras.Variable(np.ones((3, 2), "float32"))
    optimizer = keras.optimizers.Adam()
    optimizer.build([var])
    index = optimizer._get_variable_index(var.value)
    assert optimizer._momentums[index].shape == var.shape
    assert optimizer._velocities[index].shape == var.shape
    assert optimizer._distribution_strategy is tf.distribute.get_strategy()
    # A variable that is not on a ps takes Keras' own update.
    assert not keras_optimizers._can_fuse_adam(optimizer, var.value)


# -- grouped reads and gradients ---------------------------------------------------
@pytest.mark.timeout(60)
def test_grouped_transfer_keras_internals():
    variable_class = keras_grouped_reads.VARIABLE_CLASS
    assert hooks.installed(variable_class, "__tf_tensor__")
    assert params(variable_class.__tf_tensor__) == ["self", "dtype", "name"]
    assert hooks.installed(keras_grouped_reads.OPTIMIZER_CLASS, "apply")
    assert params(keras_grouped_reads.OPTIMIZER_CLASS.apply) == [
        "self", "grads", "trainable_variables"]
    assert hooks.installed(keras_optimizers.OPTIMIZER_CLASS, "_backend_update_step")
    assert issubclass(keras.optimizers.Adagrad, keras_optimizers.OPTIMIZER_CLASS)
    # Keras' own train_step is what the grouped reads trust to read inside
    # its tape.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert model.train_step.__func__ is keras_grouped_reads.TRAINER_CLASS.train_step
    # Keras' own steps return get_metrics_result() (through compute_metrics),
    # which the step functions skip in all but the last step.
    assert hooks.installed(keras_grouped_reads.TRAINER_BASE_CLASS,
                           "get_metrics_result")
    assert keras_grouped_reads.logs_are_metric_results(model, "train_step")
    assert keras_grouped_reads.logs_are_metric_results(model, "test_step")
    for step in ("train_step", "test_step"):
        source = inspect.getsource(getattr(keras_grouped_reads.TRAINER_CLASS, step))
        assert "return self.compute_metrics(" in source, step
    assert "return self.get_metrics_result()" in inspect.getsource(
        keras_grouped_reads.TRAINER_BASE_CLASS.compute_metrics)
    model.compile("sgd", "mse")
    assert "loss" in model.get_metrics_result()
    with keras_grouped_reads.metric_results_skipped():
        assert model.get_metrics_result() == {}
    assert "loss" in model.get_metrics_result()
    # Tables inside nested models are found (and never read whole).
    nested = keras.Sequential([keras.Input((1,), dtype="int64"), keras.Sequential(
        [keras.layers.Embedding(3, 2)])])
    assert any(isinstance(layer, keras_grouped_reads.ROW_LOOKUP_LAYERS)
               for layer in nested._flatten_layers())
    # Off the ps, a weight converts as Keras converts it.
    weight = model.layers[0].kernel
    assert isinstance(weight._value, tf.Variable)
    assert weight._maybe_autocast(weight._value) is weight._value
    np.testing.assert_array_equal(tf.convert_to_tensor(weight).numpy(),
                                  weight.numpy())


# -- Model.fit routing and atomic updates ---------------------------------------------
@pytest.mark.timeout(60)
def test_fit_routing_keras_internals():
    for name in fit_routing.TRAINER_METHODS:
        assert hooks.installed(fit_routing.TRAINER_CLASS, name), name
    assert issubclass(keras.Model, fit_routing.TRAINER_CLASS)
    # Keras builds an unbuilt model from the input spec with this method.
    assert callable(keras.Model._symbolic_build)
    # Keras' fit passes this private flag to evaluate for validation data.
    fit_source = inspect.getsource(hooks.original(fit_routing.TRAINER_CLASS, "fit"))
    for name in fit_routing.KERAS_PRIVATE_EVALUATE_ARGS:
        assert name in fit_source
    # Keras' BackupAndRestore tells fit where to resume through _initial_epoch.
    assert "self._initial_epoch or initial_epoch" in fit_source
    restore_source = inspect.getsource(keras.callbacks.BackupAndRestore)
    assert "self.model._initial_epoch = epoch" in restore_source
    model = keras.Sequential([keras.layers.Dense(1)])
    model._initial_epoch = 3
    assert fit_routing.take_initial_epoch(model) == 3
    assert fit_routing.take_initial_epoch(model) is None


@pytest.mark.timeout(60)
def test_atomic_update_keras_internals():
    for name in keras_atomic_updates.ATOMIC_METHODS:
        assert hooks.installed(keras_atomic_updates.VARIABLE_CLASS, name), name
    var = keras.Variable(1.0)
    assert isinstance(var._value, tf.Variable)
    assert not keras_atomic_updates.on_parameter_server(var)
    var.assign_add(2.0)  # Keras' own path off the ps
    assert float(var.numpy()) == 3.0



# -- Section: compat (keras_ps/_keras/compat.py) -------------------------------------
@pytest.mark.timeout(60)
def test_compat_keras_internals():
    from keras.src.trainers import trainer as trainer_lib

    from keras_ps._keras import compat

    for owner, name in compat.COMPAT_TARGETS:
        hooked = getattr(owner, name)
        assert hooks.original(owner, name) is not hooked, name
    compile_fn = hooks.original(trainer_lib.Trainer, "compile")
    assert list(inspect.signature(compile_fn).parameters)[:4] == [
        "self", "optimizer", "loss", "loss_weights"]
    # An optimizer made outside the scope is refused in `apply` (which
    # `apply_gradients` calls) and in `add_variable_from_reference`: the
    # hooks of grouped_reads and sharding call the check.
    from keras.src.optimizers import base_optimizer
    assert "self.apply(" in inspect.getsource(hooks.original(
        base_optimizer.BaseOptimizer, "apply_gradients"))
    apply = hooks.original(base_optimizer.BaseOptimizer, "apply")
    assert list(inspect.signature(apply).parameters) == [
        "self", "grads", "trainable_variables"]
    # What place_model_state reads and moves.
    optimizer = keras.optimizers.SGD(0.1)
    assert optimizer._iterations is optimizer.iterations
    assert isinstance(optimizer._learning_rate, keras.Variable)
    assert {id(v) for v in optimizer._variables} >= {
        id(optimizer._iterations), id(optimizer._learning_rate)}
    assert optimizer._distribution_strategy is tf.distribute.get_strategy()
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert isinstance(scaled.inner_optimizer, keras.optimizers.SGD)
    mae = keras.metrics.MeanAbsoluteError()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse", metrics=[mae])
    assert model._distribute_strategy is None  # no strategy at construction
    assert model._loss_tracker.variables
    assert model._compile_metrics._user_metrics == [mae]
    assert hasattr(model._compile_metrics, "_user_weighted_metrics")
    # A keras.Variable's tf.Variable is `_value`; `_initialize` takes one.
    variable = keras.Variable(1.0)
    inner = tf.Variable(2.0)
    compat_initialize = hooks.original(
        keras.Variable, "_initialize")
    compat_initialize(variable, inner)
    assert variable._value is inner
    # build_eagerly: the layers Keras' _symbolic_build checks.
    assert all(layer.built for layer in model._flatten_layers())


# -- Section: row-wise updates (keras_ps._keras.optimizers) -------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", keras_optimizers.ROWWISE_CLASSES,
                         ids=[c.__name__ for c in keras_optimizers.ROWWISE_CLASSES])
def test_rowwise_hook_targets(cls):
    hooked = cls.update_step
    original = getattr(hooked, "__keras_ps_original__", None)
    assert original is not None, f"{cls.__name__}.update_step is not hooked"
    assert list(inspect.signature(original).parameters) == [
        "self", "gradient", "variable", "learning_rate"]


@pytest.mark.timeout(60)
def test_rowwise_keras_internals_used_by_the_hooks():
    var = keras.Variable(np.ones((4, 2), "float32"))
    sgd = keras.optimizers.SGD(0.1)
    assert sgd.momentum == 0
    adagrad = keras.optimizers.Adagrad(0.1, epsilon=1e-3)
    adagrad.build([var])
    assert adagrad.epsilon == 1e-3
    assert keras_optimizers.slot(adagrad, "_accumulators", var.value).shape == (4, 2)
    ftrl = keras.optimizers.Ftrl(0.1)
    ftrl.build([var])
    for name in ("_accumulators", "_linears"):
        assert keras_optimizers.slot(ftrl, name, var.value).shape == (4, 2)
    for attr in ("l1_regularization_strength", "l2_regularization_strength",
                 "l2_shrinkage_regularization_strength", "beta",
                 "learning_rate_power"):
        assert isinstance(getattr(ftrl, attr), float), attr
    # Learning rate as given (a float becomes a variable; a schedule stays).
    assert keras_optimizers.has_constant_learning_rate(ftrl)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    assert not keras_optimizers.has_constant_learning_rate(
        keras.optimizers.Ftrl(schedule))
    # Weight decay per variable, and its exclusion by name.
    decayed = keras.optimizers.SGD(0.1, weight_decay=0.1)
    decayed.exclude_from_weight_decay(var_names=["bias"])
    decayed.build([var])
    assert keras_optimizers.uses_weight_decay(decayed, var)
    assert not keras_optimizers.uses_weight_decay(sgd, var)
    # Slots for LazyAdam: add_variable, colocated through the strategy.
    params = list(inspect.signature(keras.optimizers.Adam.add_variable).parameters)
    assert params[:5] == ["self", "shape", "initializer", "dtype", "aggregation"]
    assert "name" in params
    assert hasattr(adagrad._distribution_strategy.extended, "colocate_vars_with")


@pytest.mark.timeout(60)
def test_rowwise_keras_zero_gradient_facts():
    """What the row-wise hooks rely on: Keras' dense Adagrad and Ftrl (after
    its first step) leave a row with a zero gradient unchanged; Adam does not."""
    def run(optimizer, steps):
        var = keras.Variable(np.full((2, 2), 0.5, "float32"))
        optimizer.build([var])
        grad = np.array([[1.0, -1.0], [0.0, 0.0]], "float32")
        for i in range(steps):  # step 1: row 0 only; step 2: nothing
            optimizer.apply([tf.constant(grad if i == 0 else 0 * grad)], [var])
        return var.numpy()

    for make in (lambda: keras.optimizers.Adagrad(0.1),
                 lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01)):
        np.testing.assert_array_equal(run(make(), 1), run(make(), 2))
    # Adam's momentum moves row 0 at step 2.
    adam = [run(keras.optimizers.Adam(0.1), n) for n in (1, 2)]
    assert not np.array_equal(adam[0][0], adam[1][0])


# -- which weights a backup tracks by rows (keras_ps._keras.row_tracking) -----------
@pytest.mark.timeout(60)
def test_row_tracking_keras_internals():
    from keras_ps import optimizers as keras_ps_optimizers
    from keras_ps._keras import row_tracking

    var = keras.Variable(np.ones((4, 2), "float32"))
    assert keras_ps_optimizers.LazyAdam in row_tracking.ROW_SLOT_LISTS
    for cls, names in row_tracking.ROW_SLOT_LISTS.items():
        optimizer = cls(0.1)
        optimizer.build([var])
        # One list per slot kind, indexed by _get_variable_index.
        index = optimizer._get_variable_index(var)
        for name in names:
            assert getattr(optimizer, name)[index].shape[0] == 4, (cls, name)
        # Every variable the optimizer changes is listed in `variables`.
        slots = {id(getattr(optimizer, n)[index]) for n in names}
        assert slots <= {id(v) for v in optimizer.variables}
        # What moves every row outside update_step.
        assert optimizer.use_ema is False
        assert optimizer.gradient_accumulation_steps is None
        assert row_tracking.strategy_of(optimizer) is not None
    # An override of update_step is not row-wise for sure.
    class Custom(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    custom = Custom(0.1)
    custom.build([var])
    assert row_tracking._slot_lists(custom) is None


# -- initializers drawn in row blocks ------------------------------------------------
@pytest.mark.timeout(60)
def test_blockwise_initializer_hook_target():
    from keras_ps._keras import initializers as keras_initializers

    owner = keras_initializers.VARIABLE_CLASS
    original = hooks.original(owner, "_initialize_with_initializer")
    assert original is not owner._initialize_with_initializer
    assert list(inspect.signature(original).parameters) == ["self", "initializer"]
    # Keras' own path calls it with the initializer object, so a variable
    # made outside a keras_ps strategy gets Keras' numbers.
    init = keras.initializers.RandomUniform(seed=3)
    variable = keras.Variable(init, shape=(4, 2))
    np.testing.assert_array_equal(variable.numpy(), init((4, 2)).numpy())
    # Only initializers that draw each element on its own qualify.
    assert keras_initializers.block_function(init) is not None
    assert keras_initializers.block_function(
        keras.initializers.GlorotUniform()) is None
