"""Row tracking for incremental backups: each table of a backup gets a
dirty vector on its ps (keras_ps.tables._dirty_rows), and every ps that
holds backed-up state a generation variable, made through the strategy
that placed the table, so a ps recovery gives them back (as zeros: then
`GENERATIONS.agree()` is False until the next backup or restore).
"""

import functools
import logging

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.errors import ClusterConfigError
from keras_ps.tables import _dirty_rows

logger = logging.getLogger("keras_ps.backups.incremental_backup")


def _connected(strategy):
    """False once `strategy`'s cluster connection was replaced (its
    variables are gone)."""
    check = getattr(strategy, "check_connected", None)
    try:
        if check is not None:
            check()
    except ClusterConfigError:
        return False
    return True


def _generation_beside(variable, strategy):
    """The generation variable of `variable`'s ps (made there the first
    time, under the caller's scope and colocation)."""
    return _dirty_rows.GENERATIONS.variable_for(
        (variable.device, id(strategy)), lambda current: tf.Variable(
            current, dtype=tf.int32, trainable=False,
            name="keras_ps_generation"),
        functools.partial(_connected, strategy))


def track(catalog):
    """Starts tracking the changed rows of `catalog`'s tables (each gets a
    dirty vector beside it) and gives every ps holding backed-up state a
    generation variable."""
    started = False
    for group in catalog.tables:
        table = group.variables[0]
        if _dirty_rows.tracker_of(table) is not None:
            continue
        strategy = group.strategy
        with strategy.scope(), \
                strategy.extended.colocate_vars_with(table):
            generation = _generation_beside(table, strategy)
            dirty = tf.Variable(
                lambda: tf.zeros([group.parts[0].rows], tf.int32),
                trainable=False,
                name=table.name.split(":")[0] + "_dirty_rows")
        _dirty_rows.track(table, _dirty_rows.RowTracker(dirty, generation))
        started = True
    if catalog.tables:
        # A generation on every other ps holding backed-up state too, so
        # `agree()` sees any ps that was given zeros.
        strategy = catalog.tables[0].strategy
        for group in catalog.groups:
            if "/job:ps" in (group.device or ""):
                with strategy.scope(), \
                        strategy.extended.colocate_vars_with(
                            group.variables[0]):
                    _generation_beside(group.variables[0], strategy)
    if started:
        # Steps traced before must be traced again to mark their rows.
        _tf_adapter.retrace_all_functions()
        logger.info("[chief] tracking the changed rows of %d table shards",
                    len(catalog.tables))
