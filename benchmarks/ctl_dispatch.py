"""Custom-training-loop dispatch: keras_ps vs TF's native ParameterServerStrategy.

Runs each system in its own process (one TF context per process), one after
the other, in one run, and prints steps/s and the ratio.

    .venv/bin/python benchmarks/ctl_dispatch.py            # both workloads
    .venv/bin/python benchmarks/ctl_dispatch.py --repeats 3
    .venv/bin/python benchmarks/ctl_dispatch.py --workload sleep --workers 4 --json

Workloads (in-process cluster, as TF's tutorial builds it):
  tiny:  `v.assign_add(next(it))`, 2 workers, 2 ps.
  sleep: each step waits 20 ms in the worker's dataset, 16 workers, 2 ps;
         efficiency = steps/s / (16 * 50).
`--workers N` overrides the number of workers (run_all.py's scaling plot);
`--json` prints one JSON line with every measurement instead of the text.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


DEFAULT_WORKERS = {"tiny": 2, "sleep": 16}
DEFAULT_STEPS = {"tiny": 4000, "sleep": 4000}
SYSTEMS = ("tf_native", "keras_ps")


def run_one(system, workload, steps, num_workers=None):
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import testing

    num_workers = num_workers or DEFAULT_WORKERS[workload]
    if system == "keras_ps":
        import keras_ps
        resolver = keras_ps.create_in_process_cluster(num_workers, 2)
        strategy = keras_ps.ParameterServerStrategy(resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
    else:
        import portpicker
        spec = {"worker": [f"localhost:{portpicker.pick_unused_port()}"
                           for _ in range(num_workers)],
                "ps": [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]}
        cluster = tf.train.ClusterSpec(spec)
        config = tf.compat.v1.ConfigProto()
        config.inter_op_parallelism_threads = num_workers + 1
        servers = [tf.distribute.Server(cluster, job_name=j, task_index=i,
                                        protocol="grpc", config=config, start=True)
                   for j in spec for i in range(len(spec[j]))]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        v = tf.Variable(0.0)

    def dataset_fn():
        ds = tf.data.Dataset.from_tensors(1.0).repeat()
        if workload == "sleep":
            ds = ds.apply(testing.sleep(20000))
        return ds

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        v.assign_add(next(it))

    for _ in range(max(100, num_workers * 20)):  # warm up: traces, connections
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - start
    return {"steps_per_s": steps / elapsed}


def run_child(system, workload, steps, num_workers=None, timeout=900):
    """Runs one measurement in a fresh process; returns steps/s."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    num_workers = num_workers or DEFAULT_WORKERS[workload]
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", system, workload,
         str(steps), str(num_workers)],
        capture_output=True, text=True, env=env, timeout=timeout)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not line:
        print(out.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"{system}/{workload} failed")
    return json.loads(line[0][7:])["steps_per_s"]


def measure(workload, repeats=1, steps=None, num_workers=None, log=print):
    """{system: [steps/s per repeat]}, systems alternating within a repeat."""
    steps = steps or DEFAULT_STEPS[workload]
    report = {system: [] for system in SYSTEMS}
    for r in range(repeats):
        for system in SYSTEMS:
            value = run_child(system, workload, steps, num_workers)
            report[system].append(value)
            log(f"{workload:6s} {system:9s} run {r}: {value:8.1f} steps/s")
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["tiny", "sleep", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per run (default 4000)")
    parser.add_argument("--workers", type=int, default=None,
                        help="number of workers (default: 2 tiny, 16 sleep)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line with every measurement")
    parser.add_argument("--_child", nargs=4)
    args = parser.parse_args()
    if args._child:
        system, workload, steps, workers = args._child
        print("RESULT " + json.dumps(run_one(system, workload, int(steps), int(workers))),
              flush=True)
        os._exit(0)
    workloads = ["tiny", "sleep"] if args.workload == "all" else [args.workload]
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    report = {w: measure(w, args.repeats, args.steps, args.workers, log)
              for w in workloads}
    if args.json:
        print(json.dumps({w: {"workers": args.workers or DEFAULT_WORKERS[w],
                              "steps_per_s": report[w]} for w in workloads}))
        return
    print(f"\ncores: {os.cpu_count()}")
    for workload in workloads:
        native = statistics.median(report[workload]["tf_native"])
        ours = statistics.median(report[workload]["keras_ps"])
        line = (f"{workload}: TF native {native:.1f} steps/s, keras_ps {ours:.1f} "
                f"steps/s, ratio {ours / native:.2f}x")
        if workload == "sleep":
            ideal = 50 * (args.workers or DEFAULT_WORKERS["sleep"])
            line += (f"; efficiency TF {native / ideal:.2f}, keras_ps {ours / ideal:.2f}"
                     f" of the ideal {ideal} steps/s")
        print(line)


if __name__ == "__main__":
    main()
