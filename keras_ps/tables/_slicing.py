"""Slicing a sharded variable, as TF's ShardedVariable does: `sv[spec]` with
an integer or a slice on axis 0 reads only the shards holding the selected
rows; anything else reads the whole variable. And the check that the row
ids a lookup or an update routes to the shards are in the table.
"""

import numpy as np
import tensorflow as tf


def slice_sharded(sv, spec):
    """`sv[spec]`: integer or slice on axis 0 reads only the shards holding
    the selected rows; anything else (`...`, `tf.newaxis`, a boolean mask)
    reads the whole variable."""
    if isinstance(spec, (bool, np.ndarray)) or tf.is_tensor(spec):
        if (isinstance(spec, bool) or getattr(spec, "dtype", None) in (
                bool, np.bool_, tf.bool)):
            return tf.boolean_mask(sv.read_value(), spec)
        if tf.is_tensor(spec):
            raise TypeError(
                "A ShardedVariable cannot be indexed by a tensor. Received: "
                f"{spec!r:.100}. Use tf.nn.embedding_lookup(sharded, ids) or "
                "sharded.sparse_read(ids), which read only those rows.")
    if not isinstance(spec, (tuple, list)):
        spec = (spec,)
    spec = tuple(spec)
    first, rest = spec[0], spec[1:]
    rows = int(sv.shape[0])
    variables, offsets = sv._parts()
    if isinstance(first, slice):
        start, stop, step = first.indices(rows)
        parts = []
        for i, v in enumerate(variables):
            local = _local_slice(start, stop, step, offsets[i], offsets[i + 1])
            if local is not None:
                parts.append(v[(local,) + rest])
        if step < 0:
            parts.reverse()
        if not parts:
            return variables[0][(slice(0, 0),) + rest]
        return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
    if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
        index = int(first) + rows if first < 0 else int(first)
        if not 0 <= index < rows:
            raise IndexError(
                f"Index out of bounds for axis 0 of ShardedVariable "
                f"{sv.name!r}, which has {rows} rows. Received: "
                f"index={int(first)}. Use an index in [{-rows}, {rows - 1}].")
        shard = int(np.searchsorted(offsets[1:], index, side="right"))
        return variables[shard][(index - offsets[shard],) + rest]
    return sv.read_value()[spec]


def _local_slice(start, stop, step, lo, hi):
    """The part of the global slice `start:stop:step` that falls in rows
    [lo, hi), as a slice of that shard, or None."""
    if step > 0:
        begin = max(start, lo)
        begin = start + -(-(begin - start) // step) * step
        end = min(stop, hi)
        return slice(begin - lo, end - lo, step) if begin < end else None
    top = min(start, hi - 1)
    if top < start:
        top = start - -(-(start - top) // -step) * -step
    bottom = max(stop, lo - 1)
    if top <= bottom:
        return None
    local_stop = bottom - lo
    return slice(top - lo, None if local_stop < 0 else local_stop, step)


def ids_in_range(ids, rows, name):
    """`ids`, once none is `rows` or more. Such an id would reach the last
    shard as a row past its end, and TF's error there would name that
    shard's row and size, not the id and the table's. (Negative ids are
    left as they are: Keras' Embedding takes them from the end.)"""
    # One plain op (tf.debugging.assert_less adds a conditional to every
    # step): the largest id against the table's rows.
    largest = tf.reduce_max(ids)
    check = tf.raw_ops.Assert(
        condition=largest < rows, summarize=1, data=[
            f"An id is out of range for {name!r}, a table of {rows} rows: "
            f"ids must be less than {rows}. Fix: raise the table's rows "
            "(Embedding's input_dim), or map the ids into range (e.g. "
            "keras.layers.Hashing or IntegerLookup). The largest id:",
            largest])
    with tf.control_dependencies([check]):
        return tf.identity(ids)
