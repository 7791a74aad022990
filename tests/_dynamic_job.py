"""A coordinator process for DynamicEmbedding checkpoint tests; prints JSON lines.

Usage:
  python tests/_dynamic_job.py save DIR
      on its own LocalCluster with 2 ps: Model.fit a model with a
      DynamicEmbedding (min_count=2, LazyAdam) with keras_ps'
      BackupAndRestore into DIR/backup, then write tf.train.Checkpoint
      DIR/ckpt and save_weights DIR/model.weights.h5; reports lookups of
      trained and unseen ids, the live state and the optimizer slot rows.
      Then, in the same process (a job's start takes as long as its
      work), what `restore DIR 2` reports, and what `sidecar DIR/sidecar`
      does and reports.
  python tests/_dynamic_job.py restore DIR NUM_PS
      on its own LocalCluster with NUM_PS ps: loads each of the three into
      a fresh model and reports the same numbers for each.
  python tests/_dynamic_job.py ps_loss DIR [incremental]
      on its own LocalCluster with 2 ps and 2 workers: Model.fit through
      the loss of ps 0 (SIGKILLed and restarted at once), recovered in the
      same fit from BackupAndRestore (with "incremental": from its full
      backup and deltas); reports each shard's live keys and whether they
      read their own rows.
  python tests/_dynamic_job.py sidecar DIR
      Model.fit on 2 ps with a SidecarCheckpoint per epoch into DIR;
      reports the trained model's evaluation loss on the training data.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_ps
from _kills import KillAndRestartPs
from keras_ps.backups import incremental_backup
from _results import say

CAPACITY, EPOCHS, STEPS = 64, 2, 6


def data():
    rng = np.random.default_rng(4)
    vocab = rng.integers(-2**40, 2**40, size=40, dtype=np.int64)
    # Skewed: some ids are seen once only and never admitted.
    pick = np.minimum(rng.zipf(1.3, size=(384, 4)) - 1, 39)
    x = vocab[pick]
    y = rng.normal(size=(40,)).astype("float32")[pick].mean(1, keepdims=True)
    return vocab, x, y


def build(strategy):
    keras.utils.set_random_seed(2)
    with strategy.scope():
        ids = keras.Input((4,), dtype="int64")
        table = keras_ps.layers.DynamicEmbedding(
            8, capacity=CAPACITY, min_count=2, default_row="trainable",
            filter_size=4096, name="ids")
        x = keras.layers.GlobalAveragePooling1D()(table(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(keras_ps.optimizers.LazyAdam(0.02), "mse")
        model.optimizer.build(model.trainable_variables)
    return model, table


def report(model, table, vocab):
    query = np.concatenate([vocab, [1, 2, 3]]).astype(np.int64)
    lookups = table(tf.constant(query), training=False).numpy()
    state = table.live_state()
    order = np.argsort(state["keys"])
    slots = np.concatenate([state["optimizer_momentum"][order],
                            state["optimizer_velocity"][order]], axis=1)
    summary = {"keys": state["keys"][order].tolist(),
               "hits": state["hits"][order].tolist(),
               "last_seen": state["last_seen"][order].tolist(),
               "step": int(state["step"]),
               "stats": state["stats"].tolist()}
    return {"lookups": lookups.tolist(), "state": summary,
            "slots": slots.tolist(), "num_shards": table.num_shards,
            "live_rows": len(order),
            # Each shard's admission counts, combined: what a key's count is
            # at most after a restore into another number of shards.
            "filter": state["filter"].sum(axis=0).tolist()}


def main(mode, directory, num_ps=2):
    vocab, x, y = data()
    with keras_ps.LocalCluster(num_workers=1, num_ps=int(num_ps)) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        backup_dir = os.path.join(directory, "backup")
        if mode == "save":
            model, table = build(strategy)
            model.fit(x, y, batch_size=32, epochs=EPOCHS, steps_per_epoch=STEPS,
                      verbose=0, callbacks=[keras_ps.callbacks.BackupAndRestore(
                          backup_dir, delete_checkpoint=False)])
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
                os.path.join(directory, "ckpt"))
            model.save_weights(os.path.join(directory, "model.weights.h5"))
            say(**report(model, table, vocab))
            # Into fresh models (their own variables and key maps) on the
            # same 2 ps, as `restore DIR 2` does on a cluster of its own.
            say(**restore(strategy, directory, vocab, x, y))
            train_for_sidecar(strategy, os.path.join(directory, "sidecar"),
                              vocab, x, y)
            return
        say(**restore(strategy, directory, vocab, x, y))


def restore(strategy, directory, vocab, x, y):
    """The saved model loaded into a fresh model on `strategy` from each of
    the checkpoint, the weights file and the backup; the report of each."""
    results = {}
    model, table = build(strategy)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
        os.path.join(directory, "ckpt")).assert_consumed()
    results["checkpoint"] = report(model, table, vocab)
    model, table = build(strategy)
    model.load_weights(os.path.join(directory, "model.weights.h5"))
    results["weights"] = report(model, table, vocab)
    model, table = build(strategy)
    # Resumes at the end of training: restores, trains no step.
    model.fit(x, y, batch_size=32, epochs=EPOCHS, steps_per_epoch=STEPS,
              verbose=0, callbacks=[keras_ps.callbacks.BackupAndRestore(
                  os.path.join(directory, "backup"), delete_checkpoint=False)])
    results["backup"] = report(model, table, vocab)
    return results


def ps_loss(directory, incremental=False):
    """Model.fit through the loss of ps 0 (SIGKILLed, restarted at once):
    the recovery makes its key -> slot map again, the backup fills it, and
    every live key of every shard reads its own row afterwards."""
    if incremental:  # the small table tracked too
        incremental_backup.DEFAULT_MIN_TABLE_BYTES = 0
    vocab, x, y = data()
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model, table = build(strategy)
        killer = KillAndRestartPs(cluster, (1, 3))
        history = model.fit(
            x, y, batch_size=32, epochs=3, steps_per_epoch=STEPS, verbose=0,
            callbacks=[killer, keras_ps.callbacks.BackupAndRestore(
                os.path.join(directory, "backup"), save_freq=2,
                incremental=bool(incremental))])
        shards = []
        for shard in table._table.shards:  # each ps' key -> slot map
            state = shard.export_state()
            read = table(tf.constant(state["keys"], tf.int64),
                         training=False).numpy() if len(state["keys"]) else \
                np.zeros([0, 8], np.float32)
            shards.append({"keys": len(state["keys"]),
                           "reads_own_rows": bool(np.array_equal(
                               read, state["rows"])),
                           "in_vocab": bool(np.isin(state["keys"], vocab).all())})
        say(killed=killer.done, recoveries=history.history["ps_recoveries"],
            loss=history.history["loss"], shards=shards,
            iterations=int(model.optimizer.iterations.numpy()), planned=3 * STEPS)


def sidecar(directory):
    vocab, x, y = data()
    with keras_ps.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        train_for_sidecar(strategy, directory, vocab, x, y)


def train_for_sidecar(strategy, directory, vocab, x, y):
    """Model.fit with a SidecarCheckpoint per epoch; reports the trained
    model's evaluation of `data()` for the evaluator to match."""
    model, table = build(strategy)
    model.fit(x, y, batch_size=32, epochs=EPOCHS, steps_per_epoch=STEPS,
              verbose=0, callbacks=[keras_ps.callbacks.SidecarCheckpoint(
                  directory)])
    result = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    say(loss=float(result["loss"]),
        live_rows=report(model, table, vocab)["live_rows"])


if __name__ == "__main__":
    if sys.argv[1] == "ps_loss":
        ps_loss(*sys.argv[2:])
    elif sys.argv[1] == "sidecar":
        sidecar(sys.argv[2])
    else:
        main(*sys.argv[1:])
