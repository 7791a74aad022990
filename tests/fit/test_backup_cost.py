"""BackupAndRestore says what its backups cost training: each backup's
INFO line has the time training waited for it, the end of `fit` sums them,
and an epoch whose backups took a quarter of it or more is warned of once
per `fit`, with a save_freq that would bring their share near 5%. The
policy with a clock of the test's; then a real `fit` on the shared cluster,
whose clock the test moves from a callback (the steps) and from a piece of
each backup (the writing), so the shares are the test's, not the machine's.
"""

import logging
import re

import keras
import numpy as np
import pytest

import keras_ps
from _clock import FakeClock  # tests/_clock.py
from keras_ps.callbacks import _backup_cost

X = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
Y = (X.sum(1, keepdims=True) > 0).astype("float32")


def test_suggested_save_freq_brings_the_share_to_the_target():
    # Backups of c seconds every 100 steps of d seconds took half the time:
    # c = 100 d. At 1,900 steps: 100 d / (100 d + 1,900 d) = 5%.
    assert _backup_cost.suggested_save_freq(100, 0.5) == 1900
    assert _backup_cost.suggested_save_freq(100, 0.05) == 100
    # Never fewer steps than now.
    assert _backup_cost.suggested_save_freq(100, 0.01) == 100
    with pytest.raises(ValueError, match="share=1.0"):
        _backup_cost.suggested_save_freq(100, 1.0)


def test_an_epoch_over_a_quarter_is_warned_of_once_per_fit(caplog):
    caplog.set_level(logging.WARNING, logger=_backup_cost.__name__)
    clock = FakeClock()
    cost = _backup_cost.BackupCost(clock)

    def epoch(step_seconds, backup_seconds, backups):
        cost.begin_epoch()
        for _ in range(backups):
            clock.now += step_seconds
            started = cost.started()
            clock.now += backup_seconds
            assert cost.written(started) == pytest.approx(backup_seconds)

    # The fit's first backup (the full one, with incremental backups) is
    # left out of the share: 30 s, then one of 1 s against 9 s of steps.
    cost.begin_epoch()
    started = cost.started()
    clock.now += 30.0
    cost.written(started)
    epoch(step_seconds=9.0, backup_seconds=1.0, backups=1)  # 10%
    cost.end_epoch(1, 100)
    assert caplog.records == []
    epoch(step_seconds=1.0, backup_seconds=1.0, backups=4)  # 50%
    cost.end_epoch(2, 100)
    [record] = caplog.records
    assert ("Backups held training for 50% of epoch 2 (4.0 s of 8.0 s: 4 "
            "backup(s), 1.00 s each, save_freq=100)") in record.getMessage()
    assert "near 5%, save_freq must be 1900 at the very least" in (
        record.getMessage())
    epoch(step_seconds=1.0, backup_seconds=3.0, backups=1)  # 75%, same fit
    cost.end_epoch(3, 100)
    assert len(caplog.records) == 1
    # 40 + 8 + 4 s, of which 31 + 4 + 3 s backups.
    assert cost.summary() == ("7 backup(s) held training for 38.0 s (73% "
                              "of the fit's 52.0 s)")
    cost.begin_fit()  # a later fit may warn again (its first left out)
    epoch(step_seconds=1.0, backup_seconds=1.0, backups=2)
    cost.end_epoch(1, "epoch")
    assert len(caplog.records) == 2
    assert "Longer epochs (steps_per_epoch) back up less often" in (
        caplog.records[1].getMessage())


class _Steps(keras.callbacks.Callback):
    """Each execution's end moves the clock as if its steps took 1 s each."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.seen = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.seen = -1

    def on_train_batch_end(self, batch, logs=None):
        self.clock.now += batch - self.seen
        self.seen = batch


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backup_seconds, warned", [(0.1, False),
                                                    (4.0, True)])
def test_fit_says_what_its_backups_held_training(strategy, tmp_path, caplog,
                                                 backup_seconds, warned):
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=2)
    backup = keras_ps.callbacks.BackupAndRestore(str(tmp_path / "backup"),
                                                 save_freq=4)
    backup._cost = _backup_cost.BackupCost(clock)

    def writing():
        clock.now += backup_seconds  # inside the backup, after the join
        return None

    backup.state_providers["slow_part"] = writing
    # The steps' callback first: its time is counted before a backup starts.
    model.fit(X, Y, batch_size=8, epochs=2, steps_per_epoch=8, verbose=0,
              callbacks=[_Steps(clock), backup])
    assert int(model.optimizer.iterations.numpy()) == 16
    waited = [float(m) for m in re.findall(
        r"backup \d+ written: epoch \d+, step \d+ \(training waited "
        r"([0-9.]+) s\)", caplog.text)]
    # Every 4 steps and at each epoch's end: 2 + 1 a epoch.
    assert waited == [pytest.approx(backup_seconds, abs=0.01)] * 6, (
        caplog.text)
    total = 6 * backup_seconds
    share = total / (total + 16)
    assert (f"6 backup(s) held training for {total:.1f} s ({share:.0%} of "
            "the fit's") in caplog.text, caplog.text
    warnings = [r.getMessage() for r in caplog.records
                if "Backups held training" in r.getMessage()]
    if warned:
        # Epoch 1: 3 backups of 4 s against 8 s of steps, the first left
        # out: 50%.
        assert warnings == [
            "[chief] Backups held training for 50% of epoch 1 (8.0 s of "
            "16.0 s: 2 backup(s), 4.00 s each, save_freq=4). Backing up "
            "less often costs less, but less than in proportion (a delta "
            "over more steps holds more rows): for that share to fall near "
            "5%, save_freq must be 76 at the very least, and a lost ps or "
            "coordinator then rolls back up to that many steps (shards, with "
            "a ShardedInput). See 'How often to back up' in "
            "docs/incremental_backups.md."], warnings
    else:
        assert warnings == [], warnings
