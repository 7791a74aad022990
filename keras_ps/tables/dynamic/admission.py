"""Admission: a key gets a row once seen `min_count` times.

Counts live in a count-min sketch per shard: `filter_hashes` int32 counters
per key out of `filter_size`, a key's count being the least of its counters.
Memory is bounded (4 bytes x filter_size per shard, whatever the number of
keys). Collisions only add: a key can be admitted early, never late, and a
key seen fewer than `min_count` times is admitted only if each of its
counters was also hit by other keys (rare while the filter is large against
the keys still waiting).
"""

import tensorflow as tf

from keras_ps.tables.dynamic import hashing


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
