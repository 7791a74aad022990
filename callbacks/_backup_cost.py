"""What `BackupAndRestore`'s backups cost training, said where a user sees
it: the time training waited for each backup, from the end of the steps in
flight to the backup's publication (the steps' own time, the join before
it, is training and not counted), and a warning, once per `fit`, when the
backups of an epoch took a large share of it, with the smallest `save_freq`
that could bring that share near `TARGET_SHARE`. The first backup of a
`fit` is left out of the share: with incremental backups it is the full
one, whose cost `save_freq` does not change."""

import logging
import math
import time

logger = logging.getLogger(__name__)

# An epoch whose backups took this share of its time or more is warned of.
WARN_SHARE = 0.25
# The share of an epoch the suggested save_freq aims at.
TARGET_SHARE = 0.05


def suggested_save_freq(save_freq, share, target=TARGET_SHARE):
    """The `save_freq` (steps) whose backups would take about `target` of
    the time, given that backups every `save_freq` steps took `share` of
    it; each backup is assumed to cost what it did (a delta covering more
    steps holds more rows, so the share found is higher: a lower bound).

    Args:
        save_freq: steps between two backups, a positive integer.
        share: the backups' share of the time, in [0, 1).
        target: the share aimed at, in (0, 1).
    """
    if not 0 <= share < 1 or not 0 < target < 1:
        raise ValueError(f"share must be in [0, 1) and target in (0, 1). "
                         f"Received: share={share!r}, target={target!r}.")
    # Backup time over training time goes from share / (1 - share) to
    # target / (1 - target) when the steps between backups grow by that.
    growth = (share / (1 - share)) / (target / (1 - target))
    return max(save_freq, int(math.ceil(save_freq * growth)))


def advice(epoch, waited, backups, epoch_seconds, save_freq):
    """The warning for an epoch whose `backups` backups held training for
    `waited` of its `epoch_seconds` seconds, or None when their share is
    under `WARN_SHARE`."""
    if backups == 0 or epoch_seconds <= 0:
        return None
    share = min(waited / epoch_seconds, 0.99)
    if share < WARN_SHARE:
        return None
    said = (f"Backups held training for {share:.0%} of epoch {epoch} "
            f"({waited:.1f} s of {epoch_seconds:.1f} s: {backups} backup(s), "
            f"{waited / backups:.2f} s each, save_freq={save_freq!r}). ")
    if isinstance(save_freq, int):
        fix = ("Backing up less often costs less, but less than in "
               "proportion (a delta over more steps holds more rows): for "
               f"that share to fall near {TARGET_SHARE:.0%}, save_freq must "
               f"be {suggested_save_freq(save_freq, share)} at the very "
               "least, and a lost ps or coordinator then rolls back up to "
               "that many steps (shards, with a ShardedInput).")
    else:
        fix = ("Longer epochs (steps_per_epoch) back up less often; a lost "
               "ps or coordinator then rolls back up to an epoch.")
    return said + fix + (" See 'How often to back up' in "
                         "docs/incremental_backups.md.")


class BackupCost:
    """The time training waited for backups, per epoch and per `fit`.

    Args:
        clock: `() -> seconds`, `time.monotonic` by default.
    """

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self.begin_fit()

    def begin_fit(self):
        """A `fit` begins: counts from zero, and may warn once again."""
        self._warned = False
        self.total_seconds = 0.0
        self.total_backups = 0
        self._fit_began = self._clock()
        self.begin_epoch()

    def begin_epoch(self):
        self._epoch_began = self._clock()
        self._epoch_seconds = 0.0
        self._epoch_backups = 0
        self._epoch_left_out = 0.0  # the fit's first backup

    def started(self):
        """A backup starts (the steps in flight have ended): its start."""
        return self._clock()

    def written(self, started):
        """The backup begun at `started` is published; returns the seconds
        training waited for it."""
        seconds = self._clock() - started
        if self.total_backups == 0:
            self._epoch_left_out += seconds
        else:
            self._epoch_seconds += seconds
            self._epoch_backups += 1
        self.total_seconds += seconds
        self.total_backups += 1
        return seconds

    def end_epoch(self, epoch, save_freq):
        """The epoch (its last backup written) ends: warns, once per `fit`,
        when its backups took `WARN_SHARE` of it or more."""
        elapsed = self._clock() - self._epoch_began - self._epoch_left_out
        said = advice(epoch, self._epoch_seconds, self._epoch_backups,
                      elapsed, save_freq)
        if said is not None and not self._warned:
            self._warned = True
            logger.warning("[chief] %s", said)

    def summary(self):
        """A line on the `fit`'s backups and the time they held training."""
        elapsed = self._clock() - self._fit_began
        share = self.total_seconds / elapsed if elapsed > 0 else 0.0
        return (f"{self.total_backups} backup(s) held training for "
                f"{self.total_seconds:.1f} s ({share:.0%} of the fit's "
                f"{elapsed:.1f} s)")
