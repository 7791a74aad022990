"""The two queues that keep a shard's training step from scanning all its slots.

`FreeStack` holds the free slots (push on eviction, pop on admission), so
admitting a key costs the same whatever the shard's size. `LruQueue` caches
the shard's least recently seen slots, oldest first, from one `top_k` over
the shard, and hands them out over the following steps: an entry whose
slot was seen (or freed) since is skipped, which keeps the choice exact
(see `LruQueue.take`). Both are variables on the shard's ps, used under the
shard's lock only.
"""

import tensorflow as tf

from keras_ps.dynamic_embedding import policies

# Entries of the LRU cache, as a fraction of the shard's slots (at least
# `_MIN_QUEUE`): one `top_k` over the shard serves this many evictions.
_QUEUE_FRACTION = 32
_MIN_QUEUE = 64


class FreeStack:
    """The free slots of a shard, `stack[:top]`; pops give slot 0 first
    when all are free."""

    def __init__(self, index, num_slots, make_variable):
        self.num_slots = num_slots
        self.stack = make_variable(
            f"free_slots_{index}", tf.range(num_slots - 1, -1, -1, dtype=tf.int64))
        self.top = make_variable(f"free_top_{index}",
                                 tf.constant(num_slots, tf.int64))

    def size(self):
        return self.top.read_value()

    def push(self, slots):
        count = tf.size(slots, out_type=tf.int64)
        top = self.top.read_value()
        write = self.stack.scatter_update(tf.IndexedSlices(
            slots, top + tf.range(count, dtype=tf.int64)))
        with tf.control_dependencies([write]):
            return self.top.assign_add(count)

    def pop(self, count):
        """`count` (<= size) free slots, last pushed first."""
        top = self.top.assign_sub(count, read_value=True)
        return tf.reverse(self.stack.sparse_read(
            tf.range(top, top + count, dtype=tf.int64)), [0])

    def reset(self, used):
        """Slots `[0, used)` in use, the rest free (after a restore)."""
        self.stack.assign(_free_after(self.num_slots, used))
        self.top.assign(self.num_slots - used)


def _free_after(num_slots, used):
    free = tf.range(num_slots - 1, used - 1, -1, dtype=tf.int64)
    return tf.concat([free, tf.zeros([used], tf.int64)], 0)


class LruQueue:
    """The least recently seen slots of a shard, cached oldest first.

    Entry `i` is `(slots[i], seen[i])`: a slot and its last-seen step when
    the cache was filled. Between refills, every slot's age grows by the
    same amount, so slots not seen since keep their order, and any slot
    outside the cache was younger than all of them at the refill and still
    is (or was seen since, younger still). The still-valid entries, in
    order, are therefore exactly the shard's least recently seen slots, as
    a fresh `top_k` would give them (ties: the lower slot).
    """

    def __init__(self, index, num_slots, make_variable):
        self.capacity = min(num_slots, max(_MIN_QUEUE, num_slots // _QUEUE_FRACTION))
        self.slots = make_variable(f"lru_slots_{index}",
                                   tf.zeros([self.capacity], tf.int64))
        self.seen = make_variable(f"lru_seen_{index}",
                                  tf.zeros([self.capacity], tf.int64))
        self.head = make_variable(f"lru_head_{index}", tf.constant(0, tf.int64))
        self.size = make_variable(f"lru_size_{index}", tf.constant(0, tf.int64))

    def clear(self):
        self.head.assign(0)
        self.size.assign(0)

    def take(self, count, last_seen, step):
        """Up to `count` occupied slots not seen at `step`, least recently
        seen first (fewer only when fewer such slots exist).

        Args:
            count: int64 scalar.
            last_seen: the shard's last-seen variable.
            step: the shard's current step.
        """
        return tf.cond(count > 0,
                       lambda: self._take(count, last_seen, step),
                       lambda: tf.zeros([0], tf.int64))

    def _take(self, count, last_seen, step):
        head, size = self.head.read_value(), self.size.read_value()
        cached = self.slots.read_value()[head:size]
        cached_seen = self.seen.read_value()[head:size]
        current = last_seen.sparse_read(cached)
        valid = tf.reshape(tf.where(tf.equal(current, cached_seen)), [-1])

        def from_cache():
            chosen = valid[:count]
            with tf.control_dependencies([self.head.assign(head + chosen[-1] + 1)]):
                return tf.gather(cached, chosen)

        def refill():
            seen = last_seen.read_value()
            evictable = tf.logical_and(seen != policies.FREE, seen < step)
            available = tf.reduce_sum(tf.cast(evictable, tf.int64))
            k = tf.minimum(tf.maximum(count, self.capacity), available)
            oldest = policies.least_recent(seen, step, k)
            taken = tf.minimum(count, k)
            rest = oldest[taken:]
            rest_size = tf.size(rest, out_type=tf.int64)
            positions = tf.range(rest_size, dtype=tf.int64)
            writes = [
                self.slots.scatter_update(tf.IndexedSlices(rest, positions)),
                self.seen.scatter_update(tf.IndexedSlices(
                    tf.gather(seen, rest), positions)),
                self.head.assign(0), self.size.assign(rest_size)]
            with tf.control_dependencies(writes):
                return tf.identity(oldest[:taken])

        return tf.cond(tf.size(valid, out_type=tf.int64) >= count,
                       from_cache, refill)
