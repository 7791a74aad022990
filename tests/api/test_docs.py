"""The python code blocks of README.md and docs/*.md run as written.

Every block parses. Each is listed in BLOCKS (by its file and first line) with
how it is exercised: `"fixture"` blocks run here against the session
cluster's strategy (`strategy`, `dataset_fn`, `keras`, `keras_ps`, `tf`
given); the others are fragments of a longer program and name the tutorial
or test that runs that program, which must use each public call the block
shows. A new block fails until it is listed.
"""

import ast
import glob
import os
import re

import pytest

from _paths import REPO

pytestmark = pytest.mark.timeout(240)

# (file, first line of the block) -> "fixture", or (covering file, calls).
BLOCKS = {
    ("README.md", "import keras, keras_ps, tensorflow as tf"): (
        "tutorials/model_fit.py",
        ["LocalCluster", "ParameterServerStrategy", "FixedShardsPartitioner",
         "DatasetCreator", "BackupAndRestore", "SidecarCheckpoint",
         "TensorBoard", "evaluate"]),
    ("docs/custom_loops.md", "coordinator = keras_ps.ClusterCoordinator(strategy)"):
        "fixture",
    ("docs/data_shards.md", "def read_fn(filename):                     # runs on the worker given the file"): (
        "tutorials/model_fit.py",
        ["ShardedInput", "read_fn", "TFRecordDataset", "BackupAndRestore"]),
    ("docs/incremental_backups.md", "model.fit(..., callbacks=[keras_ps.callbacks.BackupAndRestore("): (
        "tests/_incremental_job.py", ["BackupAndRestore", "save_freq"]),
    ("docs/incremental_backups.md", 'with keras_ps.IncrementalBackup(model, "/shared/backup") as backup:  # model.optimizer built'): (
        "tests/_incremental_job.py",
        ["IncrementalBackup", ".restore(", ".save("]),
    ("docs/dynamic_embedding.md", "import keras"): (
        "tests/_dynamic_job.py",
        ["DynamicEmbedding", "capacity", "min_count", "LazyAdam"]),
    ("docs/ps_recovery.md", "backup = keras_ps.callbacks.BackupAndRestore("): (
        "tests/_fit_job.py", ["BackupAndRestore", "recover_ps", "lost_shards"]),
    ("docs/ps_recovery.md", "checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)"): (
        "tests/_fault_job.py",
        ["recover_parameter_servers", "ParameterServerUnavailableError",
         "tf.train.Checkpoint"]),
    ("docs/ps_recovery.md", "from keras_ps.cluster.ps_notices import PsNoticeWatch"): (
        "tests/_notice_job.py",
        ["PsNoticeWatch(strategy)", "watch.start()", "watch.noticed()",
         "coordinator.join()", "watch.release(noticed)",
         "coordinator.lost_parameter_servers()",
         "coordinator.recover_parameter_servers()", "checkpoint.read(",
         "watch.stop()"]),
}


def _blocks():
    found = {}
    for path in ["README.md"] + sorted(
            os.path.relpath(p, REPO)
            for p in glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        for code in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S):
            found[(path, code.split("\n", 1)[0])] = code
    return found


def test_every_block_parses_and_is_listed():
    blocks = _blocks()
    for key, code in blocks.items():
        ast.parse(code, filename=key[0])
    assert sorted(set(blocks) - set(BLOCKS)) == []
    assert sorted(set(BLOCKS) - set(blocks)) == []


@pytest.mark.parametrize("key", [k for k, v in BLOCKS.items() if v != "fixture"],
                         ids=lambda k: k[0])
def test_fragment_is_run_by_its_program(key):
    covering, calls = BLOCKS[key]
    code = _blocks()[key]
    with open(os.path.join(REPO, covering)) as f:
        program = f.read()
    for call in calls:
        assert call in code, (key, call)
        assert call in program, (covering, call)


def test_fixture_blocks_run(strategy):
    import keras
    import tensorflow as tf

    import keras_ps

    def dataset_fn(context):
        return tf.data.Dataset.from_tensors(
            (tf.zeros([4, 2]), tf.zeros([4, 1]))).repeat()

    blocks = _blocks()
    for key, how in BLOCKS.items():
        if how != "fixture":
            continue
        namespace = {"keras": keras, "keras_ps": keras_ps, "tf": tf,
                     "strategy": strategy, "dataset_fn": dataset_fn}
        exec(compile(blocks[key], key[0], "exec"), namespace)  # noqa: S102
