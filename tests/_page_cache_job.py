"""Which files of an incremental backup are left in the page cache: a full
backup, two deltas, a compaction that merges them and the delta that seals
it, each file's cached pages. Run in the test process on the shared cluster,
or as a coordinator process on its own LocalCluster (1 ps, 1 worker), whose
tasks inherit this process' KERAS_PS_DIRECT_IO:

  python tests/_page_cache_job.py DIR

prints one RESULT line per value of background_deltas (tests/_results.py).
"""

import json
import os
import sys

import numpy as np

import keras_ps
from keras_ps.backups import _chain
from _backups import table_model
from _page_cache import cached_pages
from _polling import wait_until
from _results import say

ROWS, DIM, IDS, BATCH = 40_000, 64, 8, 64


def _train(model, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS, size=(2 * BATCH, IDS)).astype("int32")
    y = rng.normal(size=(2 * BATCH, 1)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)


def _entries_row_files(directory):
    """{entry id: (its manifest entry, paths of its row files)}: the row
    files, not the bundles of small variables."""
    with open(os.path.join(directory, _chain.MANIFEST_FILE)) as f:
        manifest = json.load(f)
    return {entry["id"]: (entry, [
        os.path.join(directory, entry["folder"], f["file"])
        for f in entry["files"] if f["kind"] != "bundle"])
        for chain in manifest["chains"] for entry in chain}


def backups_cached_pages(resolver, directory, background_deltas):
    """Backs up a trained model into `directory` (full, delta, a delta that
    starts a compaction, the delta that seals it); returns
    {"full" | "delta" | "merged" | "sealing": [(cached, pages) of each of
    its row files]}."""
    model = table_model(resolver, ROWS, DIM, IDS)
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

    entries = _entries_row_files(directory)
    merged = [i for i, (entry, _) in entries.items() if entry.get("fuzzy")]
    assert len(merged) == 1 and entries[merged[0]][0]["kind"] == "delta", \
        entries
    return {what: [cached_pages(path) for path in entries[i][1]]
            for what, i in [("full", full.id), ("delta", delta.id),
                            ("merged", merged[0]), ("sealing", sealing.id)]}


if __name__ == "__main__":
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        for background in (False, True):
            say(background_deltas=background, seen=backups_cached_pages(
                cluster.resolver, os.path.join(sys.argv[1], str(background)),
                background))
