"""Applying a chain of backup entries (a full backup, then its deltas in
order), device by device: each device reads the row files holding rows it
holds now, checks them and scatters their rows into its variables, entry
after entry. Bundles of small variables are read by this process and
assigned whole; a variable written whole by a later entry is read from that
entry only.
"""

import logging
import os
import threading

import tensorflow as tf

from keras_ps import _native
from keras_ps import _tf_adapter
from keras_ps.backups import _chain as _backup_chain
from keras_ps.backups import _row_files
from keras_ps.backups._per_device import per_device
from keras_ps.errors import BackupCorruptError
from keras_ps.tables import _row_chunks

logger = logging.getLogger(__name__)


def _saved_ranges(record):
    """(key, first row, last row) of each variable a file holds."""
    if "offsets" in record:  # a bundle: each variable whole
        return [(key, offset, offset + count - 1) for key, offset, count
                in zip(record["keys"], record["offsets"], record["counts"])]
    return [(key, record["min"], record["max"]) for key in record["keys"]]


def _first_entries(entries):
    """{key: index of the entry from which its files are applied}: the last
    entry that writes it whole (any file of a full backup, a bundle or rows
    file of a delta); the deltas after it hold its changed rows."""
    first = {}
    for index, entry in enumerate(entries):
        for record in entry["files"]:
            if entry["kind"] == "full" or record.get("kind") != "table":
                for key in record["keys"]:
                    first[key] = index
    return first


class Applier:
    """Applies entries of a backup to a catalog's variables.

    Row files are read by the device that holds their rows now (with keras_ps'
    C++ restore op where every such device loaded it), one call per file to a
    function traced once per device and shapes of the variables it fills
    (see _apply_function).
    Bundles (small variables, whole) are read here and assigned.

    Args:
        catalog: a keras_ps.backups._catalog.Catalog.
    """

    def __init__(self, catalog):
        self._catalog = catalog

    def apply_newest(self, directory, manifest, devices, fallback):
        """Applies the newest state of `manifest` (of `directory`) that
        matches the catalog and whose files are intact, states newest first
        (each chain's, newest chain first); with `fallback` False, the
        newest only.

        Returns:
            (the entries applied, the problems of the newer ones skipped).

        Raises:
            BackupCorruptError: a file of the newest state is missing or
                damaged and `fallback` is False, or no state is complete.
            ValueError: the backup was written by another model.
        """
        problems = []
        for c, length in _backup_chain.states_newest_first(manifest):
            entries = manifest["chains"][c][:length]
            self._catalog.check_matches(entries[0], directory)
            try:
                self.apply(directory, entries, devices)
            except BackupCorruptError as error:
                if not fallback:
                    raise
                problems.append(str(error))
                logger.warning("[chief] %s", error)
                continue
            return entries, problems
        raise BackupCorruptError(f"No backup in {directory!r} is complete: "
                                 f"{' | '.join(problems)}")

    def apply(self, directory, entries, devices=None):
        """Writes `entries` (a full backup then deltas, as the manifest of
        `directory` lists them) into the catalog's variables, wherever their
        rows now live: each variable from the last entry that holds it
        whole, then the rows of the deltas after it, in order.

        `devices`: only the variables on these devices are written (None:
        all).

        Raises:
            BackupCorruptError: a file cannot be read or is not what was
                written. Its rows are not applied; earlier files' are
                (applying a chain from its full backup rewrites them all).
        """
        first = _first_entries(entries)
        plans = []  # per entry: (entry, {device: [row file]}, [bundle])
        for index, entry in enumerate(entries):
            plan, bundles = {}, []
            for record in entry["files"]:
                path = os.path.join(directory, entry["folder"], record["file"])
                wanted = [(c, key, low, high) for c, (key, low, high)
                          in enumerate(_saved_ranges(record))
                          if first.get(key, -1) <= index]
                if "offsets" in record:
                    if wanted:
                        bundles.append((path, record, wanted))
                    continue
                targets = {}
                for component, key, lowest, highest in wanted:
                    for part in self._catalog.parts.get(key, ()):
                        if (highest >= part.offset
                                and lowest < part.offset + part.rows):
                            targets.setdefault(part.variable.device, []).append(
                                (component + 1, part))  # ids come first
                for device, parts in targets.items():
                    if devices is None or device in devices:
                        plan.setdefault(device, []).append(
                            (path, record, parts))
            plans.append((entry, plan, bundles))
        # Every file used is there, whole, before any variable is written.
        for entry, plan, bundles in plans:
            for path, record, _ in bundles + [f for files in plan.values()
                                              for f in files]:
                _backup_chain.check_file(path, entry, record)
        # Asked at each restore: a ps started again may be another binary.
        kernels = _native.kernels_on(sorted(
            {d for _, plan, _ in plans for d in plan}))
        following = _following_files(plans)
        for entry, plan, bundles in plans:
            self._apply_bundles(entry, bundles, devices)
            per_device(lambda d, e=entry, p=plan: self._apply_rows(
                d, e, p[d], kernels, following), sorted(plan))

    def _apply_rows(self, device, entry, files, kernels, following):
        for path, record, targets in files:
            # A file whose rows all fall in a part is scattered without
            # filtering (a copy of its rows fewer).
            contained = tuple(
                record["min"] >= p.offset
                and record["max"] < p.offset + p.rows for _, p in targets)
            function = self._function(device, tuple(p for _, p in targets),
                                      contained, kernels)
            try:
                function(tf.constant(path),
                         tf.constant(following.get((device, path), "")),
                         tf.constant(record["bytes"], tf.int64),
                         tf.constant(record["fingerprint"], tf.int64),
                         tf.constant(record["sizes"], tf.int64),
                         tf.constant([c for c, _ in targets], tf.int32))
            except (tf.errors.NotFoundError, tf.errors.DataLossError,
                    tf.errors.InvalidArgumentError) as error:
                if path not in str(error):
                    raise
                reason = ("its content is not what was written (length or "
                          "fingerprint)" if _MISMATCH in str(error) else
                          f"{device} cannot read it ({type(error).__name__})")
                raise _backup_chain.corrupt_file_error(
                    path, entry, reason) from error

    def _function(self, device, parts, contained, kernels):
        """The function applying a row file to `parts` (on `device`), with
        the parts' variables and first rows as its arguments;
        `contained[i]`: every row of the file falls in `parts[i]`."""
        function = _apply_function(
            device, tuple((p.variable.dtype, tuple(p.variable.shape))
                          for p in parts), contained, kernels)
        variables = [p.variable for p in parts]
        offsets = tf.constant([p.offset for p in parts], tf.int64)
        return lambda *args: function(*args, variables, offsets)

    def _apply_bundles(self, entry, bundles, devices=None):
        """Reads bundle files here and assigns each variable whole (those
        on `devices`, None: all)."""
        pieces = {}  # key -> [(first row, value)]
        for path, record, wanted in bundles:
            try:
                with open(path, "rb") as f:
                    content = f.read()
            except OSError as error:
                raise _backup_chain.corrupt_file_error(
                    path, entry, f"it cannot be read ({error})") from error
            content = tf.constant(content)
            if (len(content.numpy()) != record["bytes"] or int(
                    _row_files.fingerprint(content)) != record["fingerprint"]):
                raise _backup_chain.corrupt_file_error(
                    path, entry, "its content is not what was written "
                    "(length or fingerprint)")
            sizes = tf.constant(record["sizes"], tf.int64)
            for component, key, lowest, _ in wanted:
                parts = self._catalog.parts.get(key)
                if parts:
                    pieces.setdefault(key, []).append((lowest, _row_files.part(
                        content, sizes, component,
                        parts[0].variable.dtype).numpy()))
        for key, found in pieces.items():
            for part in self._catalog.parts[key]:
                if devices is not None and part.variable.device not in devices:
                    continue
                for lowest, value in found:
                    if value.ndim == 0:
                        part.variable.assign(value)
                        continue
                    first = max(lowest, part.offset)
                    last = min(lowest + len(value), part.offset + part.rows)
                    if first < last:
                        _row_chunks.assign_rows(
                            part.variable, first - part.offset,
                            value[first - lowest:last - lowest])


# (device, the variables' dtypes and shapes, contained) -> tf.function,
# shared by every Applier of the process: the variables are arguments, so a
# restore into a new model, or by a new backup object, of the same shapes
# reuses the trace. Tracing was most of a small restore's time.
_apply_functions = {}
_apply_functions_lock = threading.Lock()


def _apply_function(device, specs, contained, kernels):
    """A function `(path, next_path, length, fingerprint, sizes, components,
    variables, offsets)` that checks the row file `path` and scatters its
    rows into `variables` (of `specs`, on `device`; `offsets`: the global id
    of each one's first row). `kernels`: keras_ps' C++ kernels, whose
    `KerasPsApplyRowFile` does it all in one op, copying each row from the
    file's bytes into its variable (and reads `next_path` ahead); or None:
    TF's ops (the file read, each part cut out, parsed and scattered: three
    copies more of every byte)."""
    if any(dtype == tf.string for dtype, _ in specs):
        kernels = None  # the C++ op copies rows as bytes: numbers only
    key = (device, specs, contained, kernels is not None)
    with _apply_functions_lock:
        function = _apply_functions.get(key)
        if function is not None:
            return function

        def apply_natively(path, next_path, length, fingerprint, sizes,
                           components, variables, offsets):
            with tf.device(device):
                kernels.keras_ps_apply_row_file(
                    path, next_path, length, fingerprint, sizes, components,
                    offsets, [v.handle for v in variables])

        def apply(path, next_path, length, fingerprint, sizes, components,
                  variables, offsets):
            del next_path  # TF's ops read no file ahead
            with tf.device(device):
                content, actual, actual_fingerprint = \
                    _row_files.read_file(path)
                check = tf.debugging.Assert(tf.logical_and(
                    tf.equal(actual, length),
                    tf.equal(actual_fingerprint, fingerprint)),
                    [_MISMATCH, path])
                with tf.control_dependencies([check]):
                    content = tf.identity(content)
                ids = tf.ensure_shape(_row_files.part(
                    content, sizes, 0, tf.int64), [None])
                for i, variable in enumerate(variables):
                    rows = tf.ensure_shape(
                        _row_files.part(content, sizes, components[i],
                                        variable.dtype),
                        [None] + variable.shape[1:].as_list())
                    _row_files.assign_rows(variable, offsets[i], ids, rows,
                                           contained=contained[i])

        function = _apply_functions[key] = _tf_adapter.keep_traces(
            _tf_adapter.traced_once_each(tf.function(
                apply if kernels is None else apply_natively,
                autograph=False)))
        return function


def _following_files(plans):
    """{(device, path): the row file that device reads after it}, over the
    whole chain: the file its reader asks the disk for ahead."""
    order = {}
    for _, plan, _ in plans:
        for device, files in plan.items():
            order.setdefault(device, []).extend(path for path, _, _ in files)
    return {(device, path): after for device, paths in order.items()
            for path, after in zip(paths, paths[1:])}


# The message of a failed length or fingerprint check of a file.
_MISMATCH = "backup file length or fingerprint mismatch"
