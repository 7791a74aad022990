"""The learning rate each epoch of a `fit` began with, so that an epoch a
restore resumes in begins again for callbacks on the rate it began with."""

import keras

from keras_ps._keras import optimizers

#: The learning rate the epoch of a backup began with, in its state file.
RATE_KEY = "learning_rate_at_epoch_begin"


class EpochRates:
    """{epoch: the learning rate it began with}, for one `fit` call.

    Attributes:
        resuming: the next `begin` is that of an epoch a restore resumes in
            (set by a ps recovery, and by `keep_with` for a fit that starts
            from a backup).
    """

    def __init__(self):
        self._rates, self._epoch, self.resuming = {}, None, False
        self._backup = None

    def keep_with(self, backup):
        """Keeps `state()` in the state file of `backup` (a
        ResumableCallback, or None); a fit that started from one of its
        backups resumes its first epoch (see `begin`)."""
        self._backup = backup
        if backup is not None:
            backup.state_providers[RATE_KEY] = self.state
            self.resuming = backup.restored_state is not None

    def begin(self, epoch, optimizer):
        """Before `on_epoch_begin(epoch)`. An epoch a restore resumes in (a
        ps recovery, or a fit restarted from a backup: `resuming`) begins
        again for callbacks; its learning rate is first set back to the one
        it began with (this process' record, else the restored backup's
        `state()`), so that a callback changing the rate relative to
        its value (`LearningRateScheduler(lambda epoch, lr: lr * 0.5)`)
        does so once for the epoch, not again on the restored rate. A
        learning-rate schedule is left alone, and nothing is read without
        a backup."""
        resuming, self.resuming, self._epoch = self.resuming, False, epoch
        if self._backup is None or \
                not optimizers.has_constant_learning_rate(optimizer):
            return  # nothing to resume from, or nothing to set back
        if resuming:
            rate = self._rates.get(epoch)
            restored = (self._backup.restored_state or {}).get(RATE_KEY)
            if rate is None and restored and restored[0] == epoch:
                rate = restored[1]
            if rate is not None:
                optimizer.learning_rate = rate
                self._rates[epoch] = rate
                return
        self._rates[epoch] = float(
            keras.ops.convert_to_numpy(optimizer.learning_rate))

    def state(self):
        """[epoch, the learning rate it began with] of the epoch begun last
        (None before one, or under a schedule): kept with each backup."""
        if self._epoch not in self._rates:
            return None
        return [self._epoch, self._rates[self._epoch]]
