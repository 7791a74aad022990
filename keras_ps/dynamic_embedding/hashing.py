"""Stable 64-bit hashes of int64 and string keys.

Which ps holds a key and which counters of the admission filter it uses are
decided from one fingerprint per key, the same in every process and every
run (no Python `hash`, no per-process seed), so a key routes to the same
place after a restart and a checkpoint restores into any number of ps.
"""

import tensorflow as tf

# splitmix64's constants: a multiply-xorshift mix that spreads consecutive
# ids (and ids that share low bits) over all 64 bits.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


def _mix(x):
    """splitmix64's finalizer on a uint64 tensor."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(30, tf.uint64)))
    x = x * tf.constant(_MIX_1, tf.uint64)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(27, tf.uint64)))
    x = x * tf.constant(_MIX_2, tf.uint64)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(31, tf.uint64)))


def fingerprint(keys):
    """A uint64 fingerprint per key (int64 of any value, or string)."""
    if keys.dtype == tf.string:
        # FarmHash (stable across processes); 2^63 - 1 buckets keeps 63 bits.
        keys = tf.strings.to_hash_bucket_fast(keys, 2**63 - 1)
    return _mix(tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)
                + tf.constant(_GOLDEN, tf.uint64))


def bucket(fingerprints, count, salt=0):
    """`fingerprints` hashed with `salt` into [0, count), as int64."""
    x = fingerprints
    if salt:
        x = _mix(x + tf.constant((salt * _GOLDEN) % 2**64, tf.uint64))
    x = tf.bitwise.right_shift(x, tf.constant(1, tf.uint64))  # fits int64
    return tf.math.floormod(tf.bitcast(x, tf.int64), tf.constant(count, tf.int64))


def route(keys, num_shards):
    """The shard (int32, in [0, num_shards)) that holds each key."""
    return tf.cast(bucket(fingerprint(keys), num_shards), tf.int32)
