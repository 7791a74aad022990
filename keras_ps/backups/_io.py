"""Writing one backup entry, device by device.

Every device holding variables of a catalog (keras_ps.backups._catalog) runs
its own part at the same time as the others, in a thread of its own: one
traced function per device writes all its groups on that device
(keras_ps.backups._row_files) and returns only each file's length,
fingerprint and row range. Applying a chain of entries is
keras_ps.backups._apply.
"""

import threading

import numpy as np
import tensorflow as tf

from keras_ps import _native
from keras_ps import _tf_adapter
from keras_ps.backups import _row_files
from keras_ps.backups._per_device import per_device
from keras_ps.tables import _dirty_rows
from keras_ps.tables import _row_chunks


class Writer:
    """Writes the groups of a catalog; traces one function per device and
    kind of backup, at its first use.

    Args:
        catalog: a keras_ps.backups._catalog.Catalog.
    """

    def __init__(self, catalog):
        self._catalog = catalog
        self._functions = {}
        self._kernels = None
        self._asked = None  # keras_ps._native.generation() when asked
        self._asked_lock = threading.Lock()

    def _refresh(self):
        """Asks whether every device written on loaded keras_ps' C++
        kernels (`_kernels`: the kernels, or None) at the first write, and
        again once a task came back without them (a ps recovered on a
        server of another keras_ps version): the functions traced with
        them are dropped then."""
        with self._asked_lock:
            if self._asked != _native.generation():
                self._asked = _native.generation()
                self._kernels = _native.kernels_on(self._devices())
                self._functions = {}

    def _groups(self, device):
        return [g for g in self._catalog.groups if g.device == device]

    def _function(self, device, full):
        """`write(prefix, since)` of `device`'s groups: a function shared
        by every Writer whose groups on `device` have the same kinds and
        variable shapes (see _write_function), given this one's variables,
        dirty vectors, names and first rows."""
        groups = self._groups(device)
        function = _write_function(device, full, tuple(
            (g.kind, tuple((v.dtype, tuple(v.shape)) for v in g.variables))
            for g in groups), self._kernels)
        variables = [g.variables for g in groups]
        dirty = [None if full else _dirty_vector(g) for g in groups]
        names = tf.constant([g.name for g in groups], tf.string)
        offsets = tf.constant([g.parts[0].offset for g in groups], tf.int64)
        return lambda prefix, since: function(prefix, since, variables, dirty,
                                              names, offsets)

    def _snapshot_functions(self, device):
        """(snapshot, write, free) of `device`: `snapshot(since)` copies
        what a delta since generation `since` holds into buffer variables
        on the device; `write(prefix)` writes them; `free()` empties them.

        The copies stay in variables: a function returning them as outputs
        took 6-8x as long as the gather itself (TF copies a remote
        function's outputs), and training waits for the snapshot."""
        key = (device, "snapshot")
        if key not in self._functions:
            groups = self._groups(device)
            with tf.device(device):
                buffers = [[_buffer(v.dtype, v.shape) for v in g.variables]
                           if g.kind == "bundle" else
                           [_buffer(tf.int64, [None])] + [
                               _buffer(v.dtype, [None] + v.shape[1:].as_list())
                               for v in g.variables] for g in groups]

            def snapshot(since):
                for group, kept in zip(groups, buffers):
                    with tf.device(group.device):
                        if group.kind == "bundle":
                            # A value read is kept as it is: an update of
                            # the variable after it copies the buffer first.
                            values = [tf.raw_ops.ReadVariableOp(
                                resource=v.handle, dtype=v.dtype)
                                for v in group.variables]
                        else:
                            ids = _rows_to_write(_dirty_vector(group),
                                                 group.parts[0].rows, since)
                            values = [ids] + _row_files.gather_rows(
                                ids, group.variables)
                        for buffer, value in zip(kept, values):
                            buffer.assign(value)

            kernels = self._kernels

            def write(prefix):
                taken = [[b.read_value() for b in kept] for kept in buffers]
                return _write_groups(
                    prefix, groups,
                    [None if g.kind == "bundle" else t[0]
                     for g, t in zip(groups, taken)],
                    [t if g.kind == "bundle" else t[1:]
                     for g, t in zip(groups, taken)], kernels=kernels,
                    direct=True)  # a snapshot is a delta's

            def free():
                # A call of its own, after the write returned: emptied in
                # the write's function, the buffers were found empty there.
                for group, kept in zip(groups, buffers):
                    if group.kind != "bundle":
                        for buffer in kept:
                            buffer.assign(tf.zeros(
                                [0] + buffer.shape[1:].as_list(), buffer.dtype))

            self._functions[key] = tuple(
                _tf_adapter.traced_once_each(tf.function(f, autograph=False))
                for f in (snapshot, write, free))
        return self._functions[key]

    def forget_snapshots(self):
        """Drops the snapshot buffers and functions (made again at the next
        snapshot): after a ps lost its state, those on it are gone."""
        self._functions = {key: value for key, value in self._functions.items()
                           if key[1] != "snapshot"}

    def can_snapshot(self):
        """Whether `snapshot` copies only a delta's worth on each device: no
        group other than tables' is written in row files (those are
        written whole by every backup)."""
        return all(g.kind != "rows" for g in self._catalog.groups)

    def _devices(self):
        return sorted({g.device for g in self._catalog.groups})

    def write(self, prefix, since, full):
        """Writes every group into files named `prefix + group name + "." +
        block`; a table group writes its rows marked after generation
        `since` (all of them when `full`).

        Returns:
            (file records for the manifest, rows of tables written).
        """
        def write(device):
            records = self._function(device, full)(
                tf.constant(prefix), tf.constant(since, tf.int32))
            return self._groups(device), [r.numpy() for r in records]

        self._refresh()
        return self._describe(per_device(write, self._devices()))

    def snapshot(self, since):
        """Copies, on each device, what `write(prefix, since, full=False)`
        would write: the rows marked after `since` of its tables (with
        their slots), the values of its small variables. The copies stay
        on their devices; training may go on meanwhile.

        Returns:
            A Snapshot, whose `write(prefix)` writes them.
        """
        def snapshot(device):
            self._snapshot_functions(device)[0](tf.constant(since, tf.int32))
            return device

        self._refresh()
        return Snapshot(self, per_device(snapshot, self._devices()))

    def _write_snapshot(self, prefix, devices):
        def write(device):
            _, write, free = self._snapshot_functions(device)
            records = [r.numpy() for r in write(tf.constant(prefix))]
            free()
            return self._groups(device), records

        return self._describe(per_device(write, sorted(devices)))

    def _block_function(self, group, changed, direct):
        """(function writing one block of `group`'s row files, rows per
        block); the function takes the prefix, the block number, a
        generation `since` and the number of the file it writes. `changed`:
        of a table, only the rows of the block marked after `since` are
        written (a block with none writes no file). `direct`: the files
        are a delta's (see `_row_files.write_rows`)."""
        key = (id(group), "block", changed, direct)
        if key not in self._functions:
            block_rows = _row_files.rows_per_block(
                group.variables, _row_chunks.chunk_bytes())
            rows, offset = group.parts[0].rows, group.parts[0].offset
            dirty = _dirty_vector(group) if changed else None
            kernels = self._kernels

            def write(prefix, block, since, number):
                with tf.device(group.device):
                    first = block * block_rows
                    ids = tf.range(first, tf.minimum(first + block_rows, rows))
                    if dirty is not None:
                        marks = tf.gather(tf.raw_ops.ReadVariableOp(
                            resource=dirty.handle, dtype=tf.int32), ids)
                        ids = tf.gather(ids, tf.reshape(
                            tf.where(marks > since), [-1]))
                    return _row_files.write_rows(
                        tf.strings.join([prefix, group.name]), ids, offset,
                        group.variables, block_rows, first_block=number,
                        kernels=kernels, direct=direct)

            self._functions[key] = (_tf_adapter.traced_once_each(
                tf.function(write, autograph=False)), block_rows)
        return self._functions[key]

    def _bundle_function(self, group, direct):
        key = (id(group), "bundle", direct)
        if key not in self._functions:
            kernels = self._kernels
            self._functions[key] = _tf_adapter.traced_once_each(tf.function(
                lambda prefix: _write_groups(prefix, [group], [None],
                                             [group.variables],
                                             kernels=kernels,
                                             direct=direct)[0],
                autograph=False))
        return self._functions[key]

    def write_in_blocks(self, prefix, stopped, before_block=None,
                        since=None):
        """Writes what `write(prefix, -1, full=True)` writes (with `since`:
        what `write(prefix, since, full=False)` writes), one block of rows
        (`_row_chunks.chunk_bytes()`) per call on each device, while
        training may go on: rows updated meanwhile may be written with any
        value they had during the write (an entry made consistent by a
        delta of every row marked since the write began).

        Args:
            stopped: called before each block; True stops the write
                (raises `WriteStopped`).
            before_block: None, or called with (device, group name, block)
                before each block is written.

        Returns:
            (file records for the manifest, rows of tables written).
        """
        # Deltas merged into one are a delta's files (past the page cache
        # with KERAS_PS_DIRECT_IO=deltas); a full backup's are not.
        direct = since is not None
        self._refresh()

        def write(device):
            groups, records = self._groups(device), []
            for group in groups:
                if group.kind == "bundle":
                    records.append(self._bundle_function(group, direct)(
                        tf.constant(prefix)).numpy())
                    continue
                function, block_rows = self._block_function(
                    group, since is not None and group.table, direct)
                columns = []
                for block in range(-(-group.parts[0].rows // block_rows)):
                    if before_block is not None:
                        before_block(device, group.name, block)
                    if stopped():
                        raise WriteStopped(f"stopped before block {block} of "
                                           f"{group.name} on {device}")
                    # Files are numbered in order: a block of a merged
                    # delta may have no changed row, and no file.
                    columns.append(function(
                        tf.constant(prefix), tf.constant(block, tf.int64),
                        tf.constant(-1 if since is None else since, tf.int32),
                        tf.constant(sum(c.shape[1] for c in columns),
                                    tf.int64)).numpy())
                records.append(np.concatenate(columns, axis=1))
            return groups, records

        return self._describe(per_device(write, self._devices()))

    def _describe(self, done):
        files, table_rows = [], 0
        for groups, records in done:
            for group, record in zip(groups, records):
                fields = len(_row_files.RECORD_FIELDS)
                for block in range(record.shape[1]):
                    values = [int(x) for x in record[:, block]]
                    files.append(dict(
                        file=f"{group.name}.{block}", kind=group.kind,
                        keys=group.keys, sizes=values[fields:],
                        **dict(zip(_row_files.RECORD_FIELDS, values))))
                    if group.kind == "bundle":
                        files[-1].update(
                            offsets=[p.offset for p in group.parts],
                            counts=[p.rows for p in group.parts])
                    if group.table:
                        table_rows += files[-1]["rows"]
        return files, table_rows


def _write_groups(prefix, groups, ids, sources, names=None, offsets=None,
                  kernels=None, direct=False):
    """Writes each group (its rows `ids[i]` of `sources[i]`, or, for a
    bundle, `sources[i]` whole), each on its device; the records of each.
    `names`, `offsets`: the groups' names and first rows as tensors (a
    shared function's arguments); None: the groups' own. `kernels`: keras_ps'
    C++ kernels (the files' writer), or None: TF's ops. `direct`: the files
    are a delta's (see `_row_files.write_rows`)."""
    block_bytes = _row_chunks.chunk_bytes()
    records = []
    for i, (group, group_ids, group_sources) in enumerate(
            zip(groups, ids, sources)):
        name = group.name if names is None else names[i]
        offset = group.parts[0].offset if offsets is None else offsets[i]
        path = tf.strings.join([prefix, name])
        with tf.device(group.device):
            if group.kind == "bundle":
                records.append(_row_files.write_whole(
                    tf.strings.join([path, ".0"]), group_sources, kernels,
                    direct))
                continue
            records.append(_row_files.write_rows(
                path, group_ids, offset, group_sources,
                _row_files.rows_per_block(group_sources, block_bytes),
                kernels=kernels, direct=direct))
    return records


# (device, full, each group's kind and variables' dtypes and shapes) ->
# tf.function, shared by every Writer of the process: the variables are
# arguments, so a new backup object, or one of a new model, with the same
# shapes reuses the trace. Tracing was most of a small backup's time.
_write_functions = {}
_write_functions_lock = threading.Lock()


class _Layout:
    """What `_write_groups` needs of a group inside a shared function: its
    kind and device (the names and first rows come as arguments)."""

    def __init__(self, kind, device):
        self.kind, self.device = kind, device


def _write_function(device, full, specs, kernels):
    """A function `(prefix, since, variables, dirty, names, offsets)` that
    writes groups of `specs` on `device`: the rows of each table marked
    after generation `since` in its `dirty` vector (every row when `full`),
    the rows of the others, or a bundle whole (with `kernels`' writer, or
    TF's ops when None)."""
    key = (device, full, specs, kernels is not None)
    with _write_functions_lock:
        function = _write_functions.get(key)
        if function is not None:
            return function
        layouts = [_Layout(kind, device) for kind, _ in specs]

        def write(prefix, since, variables, dirty, names, offsets):
            ids = []
            for layout, group_variables, marks in zip(layouts, variables,
                                                      dirty):
                if layout.kind == "bundle":
                    ids.append(None)
                    continue
                with tf.device(device):
                    first = group_variables[0]
                    ids.append(_rows_to_write(
                        marks, int(first.shape[0]) if first.shape.rank else 1,
                        since))
            # A delta's files (past the page cache with
            # KERAS_PS_DIRECT_IO=deltas), not a full backup's, which are
            # most of what a restore reads.
            return _write_groups(prefix, layouts, ids, variables, names,
                                 offsets, kernels, direct=not full)

        function = _write_functions[key] = _tf_adapter.keep_traces(
            _tf_adapter.traced_once_each(tf.function(write, autograph=False)))
        return function


class WriteStopped(Exception):
    """`Writer.write_in_blocks` was stopped between two blocks."""


class Snapshot:
    """What a delta holds, copied on each device by `Writer.snapshot` (into
    that device's buffers: one snapshot at a time); `write(prefix)` has each
    device write its own files (once)."""

    def __init__(self, writer, devices):
        self._writer = writer
        self._devices = devices

    def write(self, prefix):
        """Writes the files (each device its own, at once) and frees the
        copies.

        Returns:
            (file records for the manifest, rows of tables written).
        """
        devices, self._devices = self._devices, None
        return self._writer._write_snapshot(prefix, devices)


def _buffer(dtype, shape):
    """An empty variable on the device in scope, of `shape` (None: any
    number of rows), that a snapshot assigns its copies to."""
    shape = tf.TensorShape(shape)
    return _tf_adapter.plain_variable(
        initial_value=tf.zeros([d or 0 for d in shape.as_list()], dtype),
        shape=shape, trainable=False, name="keras_ps_snapshot")


def _dirty_vector(group):
    """A table group's dirty vector (its rows' marks); None for a group
    that is not a table (written whole by every backup)."""
    return (_dirty_rows.tracker_of(group.variables[0]).dirty if group.table
            else None)


def _rows_to_write(dirty, rows, since):
    """The local row ids a backup writes of a group of `rows` rows (inside
    its device): those whose mark in `dirty` (a table's dirty vector) is
    above generation `since`; every row when `dirty` is None."""
    if dirty is not None:
        marks = tf.raw_ops.ReadVariableOp(resource=dirty.handle,
                                          dtype=tf.int32)
        return tf.reshape(tf.where(marks > since), [-1])
    return tf.range(rows, dtype=tf.int64)
