"""IncrementalBackup: back up huge embedding tables often, writing only the
rows that changed.

A full backup of a 10M x 64 table with LazyAdam is 7.7 GB; a batch of 4,096
Zipf ids touches a few thousand rows. Here a table that its optimizer
updates row by row (SGD without momentum, Adagrad, Ftrl, keras_ps' LazyAdam)
has its changed rows tracked on its ps (keras_ps.tables._dirty_rows), and a *delta*
holds only those rows, with their optimizer slot rows, plus every other
variable whole. Each ps writes its own rows (keras_ps.backups._row_files); only file
names and sizes reach the coordinator, which publishes the backup by
renaming a small manifest (keras_ps.backups._chain). Restoring applies the
newest full backup and its deltas in order: the values a full backup at the
same step holds, bit for bit, into any number of shards (a DynamicEmbedding,
backed up ps by ps with its key maps' state: into as many ps).
"""

import logging
import os
import shutil
import threading
import time

from keras_ps.backups import _apply as _backup_apply
from keras_ps.backups import _background
from keras_ps.backups import _catalog as _backup_catalog
from keras_ps.backups import _chain as _backup_chain
from keras_ps.backups import _checks as _backup_checks
from keras_ps.backups import _io as _backup_io
from keras_ps.backups import _job_lock
from keras_ps.backups import _tracking
from keras_ps.backups._chain import BackupEntry  # noqa: F401 (returned, documented)
from keras_ps.backups._chain import check_options  # noqa: F401 (public helper)
from keras_ps.backups._chain import has_backup  # noqa: F401 (public helper)
from keras_ps.tables import _dirty_rows

logger = logging.getLogger(__name__)

# Smaller tables are written whole by every backup.
DEFAULT_MIN_TABLE_BYTES = 2**20


class IncrementalBackup(_background.BackgroundWrites):
    """Full and incremental backups of a model and its optimizer.

    `save_full()` writes every variable. `save_delta()` writes, for each
    table updated row by row (SGD without momentum, Adagrad, Ftrl without
    L2 shrinkage, `keras_ps.optimizers.LazyAdam`; weight on a ps, no weight
    decay on it, no EMA, no gradient accumulation), the rows updated since
    the previous backup with their optimizer slot rows (LazyAdam's row step
    counters included), and every other variable whole (dense layers,
    `optimizer.iterations`, a table under dense Adam). A
    `keras_ps.layers.DynamicEmbedding` is a table per ps (rows admitted
    or reused count as updated) plus its per-row ids and counters, whole;
    its backups restore into as many ps only. `save()` picks:
    a delta, or a full backup when there is none to build on yet or the
    chain reached `max_deltas` or `max_delta_bytes` (compaction). `restore()`
    loads the newest full backup and its deltas in order.

    Files are written by the ps holding the rows, so `directory` must be one
    folder that the chief and every ps see at the same path (a shared volume);
    this is checked at the first save or restore. A backup is published by
    an atomic rename of `manifest.json`: a crash while writing leaves the
    previous backups restorable. Use one directory per model. The
    environment variables a backup reads (`KERAS_PS_SAVE_CHUNK_BYTES`,
    `KERAS_PS_NATIVE`) are checked when this object is made.

    One job per directory: the first `save*()`, `restore()` or `check()`
    locks `directory` (`backup.lock` in it, as `BackupAndRestore` locks
    its `backup_dir`) until `close()` or the end of a `with` block, or
    until the process ends, however it ends. Another IncrementalBackup on
    it, of another process or this one, is refused before it writes.

    Row tracking starts at the first `save*()`, `restore()` or `check()`
    (functions traced before are traced again); it marks what the optimizer
    updates. A table changed any other way (`assign`, `load_weights`) needs
    a `save_full()` next. Call `save*()` between steps (after
    `coordinator.join()`), so that the backup is of one moment.

    Args:
        objects: a Keras model (its optimizer, built, is included), or a dict
            of names to Keras models, layers and optimizers.
        directory: where the backups live (created if missing).
        max_deltas: `save()` writes a full backup after this many deltas.
        max_delta_bytes: ...or once the chain's deltas add up to this many
            bytes; None: the size of the chain's full backup (restoring
            would read more than twice what a full backup holds).
        keep_chains: full backups (each with its deltas) kept; the older
            one is what `restore()` falls back to if the newest full backup
            is damaged.
        min_table_bytes: a table whose rows (with its slots' rows) take
            fewer bytes is written whole (tracking it would save little);
            None: `DEFAULT_MIN_TABLE_BYTES` (1 MiB).
        background_deltas: True: a delta returns once each ps has made a
            copy of what it holds (the changed rows, the small variables:
            a consistent snapshot); the ps write their files and the delta
            is published in a background thread while training goes on.
            The next save, `restore()` and `wait()` wait for it; a delta
            that fails there is logged and not published (the next backup
            holds its rows). The first full backup and `save_full()` are
            written before they return either way (a copy of the whole
            table would double the ps' memory).
        background_compaction: True (default): when compaction is due,
            `save()` writes a delta as usual and starts writing the new
            full backup in a thread, block by block on each ps, while
            training goes on; rows the steps change meanwhile may be
            written with any value they had. The first `save()` after the
            write ended writes a delta of every row changed since it began,
            which makes the two one state, and publishes them as a new
            chain. Until then the old chain goes on (deltas) and is what
            `restore()` loads (with no row-tracked table, where a delta
            is as big as a full backup, the full backup is written at
            once). A restore, `save_full()` or `stop_compaction()` drops a
            full backup being written; once the chain reached twice its
            limits without one in progress (compactions dropped again and
            again), `save()` writes the full backup before it returns.
            False: `save()` writes the compaction's full backup before it
            returns.
        merge_below: a compaction written while training goes on writes
            the rows changed since the chain's full backup (a merged delta,
            written and sealed the same way; the new chain shares the full
            backup's files, the old one stays as its fallback) while they
            take less than this share of the tables' bytes; else, and after
            a restore (which rows differ from the full backup is not known
            then), a full backup. 0: always a full backup. A merged delta
            counts toward `max_delta_bytes`: one of half a full backup
            brings the next compaction twice as soon and saves nothing; one
            of a quarter (the default) writes a third of what full backups
            would. (Zipf ids, 10M rows: 20 deltas merge into 15% of one.)
        lock: None (default): this object locks `directory` itself.
            `keras_ps.callbacks.BackupAndRestore` passes the lock it holds
            on its `backup_dir`, a folder above, while `fit` runs: the
            object then takes none, and `close()` leaves it to its holder.

    Raises:
        BackupDirInUseError: at the first `save*()`, `restore()` or
            `check()` (after `close()` too): another job holds `directory`.

    Example:
    ```python
    with keras_ps.IncrementalBackup(model, "/shared/backup") as backup:
        entry = backup.restore()  # None at the first start
        for step in range(entry.metadata["step"] if entry else 0, steps):
            coordinator.schedule(train_step, args=(iterator,))
            if step % 100 == 99:
                coordinator.join()
                backup.save(metadata={"step": step + 1})
    ```
    """

    def __init__(self, objects, directory, max_deltas=20,
                 max_delta_bytes=None, keep_chains=2,
                 min_table_bytes=None, background_deltas=False,
                 background_compaction=True, merge_below=0.25, lock=None):
        self._objects = _backup_catalog.normalize(objects)
        if not directory:
            raise ValueError("IncrementalBackup needs a directory. Received: "
                             f"directory={directory!r}.")
        # Taken in _ready(), given back by close(); None: `lock` is used.
        self._own_lock = _job_lock.own_lock(os.fspath(directory), lock)
        if min_table_bytes is None:
            min_table_bytes = DEFAULT_MIN_TABLE_BYTES
        check_options(max_deltas, max_delta_bytes, keep_chains,
                      min_table_bytes, merge_below)
        _backup_checks.check_bools(background_deltas=background_deltas,
                                   background_compaction=background_compaction)
        _backup_checks.check_environment()
        self.min_table_bytes = min_table_bytes
        self.directory = os.fspath(directory)
        self.max_deltas = max_deltas
        self.max_delta_bytes = max_delta_bytes
        self.keep_chains = keep_chains
        self._lock = threading.RLock()
        self._catalog = None
        self._checked_devices = set()
        self._writer = self._applier = None
        self._base = None  # (entry id, generation) of what a delta builds on
        # (full entry id, generation) of the first state of the chain this
        # object wrote since its full backup (None after a restore: the
        # marks do not say what differs from it).
        self._root = None
        self.background_deltas = bool(background_deltas)
        self._pending = None  # a _background.PendingDelta
        # Held while a background delta is published, and to abandon one.
        self._publish_lock = threading.Lock()
        self._next_id = 1  # above an abandoned delta's id: not given out again
        self.background_compaction = bool(background_compaction)
        self.merge_below = merge_below
        self._compaction = None  # a full backup written in the background
        self._removal = _backup_chain.FolderRemoval()  # of dropped entries
        # Tests: called with (device, group name, block) before each block.
        self._before_compaction_block = None

    # -- what is backed up ----------------------------------------------------------
    def _ready(self):
        """The catalog, with row tracking on for its tables; `directory`
        locked first (again after `close()`)."""
        if self._own_lock is not None and not self._own_lock.held:
            os.makedirs(self.directory, exist_ok=True)
            self._own_lock.acquire()
        if self._catalog is None:
            catalog = _backup_catalog.Catalog(self._objects,
                                              self.min_table_bytes)
            os.makedirs(self.directory, exist_ok=True)
            self._check_shared(catalog)
            _tracking.track(catalog)
            self._writer = _backup_io.Writer(catalog)
            self._applier = _backup_apply.Applier(catalog)
            self._catalog = catalog
        return self._catalog

    def check(self):
        """Finds what is backed up and checks the directory is shared;
        starts tracking the tables' rows.

        Raises:
            ValueError: a ps cannot write into `directory` where this
                process sees it, or the optimizer is not built yet.
        """
        with self._lock:
            self._ready()

    def close(self):
        """Gives `directory`'s lock back, once the delta being written in
        the background is published (as `wait()`) and the compaction being
        written is dropped (its thread stopped). Another job can then take
        the directory; a later `save*()`, `restore()` or `check()` takes it
        again. A `lock` passed in stays with its holder.

        Raises:
            The error that stopped the delta written in the background;
            the lock is given back all the same.
        """
        with self._lock:
            try:
                self.stop_compaction()
                self.wait()
            finally:
                if self._own_lock is not None:
                    self._own_lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def table_bytes(self):
        """Bytes of the tables (with their slots) whose changed rows a delta
        writes; finds them without tracking anything."""
        catalog = self._catalog or _backup_catalog.Catalog(
            self._objects, self.min_table_bytes)
        return sum(g.nbytes for g in catalog.tables)

    @property
    def tracked_tables(self):
        """Paths of the weights whose changed rows a delta writes."""
        catalog = self._ready()
        return sorted({catalog.variables[g.keys[0]][0] for g in catalog.tables})

    def _check_shared(self, catalog):
        """Each remote device writes a file the chief must read back."""
        devices = sorted({g.device for g in catalog.groups
                          if "/job:" in (g.device or "")} - self._checked_devices)
        _backup_checks.check_shared(self.directory, devices)
        self._checked_devices.update(devices)

    # -- saving -------------------------------------------------------------------------
    def save(self, metadata=None):
        """A delta, or a full backup when a delta cannot be or should not be
        written (no backup to build on; compaction due, unless it is
        written in the background: see `background_compaction`). Returns
        its BackupEntry."""
        with self._lock:
            self._finish_pending(saving=True)
            self._ready()  # the directory locked before it is read
            manifest = _backup_chain.read(self.directory)
            base = self._base_location(manifest)
            if base is None:
                self._stop_compaction("there is no backup to build on")
                return self._save("full", metadata, manifest, None)
            return self._save_compacting(metadata, manifest, base)

    def save_full(self, metadata=None):
        """Writes every variable whole; starts a new chain."""
        with self._lock:
            self._finish_pending(saving=True)
            self._stop_compaction("save_full() was called")
            self._ready()
            manifest = _backup_chain.read(self.directory)
            return self._save("full", metadata, manifest, None)

    def save_delta(self, metadata=None):
        """Writes the rows changed since the previous backup (and every
        variable that is not a row-tracked table, whole).

        Raises:
            ValueError: there is no backup this object wrote or restored to
                build on (or a ps lost its variables since): `save_full()`.
        """
        with self._lock:
            self._finish_pending(saving=True)
            self._ready()  # the directory locked before it is read
            manifest = _backup_chain.read(self.directory)
            base = self._base_location(manifest)
            if base is None:
                raise ValueError(
                    "A delta needs the backup it builds on: this "
                    "IncrementalBackup has written or restored none in "
                    f"{self.directory!r} yet (or a ps was given its variables "
                    "back since, without restore()). Fix: call save_full() "
                    "first, or save(), which picks.")
            return self._save("delta", metadata, manifest, base)

    def _base_location(self, manifest):
        if self._base is None or manifest is None:
            return None
        self._ready()
        if not _dirty_rows.GENERATIONS.agree():
            return None
        return _backup_chain.locate(manifest, self._base[0])

    def _new_folder(self, kind, manifest):
        """(entry id, folder name, path) of a new entry, its folder empty."""
        # An abandoned background write may still write into its folder.
        entry_id = max(manifest["next_id"], self._next_id)
        folder = _backup_chain.folder_name(kind, entry_id)
        path = os.path.join(self.directory, folder)
        self._removal.wait(path)
        shutil.rmtree(path, ignore_errors=True)  # a crashed attempt's files
        os.makedirs(path)
        return entry_id, folder, path

    def _save(self, kind, metadata, manifest, base, seal=None):
        """Writes a full backup or a delta since `base` (chain index,
        length), or, with `seal` (a finished `_background.Compaction`), the delta that
        makes it a state: published with it as a new chain."""
        started = time.monotonic()
        catalog = self._ready()
        manifest = manifest or _backup_chain.empty()
        entry_id, folder, path = self._new_folder(kind, manifest)
        since = (seal.generation if seal is not None
                 else self._base[1] if kind == "delta" else -1)

        def add(manifest, entry):
            if seal is not None:
                return _backup_chain.with_chain(
                    manifest, seal.root_entries + [seal.entry, entry],
                    self.keep_chains)
            return _backup_chain.with_entry(manifest, base, entry,
                                            self.keep_chains)

        if kind == "full":
            # No delta is pending; a ps may have lost the snapshot buffers.
            self._writer.forget_snapshots()
        generation = _dirty_rows.GENERATIONS.advance()
        if (kind == "delta" and self.background_deltas
                and self._writer.can_snapshot()):
            return self._save_in_background(
                self._writer.snapshot(since), path, entry_id, kind, folder,
                metadata, manifest, add,
                len(seal.root_entries) + 1 if seal else base[1], generation,
                started)
        with _backup_chain.write_failures(
                path, self.directory, f"{kind} {entry_id}",
                _backup_chain.still_restores(manifest)):
            files, table_rows = self._writer.write(path + os.sep, since,
                                                   full=kind == "full")
        entry = _backup_chain.new_entry(entry_id, kind, folder, files,
                                        table_rows, metadata)
        if kind == "full":
            entry.update(catalog.describe())
        updated = add(manifest, entry)
        deltas = _backup_chain.locate(updated, entry_id)[1] - 1
        return self._publish(updated, entry, generation, deltas, started)

    def _publish(self, manifest, entry, generation, deltas, started):
        keep = [] if self._compaction is None else [self._compaction.folder]
        _backup_chain.publish(self.directory, manifest, keep, self._removal)
        self._base = (entry["id"], generation)
        c, length = _backup_chain.locate(manifest, entry["id"])
        chain = manifest["chains"][c]
        if length == _backup_chain.first_state_length(chain):
            # A new chain's first state: what a merged delta builds on.
            self._root = (chain[0]["id"], generation)
        info = _backup_chain.entry_info(entry, deltas, time.monotonic() - started)
        logger.info("[chief] %s backup %d written: %d bytes in %d files, %d "
                    "table rows, %.2fs", entry["kind"], entry["id"],
                    info.bytes, info.files, entry["table_rows"], info.seconds)
        return info

    # -- restoring -------------------------------------------------------------------
    def latest(self):
        """The newest BackupEntry in the directory (not checked), or None."""
        with self._lock:
            self._finish_pending()
        manifest = _backup_chain.read(self.directory)
        if not manifest or not manifest["chains"]:
            return None
        chain = manifest["chains"][-1]
        return _backup_chain.entry_info(chain[-1], len(chain) - 1)

    def restore(self, fallback=True, devices=None):
        """Loads the newest backup: its full backup, then its deltas in order.

        Args:
            fallback: True: a backup with a missing or damaged file is
                skipped (logged, and listed in the result's `problems`) for
                the newest complete one before it. False: raise.
            devices: only the variables on these devices (ps device names)
                are written, the others keep their values; the next backup
                is then a full one (the variables no longer agree with any
                one backup). None: every variable.

        Returns:
            The restored BackupEntry (its `metadata` is what was saved with
            it), or None when the directory holds no backup.

        Raises:
            BackupCorruptError: a file is missing or damaged (naming it) and
                `fallback` is False, or no backup is complete.
            ValueError: the backup was written by a different model, or
                with a DynamicEmbedding on another number of ps.
        """
        _backup_checks.check_bools(fallback=fallback)
        with self._lock:
            self._abandon_pending_after_a_ps_loss()
            self._finish_pending()
            self._stop_compaction("a restore changes the variables")
            started = time.monotonic()
            catalog = self._ready()
            # A delta abandoned above may still write (and empty) the
            # snapshot buffers it used, which a lost ps no longer holds.
            self._writer.forget_snapshots()
            manifest = _backup_chain.read(self.directory)
            if not manifest or not manifest["chains"]:
                return None
            entries, problems = self._applier.apply_newest(
                self.directory, manifest, devices, fallback)
            catalog.restore_key_maps(devices)
            generation = _dirty_rows.GENERATIONS.advance()
            self._base = ((entries[-1]["id"], generation)
                          if devices is None else None)
            self._root = None
            info = _backup_chain.entry_info(entries[-1], len(entries) - 1,
                                            time.monotonic() - started,
                                            problems)
            logger.info("[chief] restored %s backup %d (%d deltas) in %.2fs",
                        info.kind, info.id, info.deltas, info.seconds)
            return info

