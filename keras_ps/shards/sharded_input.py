"""`ShardedInput`: the data of an epoch, split into shards the coordinator
hands out. What a shard is, its name, its records and their order.

A shard is one file (read with `read_fn`) or one range of records of a
`tf.data.Dataset` or of numpy arrays. The coordinator hands shards out one at
a time to whichever worker is free; see keras_ps/shards/epoch.py.
"""

import math
import os

import numpy as np
import tensorflow as tf

from keras_ps.shards import _count
from keras_ps.shards import epoch as epoch_lib

DEFAULT_BATCH_SIZE = 32
DEFAULT_FILE_SHUFFLE_BUFFER = 1024
# Default shards for a dataset or arrays: about this many, whatever the
# number of workers (a joining worker just takes the next one).
DEFAULT_TARGET_SHARDS = 64
DEFAULT_MAX_ATTEMPTS = 3


def _is_file_list(data):
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(
        isinstance(f, (str, bytes, os.PathLike)) for f in data)


class ShardedInput:
    """Training data the coordinator hands out shard by shard.

    Every record is trained on once per epoch, whatever the workers do: the
    coordinator keeps a ledger of the epoch's shards (handed out, done or
    lost), gives the next shard to whichever worker is free, and queues a
    shard again when its worker fails, hangs or leaves; the retry resumes
    after the last step whose updates were all applied. A record is trained
    twice only when its step was in flight on a worker that failed; the
    epoch's logs count these records, exactly, in `records_retrained` (a
    step counts when its updates start on the ps, which is once all they
    consume is there). The epoch ends when every shard is done, so `fit`
    needs no `steps_per_epoch`.

    Args:
        data: one of
            - file names (a list), or a glob pattern (a string): one shard
              per file, read by `read_fn`;
            - a finite `tf.data.Dataset` of single records (not batched):
              split into ranges of `records_per_shard` records;
            - numpy arrays: `x`, a tuple `(x, y)` or `(x, y, sample_weight)`,
              or a dict; split into ranges of rows like a dataset.
        read_fn: for files only, `read_fn(filename) -> tf.data.Dataset` of
            the file's records (e.g. `tf.data.TFRecordDataset(f).map(parse)`);
            `filename` is a string tensor. It runs on the workers, must be
            deterministic (a retry skips the records already trained), and
            must not batch.
        batch_size: records per step (default 32). Batches do not cross
            shards: a shard's last batch may be smaller.
        shuffle: shuffle the order of the shards each epoch, and the records
            within each shard (a buffer of `shuffle_buffer_size`).
        seed: makes both shuffles reproducible (the same order every run);
            default: a random seed, kept in BackupAndRestore's backups.
        records_per_shard: for a dataset or arrays, records per shard
            (default: about 64 shards, a multiple of `batch_size`).
        shuffle_buffer_size: records in the within-shard shuffle buffer
            (default: the whole shard for a dataset or arrays, 1024 for
            files).
        max_attempts: attempts of a shard that fails to read (an error in
            `read_fn` or the step) before the error is raised, naming the
            shard (default 3).

    Example, TFRecord files:
    ```python
    def read_fn(filename):
        features = {"x": tf.io.FixedLenFeature([8], tf.float32),
                    "y": tf.io.FixedLenFeature([1], tf.float32)}
        parse = lambda r: tuple(tf.io.parse_single_example(r, features).values())
        return tf.data.TFRecordDataset(filename).map(parse)

    data = keras_ps.ShardedInput("/data/train-*.tfrecord", read_fn=read_fn,
                                 batch_size=64, seed=1)
    model.fit(data, epochs=3)        # no steps_per_epoch: an epoch is the data
    ```
    """

    def __init__(self, data, read_fn=None, batch_size=None, shuffle=True,
                 seed=None, records_per_shard=None, shuffle_buffer_size=None,
                 max_attempts=DEFAULT_MAX_ATTEMPTS):
        self.batch_size = _positive("batch_size", batch_size,
                                    DEFAULT_BATCH_SIZE)
        self.shuffle = bool(shuffle)
        self.seed = int(np.random.SeedSequence().entropy % (2**31)) \
            if seed is None else int(seed)
        self.max_attempts = _positive("max_attempts", max_attempts, None)
        self.read_fn = read_fn
        if isinstance(data, (str, os.PathLike)):
            pattern = os.fspath(data)
            files = sorted(tf.io.gfile.glob(pattern))
            if not files:
                raise ValueError(
                    "ShardedInput found no file matching the pattern. "
                    f"Received: data={pattern!r}. Fix: check the path, or pass "
                    "the list of files.")
            data = files
        if _is_file_list(data):
            self._init_files(data, read_fn, records_per_shard,
                             shuffle_buffer_size)
        else:
            if read_fn is not None:
                raise ValueError(
                    "read_fn reads one file; it is only for a list of files. "
                    f"Received: read_fn={read_fn!r} with data of type "
                    f"{type(data).__name__}. Fix: map the dataset before "
                    "passing it (dataset.map(fn)), or drop read_fn.")
            self._init_records(data, records_per_shard, shuffle_buffer_size)

    # -- construction ----------------------------------------------------------
    def _init_files(self, files, read_fn, records_per_shard,
                    shuffle_buffer_size):
        self.kind = "files"
        self.files = [os.fsdecode(f) for f in files]
        if read_fn is None or not callable(read_fn):
            raise ValueError(
                "ShardedInput needs read_fn to read a file. Received: "
                f"read_fn={read_fn!r} with {len(self.files)} files. Fix: pass "
                "read_fn=lambda f: tf.data.TFRecordDataset(f).map(parse).")
        if records_per_shard is not None:
            raise ValueError(
                "With files a shard is one file. Received: records_per_shard="
                f"{records_per_shard}. Fix: drop records_per_shard, or split "
                "the files.")
        self.records_per_shard = None
        self.shuffle_buffer_size = _positive(
            "shuffle_buffer_size", shuffle_buffer_size,
            DEFAULT_FILE_SHUFFLE_BUFFER)
        self.num_records = None
        self.num_shards = len(self.files)
        self.descriptions = [f"file {f!r}" for f in self.files]
        self.shard_records = [None] * self.num_shards
        # Traced, not run: read_fn runs on the workers (it may read the
        # worker's index), here only its output's structure is needed.
        dataset = tf.function(read_fn, autograph=False).get_concrete_function(
            tf.TensorSpec([], tf.string)).structured_outputs
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "read_fn must return a tf.data.Dataset of the file's records. "
                f"Received: {type(dataset).__name__} from read_fn="
                f"{read_fn!r}.")
        self._record_spec = dataset.element_spec

    def _init_records(self, data, records_per_shard, shuffle_buffer_size):
        if isinstance(data, tf.data.Dataset):
            self.kind = "dataset"
            count = int(data.cardinality())
            if count == tf.data.INFINITE_CARDINALITY:
                raise ValueError(
                    "ShardedInput needs finite data: an epoch is every record "
                    "once. Received: a dataset of infinite cardinality. Fix: "
                    "remove .repeat() (fit's `epochs` repeats the data).")
            if count == tf.data.UNKNOWN_CARDINALITY:
                count = _count.count_records(data)
                data = data.apply(tf.data.experimental.assert_cardinality(count))
            dataset = data
        else:
            if data is None:
                raise ValueError(
                    "ShardedInput needs data. Received: data=None. Fix: pass "
                    "file names, a tf.data.Dataset or numpy arrays.")
            self.kind = "arrays"
            arrays = tf.nest.map_structure(np.asarray, data)
            rows = {a.shape[0] if a.ndim else None
                    for a in tf.nest.flatten(arrays)}
            if len(rows) != 1 or None in rows:
                raise ValueError(
                    "Every array must have one row per record. Received: "
                    f"arrays with row counts {sorted(rows, key=str)}. Fix: "
                    "pass arrays of equal length.")
            count = rows.pop()
            dataset = tf.data.Dataset.from_tensor_slices(arrays)
        if count == 0:
            raise ValueError(
                "ShardedInput received no records: an epoch would train on "
                f"nothing. Received: an empty {self.kind}. Fix: check the data "
                "(a filter that drops everything, an empty array).")
        self.num_records = count
        graph = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset))
        spec = dataset.element_spec
        self._record_spec = spec
        self._records_fn = lambda: tf.data.experimental.from_variant(
            tf.raw_ops.DatasetFromGraph(graph_def=graph), spec)
        if records_per_shard is None:
            per = math.ceil(count / (self.batch_size * DEFAULT_TARGET_SHARDS))
            records_per_shard = self.batch_size * max(1, per)
        self.records_per_shard = _positive("records_per_shard",
                                           records_per_shard, None)
        self.num_shards = math.ceil(count / self.records_per_shard)
        self._starts = [i * self.records_per_shard
                        for i in range(self.num_shards)]
        self.shard_records = [min(self.records_per_shard, count - s)
                              for s in self._starts]
        self.descriptions = [f"records {s}-{s + n - 1}" for s, n in
                             zip(self._starts, self.shard_records)]
        self.shuffle_buffer_size = _positive(
            "shuffle_buffer_size", shuffle_buffer_size, self.records_per_shard)

    # -- what the coordinator asks ------------------------------------------------
    @property
    def element_spec(self):
        """The spec of one batch (the first dimension unknown)."""
        return tf.nest.map_structure(
            lambda s: tf.TensorSpec([None] + s.shape.as_list(), s.dtype),
            self._record_spec)

    def order(self, epoch):
        """The order shards are handed out in `epoch` (reproducible)."""
        if not self.shuffle:
            return list(range(self.num_shards))
        rng = np.random.default_rng([self.seed, epoch])
        return [int(i) for i in rng.permutation(self.num_shards)]

    def shard_seed(self, epoch, index):
        """The within-shard shuffle seed of shard `index` in `epoch`."""
        return int(np.random.default_rng([self.seed, epoch, index + 1])
                   .integers(1, 2**62))

    def records(self, shard, seed):
        """Inside the shard function (on a worker): the shard's records,
        shuffled by `seed`, not batched. `shard` and `seed` are tensors."""
        if self.kind == "files":
            filename = tf.gather(tf.constant(self.files), shard)
            dataset = self.read_fn(filename)
        else:
            start = tf.gather(tf.constant(self._starts, tf.int64), shard)
            count = tf.gather(tf.constant(self.shard_records, tf.int64), shard)
            dataset = self._records_fn().skip(start).take(count)
        if self.shuffle:
            # The order depends on `seed` only, not on a global seed set with
            # tf.random.set_seed / keras.utils.set_random_seed (which would
            # also make tf.data compare the seed tensor as a Python bool when
            # that global seed is 0): no graph seed while the op is made.
            graph = tf.compat.v1.get_default_graph()
            saved, graph.seed = graph.seed, None
            try:
                dataset = dataset.shuffle(self.shuffle_buffer_size, seed=seed,
                                          reshuffle_each_iteration=False)
            finally:
                graph.seed = saved
        return dataset

    def __repr__(self):
        return (f"ShardedInput({self.num_shards} shards of {self.kind}, "
                f"batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"seed={self.seed})")

    # -- custom training loops -----------------------------------------------------
    def shard_function(self, coordinator, step_fn, steps_per_execution=1):
        """A tf.function that runs `step_fn(batch)` on every batch of one
        shard; schedule it with each shard of `self.epoch(...)`.

        The shard's progress is kept on a ps after every step, so a retry
        resumes after the last applied step. The lease is checked once per
        `max(steps_per_execution, 4)` steps (a shard is one remote call
        whatever this is; below 4 steps the checks would cost more than tiny
        steps): more steps per execution cost less per step, and a worker
        given up as hung that continues may apply up to that many steps that
        its retry runs too (counted in the summary's `records_retrained`).
        `Model.fit` uses the model's `steps_per_execution`, with the same
        floor. The variable updates of `step_fn` wait on the ps for one op
        that counts the step, which runs once everything they consume is on
        their device (except a value the step computes on the worker from
        its own updates, which they wait for after it): a worker that dies
        inside a step leaves it applied and counted, or not started.

        Example:
        ```python
        train_shard = data.shard_function(coordinator, step_fn)
        for epoch in range(3):
            shards = data.epoch(coordinator, epoch)
            for shard in shards:
                coordinator.schedule(train_shard, args=(shard,))
            coordinator.join()
            print(shards.summary())
        ```
        """
        if isinstance(steps_per_execution, bool) or not isinstance(
                steps_per_execution, int) or steps_per_execution < 1:
            raise ValueError(
                "steps_per_execution must be a positive integer. Received: "
                f"steps_per_execution={steps_per_execution!r}.")
        return epoch_lib.state_for(self, coordinator).shard_function(
            step_fn, steps_per_execution)

    def epoch(self, coordinator, epoch, ledger=None):
        """A new epoch of shards (a `keras_ps.shards.ShardedEpoch`):
        iterating it gives the shards still to train, in this epoch's order."""
        return epoch_lib.state_for(self, coordinator).new_epoch(epoch, ledger)


def _positive(name, value, default):
    if value is None:
        if default is None:
            return None
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}.")
    return int(value)
