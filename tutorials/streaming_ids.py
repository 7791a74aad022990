"""Streaming ids: a dynamic-vocabulary embedding trained with `Model.fit`.

Recommendation ids are raw 64-bit values nobody lists in advance, and they
drift: new ones every hour, old ones going quiet. `DynamicEmbedding` gives
an id its own row once seen `min_count` times in training, and frees it
when the id goes quiet (`max_age`) or the table is full (least recently
seen first). This script:

1. starts a local cluster (2 ps, 2 workers) and a ParameterServerStrategy;
2. streams synthetic clicks of 8 raw int64 ids each; every "hour" (one
   epoch) new ids appear and older ones fade; the label follows a hidden
   preference per id, so an id's own row is worth learning;
3. trains `DynamicEmbedding` beside ordinary Keras layers with LazyAdam and
   prints, per epoch, the table's live rows, admissions and evictions from
   the History logs: it stays within `capacity` while new ids keep coming;
4. evaluates on held-out clicks (evaluation never gives an id a row);
5. exports the model to plain Keras, saves it as a `.keras` file, loads it
   back without any strategy and compares its predictions.

Run:
    python tutorials/streaming_ids.py --epochs 6 --steps_per_epoch 40
"""

import argparse
import logging
import os
import sys
import tempfile

# TF's C++ runtime logs every RPC to a task that is gone (at shutdown).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ps  # noqa: E402

BATCH_SIZE = 64
RECURRING = 7  # ids per example drawn from the hour's live ids, plus...
ONE_OFF = 1    # ...one id seen once and never again (a bot, a typo)


class ClickStream:
    """Synthetic click logs whose ids drift hour by hour.

    Hour `h` brings `new_ids_per_hour` new ids; its clicks use the ids born in
    hours `h - 1` and `h`, so each id lives two hours and then fades. Every
    id has a hidden preference; an example's label is 1 when its ids'
    preferences (plus noise) add up to more than 0.
    """

    def __init__(self, hours, new_ids_per_hour, seed):
        rng = np.random.default_rng(seed)
        count = new_ids_per_hour * (hours + 1)  # +1: the next hour's new ids
        # Raw ids as a hashing service emits them: any int64 value.
        self.ids = tf.constant(rng.integers(-2**63, 2**63 - 1, size=count,
                                            dtype=np.int64))
        self.preference = tf.constant(rng.normal(size=count), tf.float32)
        self.new_ids_per_hour = new_ids_per_hour

    def batch(self, hour, source, index):
        """Batch `index` of `source` (a worker; < 0: held out) in hour
        `hour`: `(ids [64, 8] int64, labels [64, 1])`, always the same."""
        hour, source, index = (tf.cast(v, tf.int64)
                               for v in (hour, source, index))
        # Three independent seeds from (source, index): ids, one-offs, noise.
        seeds = tf.random.split(tf.stack([source, index]), 3)
        first = tf.maximum(hour - 1, 0) * self.new_ids_per_hour
        last = (hour + 1) * self.new_ids_per_hour
        which = tf.random.stateless_uniform(
            [BATCH_SIZE, RECURRING], seeds[0], first, last, dtype=tf.int64)
        one_off = tf.random.stateless_uniform(  # any int64 value
            [BATCH_SIZE, ONE_OFF], seeds[1], None, None, dtype=tf.int64)
        ids = tf.concat([tf.gather(self.ids, which), one_off], axis=1)
        score = tf.reduce_sum(tf.gather(self.preference, which), axis=1)
        score += tf.random.stateless_normal([BATCH_SIZE], seeds[2])
        labels = tf.cast(score > 0, tf.float32)[:, tf.newaxis]
        return ids, labels


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6,
                        help="hours of traffic, one epoch each")
    parser.add_argument("--steps_per_epoch", type=int, default=40)
    parser.add_argument("--steps_per_execution", type=int, default=5)
    parser.add_argument("--new_ids_per_hour", type=int, default=400)
    parser.add_argument("--capacity", type=int, default=1024,
                        help="rows of the table, over both ps")
    parser.add_argument("--max_age", type=int, help="in training steps "
                        "(default: steps_per_epoch, one hour)")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=os.path.join(
        tempfile.gettempdir(), "keras_ps_streaming_ids"))
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    tf.get_logger().setLevel("ERROR")
    # keras_ps' own log lines: the table's shards, workers lost; no per step.
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("keras_ps").setLevel(logging.INFO)
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        print("Started a local cluster: 2 ps, 2 workers")
        return train(args, keras_ps.ParameterServerStrategy(cluster.resolver))


def train(args, strategy):
    keras.utils.set_random_seed(args.seed)
    hours = args.epochs
    stream = ClickStream(hours, args.new_ids_per_hour, seed=args.seed)
    print("Some raw ids:", stream.ids.numpy()[:3].tolist())

    def dataset_fn(context):
        # Runs on each worker: an endless stream of its own batches, like a
        # log partition. A worker's clock is its own batch count: the
        # workers share each epoch's steps, so ~steps_per_epoch / workers
        # batches make an hour (a worker that ran more steps is ahead).
        per_hour = max(1, args.steps_per_epoch // context.num_input_pipelines)
        worker = context.input_pipeline_id

        def batch(k):
            hour = tf.minimum(k // per_hour, hours - 1)
            return stream.batch(hour, worker, k)

        return tf.data.Dataset.counter().map(batch).prefetch(2)

    # -- the model: a dynamic table beside ordinary Keras layers -------------
    with strategy.scope():
        ids = keras.Input((RECURRING + ONE_OFF,), dtype="int64", name="item_ids")
        # `capacity` rows, split over the ps. An id gets a row on its 2nd
        # sighting in training (min_count=2: one-off ids never take one); a
        # row unseen for `max_age` steps is freed, and when a ps' share is
        # full the least recently seen row goes to the new id.
        table = keras_ps.layers.DynamicEmbedding(
            16, capacity=args.capacity, min_count=2, name="items",
            max_age=args.max_age or args.steps_per_epoch)
        x = keras.layers.GlobalAveragePooling1D()(table(ids))
        x = keras.layers.Dense(16, activation="relu")(x)
        model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))
        # LazyAdam updates only the rows looked up (Keras' Adam would touch
        # every row of the table at every step).
        model.compile(keras_ps.optimizers.LazyAdam(0.01), "binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc"), "accuracy"],
                      steps_per_execution=args.steps_per_execution)

    # -- fit: one epoch per hour of traffic -----------------------------------
    history = model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=hours,
                        steps_per_epoch=args.steps_per_epoch, verbose=2)
    workers = keras_ps.ClusterCoordinator(strategy).workers
    print("Steps per worker: " + ", ".join(
        f"worker {w.index}: {w.closures_run * args.steps_per_execution}"
        for w in workers))
    # The table's numbers are in every epoch's logs as `<layer name>_...`:
    # live rows now, and admissions and evictions as running totals (printed
    # here per epoch).
    logs = history.history
    admitted = np.diff(logs["items_admissions"], prepend=0).astype(int)
    evicted = np.diff(logs["items_evictions"], prepend=0).astype(int)
    for e in range(hours):
        print(f"epoch {e + 1}: live rows {int(logs['items_live_rows'][e])}, "
              f"admissions {admitted[e]}, evictions {evicted[e]}, "
              f"loss {logs['loss'][e]:.4f}, auc {logs['auc'][e]:.4f}")
    # (An id back after its row was freed is admitted again, at once.)
    print(f"Over {hours} hours: {args.new_ids_per_hour * hours} recurring ids "
          f"arrived, {admitted.sum()} rows admitted, {evicted.sum()} evicted; "
          f"capacity {args.capacity}")

    # -- evaluation: held-out clicks ------------------------------------------
    # Fresh clicks (seeds no worker used) of the last hour trained, and of
    # the hour after it: half its ids never trained, they read the default
    # row (zeros). Evaluation never inserts: the live rows do not change.
    live_before = len(table.live_state()["keys"])
    for name, hour in (("last hour", hours - 1), ("next hour", hours)):
        held_out = tf.data.Dataset.range(args.eval_batches).map(
            lambda k, hour=hour: stream.batch(hour, -1, k))
        result = model.evaluate(held_out, verbose=0, return_dict=True)
        print(f"Evaluation AUC/accuracy ({name}): {result['auc']:.4f} / "
              f"{result['accuracy']:.4f}")
    live_after = len(table.live_state()["keys"])
    print(f"live rows before evaluation {live_before}, after {live_after}")

    # -- export: plain Keras, no keras_ps needed to serve ---------------------
    # The table becomes IntegerLookup (the live ids) + Embedding (row 0: the
    # default row, for every id without a row); the other layers are kept.
    plain = keras_ps.layers.export_plain_model(model)
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, "streaming_ids.keras")
    plain.save(path)
    served = keras.saving.load_model(path)  # no strategy, no cluster
    rows = served.get_layer("items").get_layer("items_embedding").embeddings
    print(f"Exported {path}: {rows.shape[0] - 1} ids + the default row")
    x, _ = stream.batch(hours - 1, -2, 0)  # known ids and one-off ids
    want = model.predict(x, verbose=0)
    got = served.predict(x, verbose=0)
    print(f"exported model matches: max abs diff "
          f"{float(np.max(np.abs(want - got))):.3g}")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip TF's teardown: it would try to reach the tasks we just stopped.
    os._exit(code)
