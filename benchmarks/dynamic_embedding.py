"""DynamicEmbedding against a static sharded Embedding fed hashed ids.

Both variants, each in its own process on its own LocalCluster (2 ps, 2
workers), train `Model.fit` on the same stream: batches of 256 x 16 ids
drawn from a drifting Zipf law (rank r ~ Zipf(1.1); the id of rank r at
step s is r + drift * s, so popular ids keep changing and new ones keep
arriving), label ~ Bernoulli(sigmoid(mean of the ids' hidden effects)),
each id's effect +-1 from a hash of the id. Model: table(dim) ->
GlobalAveragePooling1D -> Dense(1, sigmoid), Adagrad.

  dynamic: keras_ps.layers.DynamicEmbedding(dim, capacity=C, min_count=2)
  hashed:  keras.layers.Embedding(C, dim) over hash(id) mod C, sharded in 2
           (the same rows of memory)

Reported per variant: steps/s (whole `fit` calls, and epochs after the
first), ps RSS after each epoch, the table's live rows / admissions /
evictions after each epoch (dynamic), held-out AUC on fresh batches of the
final distribution, and checkpoint bytes (tf.train.Checkpoint) with the
live rows they hold.

    .venv/bin/python benchmarks/dynamic_embedding.py --quick   # minutes
    .venv/bin/python benchmarks/dynamic_embedding.py           # the full stream
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BATCH, IDS, DIM = 256, 16, 64


def _rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def run_variant(variant, capacity, epochs, steps, drift):
    import numpy as np
    import tensorflow as tf
    import keras
    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner
    from keras_ps.tables.dynamic import hashing

    def batch_ids(stream, step):
        seed = tf.stack([tf.cast(stream, tf.int64), tf.cast(step, tf.int64)])
        u = tf.random.stateless_uniform([BATCH, IDS], seed, 1e-9, 1.0,
                                        dtype=tf.float64)
        rank = tf.cast(tf.floor(tf.pow(u, -1.0 / 0.1)), tf.int64)  # Zipf-like tail
        rank = tf.minimum(rank, 10**12)
        return rank + tf.cast(step, tf.int64) * drift

    def labels(ids, seed):
        effect = tf.cast(hashing.bucket(hashing.fingerprint(ids), 2), tf.float32) * 2 - 1
        p = tf.sigmoid(2.0 * tf.reduce_mean(effect, axis=1, keepdims=True))
        return tf.cast(tf.random.stateless_uniform(tf.shape(p), seed) < p, tf.float32)

    def dataset_fn(context):
        stream = context.input_pipeline_id

        def make(step):
            ids = batch_ids(stream, step)
            return ids, labels(ids, tf.stack([tf.cast(step, tf.int64), 7]))

        # Both workers walk the same drifting clock (the global step).
        return tf.data.Dataset.range(10**9).map(make).prefetch(4)

    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(2)
            if variant == "hashed" else None)
        with strategy.scope():
            ids = keras.Input((IDS,), dtype="int64")
            if variant == "dynamic":
                table = keras_ps.layers.DynamicEmbedding(
                    DIM, capacity=capacity, min_count=2, name="ids")
                x = table(ids)
            else:
                hashed = keras.layers.Lambda(
                    lambda k: hashing.bucket(hashing.fingerprint(k), capacity))(ids)
                x = keras.layers.Embedding(capacity, DIM, name="ids")(hashed)
            x = keras.layers.GlobalAveragePooling1D()(x)
            model = keras.Model(ids, keras.layers.Dense(1, "sigmoid")(x))
            model.compile(keras.optimizers.Adagrad(0.1), "binary_crossentropy",
                          steps_per_execution=10)
        rss, epoch_times, logs = [], [], []

        class Probe(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.monotonic()

            def on_epoch_end(self, epoch, epoch_logs=None):
                epoch_times.append(time.monotonic() - self.start)
                rss.append([_rss_mb(cluster.pid("ps", i)) for i in range(2)])
                logs.append({k: float(v) for k, v in (epoch_logs or {}).items()})

        start = time.monotonic()
        model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps, verbose=0, callbacks=[Probe()])
        whole = time.monotonic() - start
        # Held-out AUC on fresh batches of the final distribution.
        auc = keras.metrics.AUC()
        last = epochs * steps
        for b in range(20):
            x_ids = batch_ids(1000 + b, last)
            y = labels(x_ids, tf.stack([tf.constant(last, tf.int64), 99 + b]))
            auc.update_state(y, model.predict(x_ids, verbose=0))
        with tempfile.TemporaryDirectory() as folder:
            path = tf.train.Checkpoint(model=model).write(os.path.join(folder, "c"))
            ckpt_bytes = sum(os.path.getsize(os.path.join(folder, f))
                             for f in os.listdir(folder))
        return {
            "variant": variant, "capacity": capacity, "epochs": epochs,
            "steps_per_epoch": steps, "drift": drift,
            "steps_per_s_whole": epochs * steps / whole,
            "steps_per_s_after_first": (epochs - 1) * steps / sum(epoch_times[1:])
            if epochs > 1 else None,
            "ps_rss_mb": rss, "epoch_logs": logs, "auc": float(auc.result()),
            "checkpoint_bytes": ckpt_bytes}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--variant")
    parser.add_argument("--capacity", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--drift", type=int, default=64)
    args = parser.parse_args()
    capacity = args.capacity or (100_000 if args.quick else 1_000_000)
    epochs = args.epochs or (4 if args.quick else 20)
    steps = args.steps or (100 if args.quick else 500)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(
            args.variant, capacity, epochs, steps, args.drift)), flush=True)
        return
    results = []
    for variant in ("hashed", "dynamic"):
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--capacity",
             str(capacity), "--epochs", str(epochs), "--steps", str(steps),
             "--drift", str(args.drift)], capture_output=True, text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
        results.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    hashed, dynamic = results
    print(f"steps/s dynamic / hashed (whole fit): "
          f"{dynamic['steps_per_s_whole'] / hashed['steps_per_s_whole']:.2f}")


if __name__ == "__main__":
    main()
