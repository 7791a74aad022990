"""Incremental backups of a keras_ps.layers.DynamicEmbedding on the shared
real cluster (3 ps, 2 workers): a full backup and deltas, with rows evicted
and their slots given to other ids in between, restore bit for bit (keys,
key maps, rows, optimizer slot rows, counters, filter) what a full backup
at the same step restores, and the restored table trains on exactly as the
original; BackupAndRestore(incremental=...) with Model.fit; a restore into
another number of shards is refused, naming the fix."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps.backups import _chain as _backup_chain
from keras_ps.backups import incremental_backup
from keras_ps.tables import _sharded_weights
from keras_ps.dynamic_embedding import slots as slots_lib

pytestmark = pytest.mark.timeout(300)

SLOTS_PER_SHARD, VOCABULARY, BATCH = 8, 120, 16
OPTIMIZERS = {"lazy_adam": lambda: keras_ps.optimizers.LazyAdam(0.05),
              "adagrad": lambda: keras.optimizers.Adagrad(0.3)}


def _model(strategy, optimizer, key_dtype="int64"):
    """A DynamicEmbedding far smaller than its vocabulary (rows are evicted
    and reused at every step), admission after 2 sightings, age eviction."""
    num_shards = (len(strategy.extended.parameter_devices) if isinstance(
        strategy, keras_ps.ParameterServerStrategy) else 1)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        ids = keras.Input((4,), dtype=key_dtype)
        table = keras_ps.layers.DynamicEmbedding(
            8, capacity=SLOTS_PER_SHARD * num_shards, key_dtype=key_dtype,
            min_count=2, max_age=6, default_row="trainable",
            filter_size=512, name="ids")
        x = keras.layers.GlobalAveragePooling1D()(table(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(OPTIMIZERS[optimizer](), "mse")
        model.optimizer.build(model.trainable_variables)
    return model, table


def _batches(seed, steps):
    rng = np.random.default_rng(seed)
    vocab = np.random.default_rng(0).integers(-2**50, 2**50, VOCABULARY)
    pick = np.minimum(rng.zipf(1.2, size=(steps, BATCH, 4)) - 1,
                      VOCABULARY - 1)
    return vocab[pick], rng.normal(size=(steps, BATCH, 1)).astype("float32")


def _step_fn(model):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        variables = model.trainable_variables
        model.optimizer.apply_gradients(
            zip(tape.gradient(loss, variables), variables))

    return step


def _train(coordinator, step, seed, steps=3):
    """`steps` steps, one after the other (each sees the previous one's
    admissions)."""
    for x, y in zip(*_batches(seed, steps)):
        coordinator.schedule(step, args=(tf.constant(x), tf.constant(y)))
        coordinator.join()


def _state(model, table):
    """Every bit of the model, its optimizer and the table's shards: rows,
    optimizer slot rows, per-slot keys, last-seen steps, hits, free stack,
    LRU cache, counters, filter, and each key map (sorted by slot)."""
    out = {f"var{i}": v.numpy() for i, v in enumerate(
        _sharded_weights.collapse(model.weights)
        + _sharded_weights.collapse(model.optimizer.variables))}
    for shard in table._table.shards:
        out[f"rows_{shard.index}"] = shard.rows.numpy()
        for name, variable, _ in shard.optimizer_slots:
            out[f"{name}_{shard.index}"] = variable.numpy()
        for name, variable in shard.backup_variables().items():
            out[name] = variable.numpy()
        keys, slots = (t.numpy() for t in shard.table.export())
        order = np.argsort(slots)
        out[f"map_keys_{shard.index}"] = keys[order]
        out[f"map_slots_{shard.index}"] = slots[order]
    return out


def _bits(value):
    # String keys come as arrays of bytes objects.
    return value.tolist() if value.dtype == object else value.tobytes()


def _differences(a, b):
    assert sorted(a) == sorted(b)
    return sorted(k for k in a if a[k].dtype != b[k].dtype
                  or a[k].shape != b[k].shape or _bits(a[k]) != _bits(b[k]))


def _backup(model, directory, **kwargs):
    return keras_ps.IncrementalBackup(model, str(directory), min_table_bytes=0,
                                      **kwargs)


def _published(directory):
    """The entries of the newest chain in `directory`'s manifest."""
    return _backup_chain.read(str(directory))["chains"][-1]


def _stats(table):
    return np.sum([s.read_stats().numpy() for s in table._table.shards], 0)


# LazyAdam's deltas in the background in the suite; Adagrad's in the
# foreground apart (-m slow). Foreground deltas of a dynamic table are
# restored in the suite by the BackupAndRestore test below.
@pytest.mark.parametrize("optimizer", [
    pytest.param(o, marks=pytest.mark.slow) if o == "adagrad" else o
    for o in sorted(OPTIMIZERS)])
def test_full_plus_deltas_restore_a_dynamic_table_bit_for_bit(
        optimizer, strategy, coordinator, tmp_path):
    # With LazyAdam the deltas are written in the background while the
    # next steps train: each is still the table as it was at its save().
    background = optimizer == "lazy_adam"
    model, table = _model(strategy, optimizer)
    step = _step_fn(model)
    chain = _backup(model, tmp_path / "chain", background_deltas=background)
    tracked = chain.tracked_tables
    _train(coordinator, step, seed=1)
    entries = [chain.save()]
    at_full = _state(model, table)
    evicted = [_stats(table)[slots_lib.EVICTED_BY_CAPACITY]]
    for seed in (2, 3):
        _train(coordinator, step, seed)
        entries.append(chain.save())
        evicted.append(_stats(table)[slots_lib.EVICTED_BY_CAPACITY])
    expected = _state(model, table)
    with _backup(model, tmp_path / "full") as writer:
        full = writer.save_full()
    chain.close()  # the delta written in the background published

    assert [e.kind for e in entries] == ["full", "delta", "delta"]
    # A background delta's entry has no size until it is written.
    assert [e.bytes == 0 for e in entries] == [False, background, background]
    assert {f"ids/embeddings_part_{s.index}"
            for s in table._table.shards} <= set(tracked), tracked
    # Rows were evicted between backups and their slots given to other ids.
    assert evicted[0] < evicted[1] < evicted[2], evicted
    reused = [(at_full[f"slot_keys_{s.index}"] != expected[f"slot_keys_{s.index}"])
              & (expected[f"last_seen_{s.index}"] >= 0)
              for s in table._table.shards]
    assert sum(int(r.sum()) for r in reused) > 0
    # A delta holds the slots changed since the previous backup, not all.
    published = _published(tmp_path / "chain")
    assert [e["id"] for e in published] == [e.id for e in entries]
    first, *deltas = published
    assert all(0 < e["table_rows"] < first["table_rows"] for e in deltas)
    assert all(e["bytes"] < first["bytes"] for e in deltas)
    assert full.table_rows == first["table_rows"]

    restored = {}
    for label, directory in (("chain", "chain"), ("full", "full")):
        again, again_table = _model(strategy, optimizer)
        with _backup(again, tmp_path / directory) as backup:
            entry = backup.restore()
        assert entry.id == (entries[-1] if label == "chain" else full).id
        restored[label] = (again, again_table)
        assert _differences(_state(again, again_table), expected) == [], label

    # The rebuilt key maps, counters and LRU cache make the same choices:
    # the original and the restored tables train on identically.
    again, again_table = restored["chain"]
    _train(coordinator, step, seed=4, steps=2)
    _train(coordinator, _step_fn(again), seed=4, steps=2)
    assert _stats(table)[slots_lib.EVICTED_BY_CAPACITY] > evicted[-1]
    assert _differences(_state(again, again_table),
                        _state(model, table)) == []

    # Into another number of shards: refused, naming the fix. (A model
    # built without a strategy: its table has one shard, here.)
    local, _ = _model(tf.distribute.get_strategy(), optimizer)
    with pytest.raises(ValueError, match=r"'ids' has 3 shards in the backup "
                       r"and 1 here.*incremental=False"):
        _backup(local, tmp_path / "chain").restore()


def test_backup_and_restore_writes_and_restores_deltas_of_a_dynamic_table(
        strategy, tmp_path, monkeypatch):
    # Model.fit with string keys (their per-slot keys are strings too).
    from keras_ps.callbacks import backup_and_restore as backup_lib

    monkeypatch.setattr(incremental_backup, "DEFAULT_MIN_TABLE_BYTES", 0)
    x, y = (a.reshape(-1, a.shape[-1]) for a in _batches(7, 4))
    x = np.char.add("id-", x.astype(str)).astype(object)
    model, table = _model(strategy, "lazy_adam", "string")
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path), save_freq=2, incremental=True, delete_checkpoint=False)
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[backup])
    kinds = [e["kind"] for e in _backup_chain.read(
        os.path.join(str(tmp_path), "incremental"))["chains"][-1]]
    assert kinds[0] == "full" and set(kinds[1:]) == {"delta"}, kinds
    expected = _state(model, table)

    again, again_table = _model(strategy, "lazy_adam", "string")
    resumed = keras_ps.callbacks.BackupAndRestore(str(tmp_path),
                                                  incremental=True)
    resumed.set_model(again)
    resumed.on_train_begin()
    assert list(resumed.resume_position()) == [1, 0]
    assert _differences(_state(again, again_table), expected) == []

    # incremental="auto" picks incremental backups from a size on, now
    # counting a dynamic table's rows and their slots.
    monkeypatch.setattr(backup_lib, "AUTO_INCREMENTAL_MIN_BYTES", 0)
    auto = keras_ps.callbacks.BackupAndRestore(str(tmp_path / "auto"))
    auto.set_model(again)
    auto.on_train_begin()
    assert "incremental=True" in auto.describe()


def test_a_layer_saving_its_own_state_without_saying_how_is_refused(
        tmp_path):
    # Rows a layer saves itself mean nothing without the rest of its state:
    # a layer that does not give incremental backups that state is refused,
    # naming the weight and the fix.
    layer = keras.layers.Dense(2, name="own")
    layer.build((None, 3))
    setattr(layer.kernel, _sharded_weights.SAVED_BY_OWNER_ATTR, True)
    with pytest.raises(ValueError, match=r"'own/kernel'.*incremental=False"):
        keras_ps.IncrementalBackup({"layer": layer}, str(tmp_path)).check()
