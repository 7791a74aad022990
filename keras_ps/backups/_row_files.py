"""Row files: rows of variables written and read on the device holding them.

An incremental backup (keras_ps.backups.incremental_backup) stores each group of
variables that share rows (a table shard and its optimizer slots, or one
variable alone) as a series of row files, written by the ps that holds the
group: the rows are gathered, serialized and written there, so none of them
passes through the coordinator. Restoring reads each file on the ps that
holds the rows now, which may be split differently: a file holds global row
ids.

A row file is the concatenation of `tf.io.serialize_tensor` of the int64
global row ids, then of the rows of each variable of the group, in order
(shape `[len(ids)] + variable.shape[1:]`); a bundle (small variables written
whole) is the same without the ids. The manifest records each part's size,
and the file's length and farmhash fingerprint, checked before it is parsed.
Written with keras_ps' C++ writer (`KerasPsWriteTensors`, one copy of the
bytes; past the page cache if asked, see `write_rows`) where the ps has
loaded it, else with TF's ops (three copies to write): the same bytes either
way. A restore applies a file with keras_ps' C++ op (`KerasPsApplyRowFile`,
keras_ps.backups._apply) where the ps has loaded it, else with `read_file`,
`part` and `assign_rows` here.
"""

import math

import tensorflow as tf

# Fields of each file's record, as `write_rows` returns them (one row each).
RECORD_FIELDS = ("bytes", "fingerprint", "rows", "min", "max")


def rows_per_block(variables, block_bytes):
    """Rows of a group of `variables` written per file (about `block_bytes`,
    at least 1), counting the 8-byte id of each row."""
    row_bytes = 8 + sum(
        math.prod(v.shape[1:]) * v.dtype.size if v.shape.rank else v.dtype.size
        for v in variables)
    return max(1, block_bytes // row_bytes)


def fingerprint(content):
    """The farmhash fingerprint of a scalar string, as an int64 scalar."""
    return tf.bitcast(tf.fingerprint(tf.reshape(content, [1]))[0], tf.int64)


def _rows(variable, local_ids):
    return tf.raw_ops.ResourceGather(resource=variable.handle,
                                     indices=local_ids, dtype=variable.dtype)


def write_rows(prefix, local_ids, offset, sources, block_rows,
               first_block=0, kernels=None, direct=False):
    """Writes rows `local_ids` of `sources` to files `prefix + ".0"`,
    `prefix + ".1"`, ..., `block_rows` rows each (numbered from
    `first_block`). Run it under the device holding the sources (inside a
    `tf.function`: one remote call writes every block).

    Args:
        prefix: string scalar, the files' path without the block number.
        local_ids: int64 row ids within the variables (1-D).
        offset: the variables' first row in the whole (sharded) variable:
            the files hold `local_ids + offset`.
        sources: `tf.Variable`s (rank >= 1) with the same number of rows,
            whose rows `local_ids` are written; or tensors holding those
            rows already (`gather_rows`, a snapshot), in the same order.
        block_rows: rows per file.
        kernels: keras_ps' C++ kernels (keras_ps._native.kernels_on the
            device), or None: TF's ops write the files.
        direct: True for a delta's files: with `KERAS_PS_DIRECT_IO=deltas`
            on the ps, `kernels`' writer writes them with O_DIRECT on a
            local disk, not through the page cache (training is not slowed
            by the kernel's copy and writing back; a restore reads them
            from the disk). With 1 every file is written so, with 0 (the
            default) none.

    Returns:
        An int64 tensor of shape `[len(RECORD_FIELDS) + 1 + len(sources),
        files]`: each file's length in bytes, fingerprint, row count, first
        and last id, then the size of each of its parts (ids, variables).
    """
    local_ids = tf.cast(tf.reshape(local_ids, [-1]), tf.int64)
    count = tf.size(local_ids, out_type=tf.int64)
    blocks = (count + block_rows - 1) // block_rows
    records = [tf.TensorArray(tf.int64, size=0, dynamic_size=True,
                              element_shape=[])
               for _ in range(len(RECORD_FIELDS) + 1 + len(sources))]

    def write_block(block, *records):
        first, stop = block * block_rows, (block + 1) * block_rows
        ids = local_ids[first:stop]
        tensors = [ids + offset] + [
            _rows(s, ids) if isinstance(s, tf.Variable) else s[first:stop]
            for s in sources]
        length, content_print, sizes = _write(tf.strings.join(
            [prefix, ".", tf.strings.as_string(block + first_block)]),
            tensors, kernels, direct)
        values = (length, content_print, tf.size(ids, out_type=tf.int64),
                  tf.reduce_min(ids) + offset, tf.reduce_max(ids) + offset,
                  *tf.unstack(sizes, len(tensors)))
        index = tf.cast(block, tf.int32)
        return (block + 1,) + tuple(
            r.write(index, v) for r, v in zip(records, values))

    results = tf.while_loop(lambda block, *_: block < blocks, write_block,
                            (tf.constant(0, tf.int64), *records))
    return tf.stack([r.stack() for r in results[1:]])


def gather_rows(local_ids, variables):
    """Copies of rows `local_ids` of `variables`: a snapshot `write_rows`
    can write later, while the variables change."""
    local_ids = tf.cast(tf.reshape(local_ids, [-1]), tf.int64)
    return [_rows(v, local_ids) for v in variables]


def write_whole(path, sources, kernels=None, direct=False):
    """Writes `sources` whole into one file (a *bundle* of small
    variables): the serialized value of each, in order, with no ids. Run it
    under the device holding them.

    Args:
        sources: `tf.Variable`s, or their values (a snapshot).
        direct: as `write_rows`'.

    Returns:
        An int64 tensor of shape `[len(RECORD_FIELDS) + len(sources), 1]`,
        as `write_rows` (rows, first and last id 0; no ids part).
    """
    length, content_print, sizes = _write(path, [
        tf.raw_ops.ReadVariableOp(resource=s.handle, dtype=s.dtype)
        if isinstance(s, tf.Variable) else s for s in sources], kernels,
        direct)
    zero = tf.constant(0, tf.int64)
    return tf.reshape(tf.stack(
        [length, content_print, zero, zero, zero]
        + tf.unstack(sizes, len(sources))), [-1, 1])


def _length(string):
    return tf.cast(tf.strings.length(string), tf.int64)


def _write(path, tensors, kernels, direct=False):
    """Writes the concatenation of `tensors` serialized to `path`; returns
    its length, its fingerprint and the size of each part (int64).
    `direct`: as `write_rows`' (TF's ops write through the page cache)."""
    if kernels is not None and all(t.dtype != tf.string for t in tensors):
        return kernels.keras_ps_write_tensors(path, tensors,
                                              direct_by_default=direct)
    parts = [tf.io.serialize_tensor(t) for t in tensors]
    content = tf.strings.join(parts)
    tf.io.write_file(path, content)
    return (_length(content), fingerprint(content),
            tf.stack([_length(part) for part in parts]))


def read_file(path):
    """(content, length, fingerprint) of a row file, read with TF's ops on
    the device in scope; only the two int64 scalars need to be fetched to
    check it."""
    content = tf.io.read_file(path)
    return (content, tf.cast(tf.strings.length(content), tf.int64),
            fingerprint(content))


def part(content, sizes, index, dtype):
    """Part `index` of a checked file's `content` (whose parts have `sizes`,
    an int64 vector), parsed as a tensor of `dtype`."""
    start = tf.reduce_sum(sizes[:index])
    return tf.io.parse_tensor(
        tf.strings.substr(content, start, sizes[index]), dtype)


def assign_rows(variable, first, ids, rows, contained):
    """Writes the `rows` whose global `ids` fall in `variable` (which holds
    global rows `[first, first + variable.shape[0])`) into it, on its
    device.

    Args:
        ids: int64 global ids of `rows`; None: `rows` is the variable's
            whole value.
        contained: True when every id is known to fall in the variable (no
            filtering needed).
    """
    with tf.device(variable.device):
        if ids is None or not variable.shape.rank:
            variable.assign(tf.reshape(rows, variable.shape))
            return
        if not contained:
            last = first + int(variable.shape[0])
            # Where and gather, not tf.boolean_mask: the same rows from 3
            # ops instead of 10 per tensor, traced once per file restored.
            kept = tf.reshape(tf.where(
                tf.logical_and(ids >= first, ids < last)), [-1])
            ids, rows = tf.gather(ids, kept), tf.gather(rows, kept)
        tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=ids - first,
            updates=tf.cast(rows, variable.dtype))
