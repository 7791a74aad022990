"""What every `fit` loop does at the end of an epoch and of training (the
steps loop in keras_ps/training/training.py and the shards loop in
keras_ps/training/sharded_fit.py), and the callbacks that tell it where to
resume (`ResumableCallback`)."""

import collections
import contextlib
import logging
import time

import keras
import tensorflow as tf

from keras_ps.coordinator.values import RemoteValueStatus
from keras_ps.errors import ParameterServerRecoveryError
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.training._epoch_rates import EpochRates
from keras_ps.training.inputs import should_validate
from keras_ps.training.logs import python_logs

logger = logging.getLogger(__name__)


def validation_logs(model, validation_data, batch_size, steps):
    """`val_`-prefixed metrics of `model.evaluate` on `validation_data`
    (evaluated on the workers: the model's evaluate is keras_ps')."""
    val_x, val_y, val_w = keras.utils.unpack_x_y_sample_weight(
        validation_data) if isinstance(validation_data, tuple) else (
        validation_data, None, None)
    logs = model.evaluate(val_x, val_y, sample_weight=val_w,
                          batch_size=batch_size, steps=steps, verbose=0,
                          return_dict=True)
    return {f"val_{k}": v for k, v in logs.items()}


def finish_epoch(model, callback_list, epoch, epoch_logs, validation_data,
                 validation_batch_size, validation_steps, validation_freq):
    """Adds the validation logs when this epoch validates, ends the epoch's
    callbacks; returns whether training stops here."""
    if validation_data is not None and should_validate(epoch, validation_freq):
        epoch_logs.update(validation_logs(
            model, validation_data, validation_batch_size, validation_steps))
    callback_list.on_epoch_end(epoch, epoch_logs)
    return model.stop_training


def end_training(model, callback_list, epochs, training_logs):
    """Finalizes the optimizer's variables, ends the callbacks; the history."""
    if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callback_list.on_train_end(logs=training_logs)
    return model.history


# -- losing a parameter server --------------------------------------------------
# recover_ps value of a ResumableCallback: restore only the lost ps' variables.
LOST_SHARDS = "lost_shards"
# Recoveries in a row with no step trained between them: past this, the loss
# keeps coming back (a ps that crashes at start, a backup that kills it) and
# fit raises instead of recovering forever.
MAX_RECOVERIES_WITHOUT_PROGRESS = 3


#: [epoch, its metrics] in a backup taken at the epoch's end.
METRICS_KEY = "epoch_metrics"


class Progress:
    """Where a fit loop is, in steps (shards, for a ShardedInput) since the
    start of training (epoch * steps per epoch + step), and what was rolled
    back.

    Attributes:
        reached: the end of the last execution scheduled (of the last shard
            done).
        recoveries, rolled_back: ps recoveries and steps (shards) trained
            again since the last `epoch_logs()`.
    """

    def __init__(self, steps_per_epoch, reporting, unit="steps"):
        self.steps_per_epoch = steps_per_epoch
        self.reporting = reporting
        self.unit = unit
        self.reached = 0
        self.recoveries = 0
        self.rolled_back = 0
        # (first, end, RemoteValue) of each execution scheduled since the
        # last join, for a recovery that goes on from where training was.
        self._executions = []
        # (epoch, its metrics as read at its end), see epoch_metrics.
        self._metrics = None
        self.rates = EpochRates()  # the learning rate each epoch began with
        self.epoch_complete = None  # see ended_epoch
        self._read = None  # the model's metrics, see keep_with

    def at(self, epoch, step):
        return epoch * self.steps_per_epoch + step

    def position(self, count):
        """(epoch, step) of `count` steps since the start of training."""
        return divmod(count, self.steps_per_epoch)

    def scheduled(self, first, end, remote):
        """Steps [first, end) were scheduled as one execution."""
        self._executions.append((first, end, remote))

    def joined(self):
        """Every execution scheduled so far has finished."""
        self._executions = []

    def resume_point(self):
        """(steps to go on from, steps after it that finished and run
        again): the first execution since the last join that did not
        finish, or where training reached when all did."""
        unfinished = [first for first, _, remote in self._executions
                      if remote.status is not RemoteValueStatus.READY]
        if not unfinished:
            return self.reached, 0
        resume = min(unfinished)
        again = sum(end - first for first, end, remote in self._executions
                    if first >= resume
                    and remote.status is RemoteValueStatus.READY)
        return resume, again

    def ended_epoch(self):
        """The epoch all of whose steps are done, when the last execution
        scheduled ended one (`epoch_complete()`, when set: a ShardedInput
        epoch's ledger, whose shards end in any order); else None."""
        if self.epoch_complete is not None:
            return self.epoch_complete()
        epoch, step = self.position(self.reached)
        return epoch - 1 if epoch and not step else None

    def keep_with(self, backup, model):
        """Reads `model`'s metrics (`epoch_metrics`), and keeps in each
        backup of `backup` (a ResumableCallback, or None) the learning rate
        its epoch began with (`rates`) and, taken at an epoch's end, the
        epoch's metrics: for a fit started from it after its process was
        lost in the epoch's validation (see `epoch_metrics`)."""
        self._read = lambda: python_logs(model.get_metrics_result())
        self.rates.keep_with(backup)
        if backup is None:
            return
        restored = (backup.restored_state or {}).get(METRICS_KEY)
        if restored:
            self._metrics = tuple(restored)

        def at_epoch_end():
            epoch = self.ended_epoch()
            if epoch is None:
                return None
            if self._metrics is None or self._metrics[0] != epoch:
                self._metrics = (epoch, self._read())
            return list(self._metrics)

        backup.state_providers[METRICS_KEY] = at_epoch_end

    def epoch_metrics(self, epoch, trained):
        """The epoch's metrics: read now when this pass of the epoch
        trained something. A recovery that resumes at the end of an epoch
        (a ps lost in its validation or its end's callbacks, after its last
        backup) trains nothing of it again, on metrics reset at the epoch's
        begin: its metrics are then those read at its end before the loss
        (or kept in the backup: `keep_with`), not zeros that
        callbacks (EarlyStopping, ModelCheckpoint) would take for the
        epoch's."""
        if trained or self._metrics is None or self._metrics[0] != epoch:
            self._metrics = (epoch, self._read())
        return dict(self._metrics[1])

    def epoch_logs(self):
        """The epoch's `ps_recoveries` and `steps_rolled_back` (or
        `shards_rolled_back`), present in every epoch's logs of a fit that
        can recover, so History's lists stay aligned; then counted from zero
        again."""
        if not self.reporting:
            return {}
        logs = {"ps_recoveries": self.recoveries,
                f"{self.unit}_rolled_back": self.rolled_back}
        self.recoveries = self.rolled_back = 0
        return logs


@contextlib.contextmanager
def cancelled_on_error(coordinator):
    """When the block raises (a callback's error, Ctrl-C), what it scheduled
    on `coordinator` is cancelled and waited for: no step of a `fit` or
    `evaluate` that raised runs after it, and the next call starts on an
    idle cluster (under TF's coordinator they run on)."""
    try:
        yield
    except ParameterServerUnavailableError:
        coordinator.cancel_scheduled(timeout=0)  # they fail by themselves
        raise
    except BaseException:
        if not coordinator.cancel_scheduled():
            logger.warning("[chief] calls of the call that raised still run "
                           "(a hung worker?); what they return is dropped: "
                           "%s", "; ".join(coordinator.calls_in_flight())
                           or "they ended just now")
        raise


def resumable_callback(callback_list):
    """The callback that keeps backups (keras_ps' BackupAndRestore), or
    None."""
    for callback in callback_list.callbacks:
        if isinstance(callback, ResumableCallback):
            return callback
    return None


def recovering_callback(callback_list):
    """The callback that restores a lost ps' variables (keras_ps'
    BackupAndRestore with recover_ps=True), or None."""
    for callback in callback_list.callbacks:
        if isinstance(callback, ResumableCallback) and callback.recover_ps:
            return callback
    return None


def train_with_ps_recovery(coordinator, backup, train_from, position,
                           progress):
    """`train_from(position)`; when a parameter server is lost and `backup`
    has a backup, gives the ps its variables back, restores every ps from
    the newest backup and trains again from the backup's position.

    Args:
        coordinator: the fit's ClusterCoordinator.
        backup: a ResumableCallback with `recover_ps`, or None (no recovery).
        train_from: `(epoch, step) -> result`, the fit's epochs loop; it
            keeps `progress.reached` up to date.
        position: (epoch, step) to start at.
        progress: the fit's Progress.

    Raises:
        ParameterServerUnavailableError: a ps was lost and there is no
            backup to restore it from, or it was lost again and again with
            no step trained in between.
        ParameterServerRecoveryError: (a ParameterServerUnavailableError)
            it did not come back in time.
    """
    lost_in_a_row = 0
    recover = False
    while True:
        try:
            if recover:
                position = _recover(coordinator, backup, progress)
                recover = False
            finished = _closures_run(coordinator)
            return train_from(position)
        except ParameterServerRecoveryError:
            raise  # the lost ps did not come back: final
        except tf.errors.OpError as error:
            if backup is None:
                raise
            lost = coordinator.lost_parameter_servers()
            if not lost:
                raise
            names = ", ".join(f"ps {i} ({a})" for i, a in sorted(lost.items()))
            if not backup.has_backup():
                raise ParameterServerUnavailableError(
                    f"{names} lost the variables this job placed there, and "
                    f"{backup.describe()} has written no backup yet to give "
                    "them back from. Restart the job (ps tasks included); to "
                    "keep training through a ps loss next time, have a "
                    "backup early (a smaller save_freq).") from error
            trained = _closures_run(coordinator) > finished
            lost_in_a_row = 1 if trained else lost_in_a_row + 1
            if lost_in_a_row > MAX_RECOVERIES_WITHOUT_PROGRESS:
                raise ParameterServerUnavailableError(
                    f"{names} lost their variables again: {lost_in_a_row} "
                    "times in a row with no step trained in between, so fit "
                    "stops recovering. Check why the ps keeps failing (its "
                    "log, its memory limit), then restart the job; it "
                    f"resumes from {backup.describe()}.") from error
            logger.warning("[chief] %s lost (%s); recovering "
                           "from %s", names, type(error).__name__,
                           backup.describe())
            recover = True


def _carry_iterations_forward(strategy, model, lost, steps):
    """When the optimizer's step count lived on a lost ps (restored to the
    backup's), adds the `steps` trained since that backup."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    if iterations is None:
        return
    variable = getattr(iterations, "value", iterations)
    on_lost = {id(v) for i in lost for v in strategy.variables_on_ps(i)}
    if id(variable) in on_lost and steps > 0:
        variable.assign_add(tf.cast(steps, variable.dtype))


def _closures_run(coordinator):
    return sum(w.closures_run for w in coordinator.workers)


def _recover(coordinator, backup, progress):
    """Gives the lost ps their variables back and restores the newest
    backup (into every ps, or with `recover_ps="lost_shards"` into the lost
    ones only); returns the (epoch, step) to train again from."""
    started = time.monotonic()
    # The backup holds the model and the optimizer whole: large variables
    # need no zeros before it is read.
    recovery = coordinator.recover_parameter_servers(restore_follows=True)
    restored_at = time.monotonic()
    if backup.recover_ps == LOST_SHARDS:
        resume, rolled_back = progress.resume_point()
        backup_at = progress.at(*backup.restore_lost_shards(recovery.lost))
        _carry_iterations_forward(coordinator.strategy, backup.model,
                                  recovery.lost, resume - backup_at)
        position = progress.position(resume)
    else:
        position = backup.restore_latest()
        rolled_back = max(0, progress.reached - progress.at(*position))
    progress.joined()
    progress.rates.resuming = True
    progress.recoveries += 1
    progress.rolled_back += rolled_back
    progress.reached = progress.at(*position)
    logger.warning(
        "[chief] ps %s recovered in %.2fs (%.2fs waiting for calls and the "
        "ps, %.2fs reconnecting, %.2fs re-creating %d variables, %.2fs "
        "restarting functions and iterators, %.2fs reading the backup); "
        "training again from epoch %d, %s %d (%d %s rolled back)",
        list(recovery.lost), time.monotonic() - started,
        recovery.waiting_seconds, recovery.reconnect_seconds,
        recovery.recreate_seconds, recovery.variables,
        recovery.restart_seconds, time.monotonic() - restored_at, position[0], progress.unit[:-1],
        position[1], rolled_back, progress.unit)
    return position



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

    # Whether `fit` must keep its batch-end calls close to the steps that
    # run (a callback that acts on a signal within a few executions).
    short_lead = False

    def on_fit_exit(self):
        """Called when keras_ps' `fit` returns or raises (Keras calls
        `on_train_end` only when it returns)."""


# For a callback with `short_lead`, `fit` schedules only the executions that
# the workers end in about SHORT_LEAD_SECONDS (by the rate they ended at so
# far), and between these many per healthy worker: fewer would cost fast
# steps their packing (a 240-step call took up to 17% longer with 4), more
# would make slow steps wait long after a signal. Without such a callback an
# epoch's executions are all scheduled at once, and its batch ends come
# before they run.
SHORT_LEAD_SECONDS = 2.0
SHORT_LEAD_PER_WORKER = (2, 16)


class Lead:
    """Holds `fit`'s loop to a few executions ahead of the workers when a
    callback of `callback_list` asks for it (else costs nothing)."""

    def __init__(self, callback_list, coordinator):
        self._on = any(getattr(c, "short_lead", False)
                       for c in callback_list.callbacks)
        self._coordinator = coordinator
        self._remotes = collections.deque()  # scheduled, oldest first
        self._ends = collections.deque(maxlen=64)  # when some were seen ended

    def scheduled(self, remote):
        if not self._on:
            return
        self._remotes.append(remote)
        self._drop_ended()
        while len(self._remotes) > self._most():
            self._wait_ended(self._remotes[0])
            self._drop_ended()

    def _drop_ended(self):
        now = time.monotonic()
        while (self._remotes
               and self._remotes[0].status is not RemoteValueStatus.PENDING):
            self._remotes.popleft()
            self._ends.append(now)

    def _most(self):
        workers = max(1, self._coordinator.num_healthy())
        fewest, most = (n * workers for n in SHORT_LEAD_PER_WORKER)
        span = self._ends[-1] - self._ends[0] if self._ends else 0.0
        if span <= 0:
            return most
        rate = (len(self._ends) - 1) / span
        return max(fewest, min(most, int(rate * SHORT_LEAD_SECONDS)))

    def _wait_ended(self, remote):
        # Finished, failed or cancelled; a lost ps, no worker left or a
        # scheduled function's error is raised here as `join` raises it.
        while remote.status is RemoteValueStatus.PENDING:
            self._coordinator.done()
            self._coordinator.raise_if_no_workers()
            try:
                remote.get(timeout=0.5)
            except Exception:  # noqa: BLE001  (its status tells; errors above)
                pass


def fit_exited(callbacks):
    """Tells the ResumableCallbacks among `callbacks` (a list, a
    CallbackList or None) that `fit` returned or raised."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in callbacks or ():
        if isinstance(callback, ResumableCallback):
            callback.on_fit_exit()
