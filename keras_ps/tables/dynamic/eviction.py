"""Eviction decisions: which occupied slots of a shard to free.

Pure functions of a shard's `last_seen` steps (-1: free slot), so the
policies are unit-testable on plain tensors; keras_ps.tables.dynamic.slots
applies them.
"""

import tensorflow as tf

FREE = -1

# A shard sweeps for rows past `max_age` every `max(1, max_age //
# SWEEP_FRACTION)` steps (a scan of all its slots); in between, a row found
# past its age at lookup is evicted then.
SWEEP_FRACTION = 8


def expired(last_seen, step, max_age):
    """Slots whose row was last seen more than `max_age` steps before `step`."""
    old = tf.logical_and(last_seen != FREE, step - last_seen > max_age)
    return tf.reshape(tf.where(old), [-1])


def free_slots(last_seen):
    return tf.reshape(tf.where(tf.equal(last_seen, FREE)), [-1])


def least_recent(last_seen, step, count):
    """Up to `count` occupied slots not seen at `step`, least recently seen
    first (ties: the lower slot)."""
    evictable = tf.logical_and(last_seen != FREE, last_seen < step)
    available = tf.reduce_sum(tf.cast(evictable, tf.int64))
    count = tf.minimum(tf.cast(count, tf.int64), available)

    def pick():
        age = tf.where(evictable, step - last_seen, tf.zeros_like(last_seen))
        _, slots = tf.math.top_k(age, k=tf.cast(count, tf.int32), sorted=True)
        return tf.cast(slots, tf.int64)

    return tf.cond(count > 0, pick, lambda: tf.zeros([0], tf.int64))
