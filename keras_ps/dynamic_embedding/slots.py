"""One shard of a dynamic table: its key -> row-slot map and counters, on one ps.

A shard owns rows `[0, rows)` of its part of the embedding (a Keras weight on
the same ps) and maps keys to them with a `MutableHashTable`. Per slot it
keeps the key (to undo the mapping on eviction), the step at which the key
was last seen (`FREE` = -1 for an empty slot) and how often it was seen. A
training lookup (`train_slots`) runs on the ps under the shard's
`tf.CriticalSection`, so workers that admit and evict at the same time never
give one slot to two keys. Lookups outside training only read the map.
"""

import logging

import numpy as np
import tensorflow as tf

from keras_ps.tables import _dirty_rows
from keras_ps.dynamic_embedding import policies
from keras_ps.dynamic_embedding import slot_queues

logger = logging.getLogger(__name__)

FREE = policies.FREE

# Columns of a shard's `stats` counters (running totals, and the live rows).
ADMITTED, EVICTED_BY_AGE, EVICTED_BY_CAPACITY, LIVE = range(4)


def _masked(values, mask):
    """`tf.boolean_mask(values, mask)` for a 1-D `mask`, in 3 ops instead of
    boolean_mask's 10 (shapes, products, reshapes): the step functions of a
    model with the table trace each of them, and run them at every step."""
    return tf.gather(values, tf.reshape(tf.where(mask), [-1]))


def _flat(x):
    return tf.reshape(x, [-1])


def _after_every_write(fn, *args):
    """`fn(*args)`'s tensor, ready only once every stateful op it made has run.

    A `tf.CriticalSection` frees its lock as soon as its function's outputs
    are ready. A write no output depends on (a slot's key, its last-seen
    step, the free stack) could then land after the next worker's step on
    this shard has read it: that step would free a slot under its previous
    key and leave the new key in the map, pointing at a row another key
    then gets."""
    if tf.executing_eagerly():
        return fn(*args)
    graph = tf.compat.v1.get_default_graph()
    before = set(graph.get_operations())
    result = fn(*args)
    writes = [op for op in graph.get_operations()
              if op not in before and op.op_def.is_stateful]
    with tf.control_dependencies(writes):
        return tf.identity(result)


class SlotShard:
    """The key -> slot map of one shard, on `device`.

    Args:
        index: the shard's number (its ps, at build time).
        device: the ps device.
        rows: the shard's `tf.Variable` of embedding rows `[slots, dim]`.
        config: the table's `TableConfig`.
        make_variable: `(name, initial_value) -> tf.Variable` placed on `device`.
    """

    def __init__(self, index, device, rows, config, make_variable):
        self.index = index
        self.device = device
        self.rows = rows
        self.config = config
        self.num_slots = int(rows.shape[0])
        key_dtype = tf.string if config.key_dtype == "string" else tf.int64
        self.key_dtype = key_dtype
        empty_key = "" if key_dtype == tf.string else 0
        n = self.num_slots
        # A full age sweep every `sweep_every` steps; in between, a row
        # found too old at lookup is treated as already evicted.
        self.sweep_every = (max(1, config.max_age // policies.SWEEP_FRACTION)
                            if config.max_age is not None else None)
        with tf.init_scope():
            self.slot_keys = make_variable(
                f"slot_keys_{index}", tf.fill([n], tf.constant(empty_key, key_dtype)))
            self.last_seen = make_variable(
                f"last_seen_{index}", tf.fill([n], tf.constant(FREE, tf.int64)))
            self.hits = make_variable(f"hits_{index}", tf.zeros([n], tf.int64))
            self.stats = make_variable(f"stats_{index}", tf.zeros([4], tf.int64))
            # The table's training step, counted on each shard (every
            # training call steps every shard), so no shard waits on another.
            self.step = make_variable(f"step_{index}", tf.constant(0, tf.int64))
            self.last_sweep = make_variable(f"last_sweep_{index}",
                                            tf.constant(0, tf.int64))
            self.free = slot_queues.FreeStack(index, n, make_variable)
            self.lru = slot_queues.LruQueue(index, n, make_variable)
            self.filter = None
            if config.min_count > 1:
                self.filter = make_variable(
                    f"filter_{index}", tf.zeros([config.filter_size], tf.int32))
            self.remake_resources()
        # (name, tf.Variable, initial row) of each optimizer slot of `rows`.
        self.optimizer_slots = []

    def remake_resources(self):
        """Makes the key -> slot map (empty) and the shard's lock on its ps:
        at build, and when a recovery gave the restarted ps its variables
        back (functions are traced again, with these)."""
        with tf.init_scope(), tf.device(self.device):
            self.table = tf.lookup.experimental.MutableHashTable(
                self.key_dtype, tf.int64, default_value=-1,
                name=f"dynamic_slots_{self.index}")
            self.lock = tf.CriticalSection(
                name=f"dynamic_slots_lock_{self.index}")

    # -- optimizer slots ------------------------------------------------------------
    def add_optimizer_slot(self, name, variable):
        """Registers an optimizer slot of this shard's rows: it is reset to
        its initial value when a slot gets a new key, and saved with the row."""
        with tf.init_scope():
            initial = tf.convert_to_tensor(variable[0]).numpy()
        self.optimizer_slots.append((name, variable, initial))

    # -- lookups ----------------------------------------------------------------------
    def _stale(self, slots, step):
        """Which of `slots` (-1: none) hold a row older than `max_age` at `step`."""
        if self.config.max_age is None:
            return tf.zeros(tf.shape(slots), tf.bool)
        seen = self.last_seen.sparse_read(tf.maximum(slots, 0))
        return tf.logical_and(slots >= 0, step - seen > self.config.max_age)

    def lookup(self, keys):
        """Slots of `keys` (1-D), -1 for keys without a row. Reads only."""
        with tf.device(self.device):
            slots = _flat(self.table.lookup(keys))
            stale = self._stale(slots, self.step.read_value())
            return tf.where(stale, tf.constant(-1, tf.int64), slots)

    def gather_rows(self, slots):
        """On the ps: `(rows, has_row)`, the rows of the keys with a slot
        (in order) and which keys have one. Only `rows` leaves the ps."""
        with tf.device(self.device):
            has_row = slots >= 0
            rows = tf.gather(self.rows, _masked(slots, has_row))
            return rows, has_row

    def train_slots(self, keys, counts, init_rows):
        """Slots of `keys` (1-D, distinct) for a training step, admitting and
        evicting as configured; -1 for keys still without a row. Steps the
        shard's step counter.

        Args:
            keys: distinct keys routed to this shard.
            counts: int32, how often each key occurs in the batch.
            init_rows: `(count, step) -> [count, dim]` values of new rows.

        Raises (when the step runs):
            InvalidArgumentError: the shard is full and `evict_lru` is off.
        """
        with tf.device(self.device):
            return self.lock.execute(
                lambda: _after_every_write(self._train_slots, keys, counts,
                                           init_rows),
                exclusive_resource_access=False)

    def _free(self, slots, column, step=None):
        """Frees `slots`, counted in `column` (or, with `step`, by age when
        older than `max_age`, else in `column`)."""
        # Sparse reads: a whole-variable read still alive when the scatters
        # below run would make each of them copy the whole variable first.
        seen = self.last_seen.sparse_read(slots)
        keys = self.slot_keys.sparse_read(slots)
        removed = self.table.remove(keys)
        with tf.control_dependencies([removed]):
            self.last_seen.scatter_update(tf.IndexedSlices(
                tf.fill(tf.shape(slots), tf.constant(FREE, tf.int64)), slots))
        self.free.push(slots)
        count = tf.size(slots, out_type=tf.int64)
        if step is not None and self.config.max_age is not None:
            old = tf.reduce_sum(tf.cast(step - seen > self.config.max_age, tf.int64))
            self.stats.scatter_add(tf.IndexedSlices(
                tf.stack([old, count - old, -count]),
                tf.constant([EVICTED_BY_AGE, column, LIVE], tf.int64)))
        else:
            self.stats.scatter_add(tf.IndexedSlices(
                tf.stack([count, -count]), tf.constant([column, LIVE], tf.int64)))

    def sweep(self, step):
        """Frees every row older than `max_age` at `step`."""
        self._free(policies.expired(self.last_seen.read_value(), step,
                                    self.config.max_age), EVICTED_BY_AGE)
        return self.last_sweep.assign(step)

    def _train_slots(self, keys, counts, init_rows):
        config = self.config
        step = self.step.assign_add(1, read_value=True)
        if config.max_age is not None:
            tf.cond(step - self.last_sweep.read_value() >= self.sweep_every,
                    lambda: self.sweep(step), self.last_sweep.read_value)
        slots = _flat(self.table.lookup(keys))
        if config.max_age is not None:
            # Rows that expired since the last sweep go now.
            stale = self._stale(slots, step)
            self._free(_masked(slots, stale), EVICTED_BY_AGE)
            slots = tf.where(stale, tf.constant(-1, tf.int64), slots)
        found = slots >= 0
        seen = _masked(slots, found)
        self.last_seen.scatter_update(tf.IndexedSlices(
            tf.fill(tf.shape(seen), step), seen))
        self.hits.scatter_add(tf.IndexedSlices(
            tf.cast(_masked(counts, found), tf.int64), seen))

        missing = tf.logical_not(found)
        candidates = _masked(keys, missing)
        candidate_counts = _masked(counts, missing)
        if self.filter is not None:
            with tf.control_dependencies([tf.cond(
                    step % policies.FILTER_CHECK_EVERY == 0,
                    lambda: policies.decay_when_loaded(self.filter, config),
                    lambda: tf.constant(False))]):
                admit = policies.count_and_admit(
                    self.filter, candidates, candidate_counts, config)
            candidates = _masked(candidates, admit)
            candidate_counts = _masked(candidate_counts, admit)
        wanted = tf.size(candidates, out_type=tf.int64)

        short = tf.maximum(wanted - self.free.size(), 0)
        if config.evict_lru:
            # The least recently seen rows; those past max_age count as
            # evicted by age (a sweep would have taken them).
            self._free(self.lru.take(short, self.last_seen, step),
                       EVICTED_BY_CAPACITY, step=step)
            available = self.free.size()
        else:
            check = tf.debugging.assert_less_equal(
                short, tf.constant(0, tf.int64), message=(
                    f"DynamicEmbedding shard {self.index} ({self.device}) is "
                    f"full: all {self.num_slots} of its rows hold keys and "
                    "eviction is off (evict_lru=False), so new keys cannot "
                    "get a row. Received: capacity too small for the live "
                    "keys. Fix: raise capacity, set max_age to evict old "
                    "rows, or set evict_lru=True. Keys still needing a row: "))
            with tf.control_dependencies([check]):
                available = self.free.size()

        admitted_count = tf.minimum(wanted, available)
        new_slots = self.free.pop(admitted_count)
        admitted = candidates[:admitted_count]
        new_counts = tf.cast(candidate_counts[:admitted_count], tf.int64)
        inserted = self.table.insert(admitted, new_slots)
        self.slot_keys.scatter_update(tf.IndexedSlices(admitted, new_slots))
        self.last_seen.scatter_update(tf.IndexedSlices(
            tf.fill(tf.shape(new_slots), step), new_slots))
        self.hits.scatter_update(tf.IndexedSlices(new_counts, new_slots))
        self.stats.scatter_add(tf.IndexedSlices(
            tf.stack([admitted_count, admitted_count]),
            tf.constant([ADMITTED, LIVE], tf.int64)))
        # A reused slot starts afresh: new row, optimizer state as at creation.
        updates = [tf.raw_ops.ResourceScatterUpdate(
            resource=self.rows.handle, indices=new_slots,
            updates=tf.cast(init_rows(admitted_count, step), self.rows.dtype))]
        for _, variable, initial in self.optimizer_slots:
            fresh = tf.tile(tf.constant(initial)[tf.newaxis],
                            [admitted_count] + [1] * initial.ndim)
            updates.append(tf.raw_ops.ResourceScatterUpdate(
                resource=variable.handle, indices=new_slots,
                updates=tf.cast(fresh, variable.dtype)))
        # The new keys' slots, without a second lookup of every key.
        position = tf.cast(tf.where(missing)[:, 0], tf.int64)
        if self.filter is not None:
            position = _masked(position, admit)
        slots = tf.tensor_scatter_nd_update(
            slots, position[:admitted_count, tf.newaxis], new_slots)
        # An incremental backup writes these rows and slot rows next.
        _dirty_rows.mark_rows(self.rows, new_slots, after=updates)
        with tf.control_dependencies([inserted] + updates):
            return tf.identity(slots)

    # -- state (checkpoints and export) ----------------------------------------------
    def export_state(self):
        """The shard's live keys and, in slot order, their rows, last-seen
        steps, hit counts and optimizer slot rows (numpy), read on the ps.
        Rows past `max_age` are evicted first, as the next step would."""
        with tf.device(self.device):
            if self.config.max_age is not None:
                self.lock.execute(lambda: self.sweep(self.step.read_value()),
                                  exclusive_resource_access=False)
            keys, slots = self.table.export()
            order = tf.argsort(slots)
            keys, slots = tf.gather(keys, order), tf.gather(slots, order)
            state = {
                "keys": keys,
                "rows": tf.gather(self.rows, slots),
                "last_seen": tf.gather(self.last_seen, slots),
                "hits": tf.gather(self.hits, slots),
            }
            for name, variable, _ in self.optimizer_slots:
                state[f"optimizer_{name}"] = tf.gather(variable, slots)
        return {k: v.numpy() for k, v in state.items()}

    def import_state(self, state, step):
        """Replaces the shard's keys with `state` (as `export_state` gives,
        at most `num_slots` keys; the slots are filled from 0) and sets its
        step counter to `step`."""
        n = len(state["keys"])
        if n > self.num_slots:
            raise ValueError(f"{n} keys for {self.num_slots} slots")
        slots = np.arange(n, dtype=np.int64)
        with tf.device(self.device):
            old, _ = self.table.export()
            self.table.remove(old)
            keys = tf.constant(state["keys"], self.key_dtype)
            self.table.insert(keys, tf.constant(slots))
            self.free.reset(n)
            self.lru.clear()
            self.step.assign(step)
            self.last_sweep.assign(step)
            self.slot_keys.scatter_update(tf.IndexedSlices(keys, slots))
            last_seen = np.full([self.num_slots], FREE, np.int64)
            last_seen[:n] = state["last_seen"]
            self.last_seen.assign(last_seen)
            hits = np.zeros([self.num_slots], np.int64)
            hits[:n] = state["hits"]
            self.hits.assign(hits)
            self.rows.scatter_update(tf.IndexedSlices(
                tf.constant(state["rows"], self.rows.dtype), slots))
            for name, variable, _ in self.optimizer_slots:
                values = state.get(f"optimizer_{name}")
                if values is not None and len(values) == n:
                    variable.scatter_update(tf.IndexedSlices(
                        tf.constant(values, variable.dtype), slots))
            # Rows moved: an incremental backup writes them all next.
            _dirty_rows.mark_all(self.rows)

    # -- incremental backups (keras_ps.backups) ---------------------------------
    def backup_variables(self):
        """{name: tf.Variable} of everything the shard keeps besides its rows
        and their optimizer slots: per slot its key, last-seen step and hits,
        the free stack, the LRU cache, the counters, the step and the
        admission filter. An incremental backup writes them whole (tens of
        bytes per slot); with the rows they are the whole shard but for its
        key map, which `restore_key_map` rebuilds from them."""
        named = dict(
            slot_keys=self.slot_keys, last_seen=self.last_seen, hits=self.hits,
            stats=self.stats, step=self.step, last_sweep=self.last_sweep,
            free_slots=self.free.stack, free_top=self.free.top,
            lru_slots=self.lru.slots, lru_seen=self.lru.seen,
            lru_head=self.lru.head, lru_size=self.lru.size)
        if self.filter is not None:
            named["filter"] = self.filter
        return {f"{name}_{self.index}": v for name, v in named.items()}

    def restore_key_map(self):
        """Makes the key map hold exactly the keys of the live slots (those
        not `FREE` in `last_seen`), each to its slot: after an incremental
        backup restored `backup_variables()`, the map they were taken with."""
        with tf.device(self.device):
            old, _ = self.table.export()
            self.table.remove(old)
            live = tf.reshape(tf.where(
                tf.not_equal(self.last_seen.read_value(), FREE)), [-1])
            self.table.insert(tf.gather(self.slot_keys.read_value(), live),
                              live)

    def read_stats(self):
        with tf.device(self.device):
            return self.stats.read_value()
