"""DynamicEmbedding against a static sharded Embedding fed the same ids hashed.

Each variant runs `Model.fit` in its own process on its own LocalCluster (2
ps, 2 workers), batches of 256 x 16 ids, dim 64, Adagrad. With
`--side_by_side` (the default) the two processes run at the same time, so
they share the machine's load and their steps/s ratio is fair on a busy
machine; `--sequential` runs one after the other (half the memory).

The stream (the same for both): each worker draws ranks r from a power law
over a vocabulary of `--vocabulary` ranks (P(r) ~ (r + 1)^-alpha); rank r
holds one id for `--lifetime` steps, then a fresh id (its generation
changes, at a phase that depends on r), so popular ids keep changing and
new ids keep arriving. Each id has a hidden effect (+-1, from a hash of the
id); an example's label is Bernoulli(sigmoid(2 * sum(effects) / 4)): a
click task where an id's row is worth learning only if the id recurs.

  dynamic: keras_ps.layers.DynamicEmbedding(dim, capacity=C, min_count=2)
  hashed:  keras.layers.Embedding(C, dim) over hash(id) mod C, split in 2
           by FixedShardsPartitioner (the same rows of memory)

Reported per variant: steps/s of the median epoch after the first, ps RSS after
each epoch, the table's live rows / admissions / evictions after each epoch
(dynamic), held-out AUC on fresh batches of the final distribution, and
checkpoint bytes (tf.train.Checkpoint) after the first epoch and at the end,
with the live rows they hold; and the distinct ids streamed (both workers,
counted again from the same generator).

    .venv/bin/python benchmarks/dynamic_embedding.py --quick --repeats 3
    .venv/bin/python benchmarks/dynamic_embedding.py --sequential   # full
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

BATCH, IDS, DIM = 256, 16, 64


def _rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def make_stream(vocabulary, lifetime, alpha):
    """`(batch_ids(stream, step), labels(ids, seed))`, pure TF functions."""
    import tensorflow as tf
    from keras_ps.tables.dynamic import hashing

    top = float(vocabulary + 1) ** (1.0 - alpha)

    def batch_ids(stream, step):
        step = tf.cast(step, tf.int64)
        seed = tf.stack([tf.cast(stream, tf.int64), step])
        u = tf.random.stateless_uniform([BATCH, IDS], seed, dtype=tf.float64)
        # Inverse CDF of a continuous power law on [1, vocabulary + 1).
        rank = tf.cast(tf.floor(tf.pow(u * (top - 1.0) + 1.0, 1.0 / (1.0 - alpha))),
                       tf.int64) - 1
        rank = tf.clip_by_value(rank, 0, vocabulary - 1)
        phase = tf.math.floormod(rank * 2654435761, lifetime)
        generation = (step + phase) // lifetime
        return rank + vocabulary * generation

    def labels(ids, seed):
        effect = tf.cast(hashing.bucket(hashing.fingerprint(ids), 2, salt=11),
                         tf.float32) * 2 - 1
        p = tf.sigmoid(2.0 * tf.reduce_sum(effect, axis=1, keepdims=True) / 4.0)
        return tf.cast(tf.random.stateless_uniform(tf.shape(p), seed) < p,
                       tf.float32)

    return batch_ids, labels


def run_variant(args):
    import numpy as np
    import tensorflow as tf
    import keras
    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner
    from keras_ps.tables.dynamic import hashing

    capacity, epochs, steps = args.capacity, args.epochs, args.steps
    variant = args.variant
    batch_ids, labels = make_stream(args.vocabulary, args.lifetime, args.alpha)

    def dataset_fn(context):
        stream = context.input_pipeline_id

        def make(step):
            ids = batch_ids(stream, step)
            return ids, labels(ids, tf.stack([tf.cast(step, tf.int64),
                                              tf.cast(7 + stream, tf.int64)]))

        # Both workers walk the same clock (their own step count).
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
        rss, epoch_times, logs, checkpoints = [], [], [], []

        def checkpoint_bytes():
            with tempfile.TemporaryDirectory() as folder:
                tf.train.Checkpoint(model=model).write(os.path.join(folder, "c"))
                return sum(os.path.getsize(os.path.join(folder, f))
                           for f in os.listdir(folder))

        class Probe(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.monotonic()

            def on_epoch_end(self, epoch, epoch_logs=None):
                epoch_times.append(time.monotonic() - self.start)
                rss.append([_rss_mb(cluster.pid("ps", i)) for i in range(2)])
                logs.append({k: float(v) for k, v in (epoch_logs or {}).items()})
                if epoch == 0:
                    checkpoints.append(
                        [checkpoint_bytes(), logs[-1].get("ids_live_rows")])
                print("PROGRESS " + json.dumps(
                    {"variant": variant, "epoch": epoch, "rss": rss[-1],
                     "seconds": epoch_times[-1], **logs[-1]}), flush=True)

        model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps, verbose=0, callbacks=[Probe()])
        checkpoints.append([checkpoint_bytes(), logs[-1].get("ids_live_rows")])
        # Held-out AUC on fresh batches of the final distribution.
        auc = keras.metrics.AUC()
        last = epochs * steps // 2
        for b in range(args.eval_batches):
            x_ids = batch_ids(1000 + b, last)
            y = labels(x_ids, tf.stack([tf.constant(last, tf.int64),
                                        tf.constant(99 + b, tf.int64)]))
            auc.update_state(y, model.predict(x_ids, verbose=0))
        timed = epoch_times[1:] or epoch_times
        return {
            "variant": variant, "capacity": capacity, "epochs": epochs,
            "steps_per_epoch": steps,
            # The median epoch: the other engineers' runs on a shared
            # machine stall single epochs of either process.
            "steps_per_s_after_first": steps / float(np.median(timed)),
            "epoch_seconds": epoch_times, "ps_rss_mb": rss, "epoch_logs": logs,
            "auc": float(auc.result()), "checkpoints": checkpoints}


def distinct_ids(args):
    """Distinct ids the two workers streamed (each trained about half the
    steps: counted over their first `epochs * steps / 2` batches)."""
    import numpy as np
    import tensorflow as tf

    batch_ids, _ = make_stream(args.vocabulary, args.lifetime, args.alpha)
    per_worker = args.epochs * args.steps // 2

    @tf.function
    def chunk(stream, start):
        return tf.reshape(tf.map_fn(lambda s: batch_ids(stream, s),
                                    tf.range(start, start + 100, dtype=tf.int64),
                                    fn_output_signature=tf.int64), [-1])

    seen = []
    for stream in range(2):
        for start in range(0, per_worker, 100):
            ids = chunk(tf.constant(stream, tf.int64),
                        tf.constant(start, tf.int64)).numpy()
            seen.append(np.unique(ids))
            if len(seen) > 20:
                seen = [np.unique(np.concatenate(seen))]
    return int(len(np.unique(np.concatenate(seen))))


def _watch_rss(peak):
    """The RSS of this process' descendants, summed, at its peak (MB)."""
    import psutil

    me = psutil.Process()
    while True:
        total = 0
        for child in me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total / 2**20)
        time.sleep(2)


def _launch(variant, args):
    cmd = [sys.executable, __file__, "--variant", variant]
    for name in ("capacity", "epochs", "steps", "vocabulary", "lifetime",
                 "alpha", "eval_batches"):
        cmd += [f"--{name}", str(getattr(args, name))]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def _result(proc):
    out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith("PROGRESS "):
            print(line, file=sys.stderr, flush=True)
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise SystemExit(out[-3000:] + err[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="capacity 100k, 5 epochs of 100 steps")
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variant")
    parser.add_argument("--capacity", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--vocabulary", type=int, default=5_000_000)
    parser.add_argument("--lifetime", type=int, default=1000)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--eval_batches", type=int, default=40)
    parser.add_argument("--count_distinct", action="store_true")
    parser.add_argument("--out", help="append each repeat's results (JSON lines)")
    args = parser.parse_args()
    args.capacity = args.capacity or (100_000 if args.quick else 1_000_000)
    args.epochs = args.epochs or (5 if args.quick else 20)
    args.steps = args.steps or (100 if args.quick else 1000)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return
    for repeat in range(args.repeats):
        peak = [0.0]
        watcher = threading.Thread(target=_watch_rss, args=(peak,), daemon=True)
        watcher.start()
        if args.sequential:
            hashed = _result(_launch("hashed", args))
            dynamic = _result(_launch("dynamic", args))
        else:
            procs = [_launch(v, args) for v in ("hashed", "dynamic")]
            hashed, dynamic = (_result(p) for p in procs)
        row = {"repeat": repeat, "uptime": os.getloadavg(),
               "total_rss_mb_peak": peak[0],
               "ratio": dynamic["steps_per_s_after_first"]
               / hashed["steps_per_s_after_first"],
               "hashed": hashed, "dynamic": dynamic}
        if args.count_distinct:
            row["distinct_ids"] = distinct_ids(args)
        print(json.dumps({k: row[k] for k in ("repeat", "uptime", "ratio",
                                              "total_rss_mb_peak")}
                         | {"auc": [hashed["auc"], dynamic["auc"]]}), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
