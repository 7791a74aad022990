"""Keras weights files (`save_weights`, `model.save`, `load_weights`,
`load_model`) of weights on the ps, written and read a block of rows at a
time, on the shared real cluster. The block bound is lowered here
(KERAS_PS_SAVE_CHUNK_BYTES) so a 40-row table is several blocks."""

import json
import os
import subprocess
import sys
import zipfile

import h5py
import numpy as np
import pytest

import keras
import keras_ps
from keras_ps.tables import _sharded_weights
from keras_ps.tables import sharded_variable

pytestmark = pytest.mark.timeout(240)

ROWS, DIM = 40, 4
BLOCK = 64  # bytes: 4 rows of the table, so each shard is 5 blocks
X = np.array([[1, 2, 39], [0, 25, 5]], np.int32)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setenv("KERAS_PS_SAVE_CHUNK_BYTES", str(BLOCK))


def make_model(rows=ROWS):
    model = keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(rows, DIM, name="table"),
        keras.layers.Dense(2, name="head"),
    ])
    model.compile(keras.optimizers.Adam(0.1), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def state(model):
    """Every weight and optimizer variable as a full array (shards joined)."""
    return [np.asarray(v.numpy()) for v in
            _sharded_weights.collapse(model.weights)
            + _sharded_weights.collapse(model.optimizer.variables)]


def randomize(model, seed):
    rng = np.random.default_rng(seed)
    for v in (_sharded_weights.collapse(model.weights)
              + _sharded_weights.collapse(model.optimizer.variables)):
        dtype = np.dtype(v.dtype if isinstance(v.dtype, str) else v.dtype.name)
        shape = tuple(v.shape)
        if dtype.kind == "f":
            v.assign(rng.normal(size=shape).astype(dtype))
        else:
            v.assign(rng.integers(1, 100, size=shape).astype(dtype))


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def saved(two_shards, small_blocks, tmp_path):
    """A 2-shard model with random weights and Adam slots, saved both ways."""
    with two_shards.scope():
        model = make_model()
    randomize(model, 0)
    assert isinstance(model.layers[0].embeddings, keras_ps.ShardedVariable)
    paths = {"h5": str(tmp_path / "w.weights.h5"), "keras": str(tmp_path / "m.keras")}
    model.save_weights(paths["h5"])
    model.save(paths["keras"])
    return model, paths


def test_round_trip_of_weights_and_slots(saved, two_shards):
    model, paths = saved
    want = state(model)
    assert want[0].shape == (ROWS, DIM) and len(want) > 6  # table + Adam slots
    randomize(model, 1)
    model.load_weights(paths["h5"])
    assert_same(state(model), want)
    randomize(model, 2)
    model.load_weights(paths["keras"])  # weights only, from the archive
    assert_same(state(model)[:3], want[:3])
    with two_shards.scope():
        loaded = keras.models.load_model(paths["keras"])
    assert len(loaded.layers[0].embeddings.variables) == 2
    assert_same(state(loaded), want)


def test_files_have_one_full_dataset_per_weight(saved):
    _, paths = saved
    with h5py.File(paths["h5"], "r") as f:
        table = f["layers/embedding/vars/0"]
        assert table.shape == (ROWS, DIM) and table.dtype == np.float32
        shapes = []
        f["optimizer/vars"].visititems(
            lambda name, d: shapes.append(tuple(d.shape)))
    assert shapes.count((ROWS, DIM)) == 2  # Adam's two slots of the table
    with zipfile.ZipFile(paths["keras"]) as z:
        assert "model.weights.h5" in z.namelist()


# Run without keras_ps: plain Keras loads both files into an unsharded model.
_PLAIN = """
import json, sys
import numpy as np
import keras
def make():
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
        keras.layers.Embedding({rows}, {dim}, name="table"),
        keras.layers.Dense(2, name="head")])
    model.compile(keras.optimizers.Adam(0.1), "mse")
    model.optimizer.build(model.trainable_variables)
    return model
rebuilt = make()
rebuilt.load_weights({h5!r})
loaded = keras.models.load_model({keras!r})
assert "keras_ps" not in sys.modules
out = {{}}
for name, model in (("h5", rebuilt), ("keras", loaded)):
    out[name] = [np.asarray(v.numpy()).tolist() for v in
                 model.weights + model.optimizer.variables]
print(json.dumps(out))
"""


def test_plain_keras_loads_the_files(saved):
    model, paths = saved
    want = state(model)
    code = _PLAIN.format(rows=ROWS, dim=DIM, **paths)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("h5", "keras"):
        assert_same([np.asarray(a, dtype=w.dtype) for a, w in
                     zip(got[name], want)], want)


class _Spy:
    """The largest array that crosses h5py, both ways, and every full read
    of a ShardedVariable, while installed."""

    def __init__(self, monkeypatch):
        self.largest = 0
        self.full_reads = []
        self.zip_in_memory = []

        def see(value):
            if isinstance(value, np.ndarray):
                self.largest = max(self.largest, value.nbytes)
            return value

        def spy(owner, name, before=None):
            original = getattr(owner, name)

            def method(obj, *args, **kwargs):
                for arg in (before(args, kwargs) if before else ()):
                    see(arg)
                return see(original(obj, *args, **kwargs))

            monkeypatch.setattr(owner, name, method)

        spy(h5py.Dataset, "__getitem__")
        spy(h5py.Dataset, "__array__")
        spy(h5py.Dataset, "__setitem__", lambda a, k: a[1:])
        spy(h5py.Group, "__setitem__", lambda a, k: a[1:])
        spy(h5py.Group, "create_dataset", lambda a, k: [k.get("data")])
        read_value = sharded_variable.ShardedVariable.read_value

        def full_read(sv):
            self.full_reads.append(sv.name)
            return read_value(sv)

        monkeypatch.setattr(sharded_variable.ShardedVariable, "read_value",
                            full_read)
        writestr = zipfile.ZipFile.writestr

        def zip_writestr(zf, name, data, *args, **kwargs):
            self.zip_in_memory.append(getattr(name, "filename", name))
            return writestr(zf, name, data, *args, **kwargs)

        monkeypatch.setattr(zipfile.ZipFile, "writestr", zip_writestr)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one_ps"])
def test_coordinator_holds_at_most_one_block(
        sharded, two_shards, strategy, small_blocks, monkeypatch, tmp_path):
    with (two_shards if sharded else strategy).scope():
        model = make_model()
    randomize(model, 3)
    want = state(model)
    table_bytes = ROWS * DIM * 4
    assert table_bytes >= 8 * BLOCK
    spy = _Spy(monkeypatch)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    model.save(str(tmp_path / "m.keras"))
    randomize(model, 4)
    model.load_weights(str(tmp_path / "w.weights.h5"))
    with (two_shards if sharded else strategy).scope():
        loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    assert 0 < spy.largest <= BLOCK
    assert spy.full_reads == []
    assert "model.weights.h5" not in spy.zip_in_memory
    monkeypatch.undo()
    assert_same(state(model), want)
    assert_same(state(loaded), want)


@pytest.mark.parametrize("block", [BLOCK, 2**26], ids=["by_rows", "whole"])
def test_wrong_shape_file_gets_keras_message(two_shards, monkeypatch, tmp_path,
                                            block):
    monkeypatch.setenv("KERAS_PS_SAVE_CHUNK_BYTES", str(block))
    with two_shards.scope():
        small = make_model()
        big = make_model(rows=ROWS + 2)
    path = str(tmp_path / "w.weights.h5")
    small.save_weights(path)
    with pytest.raises(ValueError, match="must match") as info:
        big.load_weights(path)
    message = str(info.value)
    assert f"variable.shape=({ROWS + 2}, {DIM})" in message
    assert f"value.shape=({ROWS}, {DIM})" in message
