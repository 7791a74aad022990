"""`Model.fit` on a `ShardedInput`: an epoch is every shard once.

Shards are scheduled a window ahead of the workers (twice the healthy
workers, at least 2) so a backup's wait for the steps in flight stays short;
a joining worker widens the window and takes the next shard at once.
Batch-level callbacks run once per finished shard (the progress bar counts
shards out of the epoch's total); BackupAndRestore also stores the epoch's
shard ledger, so a restarted coordinator skips the shards already done.
"""

import collections
import functools
import logging

import keras
import numpy as np

from keras_ps.training import _fit_epochs
from keras_ps._keras import fit_routing
from keras_ps.training.logs import python_logs
from keras_ps.shards.ledger import ShardLedger, ShardState

logger = logging.getLogger(__name__)

LEDGER_KEY = "shard_ledger"  # in BackupAndRestore's state file
_POLL_SECONDS = 0.5


def _restored_ledger(backup, data, epoch):
    """The backed-up ledger of `epoch`, or None."""
    if backup is None:
        return None
    snapshot = (backup.restored_state or {}).get(LEDGER_KEY)
    if not snapshot or snapshot["epoch"] != epoch:
        return None
    if snapshot.get("seed") != data.seed:
        # A random seed (seed=None) changes on every run: the backup's keeps
        # this epoch's shard order and shuffles the same.
        logger.info("[chief] using the backup's shuffle seed %s",
                    snapshot.get("seed"))
        data.seed = snapshot["seed"]
    return ShardLedger.restore(snapshot, data.descriptions)


def fit(model, coordinator, data, epochs, verbose, callbacks,
        validation_data, validation_steps, validation_batch_size,
        validation_freq, initial_epoch, steps_per_epoch):
    """`model.fit(data)` for a ShardedInput `data`, on `coordinator`."""
    # -1 is TF's "until the data runs out", which is what an epoch of a
    # ShardedInput is: the coordinator knows when every shard is done.
    if steps_per_epoch is not None and not (
            isinstance(steps_per_epoch, (int, np.integer))
            and not isinstance(steps_per_epoch, bool)
            and steps_per_epoch == -1):
        raise ValueError(
            "With a ShardedInput an epoch is every record once, so fit "
            f"takes no steps_per_epoch. Received: steps_per_epoch="
            f"{steps_per_epoch}. Fix: drop steps_per_epoch, or pass -1 "
            "(until the data runs out, as in TF), and use records_per_shard "
            "and batch_size to size the work.")
    strategy = model.distribute_strategy
    fit_routing.symbolic_build(model, strategy, data.element_spec)
    train_shard = data.shard_function(
        coordinator, model.train_step,
        max(1, int(model.steps_per_execution or 1)))
    callback_list = callbacks if isinstance(
        callbacks, keras.callbacks.CallbackList) else \
        keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0,
            verbose=verbose, epochs=epochs, steps=data.num_shards, model=model)
    recovering = _fit_epochs.recovering_callback(callback_list)
    if recovering is not None and \
            recovering.recover_ps == _fit_epochs.LOST_SHARDS:
        raise ValueError(
            f"recover_ps={_fit_epochs.LOST_SHARDS!r} goes on from where "
            "training was, which a ShardedInput's shard ledger cannot follow "
            "yet. Received: a ShardedInput with BackupAndRestore(recover_ps="
            f"{_fit_epochs.LOST_SHARDS!r}). Fix: recover_ps=True (every ps "
            "restored to the newest backup, its ledger with it).")
    model.stop_training = False
    callback_list.on_train_begin()
    backup = _fit_epochs.resumable_callback(callback_list)
    start_epoch = initial_epoch
    resume = backup.resume_position() if backup is not None else None
    if resume is not None:
        start_epoch = resume[0]
        logger.info("[chief] resuming at epoch %d", start_epoch)
    progress = _fit_epochs.Progress(data.num_shards, recovering is not None,
                                    unit="shards")
    progress.keep_with(backup, model)

    def train_from(position):
        training_logs = None
        for epoch_index in range(position[0], epochs):
            epoch = data.epoch(coordinator, epoch_index,
                               _restored_ledger(backup, data, epoch_index))
            if backup is not None:
                backup.state_providers[LEDGER_KEY] = epoch.snapshot
            progress.epoch_complete = functools.partial(
                _complete, epoch_index, epoch.ledger)
            model.reset_metrics()
            progress.rates.begin(epoch_index, model.optimizer)
            callback_list.on_epoch_begin(epoch_index)
            try:
                trained = _run_epoch(model, coordinator, train_shard, epoch,
                                     callback_list, progress)
                coordinator.join()
            except BaseException:
                epoch.abandon()
                raise
            epoch_logs = progress.epoch_metrics(epoch_index, trained)
            summary = epoch.summary()
            epoch_logs.update(summary)
            epoch_logs.update(progress.epoch_logs())
            empty = epoch.ledger.empty_shards()
            if empty:
                logger.warning(
                    "[chief] epoch %d: %d shard(s) had no records: %s",
                    epoch_index, len(empty),
                    [epoch.ledger.description(i) for i in empty[:5]])
            logger.info("[chief] epoch %d: %d of %d shards, %d records; %d "
                        "shard attempts lost, %d records trained twice",
                        epoch_index, summary["shards_done"], summary["shards"],
                        summary["records_trained"], summary["shards_lost"],
                        summary["records_retrained"])
            training_logs = epoch_logs
            if _fit_epochs.finish_epoch(
                    model, callback_list, epoch_index, epoch_logs,
                    validation_data, validation_batch_size or data.batch_size,
                    validation_steps, validation_freq):
                break
        return training_logs

    with _fit_epochs.cancelled_on_error(coordinator):
        training_logs = _fit_epochs.train_with_ps_recovery(
            coordinator, recovering, train_from,
            (start_epoch, resume[1] if resume is not None else 0), progress)
    return _fit_epochs.end_training(model, callback_list, epochs,
                                    training_logs)


def _complete(index, ledger):
    """`index` when every shard of its `ledger` is done, else None."""
    return index if ledger.complete() else None


def _run_epoch(model, coordinator, train_shard, epoch, callback_list,
               progress):
    """Schedules the epoch's shards a window ahead; runs the batch-level
    callbacks as shards finish (batch index = shards done - 1). Returns
    whether it scheduled any shard."""
    ledger = epoch.ledger
    todo = collections.deque(epoch)
    reported = ledger.count(ShardState.DONE)
    scheduled = first = reported
    seen = ledger.changes()
    while True:
        window = max(2, 2 * coordinator.num_healthy())
        while todo and scheduled - ledger.count(ShardState.DONE) < window:
            coordinator.schedule(train_shard, args=(todo.popleft(),))
            scheduled += 1
        # Asked before the count: an epoch that completes after it has its
        # last shards reported to the callbacks (a backup among them) on
        # the next round, not skipped.
        finished = not todo and ledger.complete()
        done = ledger.count(ShardState.DONE)
        progress.reached = progress.at(epoch.epoch, done)
        while reported < done:
            callback_list.on_train_batch_begin(reported)
            logs = python_logs(model.get_metrics_result())
            callback_list.on_train_batch_end(reported, logs)
            reported += 1
            if model.stop_training:
                return scheduled > first
        if finished:
            return scheduled > first
        coordinator.done()  # raises a shard's error (and a ps failure)
        coordinator.raise_if_no_workers()
        seen = ledger.wait_for_change(seen, _POLL_SECONDS)
