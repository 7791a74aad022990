"""Model.fit with a sharded embedding: keras_ps (Keras 3) vs TF's native path.

The same workload on both systems, each in its own process, in one run:

  TF native: tf.distribute.ParameterServerStrategy + tf_keras `Model.fit` with
             tf_keras' DatasetCreator (TF_USE_LEGACY_KERAS=1 in that process).
  keras_ps:  keras_ps.ParameterServerStrategy + Keras 3 `Model.fit` with
             keras_ps.DatasetCreator.

Cluster: in-process (servers started inside the coordinator's process, as TF's
tutorial does; keras_ps.create_in_process_cluster and the same tf.distribute.
Server setup for TF native), 2 workers, 2 ps. Model: 5 ids per example ->
Embedding(100_000, 32) -> Flatten -> Dense(128, relu) -> Dense(64, relu) ->
Dense(1, sigmoid), FixedShardsPartitioner(2) on both (so every weight with 2+
rows is split over the 2 ps, the embedding included), Adam(0.01), binary
crossentropy + accuracy, batch 256, steps_per_execution=10.

Data rule (known, so accuracy means something): each id is drawn log-uniformly
from [0, 100_000) (a Zipf-like law: small ids are frequent), and the label is 1
when at least 3 of the 5 ids are odd. The model must learn each id's parity in
its embedding and a majority vote in the MLP; rare ids stay unlearnt, so the
attainable accuracy is below 1. Both systems draw batches the same way (stateless
random ops seeded by a stream and batch number; each worker draws its stream
number at random, see dataset_fn_for) and start from the same weights seed.

Throughput = steps of epochs 2..N / their wall time (epoch 1 is warm-up:
tracing, connections). Final accuracy = accuracy of the trained weights on a
fixed held-out set of 10,240 examples, computed on the coordinator in numpy.

    .venv/bin/python benchmarks/fit_embedding.py                 # 3 repeats
    .venv/bin/python benchmarks/fit_embedding.py --quick --repeats 1
    .venv/bin/python benchmarks/fit_embedding.py --json          # one JSON line
    .venv/bin/python benchmarks/fit_embedding.py --preemptible   # + a third system

--preemptible adds keras_ps with BackupAndRestore(save_freq=False,
save_before_preemption=True): no backup is written (no SIGTERM comes), but
`fit` schedules only about 2 s of executions ahead of those that ended; its
steps/s against plain keras_ps' is that bound's cost.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

VOCAB, DIM, IDS, BATCH = 100_000, 32, 5, 256
STEPS_PER_EXECUTION = 10
TEST_BATCHES = 40
SYSTEMS = ("tf_native", "keras_ps")
PREEMPTIBLE = "keras_ps_preemptible"


def make_batch(tf, worker, index):
    """Batch `index` of `worker`: (ids [BATCH, IDS] int32, labels [BATCH, 1])."""
    seed = tf.stack([tf.cast(worker, tf.int64), tf.cast(index, tf.int64)])
    u = tf.random.stateless_uniform([BATCH, IDS], seed, 0.0, math.log(VOCAB + 1))
    ids = tf.minimum(tf.cast(tf.floor(tf.exp(u)), tf.int32) - 1, VOCAB - 1)
    odd = tf.reduce_sum(tf.math.floormod(ids, 2), axis=1, keepdims=True)
    return ids, tf.cast(odd >= 3, tf.float32)


def dataset_fn_for(tf, calls):
    """A dataset_fn whose every worker draws its own stream of batches.

    TF's native strategy traces dataset_fn once and hands every worker the
    same input context (input_pipeline_id=0 of 1: parameter_server_strategy_v2
    .py, _distribute_datasets_from_function), so neither the context nor a
    counter can tell its workers apart. Each worker's dataset therefore picks
    its stream number from an unseeded random op (seed=seed2=0 draws a fresh
    seed per kernel, i.e. per worker, whatever the global seed): the same
    distribution on both systems, a different stream per worker.
    """
    def dataset_fn(input_context):
        calls.append(input_context.input_pipeline_id)

        def batches(_):
            stream = tf.raw_ops.RandomUniformInt(
                shape=tf.constant([], tf.int32), minval=tf.constant(0, tf.int64),
                maxval=tf.constant(2**40, tf.int64), seed=0, seed2=0)
            return tf.data.Dataset.range(2**40).map(
                lambda i: make_batch(tf, stream, i))

        return tf.data.Dataset.range(1).flat_map(batches).prefetch(4)
    return dataset_fn


def numpy_accuracy(tf, model):
    """Accuracy of the model's current weights on the held-out batches."""
    import numpy as np
    weights = []
    for layer in model.layers:
        if hasattr(layer, "embeddings"):
            weights.append(("embedding", tf.convert_to_tensor(layer.embeddings).numpy()))
        elif hasattr(layer, "kernel"):
            weights.append(("dense", tf.convert_to_tensor(layer.kernel).numpy(),
                            tf.convert_to_tensor(layer.bias).numpy()))
    correct = total = 0
    for i in range(TEST_BATCHES):
        ids, labels = make_batch(tf, -1, i)  # a stream no worker draws
        h = ids.numpy()
        for w in weights:
            if w[0] == "embedding":
                h = w[1][h].reshape(len(h), -1)
            else:
                h = h @ w[1] + w[2]
                if w[2].shape[0] > 1:
                    h = np.maximum(h, 0.0)
        correct += int(((h > 0.0) == (labels.numpy() > 0.5)).sum())
        total += h.shape[0]
    return correct / total


def start_native_cluster(tf, num_workers, num_ps):
    """TF's equivalent of keras_ps.create_in_process_cluster (same thread config)."""
    import portpicker
    spec = {"worker": [f"localhost:{portpicker.pick_unused_port()}"
                       for _ in range(num_workers)],
            "ps": [f"localhost:{portpicker.pick_unused_port()}" for _ in range(num_ps)]}
    cluster = tf.train.ClusterSpec(spec)
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = num_workers + 1
    servers = [tf.distribute.Server(cluster, job_name=job, task_index=i,
                                    protocol="grpc", config=config, start=True)
               for job in spec for i in range(len(spec[job]))]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, rpc_layer="grpc")
    return resolver, servers


def run_one(system, epochs, steps_per_epoch):
    """Trains in this process; returns a dict of measurements."""
    if system == "tf_native":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TF is imported
        import tensorflow as tf
        import tf_keras as keras
        resolver, _servers = start_native_cluster(tf, 2, 2)
        strategy = tf.distribute.ParameterServerStrategy(
            resolver,
            variable_partitioner=tf.distribute.experimental.partitioners
            .FixedShardsPartitioner(2))
        creator = keras.utils.experimental.DatasetCreator
        keras.utils.set_random_seed(0)
    else:
        import keras
        import tensorflow as tf

        import keras_ps
        from keras_ps.partitioners import FixedShardsPartitioner
        resolver = keras_ps.create_in_process_cluster(2, 2)
        strategy = keras_ps.ParameterServerStrategy(
            resolver, variable_partitioner=FixedShardsPartitioner(2))
        creator = keras_ps.DatasetCreator
        keras.utils.set_random_seed(0)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((IDS,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ])
        model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                      metrics=["accuracy"], steps_per_execution=STEPS_PER_EXECUTION)

    epoch_ends, cpu_at_epoch_end = [], []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter())
            cpu_at_epoch_end.append(sum(os.times()[:2]))

    callbacks = [EpochTimer()]
    if system == PREEMPTIBLE:
        import tempfile
        callbacks.append(keras_ps.callbacks.BackupAndRestore(
            tempfile.mkdtemp(), save_freq=False, save_before_preemption=True))
    start = time.perf_counter()
    calls = []
    history = model.fit(creator(dataset_fn_for(tf, calls)), epochs=epochs,
                        steps_per_epoch=steps_per_epoch, verbose=0,
                        callbacks=callbacks)
    measured = (len(epoch_ends) - 1) * steps_per_epoch
    return {
        "system": system,
        "steps_per_s": measured / (epoch_ends[-1] - epoch_ends[0]),
        "first_epoch_s": epoch_ends[0] - start,
        # CPU seconds of this whole process (coordinator + in-process servers)
        # per measured step: 2 cores make 2 CPU s per wall second available.
        "cpu_s_per_step": (cpu_at_epoch_end[-1] - cpu_at_epoch_end[0]) / measured,
        "epoch_s": [b - a for a, b in zip(epoch_ends, epoch_ends[1:])],
        "train_accuracy": float(history.history["accuracy"][-1]),
        "test_accuracy": numpy_accuracy(tf, model),
        "iterations": int(model.optimizer.iterations.numpy()),
        "dataset_fn_calls": len(calls),
    }


def run_child(system, epochs, steps_per_epoch, timeout=900):
    """Runs `system` in a fresh process; returns run_one's dict."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", system,
         str(epochs), str(steps_per_epoch)],
        capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"fit_embedding {system} failed (exit {out.returncode}):\n"
                           + out.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def measure(repeats=3, quick=False, log=print, systems=SYSTEMS):
    """The systems, alternating, `repeats` times. Returns a summary dict."""
    epochs, steps = (3, 20) if quick else (6, 100)
    runs = {s: [] for s in systems}
    for r in range(repeats):
        for system in systems:
            result = run_child(system, epochs, steps)
            runs[system].append(result)
            log(f"fit_embedding {system:9s} run {r}: {result['steps_per_s']:6.2f} steps/s, "
                f"test accuracy {result['test_accuracy']:.3f}, "
                f"iterations {result['iterations']}")
    ratios = [k["steps_per_s"] / n["steps_per_s"]
              for n, k in zip(runs["tf_native"], runs["keras_ps"])]
    return {
        "epochs": epochs, "steps_per_epoch": steps, "runs": runs,
        "steps_per_s": {s: [x["steps_per_s"] for x in runs[s]] for s in systems},
        "test_accuracy": {s: [x["test_accuracy"] for x in runs[s]] for s in systems},
        "ratios": ratios,
        "preemptible_ratios": [p["steps_per_s"] / k["steps_per_s"] for k, p in
                               zip(runs["keras_ps"], runs.get(PREEMPTIBLE, []))],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="3 epochs x 20 steps instead of 6 x 100 (smoke run)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line with every measurement")
    parser.add_argument("--preemptible", action="store_true",
                        help=f"also run {PREEMPTIBLE} (see the module's doc)")
    parser.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        system, epochs, steps = args._child
        print("RESULT " + json.dumps(run_one(system, int(epochs), int(steps))),
              flush=True)
        os._exit(0)  # in-process servers do not shut down cleanly
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else \
        (lambda *a: print(*a, flush=True))
    summary = measure(args.repeats, args.quick, log,
                      SYSTEMS + ((PREEMPTIBLE,) if args.preemptible else ()))
    if args.json:
        print(json.dumps(summary))
        return
    med = {s: statistics.median(v) for s, v in summary["steps_per_s"].items()}
    acc = {s: statistics.median(v) for s, v in summary["test_accuracy"].items()}
    r = summary["ratios"]
    print(f"\ncores: {os.cpu_count()}; {summary['epochs']} epochs x "
          f"{summary['steps_per_epoch']} steps, first epoch excluded")
    print(f"TF native {med['tf_native']:.2f} steps/s, keras_ps {med['keras_ps']:.2f} "
          f"steps/s; ratio min/median/max {min(r):.2f}/{statistics.median(r):.2f}/"
          f"{max(r):.2f}x (target >= 1.5x)")
    print(f"held-out accuracy: TF native {acc['tf_native']:.3f}, keras_ps "
          f"{acc['keras_ps']:.3f}")
    p = summary["preemptible_ratios"]
    if p:
        print(f"{PREEMPTIBLE} / keras_ps steps/s: min/median/max "
              f"{min(p):.2f}/{statistics.median(p):.2f}/{max(p):.2f}x")


if __name__ == "__main__":
    main()
