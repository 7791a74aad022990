"""BackupAndRestore for parameter-server training: resume mid-epoch after a
coordinator crash."""

import json
import logging
import os
import shutil

from keras_ps import _files
from keras_ps.coordinator import ClusterCoordinator
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.strategy import ParameterServerStrategy
from keras_ps.resumable import ResumableCallback

logger = logging.getLogger(__name__)

_STATE_FILE = "backup_state.json"


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
        backup_dir: where backups live (created if missing). Use one
            directory per training job.
        save_freq: `"epoch"` (at each epoch end) or an integer `N` (every `N`
            steps, and at each epoch end).
        delete_checkpoint: delete `backup_dir` when training finishes.
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

    Example:
    ```python
    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=100,
              callbacks=[keras_ps.callbacks.BackupAndRestore("/tmp/backup",
                                                             save_freq=20)])
    ```
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True,
                 recover_ps=True):
        if not isinstance(recover_ps, bool):
            raise TypeError(
                "recover_ps must be True or False. Received: "
                f"recover_ps={recover_ps!r}.")
        super().__init__(recover_ps=recover_ps)
        if not backup_dir:
            raise ValueError(
                "BackupAndRestore needs a backup directory. Received: "
                f"backup_dir={backup_dir!r}.")
        if save_freq != "epoch" and not (
                isinstance(save_freq, int) and not isinstance(save_freq, bool)
                and save_freq > 0):
            raise ValueError(
                "save_freq must be 'epoch' or a positive integer number of "
                f"steps. Received: save_freq={save_freq!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._state_path = os.path.join(self.backup_dir, _STATE_FILE)
        self._resume = None
        self._epoch = 0
        self._steps_since_save = 0
        self._last_step_seen = -1
        self._serial = 0

    # -- what fit asks ------------------------------------------------------------
    def resume_position(self):
        """(epoch, step within the epoch) to resume at, or None (fresh start)."""
        return self._resume

    # -- Keras hooks ----------------------------------------------------------------
    def on_train_begin(self, logs=None):
        """Loads the newest backup, if any, and remembers where to resume.

        Raises:
            ValueError: the backup was written by a different model.
        """
        os.makedirs(self.backup_dir, exist_ok=True)
        self._resume = None
        self.restored_state = None
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
        weights = os.path.join(self.backup_dir, state["weights"])
        try:
            self.model.load_weights(weights)
        except ValueError as error:
            # Keras reports every failed assignment as a ValueError, a lost
            # ps' among them: that one is the ps' loss, not a wrong model.
            self._raise_if_ps_lost(error)
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
        self._serial = state["serial"]
        self._resume = (state["epoch"], state["step"])
        self.restored_state = state.get("extra", {})
        logger.info("[chief] restored backup %s: epoch %d, step %d",
                    weights, state["epoch"], state["step"])
        return self._resume

    def _raise_if_ps_lost(self, error):
        strategy = self.model.distribute_strategy
        if not isinstance(strategy, ParameterServerStrategy):
            return  # a model outside keras_ps: no ps to lose
        lost = ClusterCoordinator(strategy).lost_parameter_servers()
        if lost:
            raise ParameterServerUnavailableError(
                f"Parameter server(s) {sorted(lost)} at "
                f"{[lost[i] for i in sorted(lost)]} were lost while the backup "
                "was being restored.") from error

    def has_backup(self):
        return self._read_state() is not None

    def describe(self):
        return (f"BackupAndRestore(backup_dir={self.backup_dir!r}, "
                f"save_freq={self.save_freq!r})")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._last_step_seen = -1
        if self._resume is not None and epoch == self._resume[0]:
            self._last_step_seen = self._resume[1] - 1
        self._steps_since_save = 0

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        self._steps_since_save += batch - self._last_step_seen
        self._last_step_seen = batch
        if self._steps_since_save >= self.save_freq:
            self._backup(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._backup(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    # -- backups ----------------------------------------------------------------------
    def _backup(self, epoch, step):
        # Wait for the steps in flight, so the backup holds every step it counts.
        ClusterCoordinator(self.model.distribute_strategy).join()
        self._serial += 1
        name = f"backup-{self._serial}.weights.h5"
        path = os.path.join(self.backup_dir, name)
        self.model.save_weights(path, overwrite=True)
        previous = self._read_state()
        extra = {key: provide() for key, provide in self.state_providers.items()}
        _files.write_atomically(self._state_path, json.dumps(
            {"epoch": epoch, "step": step, "serial": self._serial,
             "weights": name, "extra": extra}))
        if previous is not None and previous["weights"] != name:
            try:
                os.remove(os.path.join(self.backup_dir, previous["weights"]))
            except FileNotFoundError:
                pass
        self._steps_since_save = 0
        logger.info("[chief] backup %d written: epoch %d, step %d",
                    self._serial, epoch, step)

    def _read_state(self):
        try:
            with open(self._state_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
