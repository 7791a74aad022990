"""Which files of an incremental backup the ps write past the page cache (on
the shared real cluster, whose ps run with KERAS_PS_DIRECT_IO unset): a
delta's, written every few hundred steps, go straight to the disk, so the
kernel's copying and writing back does not slow the steps; a full backup's,
which a restore on the same machine reads most of, stay in the cache."""

import json
import os

import keras
import numpy as np
import pytest

import keras_ps
from keras_ps.backups import _chain
from _page_cache import cached_pages, filesystem

pytestmark = pytest.mark.timeout(240)

ROWS, DIM, IDS, BATCH = 4000, 64, 8, 64


def _train(model, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS, size=(2 * BATCH, IDS)).astype("int32")
    y = rng.normal(size=(2 * BATCH, 1)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)


def _row_files(directory, entry):
    """The paths of the row files (not the bundles of small variables) of
    backup entry `entry`, as the manifest lists them."""
    with open(os.path.join(directory, _chain.MANIFEST_FILE)) as f:
        manifest = json.load(f)
    for chain in manifest["chains"]:
        for listed in chain:
            if listed["id"] == entry.id:
                return [os.path.join(directory, listed["folder"], f["file"])
                        for f in listed["files"] if f["kind"] != "bundle"]
    raise AssertionError(f"backup {entry.id} is not in {manifest}")


@pytest.mark.parametrize("background_deltas", [False, True],
                         ids=["delta", "background_delta"])
def test_a_deltas_row_files_skip_the_page_cache_a_full_backups_do_not(
        cluster, tmp_path, background_deltas):
    if os.environ.get("KERAS_PS_DIRECT_IO") is not None:
        pytest.skip("KERAS_PS_DIRECT_IO is set: the ps do as it says")
    kind = filesystem(tmp_path)
    if kind not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {kind}, which is written buffered")
    strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((IDS,), dtype="int32"),
            keras.layers.Embedding(ROWS, DIM), keras.layers.Flatten(),
            keras.layers.Dense(1)])
        model.compile(keras_ps.optimizers.LazyAdam(0.01), "mse")
    directory = str(tmp_path / "backup")
    backup = keras_ps.IncrementalBackup(model, directory, min_table_bytes=0,
                                        background_deltas=background_deltas)
    _train(model, 0)
    full = backup.save()
    _train(model, 1)
    delta = backup.save()
    backup.wait()
    assert (full.kind, delta.kind) == ("full", "delta")

    seen = {}
    for entry in (full, delta):
        files = _row_files(directory, entry)
        assert files, (entry, sorted(os.listdir(directory)))
        seen[entry.kind] = [cached_pages(f) for f in files]
    # About 1,000 rows of 64 floats and 2 slots: over a hundred pages.
    assert sum(pages for _, pages in seen["delta"]) > 100, seen
    assert all(resident == 0 for resident, _ in seen["delta"]), seen
    assert all(resident >= pages // 2 for resident, pages in seen["full"]), seen
