"""Counting the records of a dataset whose size tf.data does not know.

A filter or a generator hides the size (unknown cardinality), and such a
dataset may never end: a `.repeat()` before a `.filter()`, a generator that
loops forever. So the count runs in chunks, logs a warning every
`COUNT_LOG_INTERVAL` seconds, and gives up after KERAS_PS_COUNT_TIMEOUT
seconds with an error that says how to skip the count.
"""

import logging
import time

import tensorflow as tf

from keras_ps import _constants

logger = logging.getLogger(__name__)

# Records counted per chunk: the time limit is checked between chunks.
CHUNK_RECORDS = 8192

_GIVE_SIZE = ("dataset.apply(tf.data.experimental.assert_cardinality(N)) "
              "with N its number of records")


def count_records(dataset, clock=time.monotonic):
    """The number of records of the finite `dataset` (`clock` gives the
    seconds the count has run).

    Raises:
        ValueError: the count ran longer than KERAS_PS_COUNT_TIMEOUT
            seconds (the dataset may never end).
    """
    timeout = _constants.env_float(_constants.COUNT_TIMEOUT_ENV_VAR,
                                   _constants.DEFAULT_COUNT_TIMEOUT, minimum=0)
    # Each record becomes one byte before it is batched, so a chunk holds
    # no copy of the records.
    chunks = dataset.map(lambda *_: tf.constant(0, tf.int8)).batch(
        CHUNK_RECORDS)
    started = clock()
    next_log = started + _constants.COUNT_LOG_INTERVAL
    count = 0
    for chunk in chunks:
        count += int(chunk.shape[0])
        now = clock()
        if timeout and now - started > timeout:
            raise ValueError(
                f"ShardedInput gave up counting the dataset's records after "
                f"{now - started:.0f} s: it counted {count:,} and found no "
                "end, so the data may repeat forever (a .repeat() before a "
                ".filter(), a generator that never stops). Received: a "
                "dataset of unknown size and "
                f"{_constants.COUNT_TIMEOUT_ENV_VAR}={timeout:g}. Fix: make "
                "the data finite (remove .repeat(): fit's `epochs` repeats "
                f"the data); for finite data, give its size with {_GIVE_SIZE}, "
                f"or raise {_constants.COUNT_TIMEOUT_ENV_VAR} (0: no limit).")
        if now >= next_log:
            next_log = now + _constants.COUNT_LOG_INTERVAL
            logger.warning(
                "[chief] ShardedInput is counting the records of a dataset of "
                "unknown size: %s so far in %.0f s; it gives up after %s "
                "(%s). Data that repeats forever never ends: make it finite. "
                "To skip the count, give the size with %s.", f"{count:,}",
                now - started, f"{timeout:g} s" if timeout else "no limit",
                _constants.COUNT_TIMEOUT_ENV_VAR, _GIVE_SIZE)
    logger.info("[chief] ShardedInput counted %d records in %.1f s", count,
                clock() - started)
    return count
