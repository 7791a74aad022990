"""Dirty-row tracking (keras_ps.tables._dirty_rows) on the shared real cluster:
each row-wise update of a tracked table marks exactly the rows it touched,
on the table's ps; an update that is not row-wise marks every row; an
untracked table's update has not one op more."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ps  # noqa: F401  (installs the hooks)
from keras_ps.tables import _dirty_rows
from keras_ps.tables import _rowwise

pytestmark = pytest.mark.timeout(240)

ROWS, DIM = 12, 3
IDS = [3, 3, 7, 10, 7]


def ps_variable(strategy, value=None, like=None):
    """A [ROWS, DIM] variable on a ps (on `like`'s ps: an optimizer slot)."""
    value = np.full((ROWS, DIM), 0.5) if value is None else value
    with strategy.scope():
        if like is None:
            return tf.Variable(value, dtype=tf.float32)
        with strategy.extended.colocate_vars_with(like):
            return tf.Variable(value, dtype=tf.float32)


def track(strategy, table):
    """A tracker for `table`, made as keras_ps.IncrementalBackup makes them."""
    with strategy.scope(), strategy.extended.colocate_vars_with(table):
        generation = _dirty_rows.GENERATIONS.variable_for(
            (table.device, id(strategy)),
            lambda current: tf.Variable(current, dtype=tf.int32))
        dirty = tf.Variable(tf.zeros([int(table.shape[0])], tf.int32))
    tracker = _dirty_rows.RowTracker(dirty, generation)
    _dirty_rows.track(table, tracker)
    return tracker


def gradient(ids=IDS):
    return tf.IndexedSlices(tf.ones([len(ids), DIM]),
                            tf.constant(ids, tf.int64),
                            tf.constant([ROWS, DIM], tf.int64))


def marked(tracker):
    marks = tracker.dirty.numpy()
    return sorted(np.flatnonzero(marks).tolist()), set(marks[marks > 0])


def updates(strategy):
    """name -> (table, update(gradient)) of each keras_ps.tables._rowwise function."""
    out = {}
    table = ps_variable(strategy)
    out["sgd"] = (table, lambda g, t=table: _rowwise.sgd(t, g, 0.1))
    table = ps_variable(strategy)
    acc = ps_variable(strategy, like=table)
    out["adagrad"] = (table, lambda g, t=table, a=acc: _rowwise.adagrad(
        t, a, g, 0.1, 1e-7))
    table = ps_variable(strategy)
    acc = ps_variable(strategy, like=table)
    lin = ps_variable(strategy, np.zeros((ROWS, DIM)), like=table)
    out["ftrl"] = (table, lambda g, t=table, a=acc, b=lin: _rowwise.ftrl(
        t, a, b, g, 0.1, 0.0, 0.0, 0.0, -0.5))
    table = ps_variable(strategy)
    m, v = ps_variable(strategy, like=table), ps_variable(strategy, like=table)
    with strategy.scope(), strategy.extended.colocate_vars_with(table):
        last = tf.Variable(tf.zeros([ROWS], tf.int64))
    out["lazy_adam"] = (table, lambda g, t=table, a=m, b=v, s=last:
                        _rowwise.lazy_adam(t, a, b, s, g, 1, 0.01, 0.9, 0.999,
                                           1e-7))
    return out


@pytest.mark.parametrize("name", ["sgd", "adagrad", "ftrl", "lazy_adam"])
def test_each_rowwise_update_marks_exactly_its_rows(name, strategy):
    table, update = updates(strategy)[name]
    tracker = track(strategy, table)
    assert tracker.dirty.device == table.device
    before = table.numpy()
    with tf.device(table.device):
        tf.function(update)(gradient())
    rows, generations = marked(tracker)
    assert rows == sorted(set(IDS))
    assert generations == {_dirty_rows.GENERATIONS.current}
    changed = np.flatnonzero(np.any(table.numpy() != before, axis=1))
    assert changed.tolist() == rows


@pytest.mark.parametrize("name", ["sgd", "adagrad", "ftrl", "lazy_adam"])
def test_an_untracked_update_traces_no_extra_op(name, strategy, monkeypatch):
    table, update = updates(strategy)[name]
    spec = tf.IndexedSlicesSpec([ROWS, DIM], tf.float32, tf.int64)

    def ops():
        graph = tf.function(update).get_concrete_function(spec).graph
        return sorted(op.type for op in graph.get_operations())

    off = ops()
    monkeypatch.setattr(_dirty_rows, "mark_rows", lambda *a, **k: None)
    assert ops() == off  # the same graph as with no tracking code at all
    monkeypatch.undo()
    track(strategy, table)
    assert len(ops()) > len(off)


def test_generations_advance_on_every_ps_and_marks_follow(strategy):
    table, update = updates(strategy)["sgd"]
    tracker = track(strategy, table)
    with tf.device(table.device):
        tf.function(update)(gradient([1]))
    previous = _dirty_rows.GENERATIONS.advance()
    assert _dirty_rows.GENERATIONS.agree()
    with tf.device(table.device):
        tf.function(update)(gradient([2]))
    marks = tracker.dirty.numpy()
    assert marks[1] <= previous < marks[2] == _dirty_rows.GENERATIONS.current
    # A ps given its variables back as zeros no longer agrees.
    tracker.generation.assign(0)
    assert not _dirty_rows.GENERATIONS.agree()
    _dirty_rows.GENERATIONS.advance()
    assert _dirty_rows.GENERATIONS.agree()


def test_agree_is_not_fooled_by_an_advance_under_way():
    # A delta's thread checks agree() while the chief may start a new
    # generation (a compaction starting): every ps still holds the
    # generation, so it must never answer False. Real variables, a real
    # race: thousands of checks against advances in another thread.
    generations = _dirty_rows.Generations()
    for key in ("ps0", "ps1", "ps2"):
        generations.variable_for(key, lambda current: tf.Variable(current))
    stop, answers = threading.Event(), []

    def check():
        while not stop.is_set():
            answers.append(generations.agree())

    checker = threading.Thread(target=check)
    checker.start()
    # At least 300 advances and 300 checks, however the two threads share
    # the GIL on a loaded machine (300 advances once left only 100 checks).
    advances, deadline = 0, time.monotonic() + 120
    try:
        while (advances < 300 or len(answers) < 300) and \
                time.monotonic() < deadline:
            generations.advance()
            advances += 1
    finally:
        stop.set()
        checker.join(60)
    assert len(answers) >= 300, (advances, len(answers))
    assert all(answers), answers.count(False)


def _model(strategy, optimizer):
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((2,), dtype="int32"),
            keras.layers.Embedding(ROWS, DIM, name="table"),
            keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer, "mse")
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Adagrad(0.1),
    lambda: keras_ps.optimizers.LazyAdam(0.01),
    lambda: keras.optimizers.SGD(0.1)], ids=["adagrad", "lazy_adam", "sgd"])
def test_keras_optimizers_mark_the_looked_up_rows_of_each_shard(
        make_optimizer, two_shards, coordinator):
    model = _model(two_shards, make_optimizer())
    shards = model.get_layer("table").weights
    assert len(shards) == 2
    trackers = [track(two_shards, shard.value) for shard in shards]

    @tf.function
    def step(ids, dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(ids)))
        grads = tape.gradient(loss, model.trainable_variables)
        if dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        model.optimizer.apply(grads, model.trainable_variables)

    coordinator.schedule(step, args=(tf.constant([[1, 8], [1, 9]]), False))
    coordinator.join()
    assert [marked(t)[0] for t in trackers] == [[1], [2, 3]]  # 8, 9 in shard 1
    # A dense gradient takes Keras' own update: every row is marked.
    coordinator.schedule(step, args=(tf.constant([[0, 0]]), True))
    coordinator.join()
    assert [marked(t)[0] for t in trackers] == [list(range(6))] * 2
