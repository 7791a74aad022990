"""Dynamic data shards: a slow worker, and the cost of handing out shards.

    .venv/bin/python benchmarks/dynamic_shards.py              # both, 1 repeat
    .venv/bin/python benchmarks/dynamic_shards.py --repeats 3 --json

Workloads (each measurement in its own process):
  straggler  a LocalCluster of 4 worker processes and 1 ps. Every record
             waits READ_US (160 ms) in the worker's reads, 3x as long on
             worker 3; a warm-up epoch without the wait comes first. One
             epoch of RECORDS records, each trained once, two ways:
               dynamic: keras_ps.ShardedInput with SHARDS (128) files of 4
                        records, handed to whichever worker is free;
               static:  the same records as 4 files, one per worker (what
                        sharding by worker index does).
             Ideal time = the records over the cluster's total read rate
             (3 fast workers + one at 1/3 speed). Target: dynamic <= 1.15x
             the ideal.
  tiny       (in-process cluster, 2 workers, 2 ps) ctl_dispatch.py's tiny
             step `v.assign_add(sum(x))`, TINY_STEPS steps: today's
             per-worker iterator (`next(it)`, packed closures) vs
             shard-driven input (a ShardedInput of ones, each closure one
             shard), in each variant of TINY_VARIANTS:
               spe16    steps_per_execution=16, 16 shards of 250 steps,
                        batch_size=1 (the first measurement)
               spe4     steps_per_execution=4
               spe1     steps_per_execution=1
               shards80 steps_per_execution=16, 80 shards of 50 steps
               batch32  steps_per_execution=16, 16 shards, batch_size=32
                        (the iterator's batches hold 32 ones too)
             Target: shards >= 0.9x the iterator in every variant.

    .venv/bin/python benchmarks/dynamic_shards.py --workload tiny \
        --variants spe4,batch32 --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# Per record on a fast worker. Few long sleeps keep the run sleep-bound on
# a busy 2-core machine, where every wake-up waits for a core.
READ_US = 160000
SLOW_FACTOR = 3
SLOW_WORKER = 3
STRAGGLER_WORKERS = 4
BATCH = 1
SHARDS = 128
RECORDS_PER_SHARD = 4
RECORDS = SHARDS * RECORDS_PER_SHARD
STEPS_PER_EXECUTION = 4
TINY_STEPS = 4000
# name: (steps_per_execution, steps per shard, batch_size)
TINY_VARIANTS = {"spe16": (16, 250, 1), "spe4": (4, 250, 1),
                 "spe1": (1, 250, 1), "shards80": (16, 50, 1),
                 "batch32": (16, 250, 32)}


def _ideal_seconds():
    rate = (STRAGGLER_WORKERS - 1 + 1 / SLOW_FACTOR) / (READ_US * 1e-6)
    return RECORDS / rate


def _write_files(count):
    """`count` files of float32 ones splitting RECORDS records evenly."""
    import tempfile

    import numpy as np

    directory = tempfile.mkdtemp(prefix="keras_ps_shards_bench_")
    per_file = RECORDS // count
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"part-{i:04d}.bin")
        np.ones(per_file, np.float32).tofile(path)
        paths.append(path)
    return paths


def run_straggler(mode):
    """Seconds for one epoch (after a warm-up epoch) with `mode` shards."""
    import numpy as np
    import tensorflow as tf

    import keras_ps
    from keras_ps import _tf_adapter

    # Real server processes: in one process the workers would share one
    # inter-op thread pool, which the sleeping reads would exhaust.
    cluster = keras_ps.LocalCluster(num_workers=STRAGGLER_WORKERS, num_ps=1)
    try:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            seen = tf.Variable(0.0)
            # The read sleep, on the ps: 1 us for the warm-up epoch (traces,
            # connections), READ_US for the measured one.
            read_us = tf.Variable(1, dtype=tf.int64)
        # One file per dynamic shard; the static split reads the same records as
        # 4 files, one per worker.
        files = _write_files(SHARDS if mode == "dynamic" else STRAGGLER_WORKERS)

        def read_fn(filename):
            # Slow reads on one worker: the sleep depends on the worker running
            # the shard (a call-time value, so one trace serves every worker).
            worker = keras_ps.coordinator.worker_index()
            sleep = tf.where(tf.equal(worker, SLOW_WORKER),
                             read_us * SLOW_FACTOR, read_us + 0)
            records = tf.data.FixedLengthRecordDataset(filename, 4)
            # Each record waits for a tick of a sleeping dataset beside it,
            # never for a sleep over the records: see
            # _tf_adapter.sleep_dataset.
            return tf.data.Dataset.zip(
                (records, _tf_adapter.sleep_ticks(sleep))).map(
                    lambda r, _: tf.io.decode_raw(r, tf.float32)[0])

        data = keras_ps.ShardedInput(files, read_fn=read_fn, batch_size=BATCH,
                                     shuffle=False)

        def step(batch):
            seen.assign_add(tf.reduce_sum(batch))

        train_shard = data.shard_function(coordinator, step,
                                          steps_per_execution=STEPS_PER_EXECUTION)
        for epoch in range(2):  # the first (no sleep) traces and warms up
            read_us.assign(1 if epoch == 0 else READ_US)
            start = time.perf_counter()
            shards = data.epoch(coordinator, epoch)
            remotes = [coordinator.schedule(train_shard, args=(shard,))
                       for shard in shards]
            finished = [None] * len(remotes)

            def wait(i):
                remotes[i].fetch()
                finished[i] = time.perf_counter() - start

            threads = [threading.Thread(target=wait, args=(i,))
                       for i in range(len(remotes))]
            for t in threads:
                t.start()
            coordinator.join()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - start
        assert seen.numpy() == 2 * RECORDS, seen.numpy()
        result = {"seconds": seconds, "ideal": _ideal_seconds(),
                  "shards_per_worker": [w.closures_run for w in coordinator.workers]}
        coordinator.shutdown()
    finally:
        cluster.shutdown()
    if mode == "static":
        # Each worker's measured read rate (its quarter over the time it
        # took): the cluster's real total rate, overheads included.
        rates = [RECORDS / STRAGGLER_WORKERS / t for t in finished]
        result["measured_ideal"] = RECORDS / sum(rates)
    return result


def run_tiny(mode, steps=TINY_STEPS, variant="spe16"):
    import numpy as np
    import tensorflow as tf

    import keras_ps

    per_execution, steps_per_shard, batch = TINY_VARIANTS[variant]
    resolver = keras_ps.create_in_process_cluster(2, 2)
    strategy = keras_ps.ParameterServerStrategy(resolver)
    coordinator = keras_ps.ClusterCoordinator(strategy)
    with strategy.scope():
        v = tf.Variable(0.0)
    if mode == "iterator":
        iterator = iter(coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(tf.ones([batch])).repeat()))

        @tf.function
        def step(it):
            v.assign_add(tf.reduce_sum(next(it)))

        def run(n):
            for _ in range(n):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
    else:
        data = keras_ps.ShardedInput(
            np.ones(steps * batch, np.float32), batch_size=batch,
            shuffle=False, records_per_shard=steps_per_shard * batch)

        def shard_step(x):
            v.assign_add(tf.reduce_sum(x))

        train_shard = data.shard_function(
            coordinator, shard_step, steps_per_execution=per_execution)
        epochs = iter(range(10))

        def run(n):
            del n  # one epoch: `steps` records, one step each
            for shard in data.epoch(coordinator, next(epochs)):
                coordinator.schedule(train_shard, args=(shard,))
            coordinator.join()
    run(200)  # warm up: traces, connections
    start = time.perf_counter()
    run(steps)
    elapsed = time.perf_counter() - start
    assert v.numpy() == 2 * steps * batch or mode == "iterator", v.numpy()
    return {"steps_per_s": steps / elapsed}


def _quick():
    """Smoke-test sizes (run_all.py --quick): not a measurement."""
    global READ_US, SHARDS, RECORDS, TINY_STEPS
    READ_US, SHARDS, TINY_STEPS = 20000, 16, 500
    RECORDS = SHARDS * RECORDS_PER_SHARD


def _child(workload, mode, quick=False, variant="spe16"):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, os.path.abspath(__file__),
                          "--_child", workload, mode, str(int(quick)),
                          variant],
                         capture_output=True,
                         text=True, env=env, timeout=900)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        print(out.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"{workload}/{mode} failed")
    return json.loads(lines[0][7:])


def measure(workloads=("straggler", "tiny"), repeats=1, log=print,
            quick=False, variants=tuple(TINY_VARIANTS)):
    """{"straggler": {mode: [result per repeat]}, "tiny": {variant: {mode:
    [result per repeat]}}}; within a repeat the two modes run back to back."""
    report = {}
    if "straggler" in workloads:
        report["straggler"] = {"dynamic": [], "static": []}
    if "tiny" in workloads:
        report["tiny"] = {v: {"iterator": [], "shards": []} for v in variants}
    for r in range(repeats):
        for workload in workloads:
            runs = [(workload, m, "-", report[workload][m])
                    for m in ("dynamic", "static")] if workload == "straggler" \
                else [(workload, m, v, report[workload][v][m])
                      for v in variants for m in ("iterator", "shards")]
            for _, mode, variant, results in runs:
                result = _child(workload, mode, quick, variant)
                results.append(result)
                log(f"{workload:9s} {variant:8s} {mode:8s} run {r}: "
                    f"{json.dumps(result)}")
    return report


def summarize(report):
    """Ratios as (min, median, max) and whether each target is met."""
    out = {}
    if "straggler" in report:
        dyn = [r["seconds"] / r["ideal"] for r in report["straggler"]["dynamic"]]
        sta = [r["seconds"] / r["ideal"] for r in report["straggler"]["static"]]
        # The same ideal measured: the records over the sum of the rates
        # each worker reached in the static run of the same repeat.
        measured = [d["seconds"] / s["measured_ideal"] for d, s in zip(
            report["straggler"]["dynamic"], report["straggler"]["static"])]
        out["straggler"] = {
            "ideal_seconds": report["straggler"]["dynamic"][0]["ideal"],
            "dynamic_seconds": _spread([r["seconds"] for r in
                                        report["straggler"]["dynamic"]]),
            "static_seconds": _spread([r["seconds"] for r in
                                       report["straggler"]["static"]]),
            "dynamic_over_ideal": _spread(dyn),
            "static_over_ideal": _spread(sta),
            "dynamic_over_measured_ideal": _spread(measured),
            "met": statistics.median(dyn) <= 1.15}
    if "tiny" in report:
        out["tiny"] = {}
        for variant, runs in report["tiny"].items():
            it = [r["steps_per_s"] for r in runs["iterator"]]
            sh = [r["steps_per_s"] for r in runs["shards"]]
            ratios = [s / i for s, i in zip(sh, it)]
            out["tiny"][variant] = {
                "iterator_steps_per_s": _spread(it),
                "shards_steps_per_s": _spread(sh),
                "shards_over_iterator": _spread(ratios),
                "met": statistics.median(ratios) >= 0.9,
                "min_met": min(ratios) >= 0.9}
    return out


def _spread(values):
    return [round(min(values), 3), round(statistics.median(values), 3),
            round(max(values), 3)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["straggler", "tiny", "all"],
                        default="all")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="small runs (a smoke test, not a measurement)")
    parser.add_argument("--variants", default=",".join(TINY_VARIANTS),
                        help="tiny variants, comma-separated (default: all "
                        f"of {', '.join(TINY_VARIANTS)})")
    parser.add_argument("--_child", nargs=4)
    args = parser.parse_args()
    if args._child:
        workload, mode, quick, variant = args._child
        if quick == "1":
            _quick()
        result = run_straggler(mode) if workload == "straggler" else \
            run_tiny(mode, TINY_STEPS, variant)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    workloads = ["straggler", "tiny"] if args.workload == "all" \
        else [args.workload]
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json \
        else print
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = set(variants) - set(TINY_VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: "
                     f"{sorted(TINY_VARIANTS)}")
    report = measure(workloads, args.repeats, log, args.quick, variants)
    summary = summarize(report)
    if args.json:
        print(json.dumps({"runs": report, "summary": summary}))
        return
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
