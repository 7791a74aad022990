"""Sharded embedding lookup vs lookup on the concatenated table.

A 1,000,000 x 64 float32 table (256 MB) split over 2 ps by keras_ps, a
multi-process LocalCluster (1 worker, 2 ps; this process is the coordinator).
One training step = look up 4096 random ids with `keras.layers.Embedding`,
loss = sum of squares, SGD update, scheduled on the worker through the
ClusterCoordinator. Two variants on the same cluster and table, in one run:

  sharded: the layer's own call (rows gathered on each shard; sparse update).
  concat:  `tf.gather(tf.convert_to_tensor(layer.embeddings), ids)`, i.e. the
           whole table concatenated on the worker each step, then gathered.

Prints steps/s and their ratio, loopback bytes per step (/proc/net/dev `lo`,
transmitted bytes; every byte between local processes crosses `lo` once)
against the rows actually read (ids x 64 x 4 bytes each way), and the same
step on a fixed batch of Zipf-like ids (log-uniform, many repeats) against
its distinct rows (each distinct row crosses once each way), and the
coordinator's peak RSS during training against the table size.

    .venv/bin/python benchmarks/embedding_lookup.py
    .venv/bin/python benchmarks/embedding_lookup.py --steps 100 --concat-steps 5
    .venv/bin/python benchmarks/embedding_lookup.py --json   # one JSON line
"""

import argparse
import json
import os
import time

import numpy as np

ROWS, DIM, BATCH = 1_000_000, 64, 4096


def lo_tx_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def rss_mb(field):
    """VmRSS or VmHWM (peak) of this process, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (Linux >= 4.0)
        f.write("5")


def measure(coordinator, step, iterator, steps, warmup=2):
    for _ in range(warmup):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    reset_peak_rss()
    tx0, t0 = lo_tx_bytes(), time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - t0
    return {"steps_per_s": steps / elapsed,
            "bytes_per_step": (lo_tx_bytes() - tx0) / steps,
            "peak_rss_mb": rss_mb("VmHWM")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--concat-steps", type=int, default=5)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line with every measurement")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner

    with keras_ps.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
        coordinator = keras_ps.ClusterCoordinator(strategy)
        rss_before_build = rss_mb("VmRSS")
        with strategy.scope():
            layer = keras.layers.Embedding(ROWS, DIM)
            layer.build()
            optimizer = keras.optimizers.SGD(0.01)
            optimizer.build(layer.trainable_weights)
        rss_after_build = rss_mb("VmRSS")
        devices = [v.device for v in layer.embeddings.variables]

        def dataset_fn():
            return tf.data.Dataset.from_tensors(0).repeat().map(
                lambda _: tf.random.uniform([BATCH], 0, ROWS, tf.int32))

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        def make_step(lookup):
            @tf.function
            def step(it):
                ids = next(it)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(lookup(ids)))
                weights = layer.trainable_weights
                optimizer.apply(tape.gradient(loss, weights), weights)
                return loss
            return step

        sharded = measure(coordinator, make_step(layer), iterator, args.steps)
        # Zipf-like ids (log-uniform): most of the batch repeats a few rows.
        rng = np.random.default_rng(0)
        zipf_ids = np.minimum(np.floor(np.exp(rng.uniform(
            0, np.log(ROWS + 1), BATCH))).astype(np.int32) - 1, ROWS - 1)
        unique_rows = len(np.unique(zipf_ids))
        zipf_iterator = iter(coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(zipf_ids).repeat()))
        zipf = measure(coordinator, make_step(layer), zipf_iterator, args.steps)
        concat = measure(
            coordinator,
            make_step(lambda ids: tf.gather(tf.convert_to_tensor(layer.embeddings), ids)),
            iterator, args.concat_steps, warmup=1)
        coordinator.shutdown()

    table_mb = ROWS * DIM * 4 / 2**20
    rows_bytes = BATCH * DIM * 4
    if args.json:
        print(json.dumps({
            "sharded": sharded, "concat": concat, "table_mb": table_mb,
            "zipf": dict(zipf, unique_rows=unique_rows, bytes_ratio_unique=(
                zipf["bytes_per_step"] / (2 * unique_rows * DIM * 4))),
            "rows_bytes_each_way": rows_bytes,
            "speed_ratio": sharded["steps_per_s"] / concat["steps_per_s"],
            "bytes_ratio": sharded["bytes_per_step"] / (2 * rows_bytes),
            "rss_before_build_mb": rss_before_build,
            "rss_after_build_mb": rss_after_build}), flush=True)
        return
    print(f"table {ROWS} x {DIM} float32 = {table_mb:.0f} MB, shards on {devices}")
    print(f"sharded lookup: {sharded['steps_per_s']:.2f} steps/s "
          f"({args.steps} steps)")
    print(f"concat lookup:  {concat['steps_per_s']:.3f} steps/s "
          f"({args.concat_steps} steps)")
    print(f"speed ratio sharded/concat: "
          f"{sharded['steps_per_s'] / concat['steps_per_s']:.1f}x (target >= 20x)")
    print(f"bytes moved per step (lo tx): sharded {sharded['bytes_per_step'] / 2**20:.2f}"
          f" MB, concat {concat['bytes_per_step'] / 2**20:.1f} MB; rows read "
          f"{rows_bytes / 2**20:.2f} MB each way = {2 * rows_bytes / 2**20:.2f} MB"
          f" -> sharded/rows ratio {sharded['bytes_per_step'] / (2 * rows_bytes):.2f}"
          " (target <= 2)")
    print(f"zipf ids: {BATCH} ids, {unique_rows} distinct; "
          f"{zipf['bytes_per_step'] / 2**20:.2f} MB/step = "
          f"{zipf['bytes_per_step'] / (2 * unique_rows * DIM * 4):.2f}x the "
          "distinct rows both ways (target <= 1.1x)")
    print(f"coordinator RSS: {rss_before_build:.0f} MB before build, "
          f"{rss_after_build:.0f} MB after build; peak during sharded training "
          f"{sharded['peak_rss_mb']:.0f} MB, during concat training "
          f"{concat['peak_rss_mb']:.0f} MB; table {table_mb:.0f} MB")


if __name__ == "__main__":
    main()
