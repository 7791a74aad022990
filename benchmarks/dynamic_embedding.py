"""DynamicEmbedding against a static sharded Embedding fed the same ids hashed.

Both models live on ONE LocalCluster (2 ps, 2 workers) and are trained in
alternating `Model.fit` calls of one epoch each (pair k: both models train
epoch k on the same stretch of the stream; the order within a pair
alternates, dynamic first in even pairs), so they share the machine's load
and each pair's steps/s ratio compares neighbours in time. Batches of 256 x
16 ids, dim 64, Adagrad(0.1), `steps_per_execution=10`.

  dynamic: keras_ps.layers.DynamicEmbedding(dim, capacity=C, min_count=2)
  hashed:  keras.layers.Embedding(C, dim) over hash(id) mod C, split in 2
           by FixedShardsPartitioner (the same rows of memory)

The stream (the same for both): a clock t; worker w of an epoch that starts
at clock `base` trains the batches of clock t = base + 2j + w (j = 0, 1,
...); the next pair of epochs starts after the last tick trained in this
one (by the worker that ran more steps: a few ticks per epoch are skipped,
none is trained twice). A batch draws ranks r from a power law over
`--vocabulary` ranks (P(r) ~ (r + 1)^-alpha, seeded by t); rank r holds one
id for `--lifetime` ticks, then a fresh id (its generation changes, at a
phase that depends on r), so popular ids keep changing and new ids keep
arriving. Each id has a hidden effect (+-1, from a hash of the id); an
example's label is Bernoulli(sigmoid(2 * sum(effects) / 4)): a click task
where an id's row is worth learning only if the id recurs. The steps each
worker ran in each epoch are read from the coordinator (its closures run),
so the distinct ids counted (`--count_distinct`) are those of the batches
actually trained on.

Recorded: per epoch of each model its time and steps/s, the ps RSS after
it, the load average, and the dynamic table's live rows / admissions /
evictions; ps RSS and the total RSS of the cluster's processes sampled
every 2 s; checkpoint bytes (tf.train.Checkpoint) with the live rows they
hold: the dynamic model after the first pair and at the end, the hashed one
at the end (it always holds all its rows); held-out AUC on fresh batches of
the final distribution; each process' peak RSS (VmHWM). The workers are
stopped once training is over (their peaks read first), so the last
checkpoints and the evaluation run without their memory.

    .venv/bin/python benchmarks/dynamic_embedding.py --epochs 3 --steps 200 \\
        --out /tmp/trial.json                                   # a trial
    .venv/bin/python benchmarks/dynamic_embedding.py --epochs 18 \\
        --steps 1000 --count_distinct \\
        --out benchmarks/dynamic_embedding_raw.json \\
        --plot benchmarks/dynamic_embedding.png                 # the full run
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BATCH, IDS, DIM = 256, 16, 64
STEPS_PER_EXECUTION = 10
NUM_WORKERS = 2
EVAL_SALT = 1000


def _status_mb(pid, field):
    """A field of /proc/PID/status (VmRSS, VmHWM) in MB, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def make_stream(vocabulary, lifetime, alpha):
    """`(batch_ids(t, salt), labels(ids, seed))`, pure TF functions."""
    import tensorflow as tf
    from keras_ps.dynamic_embedding import hashing

    top = float(vocabulary + 1) ** (1.0 - alpha)

    def batch_ids(t, salt=0):
        t = tf.cast(t, tf.int64)
        seed = tf.stack([tf.constant(salt, tf.int64), t])
        u = tf.random.stateless_uniform([BATCH, IDS], seed, dtype=tf.float64)
        # Inverse CDF of a continuous power law on [1, vocabulary + 1).
        rank = tf.cast(tf.floor(tf.pow(u * (top - 1.0) + 1.0, 1.0 / (1.0 - alpha))),
                       tf.int64) - 1
        rank = tf.clip_by_value(rank, 0, vocabulary - 1)
        phase = tf.math.floormod(rank * 2654435761, lifetime)
        generation = (t + phase) // lifetime
        return rank + vocabulary * generation

    def labels(ids, seed):
        effect = tf.cast(hashing.bucket(hashing.fingerprint(ids), 2, salt=11),
                         tf.float32) * 2 - 1
        p = tf.sigmoid(2.0 * tf.reduce_sum(effect, axis=1, keepdims=True) / 4.0)
        return tf.cast(tf.random.stateless_uniform(tf.shape(p), seed) < p,
                       tf.float32)

    return batch_ids, labels


def build_models(strategy, capacity, tower=()):
    import keras
    import keras_ps
    from keras_ps.dynamic_embedding import hashing

    models = {}
    with strategy.scope():
        for variant in ("dynamic", "hashed"):
            ids = keras.Input((IDS,), dtype="int64")
            if variant == "dynamic":
                x = keras_ps.layers.DynamicEmbedding(
                    DIM, capacity=capacity, min_count=2, name="dyn")(ids)
            else:
                hashed = keras.layers.Lambda(
                    lambda k: hashing.bucket(hashing.fingerprint(k), capacity))(ids)
                x = keras.layers.Embedding(capacity, DIM, name="hashed")(hashed)
            x = keras.layers.GlobalAveragePooling1D()(x)
            for units in tower:
                x = keras.layers.Dense(units, "relu")(x)
            model = keras.Model(ids, keras.layers.Dense(1, "sigmoid")(x),
                                name=variant)
            model.compile(keras.optimizers.Adagrad(0.1), "binary_crossentropy",
                          steps_per_execution=STEPS_PER_EXECUTION)
            models[variant] = model
    return models


def _tower(text):
    """`--tower 256,128` -> (256, 128): ReLU layers between the pooled
    embedding and the output, the same in both models."""
    return tuple(int(u) for u in text.split(",")) if text else ()


def run(args):
    """One repeat: both models on one LocalCluster, alternating epochs."""
    import tensorflow as tf
    import keras
    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner

    batch_ids, labels = make_stream(args.vocabulary, args.lifetime, args.alpha)
    steps = args.steps
    clock = {"base": 0}

    def dataset_fn(context):
        # Traced once per fit call: `base` is that epoch's first clock tick.
        base = clock["base"]
        w, n = context.input_pipeline_id, context.num_input_pipelines

        def make(j):
            t = base + n * j + w
            ids = batch_ids(t)
            return ids, labels(ids, tf.stack([t, tf.constant(7, tf.int64)]))

        return tf.data.Dataset.range(10**9).map(make).prefetch(4)

    creator = keras_ps.DatasetCreator(dataset_fn)
    result = {"args": vars(args), "epochs": {"dynamic": [], "hashed": []},
              "rss_samples": [], "checkpoints": [], "uptime_start":
              list(os.getloadavg())}
    with keras_ps.LocalCluster(num_workers=NUM_WORKERS, num_ps=2) as cluster:
        ps_pids = [cluster.pid("ps", i) for i in range(2)]
        pids = {"coordinator": os.getpid(),
                **{f"ps{i}": cluster.pid("ps", i) for i in range(2)},
                **{f"worker{i}": cluster.pid("worker", i)
                   for i in range(NUM_WORKERS)}}
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
        coordinator = keras_ps.ClusterCoordinator(strategy)
        models = build_models(strategy, args.capacity, _tower(args.tower))
        started = time.monotonic()
        phase = {"now": "build"}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                rss = {name: _status_mb(pid, "VmRSS")
                       for name, pid in pids.items()}
                result["rss_samples"].append(
                    [time.monotonic() - started, phase["now"]]
                    + [rss["ps0"], rss["ps1"], sum(v or 0 for v in rss.values())])
                stop.wait(2.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def checkpoint(variant):
            with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
                tf.train.Checkpoint(model=models[variant]).write(
                    os.path.join(folder, "c"))
                return sum(os.path.getsize(os.path.join(folder, f))
                           for f in os.listdir(folder))

        class Probe(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.monotonic()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds = time.monotonic() - self.start
                self.logs = {k: float(v) for k, v in (logs or {}).items()}

        for epoch in range(args.epochs):
            order = ("dynamic", "hashed") if epoch % 2 == 0 else ("hashed", "dynamic")
            base = clock["base"]
            for variant in order:
                before = [w.closures_run for w in coordinator.workers]
                phase["now"] = f"{variant} {epoch}"
                probe = Probe()
                call_start = time.monotonic()
                models[variant].fit(creator, epochs=epoch + 1, initial_epoch=epoch,
                                    steps_per_epoch=steps, verbose=0,
                                    callbacks=[probe])
                call_seconds = time.monotonic() - call_start
                ran = [(w.closures_run - b) * STEPS_PER_EXECUTION
                       for w, b in zip(coordinator.workers, before)]
                row = {"epoch": epoch, "base": clock["base"],
                       "worker_steps": ran, "seconds": probe.seconds,
                       "call_seconds": call_seconds,
                       "steps_per_s": steps / probe.seconds,
                       "at": time.monotonic() - started,
                       "ps_rss_mb": [_status_mb(p, "VmRSS") for p in ps_pids],
                       "load": list(os.getloadavg()), "logs": probe.logs}
                result["epochs"][variant].append(row)
                print("PROGRESS " + json.dumps({"variant": variant, **row}),
                      file=sys.stderr, flush=True)
            # The next pair starts after the last tick either model trained.
            clock["base"] = base + max(
                NUM_WORKERS * n for v in order
                for n in result["epochs"][v][-1]["worker_steps"])
            if epoch == 0 or epoch == args.epochs - 1:
                phase["now"] = f"checkpoint {epoch}"
                if epoch == args.epochs - 1:
                    # Training is over: the workers' memory is freed
                    # before the checkpoints' (their peaks are kept).
                    result["peak_rss_mb"] = {
                        f"worker{i}": _status_mb(pids[f"worker{i}"], "VmHWM")
                        for i in range(NUM_WORKERS)}
                    for i in range(NUM_WORKERS):
                        cluster.stop("worker", i)
                # The hashed table's checkpoint holds all its rows whenever
                # it is written: once, at the end.
                for variant in (("dynamic",) if epoch < args.epochs - 1
                                else ("dynamic", "hashed")):
                    t0 = time.monotonic()
                    size = checkpoint(variant)
                    live = result["epochs"][variant][-1]["logs"].get("dyn_live_rows")
                    result["checkpoints"].append(
                        {"variant": variant, "after_epoch": epoch, "bytes": size,
                         "live_rows": live if variant == "dynamic"
                         else args.capacity,
                         "seconds": time.monotonic() - t0})
                    print("PROGRESS " + json.dumps(result["checkpoints"][-1]),
                          file=sys.stderr, flush=True)

        # Held-out AUC on fresh batches of the final distribution.
        phase["now"] = "evaluation"
        last = clock["base"]
        result["final_clock"] = last
        for variant, model in models.items():
            auc = keras.metrics.AUC()
            for b in range(args.eval_batches):
                x_ids = batch_ids(last, salt=EVAL_SALT + b)
                y = labels(x_ids, tf.stack([tf.constant(last, tf.int64),
                                            tf.constant(EVAL_SALT + b, tf.int64)]))
                auc.update_state(y, model.predict(x_ids, verbose=0))
            result[f"auc_{variant}"] = float(auc.result())
        stop.set()
        sampler.join()
        result["peak_rss_mb"].update(
            {name: _status_mb(pid, "VmHWM") for name, pid in pids.items()
             if not name.startswith("worker")})
        result["peak_total_rss_mb_sampled"] = max(
            x[4] for x in result["rss_samples"])
        result["uptime_end"] = list(os.getloadavg())
        result["wall_seconds"] = time.monotonic() - started
    if args.count_distinct:
        for variant in ("dynamic", "hashed"):
            result[f"distinct_ids_{variant}"] = distinct_ids(
                args, [(r["base"], r["worker_steps"])
                       for r in result["epochs"][variant]])
    result["summary"] = summarize(result, args)
    return result


def distinct_ids(args, epochs):
    """Distinct ids of the batches trained on: `epochs` is a list of
    (first clock tick, steps run by each worker)."""
    import numpy as np
    import tensorflow as tf

    batch_ids, _ = make_stream(args.vocabulary, args.lifetime, args.alpha)
    ticks = np.concatenate([
        base + NUM_WORKERS * np.arange(n, dtype=np.int64) + w
        for base, per_worker in epochs for w, n in enumerate(per_worker)])
    assert len(np.unique(ticks)) == len(ticks)  # each batch trained once
    generations = (int(ticks.max()) + args.lifetime) // args.lifetime + 1
    seen = np.zeros(args.vocabulary * generations, bool)

    @tf.function
    def chunk(t):
        return tf.reshape(tf.map_fn(batch_ids, t, fn_output_signature=tf.int64),
                          [-1])

    for start in range(0, len(ticks), 200):
        seen[chunk(tf.constant(ticks[start:start + 200])).numpy()] = True
    return {"batches": int(len(ticks)), "ids_drawn": int(len(ticks)) * BATCH * IDS,
            "distinct": int(seen.sum())}


def _spread(values):
    values = sorted(values)
    return {"min": values[0], "median": statistics.median(values),
            "max": values[-1], "n": len(values)}


def summarize(result, args):
    dyn, hashed = result["epochs"]["dynamic"], result["epochs"]["hashed"]
    # Pair 0 traces the step functions: left out of the spreads.
    ratios = [d["steps_per_s"] / h["steps_per_s"]
              for d, h in zip(dyn[1:], hashed[1:])]
    summary = {
        "ratio_steps_per_s": _spread(ratios) if ratios else None,
        "steps_per_s_dynamic": _spread([d["steps_per_s"] for d in dyn[1:]])
        if len(dyn) > 1 else None,
        "steps_per_s_hashed": _spread([h["steps_per_s"] for h in hashed[1:]])
        if len(hashed) > 1 else None,
        "steps_dynamic": sum(sum(d["worker_steps"]) for d in dyn),
    }
    full = [i for i, d in enumerate(dyn)
            if d["logs"].get("dyn_live_rows") == args.capacity]
    if full:
        first = full[0]
        base = dyn[first]["ps_rss_mb"]
        later = [r for v in ("dynamic", "hashed")
                 for r in result["epochs"][v] if r["at"] > dyn[first]["at"]]
        later.append(dyn[first])
        summary["table_first_full_after_epoch"] = first
        summary["ps_rss_mb_when_first_full"] = base
        summary["ps_rss_ratio_after_full"] = [
            {"min": min(r["ps_rss_mb"][i] for r in later) / base[i],
             "max": max(r["ps_rss_mb"][i] for r in later) / base[i]}
            for i in range(2)]
        # Training only (a checkpoint's copies are transient).
        samples = [s for s in result["rss_samples"] if s[0] >= dyn[first]["at"]
                   and s[1].split()[0] in ("dynamic", "hashed")]
        summary["ps_rss_ratio_after_full_sampled"] = [
            {"min": min(s[2 + i] for s in samples) / base[i],
             "max": max(s[2 + i] for s in samples) / base[i]}
            for i in range(2)] if samples else None
    return summary


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = results[-1]
    dyn = result["epochs"]["dynamic"]
    steps = result["args"]["steps"]
    x = [(d["epoch"] + 1) * steps for d in dyn]
    fig, axes = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    ax = axes[0]
    for i in range(2):
        ax.plot(x, [d["ps_rss_mb"][i] for d in dyn], "o-", label=f"ps {i}")
    summary = result["summary"]
    if "ps_rss_mb_when_first_full" in summary:
        first = summary["table_first_full_after_epoch"]
        for i, base in enumerate(summary["ps_rss_mb_when_first_full"]):
            ax.axhspan(0.9 * base, 1.1 * base, alpha=0.08, color=f"C{i}")
        ax.axvline(x[first], color="gray", ls=":", label="table first full")
    ax.set_ylabel("ps RSS after the dynamic epoch (MB)")
    ax.set_title("DynamicEmbedding, capacity {:,} (ps also hold the hashed "
                 "model; bands: +-10% of RSS when first full)".format(
                     result["args"]["capacity"]), fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    for key, label in (("dyn_live_rows", "live rows"),
                       ("dyn_admissions", "admissions (total)"),
                       ("dyn_evictions", "evictions (total)")):
        ax.plot(x, [d["logs"].get(key, 0) / 1e6 for d in dyn], "o-", label=label)
    ax.set_ylabel("millions")
    ax.legend(fontsize=8)
    ax = axes[2]
    hashed = result["epochs"]["hashed"]
    ax.plot(x, [d["steps_per_s"] for d in dyn], "o-", label="dynamic")
    ax.plot(x, [h["steps_per_s"] for h in hashed], "s-", label="hashed static")
    ax2 = ax.twinx()
    ax2.plot(x, [d["steps_per_s"] / h["steps_per_s"] for d, h in zip(dyn, hashed)],
             "k--", label="dynamic / hashed")
    ax2.axhline(0.7, color="gray", lw=0.8, ls=":", label="target 0.70")
    ax2.set_ylabel("ratio")
    ax2.set_ylim(0, max(1.5, ax2.get_ylim()[1]))
    ax.set_ylabel("steps/s (epoch)")
    ax.set_xlabel("training steps of each model")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=18,
                        help="epochs of each model (paired)")
    parser.add_argument("--steps", type=int, default=1000,
                        help="steps per epoch")
    parser.add_argument("--vocabulary", type=int, default=5_000_000)
    parser.add_argument("--lifetime", type=int, default=1000)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--tower", default="",
                        help="units of ReLU layers before the output, "
                             "e.g. 256,128 (default: none)")
    parser.add_argument("--eval_batches", type=int, default=40)
    parser.add_argument("--count_distinct", action="store_true")
    parser.add_argument("--tmp", default=None,
                        help="where checkpoints are written to be measured")
    parser.add_argument("--out", help="write the repeats' results (JSON)")
    parser.add_argument("--plot", help="draw the last repeat (PNG)")
    parser.add_argument("--replot", metavar="RAW_JSON",
                        help="only draw --plot from a saved --out file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    if args.one:  # a repeat, in its own process
        result = run(args)
        with open(args.one, "w") as f:
            json.dump(result, f)
        return
    results = []
    for repeat in range(args.repeats):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, "--one", out.name] + [
                a for a in sys.argv[1:]]
            subprocess.run(cmd, check=True, env=dict(
                os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
            with open(out.name) as f:
                result = json.load(f)
        result["repeat"] = repeat
        results.append(result)
        print(json.dumps({"repeat": repeat, **result["summary"],
                          "auc": [result["auc_hashed"], result["auc_dynamic"]],
                          "distinct": result.get("distinct_ids_dynamic"),
                          "peak_rss_mb": result["peak_rss_mb"],
                          "uptime": [result["uptime_start"],
                                     result["uptime_end"]]}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        if args.plot:
            plot(results, args.plot)


if __name__ == "__main__":
    main()
