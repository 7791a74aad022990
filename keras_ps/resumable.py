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
    """

    def __init__(self):
        super().__init__()
        self.state_providers = {}
        self.restored_state = None

    def resume_position(self):
        """(epoch, step within the epoch) to resume at, or None (fresh start)."""
        return None
