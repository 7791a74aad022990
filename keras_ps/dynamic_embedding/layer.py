"""`DynamicEmbedding`: an embedding whose vocabulary grows while it trains."""

import logging

import keras
import numpy as np
import tensorflow as tf

from keras_ps.dynamic_embedding import api
from keras_ps.dynamic_embedding import hashing
from keras_ps.dynamic_embedding import placement
from keras_ps.dynamic_embedding import slots as slots_lib
from keras_ps.dynamic_embedding import state as state_lib

logger = logging.getLogger(__name__)


class _Table:
    """What the layer's helpers share: config, shards and the step counter
    (a plain object, kept out of Keras' and TF's attribute tracking)."""

    def __init__(self, name, config, shards):
        self.name, self.config, self.shards = name, config, shards


@keras.saving.register_keras_serializable(package="keras_ps")
class DynamicEmbedding(keras.layers.Layer):
    """Embeds raw ids (int64 or strings) that nobody listed in advance.

    An id gets its own row the first time it is trained on (after
    `min_count` sightings), and loses it when it is not seen for `max_age`
    steps or when its shard is full and it is the least recently seen. Ids
    without a row (not yet admitted, or only seen at evaluation or
    prediction, which never insert) read the default row.

    Rows live on the parameter servers: `capacity` rows preallocated as one
    Keras weight per ps, each with a key -> row map beside it on the same ps;
    a key's ps is a stable hash of the key. Since the rows are ordinary
    weights, the row-wise optimizers (SGD, Adagrad, Ftrl,
    `keras_ps.optimizers.LazyAdam`) update them in place; a row given to a
    new key starts from a fresh row and fresh optimizer state. Checkpoints
    (`tf.train.Checkpoint`, `save_weights`, keras_ps' `BackupAndRestore`)
    hold the live keys with their rows, optimizer slot rows and counters,
    and load into any number of ps. Incremental backups
    (`keras_ps.IncrementalBackup`, `BackupAndRestore(incremental=True)`)
    write the rows changed since the previous backup and each ps' per-row
    keys and counters whole, and restore into as many ps.
    `keras_ps.layers.export_plain_model` turns a trained model into plain Keras
    (`IntegerLookup`/`StringLookup` + `Embedding`). The metrics
    `<name>_live_rows`, `<name>_admissions` and `<name>_evictions` (running
    totals) appear in the training logs.

    Args:
        output_dim: size of each row.
        capacity: rows in total, split evenly over the ps.
        key_dtype: `"int64"` (any integer id, negative included) or `"string"`.
        min_count: times an id must be seen in training before it gets a
            row (counted in a fixed-size count-min sketch per ps).
        max_age: evict a row not seen for this many training steps (None:
            never by age).
        evict_lru: when a ps' share is full, give the least recently seen
            rows to new ids (False: a full share raises an error).
        default_row: `"zeros"` (a constant zero row) or `"trainable"` (one
            shared trainable row) for ids without a row.
        embeddings_initializer: initializer of new rows (RandomUniform,
            RandomNormal, TruncatedNormal or a constant; each new row draws
            fresh values).
        filter_size, filter_hashes: the admission sketch's counters per ps
            and counters per id (only used when `min_count > 1`).

    Raises:
        DynamicTableError: a bad argument, or `capacity` below the ps count
            (at build).
        KeyDtypeError: ids of another dtype than `key_dtype` (at call).

    Example:
    ```python
    with strategy.scope():
        ids = keras.Input((16,), dtype="int64")
        x = keras_ps.layers.DynamicEmbedding(64, capacity=1_000_000,
                                             min_count=2, max_age=10_000)(ids)
        x = keras.layers.GlobalAveragePooling1D()(x)
        model = keras.Model(ids, keras.layers.Dense(1, "sigmoid")(x))
        model.compile(keras_ps.optimizers.LazyAdam(1e-3), "binary_crossentropy")
    ```
    """

    # Each training step takes every shard's lock (a tf.CriticalSection on
    # its ps). Several steps written out in one function (see
    # KERAS_PS_UNROLL_STEPS) hang on those locks, so a model with this layer
    # runs its steps in a tf.while_loop, one lock per iteration.
    keras_ps_steps_in_a_loop = True

    def __init__(self, output_dim, capacity, key_dtype="int64", min_count=1,
                 max_age=None, evict_lru=True, default_row="zeros",
                 embeddings_initializer="uniform", filter_size=1 << 20,
                 filter_hashes=3, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(output_dim, int) or output_dim < 1:
            raise api.DynamicTableError(
                "DynamicEmbedding's output_dim must be a positive integer. "
                f"Received: output_dim={output_dim!r}.")
        if default_row not in api.DEFAULT_ROWS:
            raise api.DynamicTableError(
                "DynamicEmbedding's default_row is 'zeros' or 'trainable'. "
                f"Received: default_row={default_row!r}.")
        self.output_dim = output_dim
        self.config = api.TableConfig(
            capacity=capacity, key_dtype=key_dtype, min_count=min_count,
            max_age=max_age, evict_lru=evict_lru, filter_size=filter_size,
            filter_hashes=filter_hashes)
        self.default_row = default_row
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self._stats = TableStats(None, name=self.name)

    # -- building -------------------------------------------------------------------
    def build(self, input_shape=None):
        strategy = tf.distribute.get_strategy()
        devices = placement.ps_devices(strategy)
        sizes = self.config.shard_rows(len(devices))
        add_weight = placement.unsplit_add_weight(self)
        parts, shards = [], []
        for index, (device, size) in enumerate(zip(devices, sizes)):
            with placement.on(strategy, device):
                # Zeros: a row gets its values when a key is admitted to it.
                part = add_weight(shape=(size, self.output_dim),
                                  initializer="zeros",
                                  name=f"embeddings_part_{index}")
                shard = slots_lib.SlotShard(
                    index, device, placement.tf_variable(part), self.config,
                    lambda name, value: tf.Variable(value, trainable=False,
                                                    name=name))
            placement.mark_owned(part, shard.add_optimizer_slot, shard)
            placement.remade_on_recovery(strategy, device,
                                         shard.remake_resources)
            parts.append(part)
            shards.append(shard)
        self._default = None
        if self.default_row == "trainable":
            self._default = add_weight(shape=(1, self.output_dim),
                                       initializer="zeros", name="default_row")
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_table", _Table(self.name, self.config,
                                                  shards))
        object.__setattr__(self, "_checkpoint", state_lib.TableCheckpoint(self._table))
        self._stats._table = self._table
        logger.info("[chief] %s: %d rows in %d shards %s", self.name,
                    self.config.capacity, len(shards), sizes)
        self.built = True

    @property
    def num_shards(self):
        return len(self._table.shards)

    # -- the lookup --------------------------------------------------------------------
    def _check_keys(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        want = self.config.key_dtype
        if want == "string" and inputs.dtype != tf.string:
            raise api.KeyDtypeError(
                f"DynamicEmbedding {self.name!r} takes string keys. Received: "
                f"inputs.dtype={inputs.dtype.name}. Pass strings, or create "
                "the layer with key_dtype='int64' for integer ids.")
        if want == "int64":
            if not inputs.dtype.is_integer:
                raise api.KeyDtypeError(
                    f"DynamicEmbedding {self.name!r} takes integer keys. "
                    f"Received: inputs.dtype={inputs.dtype.name}. Pass int64 "
                    "ids (keras.Input(..., dtype='int64')), or create the "
                    "layer with key_dtype='string' for string ids.")
            inputs = tf.cast(inputs, tf.int64)
        return inputs

    def _init_rows(self, count, step, salt):
        return initial_rows(self.embeddings_initializer, count, self.output_dim,
                            tf.stack([step, tf.constant(salt, tf.int64)]))

    def call(self, inputs, training=None):
        keys = self._check_keys(inputs)
        flat = tf.reshape(keys, [-1])
        unique, position, counts = tf.unique_with_counts(flat, out_idx=tf.int32)
        num_shards = self.num_shards
        owner = hashing.route(unique, num_shards)
        where = tf.dynamic_partition(tf.range(tf.size(unique)), owner, num_shards)
        shard_keys = tf.dynamic_partition(unique, owner, num_shards)
        shard_counts = tf.dynamic_partition(counts, owner, num_shards)
        if self._default is not None:
            default = tf.convert_to_tensor(self._default)
        else:
            default = tf.zeros([1, self.output_dim], self.compute_dtype)
        gathered = []
        for index, shard in enumerate(self._table.shards):
            # Everything but the rows found stays on the ps: one exchange
            # per ps and step (keys and counts there, rows back).
            if training:
                slots = shard.train_slots(
                    shard_keys[index], shard_counts[index],
                    lambda n, t, index=index: self._init_rows(n, t, index))
            else:
                slots = shard.lookup(shard_keys[index])
            rows, has_row = shard.gather_rows(slots)
            with_row = tf.cast(tf.where(has_row)[:, 0], tf.int32)
            without = tf.cast(tf.where(tf.logical_not(has_row))[:, 0], tf.int32)
            rows = tf.cast(rows, self.compute_dtype)
            fill = tf.tile(tf.cast(default, self.compute_dtype),
                           [tf.size(without), 1])
            gathered.append(tf.dynamic_stitch([with_row, without], [rows, fill]))
        rows = tf.dynamic_stitch(where, gathered)
        out = tf.gather(rows, position)
        return tf.reshape(out, tf.concat([tf.shape(keys), [self.output_dim]], 0))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs, training=None):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape),
                                 dtype=self.compute_dtype)

    # -- state -------------------------------------------------------------------------
    def live_state(self):
        """The live keys and everything saved with them, as numpy arrays:
        `keys`, `rows`, `last_seen`, `hits`, `optimizer_<slot>` per key, and
        `step`, `stats`, `filter`."""
        return state_lib.gather(self._table)

    def load_live_state(self, state):
        state_lib.assign(self._table, state)

    def default_row_value(self):
        if self._default is None:
            return np.zeros([self.output_dim], np.float32)
        return np.asarray(self._default.numpy())[0]

    def save_own_variables(self, store):
        state = self.live_state()
        for name, value in state.items():
            if value.dtype == object:  # string keys
                value = np.asarray(value, dtype=bytes)
            store[name] = value
        if self._default is not None:
            store["default_row"] = self._default.numpy()

    def load_own_variables(self, store):
        state = {}
        for name in store.keys():
            if name == "default_row":
                continue
            value = np.asarray(store[name])
            state[name] = value
        if "keys" not in state:
            raise api.DynamicTableError(
                f"The weights of DynamicEmbedding {self.name!r} hold no keys. "
                f"Received: entries {sorted(store.keys())}. Load a file saved "
                "from a model with this DynamicEmbedding layer.")
        self.load_live_state(state)
        if self._default is not None and "default_row" in store.keys():
            self._default.assign(np.asarray(store["default_row"]))

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint" or not self.built:
            return super()._trackable_children(save_type, **kwargs)
        children = {"dynamic_table": self._checkpoint}
        if self._default is not None:
            children["default_row"] = self._default
        return children

    def get_config(self):
        config = super().get_config()
        config.update(
            output_dim=self.output_dim, capacity=self.config.capacity,
            key_dtype=self.config.key_dtype, min_count=self.config.min_count,
            max_age=self.config.max_age, evict_lru=self.config.evict_lru,
            default_row=self.default_row,
            embeddings_initializer=keras.initializers.serialize(
                self.embeddings_initializer),
            filter_size=self.config.filter_size,
            filter_hashes=self.config.filter_hashes)
        return config


def initial_rows(initializer, count, dim, seed):
    """`[count, dim]` fresh rows drawn as `initializer` would, from the
    stateless `seed` (so rows admitted at different steps differ)."""
    shape = tf.stack([tf.cast(count, tf.int32), dim])
    config = initializer.get_config() if hasattr(initializer, "get_config") else {}
    kind = type(initializer).__name__
    if kind == "RandomUniform":
        return tf.random.stateless_uniform(shape, seed, config["minval"],
                                           config["maxval"])
    if kind == "RandomNormal":
        return tf.random.stateless_normal(shape, seed, config["mean"],
                                          config["stddev"])
    if kind == "TruncatedNormal":
        return tf.random.stateless_truncated_normal(shape, seed, config["mean"],
                                                    config["stddev"])
    if kind == "Zeros":
        return tf.zeros(shape)
    if kind == "Ones":
        return tf.ones(shape)
    if kind == "Constant":
        return tf.fill(shape, tf.cast(config["value"], tf.float32))
    raise api.DynamicTableError(
        "DynamicEmbedding draws each new row itself and knows RandomUniform, "
        "RandomNormal, TruncatedNormal, Zeros, Ones and Constant. Received: "
        f"embeddings_initializer={kind}. Use one of those.")


# -- the table's numbers in the epoch logs -----------------------------------
# The table's live rows, admissions and evictions as Keras metric results.
#
# A metric of the layer, so `Model.fit` puts the numbers in every epoch's logs
# (and so in `History` and TensorBoard) with nothing else to configure. They
# are running totals read from the shards' counters on the ps; resetting the
# metrics (at each epoch) does not reset them.
class TableStats(keras.metrics.Metric):
    """`<layer>_live_rows`, `<layer>_admissions`, `<layer>_evictions`."""

    def __init__(self, table, name):
        super().__init__(name=name)
        self._table = table

    def update_state(self, *args, **kwargs):
        del args, kwargs

    def reset_state(self):
        pass

    def result(self):
        totals = tf.add_n([tf.cast(shard.read_stats(), tf.int64)
                           for shard in self._table.shards])
        evicted = (totals[slots_lib.EVICTED_BY_AGE]
                   + totals[slots_lib.EVICTED_BY_CAPACITY])
        return {f"{self.name}_live_rows": totals[slots_lib.LIVE],
                f"{self.name}_admissions": totals[slots_lib.ADMITTED],
                f"{self.name}_evictions": evicted}
