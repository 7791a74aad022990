"""keras_ps.layers.DynamicEmbedding on the shared real cluster (3 ps, 2
workers): ids get rows when trained, admission, eviction by age and by
capacity with exact counts, optimizer state of reused rows, bad input,
Model.fit and custom loops with int64 and string keys, the export to plain
Keras loaded where keras_ps cannot be imported, and (in separate
processes, tests/_dynamic_job.py) a checkpoint restored into 1, 2 and 3 ps.
The save job also restores into its own 2 ps and trains the sidecar
evaluator's model: a job's start takes as long as its work.
Incremental backups of the table: test_dynamic_incremental.py."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from _paths import TESTS
from _results import last_report
from _results import reports
from _results import run_child
from keras_ps.dynamic_embedding import hashing
from keras_ps.dynamic_embedding import policies
from keras_ps.dynamic_embedding import slots as slots_lib

pytestmark = pytest.mark.timeout(300)

JOB = os.path.join(TESTS, "_dynamic_job.py")


def _keys_on_shard(shard, num_shards, count, start=1000, dtype=tf.int64):
    """`count` int64 keys that route to `shard`."""
    found, key = [], start
    while len(found) < count:
        candidates = np.arange(key, key + 256, dtype=np.int64)
        owners = hashing.route(tf.constant(candidates, dtype), num_shards).numpy()
        found.extend(candidates[owners == shard].tolist())
        key += 256
    return found[:count]


def _layer(strategy, **kwargs):
    with strategy.scope():
        layer = keras_ps.layers.DynamicEmbedding(4, **kwargs)
        layer.build()
    return layer


def _train_fn(layer, optimizer):
    """One training step of the layer alone: loss = sum(rows * 1)."""

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    return step


def _stats(layer):
    totals = np.sum([s.read_stats().numpy() for s in layer._table.shards], axis=0)
    return {"admitted": int(totals[slots_lib.ADMITTED]),
            "by_age": int(totals[slots_lib.EVICTED_BY_AGE]),
            "by_capacity": int(totals[slots_lib.EVICTED_BY_CAPACITY]),
            "live": int(totals[slots_lib.LIVE])}


def _run_steps(coordinator, step, batches):
    """Each batch as one scheduled step, one after the other."""
    for ids in batches:
        coordinator.schedule(step, args=(tf.constant(ids, tf.int64),))
        coordinator.join()


# -- training: new ids get rows, and train ------------------------------------------
def _id_model(strategy, key_dtype="int64", default_row="zeros", **kwargs):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        ids = keras.Input((4,), dtype="string" if key_dtype == "string" else "int64")
        table = keras_ps.layers.DynamicEmbedding(
            8, capacity=kwargs.pop("capacity", 300), key_dtype=key_dtype,
            default_row=default_row, name="ids", **kwargs)
        x = keras.layers.GlobalAveragePooling1D()(table(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(x))
    return model, table


def _id_data(n=512, vocabulary=200, seed=0, as_strings=False):
    rng = np.random.default_rng(seed)
    vocab = rng.integers(-2**62, 2**62, size=vocabulary, dtype=np.int64)
    target = rng.normal(size=vocabulary).astype("float32")
    pick = rng.integers(0, vocabulary, size=(n, 4))
    x = vocab[pick]
    y = target[pick].mean(1, keepdims=True)
    if as_strings:
        x = np.char.add("user-", x.astype(str)).astype(object)
    return x, y


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_unseen_ids_get_rows_and_train_custom_loop(key_dtype, strategy,
                                                   coordinator):
    strings = key_dtype == "string"
    model, table = _id_model(strategy, key_dtype=key_dtype)
    with strategy.scope():
        optimizer = keras_ps.optimizers.LazyAdam(0.05)
        optimizer.build(model.trainable_variables)
    x, y = _id_data(as_strings=strings)
    if strings:
        x = x.astype(str)

    @tf.function
    def step(ids, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids, training=True) - targets))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = []
    for epoch in range(12):
        results = [coordinator.schedule(step, args=(x[i:i + 64], y[i:i + 64]))
                   for i in range(0, len(x), 64)]
        coordinator.join()
        losses.append(np.mean([r.fetch() for r in results]))
    assert losses[-1] < 0.25 * losses[0], losses
    distinct = len(np.unique(x))
    assert _stats(table) == {"admitted": distinct, "by_age": 0,
                             "by_capacity": 0, "live": distinct}
    # Evaluation and prediction never insert: unseen ids read the default row.
    unseen = np.array([["7", "8", "9", "10"]]) if strings else \
        np.array([[7, 8, 9, 10]], np.int64)
    rows = table(tf.constant(unseen), training=False).numpy()
    np.testing.assert_array_equal(rows, np.zeros((1, 4, 8), np.float32))
    model.predict(tf.constant(unseen), verbose=0)
    assert _stats(table)["live"] == distinct


@pytest.mark.parametrize("unroll", ["0", "2"], ids=["loop", "unroll_knob"])
def test_fit_with_string_keys(strategy, monkeypatch, unroll):
    # With KERAS_PS_UNROLL_STEPS, the steps of a function are written out,
    # but not with this layer: written out, its steps hang on the shards'
    # locks (the "unroll_knob" case hung until the timeout before).
    monkeypatch.setenv("KERAS_PS_UNROLL_STEPS", unroll)
    monkeypatch.setenv("KERAS_PS_UNROLL_AFTER", "0")
    model, table = _id_model(strategy, key_dtype="string",
                             default_row="trainable")
    model.compile(keras.optimizers.Adagrad(0.5), "mse", steps_per_execution=2)
    x, y = _id_data(as_strings=True)
    history = model.fit(x, y, batch_size=32, epochs=6, steps_per_epoch=16,
                        verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    distinct = len(np.unique(x.astype(str)))
    # The table's numbers are in every epoch's logs (and so in TensorBoard).
    assert history.history["ids_live_rows"][-1] == distinct
    assert history.history["ids_admissions"][-1] == distinct
    assert history.history["ids_evictions"][-1] == 0
    keys = {k.decode() for k in table.live_state()["keys"]}
    assert keys == set(x.astype(str).ravel())


# -- admission ---------------------------------------------------------------------
def test_admission_min_count(strategy, coordinator):
    layer = _layer(strategy, capacity=30, min_count=3)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    step = _train_fn(layer, optimizer)
    # 10: three times over three steps; 13: three times in one step;
    # 11: twice; 12: once; -5: twice.
    _run_steps(coordinator, step, [[10, 11, 12, -5], [10, 11, 13, 13],
                                   [10, 13, -5, 20]])
    state = layer.live_state()
    assert sorted(state["keys"].tolist()) == [10, 13]
    assert _stats(layer)["admitted"] == 2
    # Not admitted: the default row (zeros), and never trained.
    rows = layer(tf.constant([11, 12, -5, 20], tf.int64), training=False).numpy()
    np.testing.assert_array_equal(rows, np.zeros((4, 4), np.float32))


def _one_off_admission_share(strategy, coordinator, steps=150, late=50):
    """Streams `steps` batches of 64 ids each seen once (min_count=2, two
    counters per id); the share of the last `late` batches' ids admitted
    anyway."""
    layer = _layer(strategy, capacity=64 * steps, min_count=2,
                   filter_size=4096, filter_hashes=2)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    step = _train_fn(layer, optimizer)
    ids = np.arange(64 * steps, dtype=np.int64).reshape(steps, 64) * 7919 + 3
    for batch in ids[:steps - late]:
        coordinator.schedule(step, args=(tf.constant(batch),))
    coordinator.join()
    before = _stats(layer)["admitted"]
    for batch in ids[steps - late:]:
        coordinator.schedule(step, args=(tf.constant(batch),))
    coordinator.join()
    share = (_stats(layer)["admitted"] - before) / (64 * late)
    # An id seen twice in a row is still admitted.
    _run_steps(coordinator, step, [[-1] * 64, [-1] * 64])
    assert -1 in layer.live_state()["keys"].tolist()
    return share


# By age through fit: -m slow (its exact counts by age are in the suite as
# test_eviction_by_age_and_capacity_exact).
@pytest.mark.parametrize("evict", [
    "capacity", pytest.param("age", marks=pytest.mark.slow)])
def test_admission_and_eviction_counts_with_fit(evict, strategy):
    # Through Model.fit, batches on both workers in any order: each record
    # holds one id twice (admitted at once with min_count=2) and two ids
    # seen once in the whole run (never admitted). No id comes back, so the
    # counts do not depend on the order. All 120 ids seen twice are
    # admitted; by capacity, the table keeps 30 and evicts 90; by age
    # (max_age=2, the table never full), the rows of the last 3 of the 30
    # steps (4 ids each) stay and 108 are evicted.
    n, batch = 120, 4
    rng = np.random.default_rng(5)
    ids = rng.choice(2**40, size=3 * n, replace=False).astype(np.int64)
    twice, once = ids[:n], ids[n:].reshape(n, 2)
    x = np.concatenate([twice[:, None], twice[:, None], once], axis=1)
    y = np.zeros([n, 1], np.float32)
    if evict == "capacity":
        model, table = _id_model(strategy, capacity=30, min_count=2)
        live, by_age = 30, 0
    else:
        model, table = _id_model(strategy, capacity=3 * n, min_count=2,
                                 max_age=2)
        live, by_age = 3 * batch, n - 3 * batch
    model.compile(keras.optimizers.Adagrad(0.1), "mse", steps_per_execution=2)
    history = model.fit(keras_ps.ShardedInput((x, y), batch_size=batch,
                                              shuffle=False),
                        epochs=1, verbose=0)
    assert history.history["ids_admissions"][-1] == n, history.history
    keys = set(table.live_state()["keys"].tolist())  # sweeps, as a step would
    assert _stats(table) == {"admitted": n, "by_age": by_age,
                             "by_capacity": n - live - by_age, "live": live}
    assert len(keys) == live and keys <= set(twice.tolist())


@pytest.mark.slow  # two streams through the filter: minutes on a loaded machine
def test_admission_filter_does_not_saturate_on_a_stream(
        strategy, coordinator, monkeypatch):
    # A stream of ids each seen once must not get rows with min_count=2.
    # Counters that only grow admit more and more of them as the filter
    # fills; halved whenever their load would let more than 5% in, they
    # stay selective.
    decaying = _one_off_admission_share(strategy, coordinator)
    monkeypatch.setattr(policies, "FALSE_ADMISSIONS", 1.0)  # never halves
    growing = _one_off_admission_share(strategy, coordinator)
    assert decaying < 0.1, (decaying, growing)
    assert growing > 0.3, (decaying, growing)


# -- eviction ----------------------------------------------------------------------
def test_eviction_by_age_and_capacity_exact(strategy, coordinator):
    num_shards = len(strategy.extended.parameter_devices)
    # 2 rows per shard; every key below lives on shard 0.
    layer = _layer(strategy, capacity=2 * num_shards, max_age=2)
    with strategy.scope():
        optimizer = keras_ps.optimizers.LazyAdam(0.01)
        optimizer.build(layer.trainable_variables)
    step = _train_fn(layer, optimizer)
    a, b, c, d, e, f = _keys_on_shard(0, num_shards, 6)
    _run_steps(coordinator, step, [[a, b], [c], [c]])
    # Step 2: shard 0 full, c took a's row (least recently seen, first slot).
    assert sorted(layer.live_state()["keys"].tolist()) == sorted([b, c])
    assert _stats(layer) == {"admitted": 3, "by_age": 0, "by_capacity": 1,
                             "live": 2}
    # Step 4: b, last seen at step 1, is older than max_age=2 and goes.
    _run_steps(coordinator, step, [[c]])
    assert layer.live_state()["keys"].tolist() == [c]
    assert _stats(layer) == {"admitted": 3, "by_age": 1, "by_capacity": 1,
                             "live": 1}
    # Step 5: three new keys, one free row plus c's (not seen at step 5):
    # d and e get rows, f reads the default row.
    _run_steps(coordinator, step, [[d, e, f]])
    state = layer.live_state()
    assert sorted(state["keys"].tolist()) == sorted([d, e])
    assert _stats(layer) == {"admitted": 5, "by_age": 1, "by_capacity": 2,
                             "live": 2}
    # The reused rows started from fresh optimizer state: after one update
    # from zero moments, |m| / sqrt(v) = (1 - beta_1) / sqrt(1 - beta_2).
    m, v = state["optimizer_momentum"], state["optimizer_velocity"]
    np.testing.assert_allclose(np.abs(m) / np.sqrt(v),
                               0.1 / np.sqrt(0.001), rtol=1e-3)
    np.testing.assert_array_equal(state["last_seen"], [5, 5])


def test_full_shard_without_eviction_raises_and_changes_nothing(
        strategy, coordinator):
    num_shards = len(strategy.extended.parameter_devices)
    layer = _layer(strategy, capacity=num_shards, evict_lru=False)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    step = _train_fn(layer, optimizer)
    a, b, c = _keys_on_shard(0, num_shards, 3)
    _run_steps(coordinator, step, [[a]])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="is full.*evict_lru=True"):
        _run_steps(coordinator, step, [[b, c]])
    assert layer.live_state()["keys"].tolist() == [a]
    assert _stats(layer)["live"] == 1


def test_bad_input(strategy):
    num_shards = len(strategy.extended.parameter_devices)
    with pytest.raises(keras_ps.KerasPSError,
                       match=rf"Received: capacity=2 with {num_shards} ps"):
        _layer(strategy, capacity=2)
    layer = _layer(strategy, capacity=30)
    with pytest.raises(TypeError, match="Received: inputs.dtype=string"):
        layer(tf.constant(["a"]), training=False)
    strings = _layer(strategy, capacity=30, key_dtype="string")
    with pytest.raises(keras_ps.KerasPSError, match="Received: inputs.dtype=int64"):
        strings(tf.constant([1], tf.int64), training=False)
    with pytest.raises(ValueError, match="Received: key_dtype='float32'"):
        keras_ps.layers.DynamicEmbedding(4, capacity=10, key_dtype="float32")


# -- export to plain Keras ------------------------------------------------------------
_PLAIN_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path = [p for p in sys.path
                if not os.path.isdir(os.path.join(p or ".", "keras_ps"))]
    class _NoKerasPS:
        def find_spec(self, name, path=None, target=None):
            if name == "keras_ps" or name.startswith("keras_ps."):
                raise ImportError("keras_ps is not installed here")
    sys.meta_path.insert(0, _NoKerasPS())
    try:
        import keras_ps
        raise SystemExit("keras_ps could be imported")
    except ImportError:
        pass
    import json
    import numpy as np
    import keras
    import tensorflow as tf
    out = {}
    for name in ("ints", "strings"):
        model = keras.saving.load_model(sys.argv[1] + f"/{name}.keras")
        x = np.load(sys.argv[1] + f"/{name}_x.npy")
        out[name] = model.predict(tf.constant(x), verbose=0).tolist()
    out["modules"] = sorted(m for m in sys.modules if m.startswith("keras_ps"))
    print("RESULT " + json.dumps(out))
""")


def test_export_loads_and_predicts_without_keras_ps(strategy, tmp_path):
    want = {}
    for name, as_strings in (("ints", False), ("strings", True)):
        model, _ = _id_model(strategy, key_dtype="string" if as_strings
                             else "int64", default_row="trainable")
        model.compile(keras_ps.optimizers.LazyAdam(0.02), "mse")
        x, y = _id_data(as_strings=as_strings)
        model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=8, verbose=0)
        # Trained ids, and ids never seen (the default row).
        unseen, _ = _id_data(n=4, seed=9, as_strings=as_strings)
        query = np.concatenate([x[:12], unseen])
        if as_strings:  # Keras' predict takes no numpy object arrays
            query = query.astype(str)
        want[name] = model.predict(tf.constant(query), verbose=0)
        plain = keras_ps.layers.export_plain_model(model)
        np.testing.assert_allclose(plain.predict(tf.constant(query), verbose=0),
                                   want[name],
                                   rtol=1e-5, atol=1e-6)
        plain.save(str(tmp_path / f"{name}.keras"))
        np.save(tmp_path / f"{name}_x.npy", query)
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=240,
                          cwd=str(tmp_path),
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = last_report(done.stdout)
    assert got["modules"] == []
    for name in want:
        np.testing.assert_allclose(np.array(got[name]), want[name],
                                   rtol=1e-5, atol=1e-6)


# -- checkpoints: restore into 1, 2 and 3 ps ------------------------------------------
def _job(*args, timeout=280, every_report=False):
    code, output = run_child([sys.executable, JOB, *map(str, args)], timeout,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                      PYTHONUNBUFFERED="1"))
    assert code == 0, output[-6000:]
    if every_report:
        return reports(output)
    return last_report(output)


@pytest.fixture(scope="module")
def save_job(tmp_path_factory):
    """The save job (2 ps): its directory, and its reports of the saved
    model, of the restore into 2 ps, and of the model trained with a
    SidecarCheckpoint per epoch into DIR/sidecar."""
    directory = tmp_path_factory.mktemp("dynamic")
    found = _job("save", directory, timeout=400, every_report=True)
    assert len(found) == 3, found
    return directory, found


# Saved from 2 ps; into 1 ps apart (-m slow): into 3 ps already restores
# every saved shard into shards of other key ranges.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_ps", [
    pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_checkpoint_restores_into_1_2_and_3_ps(num_ps, save_job):
    directory, (saved, into_2_ps, _) = save_job
    assert saved["live_rows"] > 0
    # Into 2 ps: done by the save job, on its cluster (fresh models).
    restored = into_2_ps if num_ps == 2 else _job("restore", directory,
                                                  num_ps)
    for how in ("checkpoint", "weights", "backup"):
        got = restored[how]
        assert got["num_shards"] == num_ps
        np.testing.assert_allclose(got["lookups"], saved["lookups"],
                                   rtol=1e-6, err_msg=f"{how}, {num_ps} ps")
        assert got["state"] == saved["state"], (how, num_ps)
        np.testing.assert_allclose(got["slots"], saved["slots"], rtol=1e-6)
        # Admission counts are kept: per shard into 2 ps; into 1 or 3 ps
        # every shard starts from all the counts (a key's count may be
        # overestimated after such a restore, never lost).
        copies = 3 if num_ps == 3 else 1
        assert got["filter"] == [copies * c for c in saved["filter"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backups", [  # incremental: run apart (-m slow)
    "full", pytest.param("incremental", marks=pytest.mark.slow)])
def test_a_lost_ps_gets_its_key_map_back_in_the_same_fit(backups, tmp_path):
    # ps 0 is SIGKILLed mid-fit and restarted at once: the recovery makes its
    # key -> slot map and lock again (they are not variables), the backup
    # (a weights file, or a full backup and deltas) refills them, training
    # goes on to the planned steps, and every live key of both shards reads
    # its own row afterwards.
    result = _job("ps_loss", tmp_path,
                  *(["incremental"] if backups == "incremental" else []))
    assert result["killed"] and sum(result["recoveries"]) == 1, result
    assert result["planned"] <= result["iterations"] <= result["planned"] + 4, \
        result
    for shard in result["shards"]:
        assert shard["keys"] > 0 and shard["in_vocab"], result
        assert shard["reads_own_rows"], result


@pytest.mark.timeout(600)
def test_sidecar_evaluator_evaluates_a_dynamic_table(save_job):
    # Trained on 2 ps with a SidecarCheckpoint per epoch (by the save job,
    # after its own model); the evaluator, a plain process-local model (one
    # shard), restores the newest checkpoint (its keys routed again) and
    # evaluates as the trained model did.
    import _dynamic_job as job

    directory, (_, _, trained) = save_job
    model, table = job.build(tf.distribute.get_strategy())
    _, x, y = job.data()
    sidecar = keras_ps.SidecarEvaluator(model, (x, y),
                                        str(directory / "sidecar"),
                                        timeout=60, poll_interval=0.05)
    made = sidecar.start()
    assert made and made[-1].checkpoint.final
    assert table.num_shards == 1
    assert made[-1].metrics["loss"] == pytest.approx(trained["loss"],
                                                      rel=1e-5)
    assert len(table.live_state()["keys"]) == trained["live_rows"] > 0


def test_lost_shards_recovery_is_refused_for_a_dynamic_table(strategy,
                                                              tmp_path):
    # Its key maps are not variables: restoring only a lost ps' variables
    # would leave them out of step with the rows. Refused before training,
    # naming the value and the fix; no step is trained.
    model, _ = _id_model(strategy)
    model.compile(keras.optimizers.Adagrad(0.5), "mse")
    x, y = _id_data()
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=2, verbose=0)
    before = int(model.optimizer.iterations.numpy())
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path / "b"), recover_ps="lost_shards")
    with pytest.raises(ValueError, match=r"recover_ps='lost_shards'.*"
                                         r"DynamicEmbedding.*recover_ps=True"):
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=2,
                  verbose=0, callbacks=[backup])
    assert int(model.optimizer.iterations.numpy()) == before


def test_recover_ps_takes_true_false_or_lost_shards():
    with pytest.raises(ValueError, match=r"recover_ps='all'"):
        keras_ps.callbacks.BackupAndRestore("/tmp/unused", recover_ps="all")
