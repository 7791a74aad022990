"""Admission and eviction: which keys get a row, which rows are freed.

Admission: a key gets a row once seen `min_count` times.
Counts live in a count-min sketch per shard: `filter_hashes` int32 counters
per key out of `filter_size`, a key's count being the least of its counters.
Memory is bounded (4 bytes x filter_size per shard, whatever the number of
keys). Collisions only add: a key can be admitted early, never late, and a
key seen fewer than `min_count` times is admitted only if each of its
counters was also hit by other keys (rare while few counters are in use).
A key seen once is admitted anyway when each of its counters was already
in use, about load ** filter_hashes of the time. A stream brings new keys
forever, so the counters would fill up and admit any key on sight: every
FILTER_CHECK_EVERY steps a shard looks at the share of its counters in use,
and when it would let more than FALSE_ADMISSIONS of one-off keys in, halves
them all (old sightings fade; a key must reach `min_count` within a while).

Eviction: pure functions of a shard's `last_seen` steps (-1: free slot), so
the policies are unit-testable on plain tensors; keras_ps.dynamic_embedding.slots
applies them.
"""

import tensorflow as tf

from keras_ps.dynamic_embedding import hashing

FREE = -1

# A shard sweeps for rows past `max_age` every `max(1, max_age //
# SWEEP_FRACTION)` steps (a scan of all its slots); in between, a row found
# past its age at lookup is evicted then.
SWEEP_FRACTION = 8


def positions(keys, config):
    """[filter_hashes, n] counter positions of `keys` in a shard's filter."""
    fp = hashing.fingerprint(keys)
    return tf.stack([hashing.bucket(fp, config.filter_size, salt=j + 1)
                     for j in range(config.filter_hashes)])


def count_and_admit(counters, keys, counts, config):
    """Adds `counts` (int32 per key) to the keys' counters and returns which
    keys have now reached `config.min_count` (bool per key)."""
    where = positions(keys, config)
    flat = tf.reshape(where, [-1])
    added = tf.tile(counts, [config.filter_hashes])
    update = tf.raw_ops.ResourceScatterAdd(
        resource=counters.handle, indices=flat, updates=added)
    with tf.control_dependencies([update]):
        seen = tf.raw_ops.ResourceGather(resource=counters.handle, indices=flat,
                                         dtype=tf.int32)
    seen = tf.reduce_min(tf.reshape(seen, tf.shape(where)), axis=0)
    return seen >= config.min_count


# Steps between looks at a shard's filter, and the share of one-off keys
# its load may let in before the counters are halved.
FILTER_CHECK_EVERY = 8
FALSE_ADMISSIONS = 0.05


def decay_when_loaded(counters, config):
    """Halves every counter when the share of them in use would admit more
    than FALSE_ADMISSIONS of keys seen once; returns whether it did."""
    max_load = FALSE_ADMISSIONS ** (1.0 / config.filter_hashes)
    values = counters.read_value()
    used = tf.math.count_nonzero(values, dtype=tf.int64)
    size = tf.size(values, out_type=tf.int64)
    loaded = tf.cast(used, tf.float64) > max_load * tf.cast(size, tf.float64)

    def halve():
        with tf.control_dependencies([counters.assign(
                tf.bitwise.right_shift(values, 1))]):
            return tf.constant(True)

    return tf.cond(loaded, halve, lambda: tf.constant(False))


# -- eviction --------------------------------------------------------------
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
