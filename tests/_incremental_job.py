"""A coordinator process for the incremental backup tests, on its own
LocalCluster (2 ps, 2 workers); prints RESULT lines (tests/_results.py).

Usage:
  python tests/_incremental_job.py equivalence DIR
      for each optimizer and (saving, restoring) partitioning: full backup,
      training, deltas; restores the chain into a model sharded otherwise
      and compares it with the model and with its Keras weights file at the
      same step.
  python tests/_incremental_job.py faults DIR
      a truncated, altered or missing delta file; a crash (an exception)
      between writing a delta's files and publishing it; compaction.
  python tests/_incremental_job.py crash_write DIR
      full backup and delta, then a process crash (os._exit) after the next
      delta's files are written, before its manifest is published.
  python tests/_incremental_job.py crash_restore DIR
      restores what crash_write left into a model with 3 shards.
  python tests/_incremental_job.py callback DIR
      Model.fit with BackupAndRestore(incremental=True), then its restore
      into a model with 3 shards; incremental="auto" on a small model.
  python tests/_incremental_job.py ps_loss DIR
      Model.fit with BackupAndRestore(incremental=True) through the loss of
      a ps (SIGKILLed and restarted on its address).
  python tests/_incremental_job.py ps_loss_background DIR
      the same with background_deltas=True, the ps killed while a delta is
      being written, which goes on writing only after the lost ps was given
      its variables back (as zeros).
  python tests/_incremental_job.py zeroed_generation DIR
      a background delta during whose write a ps' generation is set to 0
      (as a recovery leaves it).
  python tests/_incremental_job.py background_compaction DIR
      compaction while training goes on: a step trained before each block
      of the full backup is written, then the delta that seals it; the new
      chain restores bit for bit into 3 shards. Then a compaction dropped
      by a restore.
  python tests/_incremental_job.py shared DIR CRASHED_DIR
      zeroed_generation, equivalence, faults, crash_restore (of
      CRASHED_DIR), callback and background_compaction in one process, on
      one cluster.
"""

import glob
import json
import os
import sys
import threading
import time

import keras
import numpy as np
import tensorflow as tf

import keras_ps
from _kills import KillAndRestartPs
from keras_ps import _constants
from _results import say
from keras_ps.backups import _chain as _backup_chain
from keras_ps.tables import _blockwise_init
from keras_ps.tables import _dirty_rows
from keras_ps.tables import _sharded_weights
from keras_ps.backups import _io as _backup_io
from keras_ps.backups import _job_lock
from keras_ps.backups import incremental_backup
from keras_ps.strategy import _ps_state
from keras_ps.errors import BackupCorruptError
from keras_ps.partitioners import FixedShardsPartitioner

ROWS, DIM, IDS, BATCH = 60, 4, 3, 8
TOUCHED = 24  # ids are drawn below this: rows 24..59 are never updated

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "lazy_adam": lambda: keras_ps.optimizers.LazyAdam(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
}


def build(strategy, optimizer):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((IDS,), dtype="int32"),
            keras.layers.Embedding(ROWS, DIM, name="table"),
            keras.layers.Flatten(), keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(1)])
        model.compile(OPTIMIZERS[optimizer](), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


def train(model, seed, steps=3):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, TOUCHED, size=(steps * BATCH, IDS)).astype("int32")
    y = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps,
              verbose=0)


def values(model):
    """Every model and optimizer variable, whole, in Keras' saving order."""
    return [np.array(v.numpy()) for v in
            _sharded_weights.collapse(model.weights)
            + _sharded_weights.collapse(model.optimizer.variables)]


def mismatches(a, b):
    """Indices of the variables that differ (shape or any bit)."""
    if len(a) != len(b):
        return ["count"]
    return [i for i, (x, y) in enumerate(zip(a, b))
            if x.shape != y.shape or x.dtype != y.dtype
            or x.tobytes() != y.tobytes()]


def strategies(cluster):
    return {shards: keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=(
            FixedShardsPartitioner(shards) if shards > 1 else None))
        for shards in (1, 2, 3)}


# The lock this job holds on each of its backup directories. Its backup
# objects share it (given as `lock`, as BackupAndRestore gives its own), so
# that a model restores from a directory while the object that wrote it is
# still open.
_LOCKS = {}


def backup(model, directory, **kwargs):
    if directory not in _LOCKS:
        os.makedirs(directory, exist_ok=True)
        _LOCKS[directory] = _job_lock.JobLock(directory, "IncrementalBackup")
        _LOCKS[directory].acquire()
    return keras_ps.IncrementalBackup(model, directory, min_table_bytes=0,
                                      lock=_LOCKS[directory], **kwargs)


# -- equivalence ---------------------------------------------------------------------
CASES = [(opt, 2, 3) for opt in OPTIMIZERS] + \
        [(opt, 3, 2) for opt in OPTIMIZERS] + [("lazy_adam", 2, 1)]
# Deltas written in the background (background_deltas=True) while the
# model trains on: the chain restores the model as it was at each save.
BACKGROUND_CASES = [("lazy_adam", 2, 3), ("adagrad", 3, 2)]


def equivalence(by_shards, directory):
    """Every case, or those named in KERAS_PS_TEST_CASES (comma-separated)."""
    only = os.environ.get("KERAS_PS_TEST_CASES")
    for optimizer, saved_in, restored_in, background in (
            [c + (False,) for c in CASES]
            + [c + (True,) for c in BACKGROUND_CASES]):
        case = (f"{optimizer}{'_background' if background else ''}-"
                f"{saved_in}-to-{restored_in}")
        if only and case not in only.split(","):
            continue
        folder = os.path.join(directory, case)
        model = build(by_shards[saved_in], optimizer)
        train(model, 0)
        writer = backup(model, folder, background_deltas=background)
        entries = [writer.save()]
        for seed in (1, 2):
            train(model, seed)
            entries.append(writer.save())
        expected = values(model)
        weights_file = os.path.join(directory, f"{case}.weights.h5")
        model.save_weights(weights_file)
        if background:
            train(model, 3)  # while the last delta is being written
            writer.wait()

        restored = build(by_shards[restored_in], optimizer)
        entry = backup(restored, folder).restore()
        from_keras = build(by_shards[restored_in], optimizer)
        from_keras.load_weights(weights_file)
        say(case=case, optimizer=optimizer,
            kinds=[e.kind for e in entries],
            table_rows=[e.table_rows for e in entries],
            embedding_rows=[table_rows(folder, e.id) for e in entries],
            bytes=[e.bytes for e in entries],
            tracked=writer.tracked_tables,
            restored_id=entry.id, last_id=entries[-1].id,
            vs_model=mismatches(values(restored), expected),
            vs_keras_file=mismatches(values(restored), values(from_keras)),
            shards=[len(restored.get_layer("table").weights),
                    len(model.get_layer("table").weights)])


def table_rows(directory, entry_id):
    """Rows of the embedding table (key "model/0") in backup `entry_id`
    (a full backup two chains share counted once)."""
    entry = next(entry for chain in _backup_chain.read(directory)["chains"]
                 for entry in chain if entry["id"] == entry_id)
    return sum(record["rows"] for record in entry["files"]
               if record["keys"][0] == "model/0")


# -- faults ----------------------------------------------------------------------------------
def _table_file(directory, entry_id):
    """A row file of the table in backup `entry_id` (rows > 0)."""
    manifest = _backup_chain.read(directory)
    for chain in manifest["chains"]:
        for entry in chain:
            if entry["id"] != entry_id:
                continue
            for record in entry["files"]:
                if record["keys"][0] == "model/0" and record["rows"] > 0:
                    return os.path.join(directory, entry["folder"],
                                        record["file"])
    raise AssertionError(f"no table file in backup {entry_id}")


# The fault tests' chain grows by deltas only (no compaction by bytes).
NO_COMPACTION = dict(max_delta_bytes=10**9)


def _restore_outcome(strategy, directory, expected_by_id, fallback=True):
    model = build(strategy, "lazy_adam")
    writer = backup(model, directory, **NO_COMPACTION)
    try:
        entry = writer.restore(fallback=fallback)
    except BackupCorruptError as error:
        return {"error": str(error)}, model, writer
    return {"id": entry.id, "problems": list(entry.problems),
            "equal": not mismatches(values(model), expected_by_id[entry.id])
            }, model, writer


def faults(by_shards, directory):
    folder = os.path.join(directory, "chain")
    model = build(by_shards[2], "lazy_adam")
    writer = backup(model, folder, **NO_COMPACTION)
    expected = {}
    for seed in range(3):  # full, delta, delta
        train(model, seed)
        entry = writer.save()
        expected[entry.id] = values(model)
    ids = sorted(expected)
    damaged = _table_file(folder, ids[-1])
    original = open(damaged, "rb").read()
    outcomes = {}
    for how in ("truncated", "altered", "missing"):
        if how == "truncated":
            open(damaged, "wb").write(original[:len(original) // 2])
        elif how == "altered":
            flipped = bytearray(original)
            flipped[len(flipped) // 2] ^= 0xFF
            open(damaged, "wb").write(bytes(flipped))
        else:
            os.remove(damaged)
        outcomes[how] = {
            "strict": _restore_outcome(by_shards[3], folder, expected,
                                       fallback=False)[0],
            "fallback": _restore_outcome(by_shards[3], folder, expected)[0]}
    open(damaged, "wb").write(original)
    intact = _restore_outcome(by_shards[3], folder, expected)[0]
    say(ids=ids, damaged=damaged, outcomes=outcomes, intact=intact)

    # Training on from a fallback: the next delta follows the restored
    # backup; the damaged one is dropped with its files.
    os.remove(damaged)
    _, resumed, resumed_writer = _restore_outcome(by_shards[2], folder,
                                                  expected)
    train(resumed, 7)
    entry = resumed_writer.save()
    resumed_writer.wait()  # the dropped folders deleted (in a thread)
    expected[entry.id] = values(resumed)
    chain = [e["id"] for e in _backup_chain.read(folder)["chains"][-1]]
    after_fallback = _restore_outcome(by_shards[3], folder, expected)[0]
    say(after_fallback=after_fallback, chain=chain, new_id=entry.id,
        new_kind=entry.kind,
        damaged_folder_left=os.path.exists(os.path.dirname(damaged)))

    # A crash between writing a delta's files and publishing it.
    train(resumed, 8)
    publish = _backup_chain.publish

    def crash(*args, **kwargs):
        raise RuntimeError("crashed before publishing")

    _backup_chain.publish = crash
    try:
        resumed_writer.save()
    except RuntimeError:
        pass
    finally:
        _backup_chain.publish = publish
    orphans = sorted(os.path.basename(p) for p in glob.glob(
        os.path.join(folder, "*-0*")))
    after_crash = _restore_outcome(by_shards[3], folder, expected)[0]
    entry = resumed_writer.save()  # the crashed delta's rows are in it
    expected[entry.id] = values(resumed)
    after_crash_next = _restore_outcome(by_shards[1], folder, expected)[0]
    say(after_crash=after_crash, after_crash_next=after_crash_next,
        next_kind=entry.kind, folders_after_crash=orphans)

    # Compaction: a full backup after max_deltas deltas, or once the
    # deltas add up to max_delta_bytes; keep_chains chains kept.
    kinds = {}
    for label, options in (("deltas", dict(max_deltas=2)),
                           ("bytes", dict(max_delta_bytes=1))):
        compacted = build(by_shards[2], "lazy_adam")
        compacting = backup(compacted, os.path.join(directory, label),
                            keep_chains=2, background_compaction=False,
                            **options)
        kinds[label] = []
        for seed in range(7):
            train(compacted, seed, steps=1)
            kinds[label].append(compacting.save().kind)
        kinds[label + "_chains"] = [
            [e["kind"] for e in chain] for chain in
            _backup_chain.read(os.path.join(directory, label))["chains"]]
    say(compaction=kinds)


# -- a real crash ------------------------------------------------------------------------
def crash_write(directory):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        model = build(strategies(cluster)[2], "lazy_adam")
        writer = backup(model, directory)
        for seed in range(2):
            train(model, seed)
            entry = writer.save()
        np.savez(os.path.join(directory, "..", "expected.npz"), *values(model))
        say(published=entry.id)
        train(model, 5)

        def crash(*args, **kwargs):
            os._exit(17)  # every file written, the manifest not replaced

        _backup_chain.publish = crash
        writer.save()


def crash_restore(by_shards, directory):
    folders = sorted(os.listdir(directory))
    saved = np.load(os.path.join(directory, "..", "expected.npz"))
    expected = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    model = build(by_shards[3], "lazy_adam")
    writer = backup(model, directory)
    entry = writer.restore()
    equal = not mismatches(values(model), expected)
    train(model, 6)
    writer.save()
    listed = [e["id"] for e in _backup_chain.read(directory)["chains"][-1]]
    say(folders_before=folders, restored=entry.id, equal=equal,
        folders_after=sorted(os.listdir(directory)), listed=listed)


# -- BackupAndRestore --------------------------------------------------------------------
def _fit_data(steps):
    rng = np.random.default_rng(11)
    x = rng.integers(0, TOUCHED, size=(steps * BATCH, IDS)).astype("int32")
    y = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    return x, y


def _states(backup_dir):
    with open(os.path.join(backup_dir, "backup_state.json")) as f:
        return json.load(f)


class _StateLog(keras.callbacks.Callback):
    """The kind of each backup (read after BackupAndRestore's own hook)."""

    def __init__(self, backup_dir):
        super().__init__()
        self.backup_dir, self.kinds, self.last = backup_dir, [], None

    def on_train_batch_end(self, batch, logs=None):
        self._log()

    def on_epoch_end(self, epoch, logs=None):
        self._log()

    def _log(self):
        if not os.path.exists(os.path.join(self.backup_dir,
                                           "backup_state.json")):
            return  # no backup yet
        state = _states(self.backup_dir)
        if state["serial"] != self.last:
            self.last = state["serial"]
            self.kinds.append(state.get("kind", "weights"))


def callback(by_shards, directory):
    from keras_ps.callbacks import backup_and_restore as backup_lib

    backup_dir = os.path.join(directory, "fit")
    model = build(by_shards[2], "lazy_adam")
    log = _StateLog(backup_dir)
    incremental_backup.DEFAULT_MIN_TABLE_BYTES = 0  # the small table too
    cb = keras_ps.callbacks.BackupAndRestore(
        backup_dir, save_freq=3, incremental=True, max_deltas=3,
        max_delta_bytes=10**9, delete_checkpoint=False)
    x, y = _fit_data(9)
    model.fit(x, y, batch_size=BATCH, epochs=2, steps_per_epoch=9,
              callbacks=[cb, log], verbose=0)
    expected = values(model)
    restored = build(by_shards[3], "lazy_adam")
    again = keras_ps.callbacks.BackupAndRestore(backup_dir,
                                                incremental=True)
    again.set_model(restored)
    again.on_train_begin()
    say(kinds=log.kinds, resume=list(again.resume_position()),
        tracked=cb._incremental.tracked_tables,
        equal=not mismatches(values(restored), expected),
        state=_states(backup_dir))

    modes = {}
    for label, minimum in (("small", None), ("over", 0)):
        if minimum is not None:
            backup_lib.AUTO_INCREMENTAL_MIN_BYTES = minimum
        auto_dir = os.path.join(directory, f"auto-{label}")
        auto = keras_ps.callbacks.BackupAndRestore(auto_dir, save_freq=3)
        model = build(by_shards[2], "adagrad")
        model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=6,
                  callbacks=[auto], verbose=0)
        modes[label] = auto.describe()
    say(auto=modes)


def ps_loss(directory):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        model = build(strategies(cluster)[2], "lazy_adam")
        incremental_backup.DEFAULT_MIN_TABLE_BYTES = 0  # the small table too
        # The recovery leaves every variable unwritten until the restore
        # (as it does a table of 256 MiB and more).
        _blockwise_init.BLOCKWISE_MIN_BYTES = 0
        killer = KillAndRestartPs(cluster, (1, 7))
        cb = keras_ps.callbacks.BackupAndRestore(
            os.path.join(directory, "fit"), save_freq=3, incremental=True,
            max_delta_bytes=10**9, delete_checkpoint=False)
        x, y = _fit_data(12)
        history = model.fit(x, y, batch_size=BATCH, epochs=3,
                            steps_per_epoch=12, callbacks=[killer, cb],
                            verbose=0)
        say(killed=killer.done, planned=36,
            iterations=int(model.optimizer.iterations.numpy()),
            recoveries=history.history.get("ps_recoveries"),
            rolled_back=history.history.get("steps_rolled_back"),
            kind=_states(os.path.join(directory, "fit")).get("kind"),
            finite=all(bool(np.isfinite(np.asarray(w)).all())
                       for w in model.get_weights()),
            loss=history.history["loss"])


class _KillWhileWriting(keras.callbacks.Callback):
    """Holds the first background delta's write until the lost ps was given
    its variables back, and kills that ps while the write waits."""

    def __init__(self, cluster):
        super().__init__()
        self.cluster, self.done = cluster, False
        self.writing, self.recreated = threading.Event(), threading.Event()
        snapshot_write = _backup_io.Snapshot.write
        recreate = _ps_state.recreate

        def held_write(snapshot, prefix):
            if not self.done:
                self.writing.set()
                assert self.recreated.wait(300), "no ps recovery came"
            return snapshot_write(snapshot, prefix)

        def recreate_and_tell(variables, **kwargs):
            handles = recreate(variables, **kwargs)
            self.recreated.set()
            return handles

        _backup_io.Snapshot.write = held_write
        _ps_state.recreate = recreate_and_tell

    def on_train_batch_end(self, batch, logs=None):
        if self.writing.is_set() and not self.done:
            self.done = True
            self.cluster.kill("ps", 0)
            self.cluster.restart("ps", 0)
            print("KILLED AND RESTARTED ps 0 while a delta was written",
                  flush=True)


def _zeroed_generation(strategy, directory):
    """A background delta during whose write a ps' generation turns 0 (as
    a recovery leaves it): not published; the chain ends at the full."""
    model = build(strategy, "lazy_adam")
    writer = backup(model, directory, background_deltas=True)
    train(model, 0)
    full = writer.save()
    train(model, 1)
    snapshot_write = _backup_io.Snapshot.write
    writing, zeroed = threading.Event(), threading.Event()

    def write_after_a_zeroed_generation(snapshot, prefix):
        writing.set()
        assert zeroed.wait(120)
        return snapshot_write(snapshot, prefix)

    _backup_io.Snapshot.write = write_after_a_zeroed_generation
    try:
        writer.save()
        assert writing.wait(120)
        on_ps0 = [g for g in _dirty_rows.GENERATIONS._live()
                  if g.device.endswith("/job:ps/replica:0/task:0/device:CPU:0")]
        with tf.device(on_ps0[0].device):
            on_ps0[0].assign(0)
        zeroed.set()
        try:
            writer.wait()
            error = None
        except RuntimeError as raised:
            error = str(raised)
    finally:
        _backup_io.Snapshot.write = snapshot_write
    return {"error": error, "latest": writer.latest().id, "full": full.id}


def zeroed_generation(by_shards, directory):
    say(zeroed=_zeroed_generation(by_shards[2], directory))


def ps_loss_background(directory):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        model = build(strategies(cluster)[2], "lazy_adam")
        incremental_backup.DEFAULT_MIN_TABLE_BYTES = 0  # the small table too
        cb = keras_ps.callbacks.BackupAndRestore(
            os.path.join(directory, "fit"), save_freq=3, incremental=True,
            max_delta_bytes=10**9, delete_checkpoint=False,
            background_deltas=True)
        killer = _KillWhileWriting(cluster)
        x, y = _fit_data(12)
        history = model.fit(x, y, batch_size=BATCH, epochs=3,
                            steps_per_epoch=12, callbacks=[cb, killer],
                            verbose=0)
        say(killed=killer.done, planned=36,
            iterations=int(model.optimizer.iterations.numpy()),
            recoveries=history.history.get("ps_recoveries"),
            rolled_back=history.history.get("steps_rolled_back"),
            kind=_states(os.path.join(directory, "fit")).get("kind"))


# -- compaction while training goes on ------------------------------------------
def _chain_kinds(directory):
    return [[(e["kind"], bool(e.get("fuzzy"))) for e in chain]
            for chain in _backup_chain.read(directory)["chains"]]


def background_compaction(by_shards, directory):
    # Blocks of 4 rows: 8 blocks per 30-row shard.
    os.environ[_constants.SAVE_CHUNK_BYTES_ENV_VAR] = "256"
    # Compaction writes a full backup (merge_below=0), or merges the
    # deltas. With min_table_bytes=0 the dense layers' weights are tracked
    # tables too, every row changed each step: 52% of the tables' bytes
    # change (only rows 0..23 of the embedding's 60), below 0.9.
    for case, optimizer, background, merge_below in (
            ("lazy_adam", "lazy_adam", False, 0),
            ("adagrad", "adagrad", True, 0),
            ("lazy_adam_merged", "lazy_adam", True, 0.9)):
        folder = os.path.join(directory, case)
        model = build(by_shards[2], optimizer)
        writer = backup(model, folder, max_deltas=2,
                        background_deltas=background,
                        merge_below=merge_below)
        expected_by_id = {}
        step_ran, released = threading.Event(), threading.Event()
        blocks = []

        def before_block(device, group, block):
            # Each block waits for a step trained since the one before.
            if released.is_set():
                return
            if not step_ran.wait(300):
                raise RuntimeError("no step was trained for 300 s")
            step_ran.clear()
            blocks.append((device, group, block))

        writer._before_compaction_block = before_block

        def save():
            saved.append(writer.save())
            expected_by_id[saved[-1].id] = values(model)

        train(model, 0)
        saved = []
        save()  # full
        for seed in (1, 2, 3):  # deltas; the third starts a compaction
            train(model, seed)
            save()
        compacting_after_save = writer.compacting
        steps = 0
        while writer.compacting and steps < 400:
            train(model, 100 + steps, steps=1)
            steps += 1
            step_ran.set()
            if steps == 2:  # the old chain goes on meanwhile
                save()
        writer.wait()
        chains_before_seal = _chain_kinds(folder)
        train(model, 4)
        save()  # the seal: a new chain
        train(model, 5)
        save()  # a delta after it
        writer.wait()
        expected = values(model)
        restored = build(by_shards[3], optimizer)
        entry = backup(restored, folder).restore()
        chains = _backup_chain.read(folder)["chains"]
        report = dict(
            case=case, optimizer=optimizer, background=background,
            compacting_after_save=compacting_after_save, steps=steps,
            blocks=len(blocks),
            block_devices=len({d for d, _, _ in blocks}),
            kinds=[e.kind for e in saved],
            deltas=[e.deltas for e in saved],
            chains_before_seal=chains_before_seal,
            chains=_chain_kinds(folder), restored_id=entry.id,
            last_id=saved[-1].id, seal_rows=table_rows(folder,
                                                       saved[-2].id),
            vs_model=mismatches(values(restored), expected),
            chain_ids=[[e["id"] for e in chain] for chain in chains],
            new_chain_rows=[table_rows(folder, e["id"])
                            for e in chains[-1]])
        if merge_below:
            # The merged delta damaged: the newest state of the chain it
            # merged restores.
            merged = chains[-1][1]["id"]
            damaged = _table_file(folder, merged)
            original = open(damaged, "rb").read()
            open(damaged, "wb").write(original[:len(original) // 2])
            fallback = build(by_shards[3], optimizer)
            entry = backup(fallback, folder).restore()
            open(damaged, "wb").write(original)
            report.update(fallback_id=entry.id, damaged=damaged,
                          fallback_problems=list(entry.problems),
                          fallback_equal=not mismatches(
                              values(fallback), expected_by_id[entry.id]))
            # The merged chain counts 3 deltas: the save after the seal
            # started merging again. Dropping one is the same as above.
            report.update(merging_again=writer.compacting)
            released.set()
            step_ran.set()
            report.update(stop_merging=writer.stop_compaction(timeout=300))
            say(**report)
            continue

        # A compaction dropped by a restore: its thread stops before
        # its next block and its folder goes at the next publish.
        train(model, 6)
        step_ran.clear()
        started = writer.save()  # 2 deltas: a compaction starts
        writer.wait()
        expected = values(model)
        compaction = writer._compaction
        dropped_folder = os.path.join(folder, compaction.folder)
        train(model, 7)  # after the backup restored next
        entry = writer.restore()
        step_ran.set()
        compaction.thread.join(300)
        restored_equal = not mismatches(values(model), expected)
        train(model, 8)
        after = writer.save()  # a delta, and a compaction starts again
        writer.wait()
        again = writer._compaction
        released.set()
        step_ran.set()
        stopped = writer.stop_compaction(timeout=300)
        report.update(
            dropped_started=started.id, dropped_restored=entry.id,
            dropped_thread_alive=compaction.thread.is_alive(),
            dropped_error=type(compaction.error).__name__,
            dropped_equal=restored_equal, after_kind=after.kind,
            dropped_folder_left=os.path.exists(dropped_folder),
            started_again=again is not None, stop_compaction=stopped,
            stopped_error=type(again.error).__name__)
        say(**report)


def on_own_cluster(part):
    """`part` as a job of its own: on a LocalCluster it starts."""
    def job(directory):
        with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
            part(strategies(cluster), directory)
    return job


def shared(directory, crashed):
    """The parts that need no process of their own, one after the other in
    one process on one cluster (a job's start, TensorFlow's import and the
    cluster's, takes about as long as a part); each part's reports follow a
    `PART name` line. crash_restore restores `crashed`, the directory
    crash_write left, if it left its expected values.

    In this order: the zeroed generation first, when its strategy's are the
    only generations on ps 0 (it zeroes the first one there); the
    callback's smaller defaults and the compaction's block size (an
    environment variable) last, when no part follows that they change."""
    def restore_crashed(by_shards, _):
        if os.path.exists(os.path.join(crashed, "..", "expected.npz")):
            crash_restore(by_shards, crashed)

    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        by_shards = strategies(cluster)
        for name, part in [("zeroed_generation", zeroed_generation),
                           ("equivalence", equivalence), ("faults", faults),
                           ("crash_restore", restore_crashed),
                           ("callback", callback),
                           ("background_compaction", background_compaction)]:
            print(f"PART {name}", flush=True)
            os.makedirs(os.path.join(directory, name), exist_ok=True)
            part(by_shards, os.path.join(directory, name))


if __name__ == "__main__":
    started = time.monotonic()
    if sys.argv[1] == "shared":
        shared(sys.argv[2], sys.argv[3])
    else:
        {"equivalence": on_own_cluster(equivalence),
         "faults": on_own_cluster(faults), "crash_write": crash_write,
         "crash_restore": on_own_cluster(crash_restore),
         "callback": on_own_cluster(callback), "ps_loss": ps_loss,
         "ps_loss_background": ps_loss_background,
         "zeroed_generation": on_own_cluster(zeroed_generation),
         "background_compaction": on_own_cluster(background_compaction),
         }[sys.argv[1]](sys.argv[2])
    print(f"done in {time.monotonic() - started:.1f}s", flush=True)
