"""BackupAndRestore for parameter-server training: resume mid-epoch after a
coordinator crash."""

import json
import logging
import os
import shutil
import sys

from keras_ps.callbacks import _backup_cost
from keras_ps.callbacks import _backup_modes
from keras_ps.callbacks import _state_file
from keras_ps.callbacks import _weights_files
from keras_ps.callbacks._preemption import PreemptionNotice
from keras_ps.callbacks._preemption import PsNotices
from keras_ps.backups import _chain
from keras_ps.backups import _checks
from keras_ps.backups import _job_lock
from keras_ps.coordinator import ClusterCoordinator
from keras_ps.backups import incremental_backup
from keras_ps.backups.incremental_backup import IncrementalBackup
from keras_ps.training._fit_epochs import LOST_SHARDS, ResumableCallback

logger = logging.getLogger(__name__)

_INCREMENTAL_FOLDER = "incremental"
# incremental="auto" turns incremental backups on from this many bytes of
# row-tracked tables (with their optimizer slots).
AUTO_INCREMENTAL_MIN_BYTES = 256 * 2**20


class BackupAndRestore(ResumableCallback):
    """Backs up training so a killed coordinator resumes where it stopped.

    Each backup holds the model's and the optimizer's weights and the
    position in training (epoch and step within the epoch). With a
    `keras_ps.ShardedInput` it also holds the epoch's shard ledger: a resumed
    epoch skips the shards already done, and `save_freq` counts shards.
    When the same script starts again with the same `backup_dir`, `fit`
    loads the newest backup and continues from that epoch and step, so
    `optimizer.iterations` ends at the planned total (plus at most one packed
    execution per worker that ran twice under at-least-once execution).

    A backup waits for the steps in flight to finish first, so it is
    consistent: every step it counts is in its weights. Backups are written
    to a new file and then published by an atomic rename of a small state
    file, so a crash while writing leaves the previous backup intact.

    Args:
        backup_dir: where backups live (created if missing). One directory
            per training job: `fit` locks it while it runs (see
            `keras_ps.errors.BackupDirInUseError`).
        save_freq: `"epoch"` (at each epoch end), an integer `N` (every `N`
            steps, and at each epoch end), or False (only before a
            preemption: needs `save_before_preemption=True`). Each
            backup's INFO log line says how long training waited for it; an
            epoch whose backups took a quarter of it or more is warned of
            once per `fit`, naming the least save_freq that could bring that
            near 5%.
        delete_checkpoint: delete `backup_dir` when training finishes.
        save_before_preemption: True: SIGTERM (a preemption notice, a pod
            deletion, `docker stop`) during `fit` waits for the next step
            boundary, where a backup is written, then goes to its handler
            from before `fit` (by default the process ends, status 143);
            the job started again resumes at that step. `fit` must run in
            the main thread. After the last step the backup directory is
            kept, so a restart finds training done. A ps' own SIGTERM (a ps
            of `python -m keras_ps.server`) is heard too: the ps serves on
            while a backup is written at the next step boundary, then
            stops, and `fit` recovers it from that backup (`recover_ps`)
            with no step trained twice. See docs/ps_recovery.md.
        incremental: `"auto"` (default), True or False. True: backups are
            those of `keras_ps.IncrementalBackup`: a full backup, then at
            each `save_freq` a delta holding only the table rows the
            optimizer changed since the previous backup (with their
            optimizer slot rows) and every other variable whole, written by
            each ps itself; a new full backup after `max_deltas` deltas or
            once the deltas add up to `max_delta_bytes` (default: the full
            backup's size). Restoring loads the full backup and its deltas.
            The tables are those a row-wise optimizer updates (SGD without
            momentum, Adagrad, Ftrl, `keras_ps.optimizers.LazyAdam`); under
            dense Adam every row moves at every step, so a delta would hold
            the whole table. A `keras_ps.layers.DynamicEmbedding` is one
            table per ps, with its ids and counters; its incremental
            backups restore into as many ps as wrote them only.
            `backup_dir` must then be one folder shared by the chief and
            every ps at the same path (checked at the start).
            False: each backup is a Keras weights file written through the
            chief. `"auto"`: True when the model's row-tracked tables and
            their slots hold at least 256 MiB (`AUTO_INCREMENTAL_MIN_BYTES`)
            and `backup_dir` is shared with every ps, else False. Below
            that size a full backup takes about a second and keeps the
            portable Keras format (a plain Keras model loads it); above it,
            each backup costs in proportion to what the steps since the
            previous one changed (a 10M x 64 LazyAdam table is 7.7 GB whole).
        max_deltas: with `incremental`, deltas between full backups.
        max_delta_bytes: with `incremental`, bytes of deltas after which the
            next backup is full (None: the size of the full backup). Such
            a full backup (compaction) is written by the ps while training
            goes on and published with the delta of the next backup (see
            `keras_ps.IncrementalBackup`'s `background_compaction`); one
            not finished when `fit` ends is dropped.
        background_deltas: with `incremental`, False (default): training
            waits until each delta is published. True: a delta holds
            training only while each ps copies the rows it holds; the ps
            write the files and the delta is published while training goes
            on (see `keras_ps.IncrementalBackup`). Off by default: with a ps
            lost while a delta is written, a recovery in the same `fit`
            once ended with `optimizer.iterations` short of the planned
            steps, a case not yet understood; and where the ps share their
            cores with the workers it trained slower than waiting for each
            delta, at every backup interval measured (100 to 1,000 steps,
            docs/incremental_backups.md).
        recover_ps: True (default): when a parameter server is lost during
            `fit` (killed and brought back on its address by a restart
            policy, or replaced), `fit` waits for it to answer again, gives
            it back the variables it held, restores every ps from the
            newest backup and goes on from the backup's epoch and step: the
            same `fit` call finishes. Steps since that backup are trained
            again (the epoch logs count them as `steps_rolled_back`, and the
            recoveries as `ps_recoveries`). Without a backup yet, or with
            False, a lost ps ends `fit` with
            `keras_ps.errors.ParameterServerUnavailableError`.
            `"lost_shards"`: the same, but only the variables that lived on
            the lost ps are restored from the newest backup; the other ps
            keep theirs and training goes on from where it was, not from
            the backup (only the executions the loss interrupted run again,
            counted in `steps_rolled_back`). The lost ps' variables lose
            their updates since that backup (rows of a table on it, and
            whatever dense weights and optimizer state it held): the model
            is no longer one backup's state, which is the trade for not
            retraining the steps since the backup. `optimizer.iterations`
            is carried forward if it lived there. The next backup is a full
            one. For step-based `fit` (not a `ShardedInput`), and not with a
            `keras_ps.layers.DynamicEmbedding` (its key maps are not
            variables).
        double_checkpoint: Keras 3's argument. True: a Keras weights backup
            keeps the one before it, which is restored (with a warning)
            when the newest file cannot be read; twice the disk. False
            (default): such a file ends `fit` with `BackupCorruptError`
            naming it. Incremental backups always keep the chain before the
            newest full backup and fall back to the newest intact one. A
            damaged state file (backup_state.json) is such an error too,
            but for incremental backups, whose manifest holds the same.

    Example:
    ```python
    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=100,
              callbacks=[keras_ps.callbacks.BackupAndRestore("/tmp/backup",
                                                             save_freq=20)])
    ```
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True,
                 save_before_preemption=False, recover_ps=True,
                 incremental="auto", max_deltas=20, max_delta_bytes=None,
                 background_deltas=False, double_checkpoint=False):
        incremental, recover_ps = _backup_modes.check_modes(incremental,
                                                            recover_ps)
        super().__init__(recover_ps=recover_ps)
        if not backup_dir:
            raise ValueError(
                "BackupAndRestore needs a backup directory. Received: "
                f"backup_dir={backup_dir!r}.")
        if save_freq != "epoch" and save_freq is not False and not (
                isinstance(save_freq, int) and not isinstance(save_freq, bool)
                and save_freq > 0):
            raise ValueError(
                "save_freq must be 'epoch', a positive integer number of "
                "steps, or False (backups before a preemption only). "
                f"Received: save_freq={save_freq!r}.")
        _checks.check_bools(delete_checkpoint=delete_checkpoint,
                            save_before_preemption=save_before_preemption,
                            double_checkpoint=double_checkpoint,
                            background_deltas=background_deltas)
        if save_freq is False and not save_before_preemption:
            raise ValueError(
                "save_freq=False writes backups only before a preemption, "
                "but save_before_preemption is False: nothing would be "
                "backed up. Fix: save_freq='epoch' or a number of steps, or "
                "save_before_preemption=True.")
        self.backup_dir = os.fspath(backup_dir)
        _checks.check_directory(self.backup_dir, "backup_dir")
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.save_before_preemption = bool(save_before_preemption)
        self.double_checkpoint = bool(double_checkpoint)
        self.short_lead = self.save_before_preemption  # acts within executions
        self._notice, self._ps_notices = PreemptionNotice(), PsNotices()
        self._newest_backup_at = None  # (epoch, step)
        self._state_path = os.path.join(self.backup_dir, _state_file.FILE_NAME)
        self._resume = None
        self._epoch = 0
        self._steps_since_save = 0
        self._last_step_seen = -1
        self._serial = 0
        self.incremental = incremental
        incremental_backup.check_options(max_deltas, max_delta_bytes)
        self._lock = _job_lock.JobLock(self.backup_dir, "BackupAndRestore")
        # The incremental backups, in a folder of backup_dir, are written
        # under this callback's lock: they take none of their own.
        self._incremental_options = dict(
            max_deltas=max_deltas, max_delta_bytes=max_delta_bytes,
            background_deltas=bool(background_deltas), lock=self._lock)
        self._incremental_path = os.path.join(self.backup_dir,
                                              _INCREMENTAL_FOLDER)
        self._incremental = None
        self._cost = _backup_cost.BackupCost()

    # -- what fit asks ------------------------------------------------------------
    def resume_position(self):
        """(epoch, step within the epoch) to resume at, or None (fresh start)."""
        return self._resume

    # -- Keras hooks ----------------------------------------------------------------
    def on_train_begin(self, logs=None):
        """Loads the newest backup, if any, and remembers where to resume.

        Raises:
            ValueError: the backup was written by a different model, an
                environment variable a backup reads has a bad value, or
                a file is where `backup_dir` should be.
            BackupDirInUseError: another job (or another callback of this
                process whose fit has not ended) holds `backup_dir`.
        """
        _checks.check_environment()  # not at the first backup, after steps
        _checks.make_directory(self.backup_dir, "backup_dir")
        self._lock.acquire()  # held until fit ends (on_train_end, on_fit_exit)
        self._cost.begin_fit()
        try:
            self._begin()
        except BaseException:
            self._lock.release()
            raise

    def _begin(self):
        if self.save_before_preemption:
            _backup_modes.check_preemption_mode(self.model)
            self._notice.install()
            self._ps_notices.start(self.model.distribute_strategy)
        self._resume = None
        self.restored_state = None
        self._incremental = _backup_modes.incremental_writer(
            self.model, self.incremental, self._incremental_path,
            self._incremental_options, AUTO_INCREMENTAL_MIN_BYTES)
        if self.recover_ps == LOST_SHARDS:
            _backup_modes.check_lost_shards_mode(self.model)
        self.restore_latest()

    def restore_latest(self):
        """Loads the newest backup into the model and its optimizer.

        `fit` calls it at its start, and again after it gave a lost
        parameter server its variables back.

        Returns:
            (epoch, step within the epoch) of the backup, or None when there
            is none.

        Raises:
            ValueError: the backup was written by a different model.
        """
        state = self._read_state()
        if state is None:
            return None
        if state.get("weights") is None:
            return self._restore_incremental()
        state = _weights_files.load(self.model, self.backup_dir, state,
                                    self._mismatch)
        self._serial = state["serial"]
        self._resume = (state["epoch"], state["step"])
        self.restored_state = state.get("extra", {})
        logger.info("[chief] restored backup %s: epoch %d, step %d",
                    state["weights"], state["epoch"], state["step"])
        return self._resume

    def _mismatch(self, weights, error):
        # Keras reports every failed assignment as a ValueError, a lost
        # ps' among them: that one is the ps' loss, not a wrong model.
        _backup_modes.raise_if_ps_lost(self.model, error)
        detail = " ".join(str(error).split())
        if len(detail) > 300:
            detail = detail[:300] + "..."
        raise ValueError(
            f"The backup {weights!r} was written by a different model and "
            f"does not load into model {self.model.name!r}: "
            f"{detail} Received: backup_dir="
            f"{self.backup_dir!r}. Fix: give a changed model its own "
            "backup_dir, or delete the backup directory to train from "
            "scratch.") from error

    def restore_lost_shards(self, lost):
        """Loads the newest backup into the variables of the ps in `lost`
        (indices) only; the others keep theirs.

        Returns:
            (epoch, step within the epoch) of that backup.
        """
        strategy = self.model.distribute_strategy
        lost_variables = [v for i in lost for v in strategy.variables_on_ps(i)]
        devices = {v.device for v in lost_variables}
        state = self._read_state()
        if state.get("weights") is None:
            backup = self._incremental or IncrementalBackup(
                self.model, self._incremental_path,
                **self._incremental_options)
            state = backup.restore(devices=devices).metadata
        else:
            _weights_files.load_keeping(
                self.model, os.path.join(self.backup_dir, state["weights"]),
                [v for i in range(strategy.num_ps) if i not in lost
                 for v in strategy.variables_on_ps(i)])
        logger.warning("[chief] restored the variables of ps %s (%d) from "
                       "the backup of epoch %d, step %d; the other ps kept "
                       "theirs", sorted(lost), len(lost_variables),
                       state["epoch"], state["step"])
        return state["epoch"], state["step"]

    def _restore_incremental(self):
        # Backups written incrementally restore so whatever `incremental` is
        # now; a damaged newest one falls back to the newest complete one.
        backup = self._incremental or IncrementalBackup(
            self.model, self._incremental_path, **self._incremental_options)
        entry = backup.restore()
        if entry is None:
            return None
        state = entry.metadata
        self._serial = state["serial"]
        self._resume = (state["epoch"], state["step"])
        self.restored_state = state.get("extra", {})
        logger.info("[chief] restored %s backup %d (%d deltas): epoch %d, "
                    "step %d", entry.kind, entry.id, entry.deltas,
                    state["epoch"], state["step"])
        return self._resume

    def has_backup(self):
        return self._read_state() is not None

    def describe(self):
        return (f"BackupAndRestore(backup_dir={self.backup_dir!r}, "
                f"save_freq={self.save_freq!r}, incremental="
                f"{self._incremental is not None})")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._cost.begin_epoch()
        self._last_step_seen = -1
        if self._resume is not None and epoch == self._resume[0]:
            self._last_step_seen = self._resume[1] - 1
        self._steps_since_save = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps_since_save += batch - self._last_step_seen
        self._last_step_seen = batch
        if self._notice.received or self._ps_notices.due() or (
                self.save_freq not in ("epoch", False)
                and self._steps_since_save >= self.save_freq):
            self._backup(self._epoch, batch + 1)
        self._end_if_preempted()

    def on_epoch_end(self, epoch, logs=None):
        if (self.save_freq is not False or self._notice.received
                or self._ps_notices.due()):
            self._backup(epoch + 1, 0)
        self._cost.end_epoch(epoch + 1, self.save_freq)
        self._end_if_preempted()

    def on_train_end(self, logs=None):
        end = ((self.params or {}).get("epochs", self._epoch + 1), 0)
        if self._notice.received and self._newest_backup_at != end:
            self._backup(*end)  # a job started again finds training done
        self._finish_writes()
        self._ps_notices.stop()
        logger.info("[chief] %s", self._cost.summary())
        if self._notice.received:
            logger.warning("[chief] training ended after SIGTERM: %s is "
                           "kept", self.backup_dir)
        elif self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)
        self._lock.release()

    def on_fit_exit(self):
        self._lock.release()  # fit raised: on_train_end was not called
        self._ps_notices.stop()
        if not self._notice.received:
            return self._notice.uninstall()
        error = sys.exc_info()[1]  # fit's, when it raised after the signal
        logger.warning("[chief] fit ended%s after SIGTERM; passing the "
                       "signal on", f" by {error!r}" if error else "")
        self._notice.deliver()

    # -- preemption notices -------------------------------------------------------
    def _end_if_preempted(self):
        """After SIGTERM, once the backup is written and published: the
        signal goes to its previous handler (by default the process ends).
        A ps released after its own notice is recovered from at once."""
        self._ps_notices.raise_once_gone()
        if not self._notice.received:
            return
        self._finish_writes()
        logger.warning("[chief] SIGTERM: backup %d (epoch %d, step %d) "
                       "written; passing the signal on", self._serial,
                       *self._newest_backup_at)
        self._notice.deliver()

    def _finish_writes(self):
        if self._incremental is not None:
            _backup_modes.finish_incremental(self._incremental)

    # -- backups ----------------------------------------------------------------------
    def _backup(self, epoch, step):
        # Wait for the steps in flight, so the backup holds every step it counts.
        ClusterCoordinator(self.model.distribute_strategy).join()
        started = self._cost.started()
        self._serial += 1
        extra = {key: provide() for key, provide in self.state_providers.items()}
        state = {"epoch": epoch, "step": step, "serial": self._serial,
                 "extra": extra}
        _backup_modes.written_again_on_dropped_connections(
            self.model, lambda: self._write(state), f"backup {self._serial}")
        self._steps_since_save = 0
        self._newest_backup_at = (epoch, step)
        logger.info("[chief] backup %d written: epoch %d, step %d (training "
                    "waited %.2f s)", self._serial, epoch, step,
                    self._cost.written(started))
        self._ps_notices.release(self._incremental.wait if self._incremental
                                 else lambda: None, self._serial, epoch, step)

    def _write(self, state):
        if self._incremental is not None:
            # Published by the manifest's rename; the state file follows.
            entry = self._incremental.save(metadata=state)
            state = dict(state, weights=None, incremental=entry.id,
                         kind=entry.kind)
            _chain.write_atomically(self._state_path, json.dumps(state))
            _weights_files.remove_unlisted(self.backup_dir, state)
        else:
            _weights_files.write(self.model, self.backup_dir,
                                 self._state_path, state, self._read_state(),
                                 self.double_checkpoint)

    def _read_state(self):
        return _state_file.read(self._state_path, self._incremental_path)
