"""Callbacks that tell `fit` where to resume, and keep state with their backups."""

import keras


class ResumableCallback(keras.callbacks.Callback):
    """A callback that tells `fit` where to resume after `on_train_begin`.

    `keras_ps.callbacks.BackupAndRestore` is one: after loading a backup it
    returns the (epoch, step within the epoch) the backup was taken at.

    Attributes:
        state_providers: name -> callable returning a JSON-able value, saved
            with each backup (fit on a `keras_ps.ShardedInput` stores the
            epoch's shard ledger here).
        restored_state: the values restored with the newest backup (a dict),
            or None.
        recover_ps: whether `fit` gives a lost parameter server its
            variables back and continues from `restore_latest()` (instead
            of raising `ParameterServerUnavailableError`).
    """

    def __init__(self, recover_ps=False):
        super().__init__()
        self.state_providers = {}
        self.restored_state = None
        self.recover_ps = recover_ps

    def restore_latest(self):
        """Loads the newest backup; returns its (epoch, step) or None."""
        return None

    def has_backup(self):
        """Whether a backup exists to restore from."""
        return False

    def describe(self):
        """Where the backups are, for error messages."""
        return type(self).__name__

    def resume_position(self):
        """(epoch, step within the epoch) to resume at, or None (fresh start)."""
        return None
