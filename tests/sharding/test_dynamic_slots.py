"""One dynamic-table shard (no cluster) against a reference model of its
rules: a full age sweep at the start of every step, then exact LRU eviction
by a scan of every slot. The shard instead keeps a free-slot stack, an LRU
cache refilled by one top_k per many evictions, and sweeps every few steps
(evicting a row found past its age at lookup); the keys that have a row
after each step, and the counts, must be the same."""

import numpy as np
import pytest
import tensorflow as tf

from keras_ps.dynamic_embedding import api
from keras_ps.dynamic_embedding import slots as slots_lib

pytestmark = pytest.mark.timeout(240)


class Reference:
    """The table's rules, written out plainly. Among rows last seen at the
    same step, which one LRU takes first is the shard's choice (its slot
    order): the reference checks that choice and follows it."""

    def __init__(self, slots, max_age):
        self.last_seen = {}  # key -> step
        self.slots, self.max_age, self.step = slots, max_age, 0
        self.admitted = 0
        self.dead = set()  # evicted by age: the shard may hold them unswept

    def train(self, keys, shard_keys):
        """Checks one step against the keys the shard holds after it."""
        self.step += 1
        if self.max_age is not None:
            old = {k for k, s in self.last_seen.items()
                   if self.step - s > self.max_age}
            for k in old:
                del self.last_seen[k]
            self.dead |= old
        shard_keys = set(shard_keys) - (self.dead - set(keys))
        missing = [k for k in keys if k not in self.last_seen]
        for k in keys:
            if k in self.last_seen:
                self.last_seen[k] = self.step
        short = len(missing) - (self.slots - len(self.last_seen))
        if short > 0:
            evictable = sorted(s for s in self.last_seen.values() if s < self.step)
            if evictable:
                threshold = evictable[min(short, len(evictable)) - 1]
                must_go = {k for k, s in self.last_seen.items() if s < threshold}
                ties = {k for k, s in self.last_seen.items() if s == threshold}
                assert not must_go & shard_keys, "a newer row went first"
                gone = ties - shard_keys
                assert len(must_go) + len(gone) == min(short, len(evictable))
                for k in must_go | gone:
                    del self.last_seen[k]
        room = self.slots - len(self.last_seen)
        for k in missing[:room]:
            self.last_seen[k] = self.step
            self.dead.discard(k)
        self.admitted += min(len(missing), room)
        assert set(self.last_seen) == shard_keys
        return {k for k in keys if k in self.last_seen}

    def live(self, step):
        return {k for k, s in self.last_seen.items()
                if self.max_age is None or step - s <= self.max_age}


@pytest.mark.parametrize("slots,max_age", [(200, None), (200, 2), (1000, 16),
                                           (1000, 40)])
def test_shard_matches_the_reference_rules(slots, max_age):
    # The LRU cache holds 64 slots: refilled many times. max_age 16 and 40:
    # a sweep every 2 and 5 steps, rows found past their age in between.
    config = api.TableConfig(capacity=slots, max_age=max_age)
    rows = tf.Variable(tf.zeros([slots, 2]))
    shard = slots_lib.SlotShard(
        0, None, rows, config,
        lambda name, value: tf.Variable(value, trainable=False, name=name))
    assert shard.lru.capacity < slots

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def train(keys):
        return shard.train_slots(keys, tf.ones(tf.shape(keys), tf.int32),
                                 lambda n, t: tf.zeros(tf.stack([n, 2])))

    reference = Reference(slots, max_age)
    rng = np.random.default_rng(0 if max_age is None else max_age)
    for step in range(1, 301):
        # Popular keys drift; a few from a long tail.
        head = rng.integers(0, 150, size=40) + step
        tail = rng.integers(0, 10_000, size=rng.integers(0, 60))
        keys = list(dict.fromkeys(np.concatenate([head, tail]).tolist()))
        got = train(tf.constant(keys, tf.int64)).numpy()
        with_row = {k for k, s in zip(keys, got) if s >= 0}
        held = shard.table.export()[0].numpy().tolist()
        assert with_row == reference.train(keys, held), step
        assert len(set(got[got >= 0].tolist())) == len(with_row)  # no slot twice
        if step % 7 == 0:
            # Reads: a row past its age reads as none, without a sweep.
            probe = sorted(reference.last_seen)[:50] + [10**9]
            looked = shard.lookup(tf.constant(probe, tf.int64)).numpy()
            assert {k for k, s in zip(probe, looked) if s >= 0} == \
                reference.live(step) & set(probe), step
        if step % 25 == 0:
            state = shard.export_state()  # sweeps, as the next step would
            assert set(state["keys"].tolist()) == reference.live(step), step
            stats = shard.read_stats().numpy()
            assert stats[slots_lib.ADMITTED] == reference.admitted
            live = len(reference.live(step))
            assert stats[slots_lib.LIVE] == live
            assert int(shard.free.size()) == slots - live
    assert stats[slots_lib.EVICTED_BY_AGE] + stats[slots_lib.EVICTED_BY_CAPACITY] > 0
    if max_age is None:
        assert stats[slots_lib.EVICTED_BY_AGE] == 0


def test_a_training_step_reads_single_slots_of_its_per_slot_variables():
    # TF copies a whole variable before a scatter into it while a read of
    # the whole variable is still alive, so a step that read `last_seen`,
    # the keys or the free stack whole paid a full copy of each per step.
    # The step reads single slots; only the LRU refill and the age sweep,
    # each in a branch of its own, scan a whole variable.
    config = api.TableConfig(capacity=1000, max_age=40, min_count=2)
    rows = tf.Variable(tf.zeros([1000, 2]))
    shard = slots_lib.SlotShard(
        0, None, rows, config,
        lambda name, value: tf.Variable(value, trainable=False, name=name))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def train(keys):
        return shard.train_slots(keys, tf.ones(tf.shape(keys), tf.int32),
                                 lambda n, t: tf.zeros(tf.stack([n, 2])))

    graph = train.get_concrete_function().graph
    watched = {"slot_keys": shard.slot_keys, "last_seen": shard.last_seen,
               "hits": shard.hits, "free stack": shard.free.stack,
               "filter": shard.filter}
    inside = {name: [internal for external, internal in graph.captures
                     if external is variable.handle]
              for name, variable in watched.items()}
    assert all(inside.values()), inside  # each is used by the step
    whole_reads = sorted(
        name for op in graph.get_operations() if op.type == "ReadVariableOp"
        for name, handles in inside.items()
        if any(op.inputs[0] is h for h in handles))
    assert whole_reads == []
    # And the step still admits: a key seen twice gets a row.
    train(tf.constant([5, 6], tf.int64))
    assert train(tf.constant([5], tf.int64)).numpy()[0] >= 0
