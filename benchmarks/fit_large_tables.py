"""Model.fit with large embedding tables: step time vs table rows.

Embedding(R, 64) sharded over 2 ps, 2 workers, in-process cluster (as
fit_embedding.py), batch 256 x 16 ids drawn log-uniformly (Zipf-like) over the
whole table, MLP 128-64-1, steps_per_execution=10, R = 1M, 4M, 10M (the
row width and the MLP's hidden layers: BENCH_DIM and BENCH_TOWER in the
environment, e.g. 32 and 256,128). Systems, each in its own process:

  tf_native_adam     TF ParameterServerStrategy + tf_keras, Adam (dense
                     update of the whole table per step)
  keras_ps_lazyadam  keras_ps + Keras 3, keras_ps.optimizers.LazyAdam
  tf_native_adagrad  TF + tf_keras, Adagrad (TF's sparse kernel)
  keras_ps_adagrad   keras_ps + Keras 3, keras.optimizers.Adagrad (row-wise)
  keras_ps_adam      keras_ps + Keras 3, keras.optimizers.Adam (dense, fused;
                     R = 1M only: the accuracy reference for LazyAdam)

TF native Adam is not run at 10M: its dense update needs the table, both
moments and dense temporaries at once (killed by the OOM killer at 21.6 GB on
this 24 GB machine, taking other jobs with it).

Label rule: 1 when at least 8 of the 16 ids are odd (each id's parity must be
learnt in its row). Throughput = steps of epochs 2..N / their wall time.
Held-out accuracy on 10,240 examples from a stream no worker draws, looking up
only the rows those examples use. Peak RSS: the whole process (coordinator,
ps and workers share it in an in-process cluster), from getrusage; psutil
gives the RSS before and after the model is built. The peak minus the RSS
before the build is what the table, its slots and training added.

    .venv/bin/python benchmarks/fit_large_tables.py --rows 1000000 --repeats 1
    .venv/bin/python benchmarks/fit_large_tables.py --json
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

IDS, BATCH = 16, 256
# The model's shape (BENCH_DIM and BENCH_TOWER in the environment, which
# fit_calls.py's --dim and --tower set for its children): a row's width and
# the Dense layers' units under the one-unit output.
DIM_ENV_VAR, TOWER_ENV_VAR = "BENCH_DIM", "BENCH_TOWER"
DIM = int(os.environ.get(DIM_ENV_VAR, "64"))
TOWER = tuple(int(u) for u in os.environ.get(TOWER_ENV_VAR, "128,64").split(","))
STEPS_PER_EXECUTION = 10
TEST_BATCHES = 40
ROWS = (1_000_000, 4_000_000, 10_000_000)
SYSTEMS = ("tf_native_adam", "keras_ps_lazyadam", "tf_native_adagrad",
           "keras_ps_adagrad", "keras_ps_adam")
SKIP = {("tf_native_adam", 10_000_000): "OOM-killed at 21.6 GB (dense Adam "
        "update of a 10M x 64 table); not run"}
# (epochs, steps per epoch): epoch 1 is warm-up. 900 measured steps (15-30 s
# for the row-wise systems) keep one slow second of a shared machine from
# deciding a ratio. TF native's dense Adam is slow: 40 measured steps.
# keras_ps' dense Adam (the accuracy reference for LazyAdam at 1M) takes as
# many steps as LazyAdam.
# At the rates of 2026-11-29 (160-190 steps/s in-process), 900 steps pass in
# 5 s: `--steps-per-epoch 1200` measures 3,600 steps (20-30 s) and puts the
# switch to 10 steps an iteration (after 100 executions, KERAS_PS_UNROLL_AFTER)
# inside the warm-up epoch. The accuracy row keeps 300 (dense Adam at 1M runs
# at 7-20 steps/s).
SCHEDULE = {"tf_native_adam": (3, 20)}
DEFAULT_SCHEDULE = (4, 300)


# Ids "zipf" (log-uniform, the default: most of a batch repeats a few rows,
# the lowest ids the most, so with rows split into ranges the first ps
# holds the hot ones), "zipf_spread" (the same ids, each moved to
# id * SPREAD % rows: as often repeated, the hot ones scattered over the
# table) or "uniform" over the whole table (BENCH_IDS in the environment).
IDS_ENV_VAR = "BENCH_IDS"
ID_DISTRIBUTIONS = ("zipf", "zipf_spread", "uniform")
SPREAD = 1_000_003  # a prime: a one-to-one map of [0, rows) unless it divides rows


def make_batch(tf, rows, worker, index):
    seed = tf.stack([tf.cast(worker, tf.int64), tf.cast(index, tf.int64)])
    distribution = os.environ.get(IDS_ENV_VAR, "zipf")
    if distribution == "uniform":
        ids = tf.random.stateless_uniform([BATCH, IDS], seed, 0, rows,
                                          dtype=tf.int64)
    else:
        u = tf.random.stateless_uniform([BATCH, IDS], seed, 0.0,
                                        math.log(rows + 1))
        ids = tf.minimum(tf.cast(tf.floor(tf.exp(u)), tf.int64) - 1, rows - 1)
        if distribution == "zipf_spread":
            ids = ids * SPREAD % rows
    odd = tf.reduce_sum(tf.math.floormod(ids, 2), axis=1, keepdims=True)
    return ids, tf.cast(odd >= IDS // 2, tf.float32)


def dataset_fn_for(tf, rows):
    # See fit_embedding.dataset_fn_for: a fresh random stream per worker.
    def dataset_fn(input_context):
        del input_context

        def batches(_):
            stream = tf.raw_ops.RandomUniformInt(
                shape=tf.constant([], tf.int32), minval=tf.constant(0, tf.int64),
                maxval=tf.constant(2**40, tf.int64), seed=0, seed2=0)
            return tf.data.Dataset.range(2**40).map(
                lambda i: make_batch(tf, rows, stream, i))

        return tf.data.Dataset.range(1).flat_map(batches).prefetch(4)
    return dataset_fn


def table_model(keras, rows, optimizer, metrics):
    """The benchmarks' model, compiled (under the caller's strategy scope):
    Embedding(rows, DIM) over a batch's IDS ids a row, then Dense layers of
    TOWER's units (128 and 64 by default) and 1 unit. `keras` is Keras 3 or,
    for TF's native path, tf_keras."""
    model = keras.Sequential(
        [keras.Input((IDS,), dtype="int64"),
         keras.layers.Embedding(rows, DIM),
         keras.layers.Flatten()]
        + [keras.layers.Dense(units, activation="relu") for units in TOWER]
        + [keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer, "binary_crossentropy", metrics=metrics,
                  steps_per_execution=STEPS_PER_EXECUTION)
    return model


def held_out_accuracy(tf, model, rows, lookup):
    """Accuracy on TEST_BATCHES batches, reading only the rows they use."""
    import numpy as np
    embedding = model.layers[0]
    dense = [(tf.convert_to_tensor(l.kernel).numpy(), tf.convert_to_tensor(l.bias).numpy())
             for l in model.layers if hasattr(l, "kernel")]
    correct = total = 0
    for i in range(TEST_BATCHES):
        ids, labels = make_batch(tf, rows, -1, i)
        h = lookup(embedding, ids).numpy().reshape(BATCH, -1)
        for j, (w, b) in enumerate(dense):
            h = h @ w + b
            if j < len(dense) - 1:
                h = np.maximum(h, 0.0)
        correct += int(((h > 0.0) == (labels.numpy() > 0.5)).sum())
        total += BATCH
    return correct / total


def run_one(system, rows, epochs, steps_per_epoch):
    import resource

    import psutil
    native = system.startswith("tf_native")
    optimizer_name = system.rsplit("_", 1)[1]
    if native:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TF is imported
        import tensorflow as tf
        import tf_keras as keras

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from fit_embedding import start_native_cluster
        resolver, _servers = start_native_cluster(tf, 2, 2)
        strategy = tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners
            .FixedShardsPartitioner(2))
        creator = keras.utils.experimental.DatasetCreator

        def lookup(layer, ids):
            return tf.nn.embedding_lookup(layer.embeddings, ids)
    else:
        import keras
        import tensorflow as tf

        import keras_ps
        from keras_ps.partitioners import FixedShardsPartitioner
        resolver = keras_ps.create_in_process_cluster(2, 2)
        strategy = keras_ps.ParameterServerStrategy(
            resolver, variable_partitioner=FixedShardsPartitioner(2))
        creator = keras_ps.DatasetCreator

        def lookup(layer, ids):
            return keras.ops.take(layer.embeddings, ids, axis=0)
    keras.utils.set_random_seed(0)
    rss_before_build = psutil.Process().memory_info().rss
    build_start = time.perf_counter()
    with strategy.scope():
        if optimizer_name == "lazyadam":
            import keras_ps
            optimizer = keras_ps.optimizers.LazyAdam(0.01)
        elif optimizer_name == "adam":
            optimizer = keras.optimizers.Adam(0.01)
        else:
            optimizer = keras.optimizers.Adagrad(0.1)
        model = table_model(keras, rows, optimizer, ["accuracy"])
    build_s = time.perf_counter() - build_start
    rss_after_build = psutil.Process().memory_info().rss

    epoch_ends = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter())

    start = time.perf_counter()
    model.fit(creator(dataset_fn_for(tf, rows)), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0, callbacks=[EpochTimer()])
    measured = (len(epoch_ends) - 1) * steps_per_epoch
    epoch_s = [b - a for a, b in zip(epoch_ends, epoch_ends[1:])]
    slots = {"adam": 2, "lazyadam": 2, "adagrad": 1}[optimizer_name]
    table_bytes = rows * DIM * 4 * (1 + slots) + (
        rows * 8 if optimizer_name == "lazyadam" else 0)
    return {
        "system": system, "rows": rows,
        "steps_per_s": measured / (epoch_ends[-1] - epoch_ends[0]),
        "epoch_s": epoch_s, "first_epoch_s": epoch_ends[0] - start,
        "build_s": build_s,
        "test_accuracy": held_out_accuracy(tf, model, rows, lookup),
        "iterations": int(model.optimizer.iterations.numpy()),
        "rss_before_build_gb": rss_before_build / 2**30,
        "rss_after_build_gb": rss_after_build / 2**30,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "table_and_slots_gb": table_bytes / 2**30,
    }


QUICK_SCHEDULE = (2, 10)


def run_child(system, rows, timeout=1800, quick=False, steps_per_epoch=None):
    epochs, steps = QUICK_SCHEDULE if quick else SCHEDULE.get(system, DEFAULT_SCHEDULE)
    if steps_per_epoch and not quick and system not in SCHEDULE:
        steps = steps_per_epoch
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", system,
         str(rows), str(epochs), str(steps)],
        capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"system": system, "rows": rows, "error":
                f"exit {out.returncode}: " + out.stderr[-1500:]}
    return json.loads(lines[-1][len("RESULT "):])


def measure(rows_list=ROWS, systems=SYSTEMS, repeats=3, log=print, quick=False,
            steps_per_epoch=None):
    """Every (system, rows) `repeats` times, systems side by side per repeat,
    their order turned by one each repeat (quick: 2 epochs of 10 steps, a
    smoke run; `steps_per_epoch` replaces the default schedule's 300)."""
    runs = []
    for r in range(repeats):
        # Each repeat starts one system later, so no system always runs first
        # (on a memory-heavy table the machine's state after the last
        # process shifts the next one's rate).
        order = list(systems[r % len(systems):]) + list(systems[:r % len(systems)])
        for rows in rows_list:
            for system in order:
                if (system, rows) in SKIP:
                    continue
                if system == "keras_ps_adam" and rows != min(rows_list):
                    continue
                result = run_child(system, rows, quick=quick,
                                   steps_per_epoch=steps_per_epoch)
                result["repeat"] = r
                runs.append(result)
                if "error" in result:
                    log(f"large {system} R={rows:,} run {r}: FAILED {result['error'][-300:]}")
                else:
                    log(f"large {system:18s} R={rows:>10,} run {r}: "
                        f"{result['steps_per_s']:7.2f} steps/s, acc "
                        f"{result['test_accuracy']:.3f}, peak RSS "
                        f"{result['peak_rss_gb']:.1f} GB (table+slots "
                        f"{result['table_and_slots_gb']:.1f} GB), build {result['build_s']:.0f} s")
    return {"runs": runs, "skipped": {f"{s}@{r}": why for (s, r), why in SKIP.items()}}


def by(runs, system, rows, key="steps_per_s"):
    return [x[key] for x in runs
            if x["system"] == system and x["rows"] == rows and "error" not in x]


def spread(values, digits=2):
    if not values:
        return "-"
    return (f"{min(values):.{digits}f} / **{statistics.median(values):.{digits}f}** / "
            f"{max(values):.{digits}f}")


def markdown(summary):
    """The "Large embedding tables" section of RESULTS.md (lines)."""
    runs = summary["runs"]
    lines = [
        "## Large embedding tables: steps/s and memory vs table rows",
        "",
        "`benchmarks/fit_large_tables.py`: Model.fit, Embedding(R, 64) on 2 ps "
        "(FixedShardsPartitioner(2)), 2 workers, in-process cluster, batch 256 x 16 "
        "Zipf-like ids over the whole table, MLP 128-64-1, steps_per_execution=10. "
        "Each system in its own process. Figures are min / **median** / max over "
        "the repeats. Peak RSS is the whole process (coordinator, ps and workers "
        "share it in an in-process cluster); table + slots is R x 64 x 4 bytes x "
        "(1 + slots) (+ 8 bytes per row for LazyAdam's row steps).",
        "",
        "![steps/s vs table rows](large_tables.png)",
        "",
        "| R | system | steps/s | held-out accuracy | peak RSS GB | table + slots GB "
        "| build s |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows in sorted({x["rows"] for x in runs}):
        for system in SYSTEMS:
            ok = [x for x in runs if x["system"] == system and x["rows"] == rows
                  and "error" not in x]
            failed = [x for x in runs if x["system"] == system and x["rows"] == rows
                      and "error" in x]
            skipped = summary["skipped"].get(f"{system}@{rows}")
            if not ok and not failed and not skipped:
                continue
            if not ok:
                why = skipped or f"failed: {failed[0]['error'][:80]}"
                lines.append(f"| {rows / 1e6:g}M | {system} | {why} | | | | |")
                continue
            lines.append(
                f"| {rows / 1e6:g}M | {system} | {spread([x['steps_per_s'] for x in ok])} "
                f"| {spread([x['test_accuracy'] for x in ok], 3)} "
                f"| {spread([x['peak_rss_gb'] for x in ok], 1)} "
                f"| {ok[0]['table_and_slots_gb']:.2f} "
                f"| {spread([x['build_s'] for x in ok], 1)} |")
    return lines


def write_plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system, style in (("tf_native_adam", "o--"), ("keras_ps_lazyadam", "s-"),
                          ("tf_native_adagrad", "^--"), ("keras_ps_adagrad", "D-")):
        xs, med, lo, hi = [], [], [], []
        for rows in sorted({x["rows"] for x in runs}):
            values = by(runs, system, rows)
            if values:
                xs.append(rows / 1e6)
                m = statistics.median(values)
                med.append(m)
                lo.append(m - min(values))
                hi.append(max(values) - m)
        if xs:
            ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=system)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("table rows (millions), Embedding(R, 64) on 2 ps")
    ax.set_ylabel("steps/s (Model.fit, 2 workers)")
    ax.set_title(f"Step rate vs table size ({os.cpu_count()} cores)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(str(r) for r in ROWS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps-per-epoch", type=int, default=None,
                        help="steps of each of the 4 epochs (default 300; "
                        "TF native's dense Adam keeps 20)")
    parser.add_argument("--from-json", help="format a saved --json summary "
                        "(markdown section; --plot PNG) instead of measuring")
    parser.add_argument("--plot", help="write the plot to this PNG")
    parser.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        system, rows, epochs, steps = args._child
        print("RESULT " + json.dumps(run_one(system, int(rows), int(epochs), int(steps))),
              flush=True)
        os._exit(0)  # in-process servers do not shut down cleanly
    if args.from_json:
        with open(args.from_json) as f:
            summary = json.loads(f.read().strip().splitlines()[-1])
        print("\n".join(markdown(summary)))
        if args.plot:
            write_plot(summary, args.plot)
        return
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else \
        (lambda *a: print(*a, flush=True))
    summary = measure([int(r) for r in args.rows.split(",")],
                      args.systems.split(","), args.repeats, log,
                      steps_per_epoch=args.steps_per_epoch)
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(markdown(summary)))
    if args.plot:
        write_plot(summary, args.plot)


if __name__ == "__main__":
    main()
