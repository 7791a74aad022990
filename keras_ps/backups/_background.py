"""Backups written in threads of the chief while training goes on.

- `BackgroundWrites`: the part of keras_ps.IncrementalBackup that starts,
  waits for and drops them.
- `PendingDelta`: a delta whose rows each ps has copied (a consistent
  snapshot, taken between steps); the thread has each ps write its copy,
  then publishes the delta, unless a ps lost its variables meanwhile or a
  restore abandoned it.
- `Compaction`: a full backup, or a *merged delta* (every row changed since
  the chain's first state, to follow that state instead of the chain's
  deltas), each ps writes block by block from its live variables while the
  steps go on. Alone it is not one state (rows changed during the write may
  hold any value they had); the delta of every row marked since
  `generation` makes it one (keras_ps.backups.incremental_backup writes
  that delta and publishes them as a new chain).
"""

import logging
import os
import threading
import time

from keras_ps import _exit_guard
from keras_ps import _tf_adapter
from keras_ps.backups import _chain as _backup_chain
from keras_ps.backups._chain import BackupEntry
from keras_ps.errors import BackupWriteError
from keras_ps.tables import _dirty_rows

logger = logging.getLogger("keras_ps.backups.incremental_backup")


class PendingDelta:
    """Writes a delta's `snapshot` into `path` and calls `publish(files,
    table_rows)` (under `lock`), in a thread.

    Args:
        entry_id: the delta's id.
        snapshot: a keras_ps.backups._io.Snapshot.
        path: the delta's folder.
        publish: returns the published BackupEntry.
        lock: held while publishing, and by `abandon`.
    """

    def __init__(self, entry_id, snapshot, path, publish, lock):
        self.entry_id = entry_id
        self._lock = lock
        self._abandoned = False
        self._outcome = {}

        def finish():
            # Not cut short by the process' exit (keras_ps._exit_guard): the
            # exit waits for the delta to be written and published.
            with _exit_guard.tf_section():
                _finish()

        def _finish():
            try:
                with _backup_chain.write_failures(
                        path, os.path.dirname(path), f"delta {entry_id}",
                        "the backups published before it restore as they "
                        "did"), _tf_adapter.own_executor():
                    files, table_rows = snapshot.write(path + os.sep)
                if not _dirty_rows.GENERATIONS.agree():
                    # Its copies may have been read from the zeros a lost
                    # ps was given back: a delta to drop, not to restore.
                    raise RuntimeError(
                        f"a ps lost its variables while delta {entry_id} was "
                        "written")
                with lock:
                    if self._abandoned:
                        raise RuntimeError(
                            f"delta {entry_id} was abandoned by a restore")
                    self._outcome["entry"] = publish(files, table_rows)
            except Exception as error:  # noqa: BLE001  (kept for wait())
                self._outcome["error"] = error

        self.thread = threading.Thread(target=finish, daemon=True,
                                       name=f"keras_ps-backup-{entry_id}")
        self.thread.start()

    def wait(self):
        """The published BackupEntry, once the thread ended; raises the
        error that stopped it."""
        self.thread.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["entry"]

    def abandon(self):
        """Makes sure the delta is never published, without waiting for its
        thread; False if it was published already."""
        with self._lock:
            if "entry" in self._outcome:
                return False
            self._abandoned = True
            return True


class Compaction:
    """Writes a full backup, or a merged delta, into `path` with
    `writer.write_in_blocks`, in a thread, while training goes on.

    Args:
        writer: a keras_ps.backups._io.Writer.
        catalog: its keras_ps.backups._catalog.Catalog.
        path: the entry's folder; `folder` its name.
        entry_id: the entry's id.
        generation: every row changed since the write began is marked
            after it.
        before_block: None, or called before each block (tests).
        root: None: a full backup. Else (manifest entries of the chain's
            first state, the generation of that state): a merged delta of
            the rows changed since that state, which follows those entries
            in the new chain.

    Attributes:
        entry: its manifest entry (`"fuzzy": True`) once written;
            `seconds` the write took.
        root_entries: the entries it follows in the new chain ([] for a
            full backup).
        error: what stopped the write (`WriteStopped` after `stop()`).
    """

    def __init__(self, writer, catalog, path, folder, entry_id, generation,
                 before_block=None, root=None):
        self.folder = folder
        self.entry_id = entry_id
        self.generation = generation
        self.root_entries = [] if root is None else list(root[0])
        self.kind = "full" if root is None else "delta"
        self.description = "full backup" if root is None else "merged delta"
        self.entry = self.error = self.seconds = None
        self.stopped = False
        self._stop_lock = threading.Lock()

        def write():
            started = time.monotonic()
            try:
                # Its traces are not cut short by the process' exit
                # (keras_ps._exit_guard), and the exit stops it at its
                # next block.
                with _exit_guard.tf_section(), _tf_adapter.own_executor():
                    files, table_rows = writer.write_in_blocks(
                        path + os.sep, self._should_stop, before_block,
                        since=None if root is None else root[1])
                written = time.monotonic()
                # On the disk before a manifest names it, and here rather
                # than in the publishing save(), where training waits: the
                # manifest's own fsync would otherwise wait for the kernel
                # to write these files back (ext4 orders the two).
                _backup_chain.sync_files(path, self._should_stop)
                entry = _backup_chain.new_entry(entry_id, self.kind, folder,
                                                files, table_rows, None)
                if root is None:
                    entry.update(catalog.describe())
                entry.update(fuzzy=True)
                self.entry = entry
                self.seconds = time.monotonic() - started
                logger.info("[chief] %s %d written while training went on: "
                            "%d bytes in %.2fs (synced to the disk in "
                            "%.2fs); the next backup publishes it",
                            self.description, entry_id, entry["bytes"],
                            self.seconds, time.monotonic() - written)
            except Exception as error:  # noqa: BLE001  (logged by save())
                self.error = error

        self.thread = threading.Thread(
            target=write, daemon=True, name=f"keras_ps-compaction-{entry_id}")
        self.thread.start()
        logger.info("[chief] compaction: %s %d being written while "
                    "training goes on", self.description, entry_id)

    @property
    def running(self):
        return self.thread.is_alive()

    def _should_stop(self):
        """Asked before each block: stopped, or the process exits."""
        if not self.stopped and _exit_guard.exiting():
            self.stop("the process exits (the published backups are as "
                      "they were)", level=logging.WARNING)
        return self.stopped

    def stop(self, reason, level=logging.INFO):
        """Stops the write before its next block (without waiting)."""
        with self._stop_lock:  # each device's thread may ask at once
            if self.stopped:
                return
            self.stopped = True
        logger.log(level, "[chief] the %s %d being written in the background "
                   "is dropped: %s", self.description, self.entry_id, reason)


class BackgroundWrites:
    """What keras_ps.IncrementalBackup writes in the background: the delta
    being written (`_pending`, a PendingDelta) and the compaction
    (`_compaction`, a Compaction). Uses the backup's `_lock`,
    `_publish_lock`, `_next_id`, `_writer`, `_root`, `merge_below`,
    `max_deltas`, `max_delta_bytes`, `background_compaction`, `_ready()`,
    `_new_folder()`, `_save()` and `_publish()`."""

    # -- compaction while training goes on ----------------------------------------
    @property
    def compacting(self):
        """Whether a compaction (a full backup or a merged delta) is being
        written in the background (it is published by the next `save()`
        after its write ends)."""
        compaction = self._compaction
        return compaction is not None and compaction.running

    def _save_compacting(self, metadata, manifest, base):
        """`save()` once there is a backup to build on, `base` (chain index,
        length): the delta that seals a compaction whose write ended, or
        the full backup or the delta that starts one when it is due, or a
        delta. Returns its BackupEntry."""
        compaction = self._compaction
        if compaction is not None and not compaction.running:
            self._compaction = None
            if compaction.error is None:
                # The delta that makes it a state; both as a new chain.
                return self._save("delta", metadata, manifest, None,
                                  seal=compaction)
            logger.warning(
                "[chief] the full backup written in the background was "
                "dropped (%s: %s)", type(compaction.error).__name__,
                compaction.error)
        if self._compaction is None and self._compaction_due(
                manifest, base, 1):
            if (not self.background_compaction
                    or not self._ready().tables  # a delta is whole
                    or self._compaction_due(manifest, base, 2)):
                return self._save("full", metadata, manifest, None)
            entry = self._save("delta", metadata, manifest, base)
            self._start_compaction(entry.id, manifest, base)
            return entry
        return self._save("delta", metadata, manifest, base)

    def _start_compaction(self, last_id, manifest, base):
        """Starts writing a full backup, or a merged delta
        (`_merge_root`), in a thread, block by block, while training goes
        on; called between steps (the rows changed from here on are the
        ones the sealing delta writes). `last_id`: the entry just saved (it
        may not be published yet), after `manifest`, in the chain of `base`
        (chain index, length)."""
        root = self._merge_root(manifest, base)
        self._next_id = max(self._next_id, last_id + 1)
        entry_id, folder, path = self._new_folder(
            "full" if root is None else "delta", manifest)
        # Not in the manifest until sealed: not given out again.
        self._next_id = entry_id + 1
        self._compaction = Compaction(
            self._writer, self._ready(), path, folder, entry_id,
            _dirty_rows.GENERATIONS.advance(), self._before_compaction_block,
            root)

    def _merge_root(self, manifest, base):
        """(the entries of the first state of `base`'s chain, its
        generation) when a compaction can merge the chain's deltas into
        one: the rows changed since that state take less than
        `merge_below` of the tables' bytes. None: it writes a full
        backup."""
        chain = manifest["chains"][base[0]]
        if (not self.merge_below or self._root is None
                or self._root[0] != chain[0]["id"]
                or not self._ready().tables):
            return None
        generation = self._root[1]
        fraction = _changed_fraction(self._ready().tables, generation)
        if fraction >= self.merge_below:
            logger.info("[chief] compaction: %.0f%% of the tables' rows "
                        "changed since the chain's full backup (merge_below="
                        "%s): a new full backup", 100 * fraction,
                        self.merge_below)
            return None
        return chain[:_backup_chain.first_state_length(chain)], generation

    def _compaction_due(self, manifest, base, factor):
        """Whether the chain of `base` reached `factor` times its limits."""
        chain = manifest["chains"][base[0]]
        limit = (self.max_delta_bytes if self.max_delta_bytes is not None
                 else chain[0]["bytes"])
        return (base[1] - 1 >= factor * self.max_deltas
                or _backup_chain.delta_bytes(chain, base[1]) >= factor * limit)

    def _stop_compaction(self, reason):
        """Drops the compaction being written in the background, if any,
        without waiting for it: it stops before its next block, and its
        folder goes at the next publish."""
        compaction, self._compaction = self._compaction, None
        if compaction is not None:
            compaction.stop(reason)

    def stop_compaction(self, timeout=None):
        """Drops the compaction being written in the background, if any,
        and waits up to `timeout` seconds (None: no limit) for its thread
        to stop (it stops between two blocks). `BackupAndRestore` calls it
        at the end of `fit`; the next `save()` due to compact starts again.

        Returns:
            False if the thread was still running after `timeout`.
        """
        with self._lock:
            compaction = self._compaction
            self._stop_compaction("stop_compaction() was called")
        if compaction is None:
            return True
        compaction.thread.join(timeout)
        return not compaction.running

    def _save_in_background(self, snapshot, path, entry_id, kind, folder,
                            metadata, manifest, add, deltas, generation,
                            started):
        """Writes and publishes a delta whose `snapshot` was taken, in a
        thread; returns its BackupEntry (`bytes` 0: not known yet)."""
        def publish(files, table_rows):
            entry = _backup_chain.new_entry(entry_id, kind, folder, files,
                                            table_rows, metadata)
            return self._publish(add(manifest, entry), entry, generation,
                                 deltas, started)

        self._pending = PendingDelta(
            entry_id, snapshot, path, publish, self._publish_lock)
        seconds = time.monotonic() - started
        logger.info("[chief] delta backup %d: copied on the ps in %.2fs, "
                    "being written", entry_id, seconds)
        return BackupEntry(id=entry_id, kind=kind, bytes=0, files=0,
                           table_rows=0, deltas=deltas, metadata=metadata
                           or {}, seconds=seconds)

    def wait(self):
        """Waits for the delta being written in the background, if any, and
        for the folders of dropped backups to be deleted.

        Returns:
            The delta's BackupEntry once published (`seconds`: from the save
            to the publication), or None when none was pending.

        Raises:
            The error that stopped it (it was not published; the next
            backup holds its rows).
        """
        try:
            return self._wait_pending()
        finally:
            self._removal.wait()

    def _wait_pending(self):
        with self._lock:
            pending, self._pending = self._pending, None
            return None if pending is None else pending.wait()

    def _finish_pending(self, saving=False):
        """Ends the delta being written in the background. Its failure is
        logged, but a failed write raises when `saving`: every later
        backup would fail the same way, and training must not go on
        without them unnoticed. The folders of dropped backups may still
        be being deleted."""
        try:
            self._wait_pending()
        except BackupWriteError as error:
            if saving:
                raise
            logger.warning("[chief] %s", error)
        except Exception as error:  # noqa: BLE001  (not fatal: logged)
            logger.warning("[chief] a delta written in the background was "
                           "not published (%s: %s); the next backup holds "
                           "its rows", type(error).__name__, error)

    def _abandon_pending_after_a_ps_loss(self):
        """Drops the delta being written in the background when a ps lost
        its variables since its snapshot, without waiting for it: its copies
        on that ps are gone, and its write, which may be stuck in a call to
        the lost ps, is never published (no restore waits on it)."""
        if self._pending is None or _dirty_rows.GENERATIONS.agree():
            return
        pending, self._pending = self._pending, None
        if not pending.abandon():
            return  # published before the loss was seen
        self._next_id = max(self._next_id, pending.entry_id + 1)
        logger.warning("[chief] a ps lost its variables while a delta was "
                       "written in the background (%s): that delta is "
                       "dropped, the restore takes the backup before it",
                       pending.thread.name)


def _changed_fraction(tables, since):
    """The share of `tables`' bytes (catalog groups: rows with their slots)
    in rows marked after generation `since`: what a delta since then holds
    of them."""
    counts = _dirty_rows.count_marked(
        [_dirty_rows.tracker_of(g.variables[0]) for g in tables], since)
    total = sum(g.nbytes for g in tables)
    return sum(n * g.nbytes / g.parts[0].rows
               for n, g in zip(counts, tables)) / total
