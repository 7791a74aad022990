"""CPU per step of each process of a Model.fit, and its steps/s over a long
call, separate processes.

Model, cluster and systems as benchmarks/fit_calls.py (its `build`): the
ps and worker tasks in their own processes (`keras_ps.LocalCluster`), the
coordinator is this process. After a warm-up call of `--warmup` steps, one
call of `--steps` steps (one epoch) is timed, and each process' user +
system CPU time over it is read from /proc. One system per process; run
the systems alternately for pairs.

    .venv/bin/python benchmarks/process_cpu.py keras_ps_adagrad --rows 10000000
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fit_calls  # noqa: E402
from step_breakdown import _cpu_s as cpu_seconds  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("system", help="a system of fit_calls.py")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--warmup", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    cluster, model, creator, keras = fit_calls.build(args.system, args.rows)
    fit_calls.timed_fit(keras, model, creator, 1, args.warmup)
    pids = fit_calls.task_pids(cluster)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    fit_calls.timed_fit(keras, model, creator, 1, args.steps)
    wall = time.perf_counter() - start
    per_step = {name: (cpu_seconds(pid) - before[name]) / args.steps * 1e3
                for name, pid in pids.items()}
    print("RESULT " + json.dumps({
        "system": args.system, "rows": args.rows,
        "ids": os.environ.get(fit_calls.IDS_ENV_VAR, "zipf"),
        "steps_per_s": args.steps / wall,
        "cpu_ms_per_step": per_step,
        "cpu_ms_per_step_total": sum(per_step.values()),
        "cores": sum(per_step.values()) * args.steps / wall / 1e3,
        "iterations": int(model.optimizer.iterations.numpy())}), flush=True)
    cluster.shutdown()
    os._exit(0)  # as fit_calls: the coordinator's threads need not wind down


if __name__ == "__main__":
    main()
