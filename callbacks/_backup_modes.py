"""Which backups `BackupAndRestore` writes, and the checks of its modes."""

import logging

from keras_ps.backups import _checks
from keras_ps.coordinator import ClusterCoordinator
from keras_ps.coordinator.failure_handling import is_connectivity_error
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.backups.incremental_backup import IncrementalBackup
from keras_ps.strategy import ParameterServerStrategy
from keras_ps.training._fit_epochs import LOST_SHARDS

logger = logging.getLogger(__name__)

# Writes of one backup, at most, when each fails on a connection while every
# ps still holds its variables.
WRITE_ATTEMPTS = 3


def check_modes(incremental, recover_ps):
    """`incremental` and `recover_ps` as `BackupAndRestore` keeps them (a
    numpy bool made Python's).

    Raises:
        ValueError: either is not one of its values (naming it): 0 and 1
            are refused, not read as False and True.
    """
    if not (incremental == "auto" if isinstance(incremental, str)
            else _checks.is_bool(incremental)):
        raise ValueError(
            "incremental must be 'auto', True or False. Received: "
            f"incremental={incremental!r}.")
    if not (recover_ps == LOST_SHARDS if isinstance(recover_ps, str)
            else _checks.is_bool(recover_ps)):
        raise ValueError(
            f"recover_ps must be True, False or {LOST_SHARDS!r}. "
            f"Received: recover_ps={recover_ps!r}.")
    return (incremental if isinstance(incremental, str) else bool(incremental),
            recover_ps if isinstance(recover_ps, str) else bool(recover_ps))


def incremental_writer(model, incremental, path, options, auto_min_bytes):
    """The IncrementalBackup that writes `model`'s backups under `path`, or
    None (each backup a Keras weights file). `incremental`: True, False or
    "auto" (True from `auto_min_bytes` of row-tracked tables with their
    slots, on a folder every ps shares)."""
    if incremental is False:
        return None
    backup = IncrementalBackup(model, path, **options)
    if incremental == "auto":
        try:
            size = backup.table_bytes()
        except ValueError as error:  # optimizer not built, or a table
            logger.info(           # that saves its own state
                "[chief] full backups (incremental='auto'): %s", error)
            return None
        if size < auto_min_bytes:
            return None
        try:
            backup.check()
        except ValueError as error:
            logger.warning(
                "[chief] full backups (incremental='auto'): %s", error)
            return None
        logger.info("[chief] incremental backups: %.0f MiB of tables",
                    size / 2**20)
    else:
        backup.check()
    return backup


def check_lost_shards_mode(model):
    """Raises ValueError when `model` keeps state on the ps that a restore
    of the lost ps' variables alone would leave out of step."""
    strategy = model.distribute_strategy
    if (isinstance(strategy, ParameterServerStrategy)
            and strategy.extended.placed.has_resources()):
        raise ValueError(
            f"recover_ps={LOST_SHARDS!r} restores only the lost ps' "
            "variables, but this model keeps state on the ps that is not "
            "a variable (a keras_ps.layers.DynamicEmbedding's key maps), "
            "which would no longer match its rows. Fix: "
            "recover_ps=True (every ps restored to the newest backup).")


def check_preemption_mode(model):
    """Raises ValueError when `model`'s fit is not keras_ps' (which gives
    SIGTERM back when it ends, also by an error)."""
    if not isinstance(model.distribute_strategy, ParameterServerStrategy):
        raise ValueError(
            "BackupAndRestore(save_before_preemption=True) needs a model "
            "made under keras_ps.ParameterServerStrategy (keras_ps' fit "
            "gives SIGTERM back when fit ends, also by an error). "
            f"Received: model {model.name!r} under "
            f"{type(model.distribute_strategy).__name__}. Fix: build "
            "the model under the strategy's scope, or pass "
            "save_before_preemption=False.")


def finish_incremental(backup):
    """Waits for `backup`'s last delta to be published (an error is logged:
    `fit` is ending); a full backup still being written in the background
    is dropped (the next fit starts it again), the chain stays."""
    if not backup.stop_compaction(timeout=60):
        logger.warning("[chief] the full backup being written in the "
                       "background did not stop within 60 s (a ps does not "
                       "answer?); left behind")
    try:
        backup.wait()
    except Exception as error:  # noqa: BLE001  (logged, as in fit)
        logger.warning("[chief] the last delta was not published (%s: %s)",
                       type(error).__name__, error)


def raise_if_ps_lost(model, error):
    """Raises ParameterServerUnavailableError (from `error`) when a ps of
    `model`'s keras_ps strategy is lost: a failed restore's real cause."""
    strategy = model.distribute_strategy
    if not isinstance(strategy, ParameterServerStrategy):
        return  # a model outside keras_ps: no ps to lose
    lost = ClusterCoordinator(strategy).lost_parameter_servers()
    if lost:
        raise ParameterServerUnavailableError(
            f"Parameter server(s) {sorted(lost)} at "
            f"{[lost[i] for i in sorted(lost)]} were lost while the backup "
            "was being restored.") from error


def written_again_on_dropped_connections(model, write, what):
    """`write()`, made again when it fails on a connection while every ps
    of `model`'s keras_ps strategy still holds its variables (the network
    dropped a connection under a read or a write: nothing of a failed
    attempt is published, and an incremental backup's delta covers the
    rows since its base again), up to WRITE_ATTEMPTS writes in all. A lost
    ps' error passes on, to the fit's recovery. Returns what `write`
    returns."""
    strategy = model.distribute_strategy
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            return write()
        except Exception as error:  # noqa: BLE001  (re-raised unless retried)
            if (not is_connectivity_error(error) or attempt == WRITE_ATTEMPTS
                    or not isinstance(strategy, ParameterServerStrategy)
                    or ClusterCoordinator(strategy).lost_parameter_servers()):
                raise
            logger.warning(
                "[chief] %s failed on a connection (%s: %s), every ps "
                "holding its variables; writing it again (%d of %d)", what,
                type(error).__name__,
                (str(error).strip().splitlines() or [""])[0][:200],
                attempt + 1, WRITE_ATTEMPTS)
