"""Incremental backups of models alike share their traced functions (on the
shared real cluster): a second backup object, of a second model of the same
shapes, writes and restores with the functions the first one traced, and
the retracing that starting to track a table's rows sets off leaves them."""

import numpy as np
import pytest

import keras_ps
from keras_ps.backups import _apply
from keras_ps.backups import _io
from _backups import table_model

pytestmark = pytest.mark.timeout(240)

ROWS, DIM, IDS, BATCH = 40, 4, 3, 8


def _model(cluster):
    return table_model(cluster.resolver, ROWS, DIM, IDS)


def _train(model, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS // 2, size=(2 * BATCH, IDS)).astype("int32")
    y = rng.normal(size=(2 * BATCH, 1)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)


def _values(model):
    return [np.array(v.numpy()) for v in
            model.weights + model.optimizer.variables]


def _backed_up_and_restored(cluster, directory, seed):
    """A model trained, saved (full, then a delta), and restored into a new
    model by a new backup object: (saved values, restored values)."""
    model = _model(cluster)
    with keras_ps.IncrementalBackup(model, directory,
                                    min_table_bytes=0) as backup:
        _train(model, seed)
        assert backup.save().kind == "full"
        _train(model, seed + 1)
        assert backup.save().kind == "delta"
    restored = _model(cluster)
    with keras_ps.IncrementalBackup(restored, directory,
                                    min_table_bytes=0) as backup:
        backup.restore()
    return _values(model), _values(restored)


def _traces():
    return {key: function.experimental_get_tracing_count()
            for functions in (_io._write_functions, _apply._apply_functions)
            for key, function in functions.items()}


def test_a_second_models_backup_and_restore_trace_nothing(cluster, strategy,
                                                          tmp_path):
    saved, restored = _backed_up_and_restored(cluster, tmp_path / "a", 0)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
    first = _traces()
    assert first and all(count >= 1 for count in first.values()), first

    # New models and backup objects: each tracks its table, which makes
    # every other traced function of the process trace again.
    saved, restored = _backed_up_and_restored(cluster, tmp_path / "b", 5)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
    assert _traces() == first

