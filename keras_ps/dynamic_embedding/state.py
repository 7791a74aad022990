"""Saving a dynamic table: its live keys with their rows, optimizer slot rows
and counters, never its empty capacity.

The same state serves `tf.train.Checkpoint` (through `TableCheckpoint`, a
trackable the layer lists as its checkpoint child) and Keras' weights files
(`save_weights`, `.keras`, keras_ps' BackupAndRestore, through the layer's
`save_own_variables`). Keys are stored without their shard: a restore routes
each key again with the restoring job's shard count, so a table saved on 2 ps
loads into 1, 3 or any other number.
"""

import logging

import numpy as np
import tensorflow as tf

from keras_ps.dynamic_embedding import hashing
from keras_ps.dynamic_embedding import slots as slots_lib

logger = logging.getLogger(__name__)

_PER_KEY = ("keys", "rows", "last_seen", "hits")


def gather(table):
    """The table's state as numpy arrays: per-key arrays concatenated over
    shards, and `step`, `stats` (summed over shards), `filter` (`[shards,
    filter_size]`, or `[0]`), `default_row` when trainable."""
    parts = [shard.export_state() for shard in table.shards]
    state = {name: np.concatenate([p[name] for p in parts])
             for name in parts[0] if name in _PER_KEY or name.startswith("optimizer_")}
    state["step"] = np.asarray(max(int(s.step.numpy()) for s in table.shards),
                               np.int64)
    state["stats"] = np.sum([s.read_stats().numpy() for s in table.shards], axis=0)
    if table.shards[0].filter is not None:
        state["filter"] = np.stack([s.filter.numpy() for s in table.shards])
    else:
        state["filter"] = np.zeros([0], np.int32)
    return state


def assign(table, state):
    """Loads `state` (as `gather` returns) into `table`, routing every key
    to its shard under the table's current shard count. A shard that gets
    more keys than it has slots keeps the most recently seen ones (the rest
    count as evicted by capacity)."""
    keys = state["keys"]
    num_shards = len(table.shards)
    key_dtype = tf.string if table.config.key_dtype == "string" else tf.int64
    where = hashing.route(tf.constant(keys, key_dtype), num_shards).numpy() \
        if len(keys) else np.zeros([0], np.int32)
    dropped = 0
    live = []
    for index, shard in enumerate(table.shards):
        mine = np.flatnonzero(where == index)
        if len(mine) > shard.num_slots:
            newest = np.argsort(-state["last_seen"][mine], kind="stable")
            dropped += len(mine) - shard.num_slots
            mine = np.sort(mine[newest[:shard.num_slots]])
        part = {name: value[mine] for name, value in state.items()
                if name in _PER_KEY or name.startswith("optimizer_")}
        shard.import_state(part, int(state["step"]))
        live.append(len(mine))
    if dropped:
        logger.warning("[chief] %s: %d restored keys did not fit their shard "
                       "and were evicted (least recently seen first)",
                       table.name, dropped)
    totals = np.asarray(state["stats"], np.int64).copy()
    totals[slots_lib.EVICTED_BY_CAPACITY] += dropped
    for index, shard in enumerate(table.shards):
        stats = np.zeros([4], np.int64) if index else totals.copy()
        stats[slots_lib.LIVE] = live[index]
        shard.stats.assign(stats)
    saved_filter = np.asarray(state["filter"])
    if table.shards[0].filter is not None and saved_filter.ndim == 2:
        if saved_filter.shape[0] != num_shards:
            # Keys route elsewhere now: each shard gets every shard's counts
            # (a key's count can only be overestimated, never lost).
            combined = np.minimum(saved_filter.astype(np.int64).sum(0),
                                  np.iinfo(np.int32).max).astype(np.int32)
            saved_filter = np.stack([combined] * num_shards)
        for shard, counts in zip(table.shards, saved_filter):
            shard.filter.assign(counts)


class TableCheckpoint(tf.__internal__.tracking.Trackable):
    """The table's state as one `tf.train.Checkpoint` object."""

    def __init__(self, table):
        self._table = table

    def _serialize_to_tensors(self):
        state = gather(self._table)
        return {name: tf.constant(value) for name, value in state.items()}

    def _restore_from_tensors(self, restored_tensors):
        # TF reads checkpoints inside a tf.function; the keys are re-routed
        # and written shard by shard in Python, so the values come back out
        # through a py_function.
        names = sorted(restored_tensors)

        def load(*values):
            assign(self._table, {name: value.numpy()
                                 for name, value in zip(names, values)})
            return []

        if tf.executing_eagerly():
            return load(*(restored_tensors[n] for n in names)) or tf.no_op()
        return tf.py_function(load, [restored_tensors[n] for n in names], Tout=[])
