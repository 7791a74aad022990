"""Which files of an incremental backup the ps write past the page cache (on
the shared real cluster, whose ps run with KERAS_PS_DIRECT_IO unset): a
delta's (merged deltas too), written every few hundred steps, go straight to
the disk, so the kernel's copying and writing back does not slow the steps;
a full backup's, which a restore on the same machine reads most of, stay in
the cache."""

import json
import os

import keras
import numpy as np
import pytest

import keras_ps
from keras_ps.backups import _chain
from _page_cache import cached_pages, filesystem
from _polling import wait_until

pytestmark = pytest.mark.timeout(240)

ROWS, DIM, IDS, BATCH = 40_000, 64, 8, 64


def _train(model, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS, size=(2 * BATCH, IDS)).astype("int32")
    y = rng.normal(size=(2 * BATCH, 1)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)


def _entries(directory):
    """{entry id: (its manifest entry, paths of its row files)}: the row
    files, not the bundles of small variables."""
    with open(os.path.join(directory, _chain.MANIFEST_FILE)) as f:
        manifest = json.load(f)
    return {entry["id"]: (entry, [
        os.path.join(directory, entry["folder"], f["file"])
        for f in entry["files"] if f["kind"] != "bundle"])
        for chain in manifest["chains"] for entry in chain}


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
    # A compaction due at the second delta: about 2,000 rows changed of
    # 40,000, so it merges the deltas instead of writing a full backup.
    backup = keras_ps.IncrementalBackup(model, directory, min_table_bytes=0,
                                        max_deltas=1,
                                        background_deltas=background_deltas)
    saved = []
    for seed in range(3):
        _train(model, seed)
        saved.append(backup.save())
        backup.wait()
    full, delta, _ = saved
    wait_until(lambda: not backup.compacting, 120, "the compaction")
    _train(model, 3)
    sealing = backup.save()  # publishes the merged delta with it
    backup.wait()
    assert [e.kind for e in saved + [sealing]] == ["full"] + ["delta"] * 3

    entries = _entries(directory)
    merged = [i for i, (entry, _) in entries.items() if entry.get("fuzzy")]
    assert len(merged) == 1 and entries[merged[0]][0]["kind"] == "delta", \
        entries
    seen = {what: [cached_pages(path) for path in entries[i][1]]
            for what, i in [("full", full.id), ("delta", delta.id),
                            ("merged", merged[0]), ("sealing", sealing.id)]}
    assert all(seen.values()), seen  # each of them has row files
    for what in ("delta", "merged", "sealing"):
        # About 1,000 rows of 64 floats and 2 slots: over a hundred pages.
        assert sum(pages for _, pages in seen[what]) > 100, seen
        assert all(resident == 0 for resident, _ in seen[what]), (what, seen)
    assert all(resident >= pages // 2 for resident, pages in seen["full"]), \
        seen
