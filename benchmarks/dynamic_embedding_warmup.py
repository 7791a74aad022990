"""The warm-up of a DynamicEmbedding model: how long each remote call takes.

The DynamicEmbedding model of benchmarks/dynamic_embedding.py alone (the
same stream, a clock tick per batch), on a LocalCluster of 2 ps and 2
workers, trained with `Model.fit`; every remote call the coordinator makes
(one pack of 1-16 closures of `steps_per_execution=10` steps) is timed.
Prints each epoch's time and the table's live rows, then every call that was
the first of its pack size on its worker or took more than 3 s.

    .venv/bin/python benchmarks/dynamic_embedding_warmup.py \\
        --capacity 1000000 --epochs 6 --steps 500
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamic_embedding import IDS, DIM, STEPS_PER_EXECUTION  # noqa: E402
from dynamic_embedding import make_stream  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    import tensorflow as tf
    import keras
    import keras_ps
    from keras_ps.coordinator import worker as worker_lib

    calls = []
    started = time.monotonic()
    execute = worker_lib.Worker._execute

    def timed(self, batch):
        t0 = time.monotonic()
        try:
            return execute(self, batch)
        finally:
            calls.append((self.index, len(batch), t0 - started,
                          time.monotonic() - t0))

    worker_lib.Worker._execute = timed
    batch_ids, labels = make_stream(5_000_000, 1000, 0.9)

    def dataset_fn(context):
        w, n = context.input_pipeline_id, context.num_input_pipelines

        def make(j):
            t = n * j + w
            ids = batch_ids(t)
            return ids, labels(ids, tf.stack([t, tf.constant(7, tf.int64)]))

        return tf.data.Dataset.range(10**9).map(make).prefetch(4)

    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            ids = keras.Input((IDS,), dtype="int64")
            x = keras_ps.layers.DynamicEmbedding(
                DIM, capacity=args.capacity, min_count=2, name="dyn")(ids)
            x = keras.layers.GlobalAveragePooling1D()(x)
            model = keras.Model(ids, keras.layers.Dense(1, "sigmoid")(x))
            model.compile(keras.optimizers.Adagrad(0.1), "binary_crossentropy",
                          steps_per_execution=STEPS_PER_EXECUTION)

        class Probe(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.monotonic()

            def on_epoch_end(self, epoch, logs=None):
                print(json.dumps({
                    "epoch": epoch,
                    "seconds": round(time.monotonic() - self.start, 2),
                    "live_rows": int(logs["dyn_live_rows"]),
                    "load": os.getloadavg()[0]}), flush=True)

        model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=args.epochs,
                  steps_per_epoch=args.steps, verbose=0, callbacks=[Probe()])
    seen = set()
    for worker, size, at, seconds in calls:
        first = (worker, size) not in seen
        seen.add((worker, size))
        if first or seconds > 3:
            print(f"worker {worker} pack {size:2d} at {at:6.1f} s took "
                  f"{seconds:6.2f} s{'  (first of its size)' if first else ''}",
                  flush=True)
    print(f"{len(calls)} calls")


if __name__ == "__main__":
    main()
