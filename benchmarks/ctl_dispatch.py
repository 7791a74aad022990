"""Custom-training-loop dispatch: keras_ps vs TF's native ParameterServerStrategy.

Runs each system in its own process (one TF context per process), one after
the other, in one run, and prints steps/s and the ratio.

    .venv/bin/python benchmarks/ctl_dispatch.py            # both workloads
    .venv/bin/python benchmarks/ctl_dispatch.py --repeats 3

Workloads (in-process cluster, as TF's tutorial builds it):
  tiny:  `v.assign_add(next(it))`, 2 workers, 2 ps.
  sleep: each step waits 20 ms in the worker's dataset, 16 workers, 2 ps;
         efficiency = steps/s / (16 * 50).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_one(system, workload, steps):
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import testing

    num_workers = 2 if workload == "tiny" else 16
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["tiny", "sleep", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--_child", nargs=3)
    args = parser.parse_args()
    if args._child:
        system, workload, steps = args._child
        print("RESULT " + json.dumps(run_one(system, workload, int(steps))), flush=True)
        os._exit(0)
    workloads = ["tiny", "sleep"] if args.workload == "all" else [args.workload]
    steps = {"tiny": 4000, "sleep": 4000}
    report = {}
    for workload in workloads:
        for system in ("tf_native", "keras_ps"):
            for r in range(args.repeats):
                env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
                out = subprocess.run(
                    [sys.executable, __file__, "--_child", system, workload,
                     str(steps[workload])],
                    capture_output=True, text=True, env=env, timeout=900)
                line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
                if not line:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{system}/{workload} failed")
                value = json.loads(line[0][7:])["steps_per_s"]
                report.setdefault((workload, system), []).append(value)
                print(f"{workload:6s} {system:9s} run {r}: {value:8.1f} steps/s", flush=True)
    print(f"\ncores: {os.cpu_count()}")
    for workload in workloads:
        native = statistics.median(report[(workload, "tf_native")])
        ours = statistics.median(report[(workload, "keras_ps")])
        line = (f"{workload}: TF native {native:.1f} steps/s, keras_ps {ours:.1f} "
                f"steps/s, ratio {ours / native:.2f}x")
        if workload == "sleep":
            line += (f"; efficiency TF {native / 800:.2f}, keras_ps {ours / 800:.2f}"
                     " of the ideal 800 steps/s")
        print(line)


if __name__ == "__main__":
    main()
