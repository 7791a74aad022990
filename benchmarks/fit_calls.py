"""Model.fit called several times in one process: start-up of a later call.

A script that trains in calls of a few hundred steps (a day's data, a loop
with evaluation between calls) pays each call's start-up again. This measures,
side by side in one run, keras_ps against TF's native path (TF's
ParameterServerStrategy + ClusterCoordinator + tf_keras), with the ps and
worker tasks in their own processes as users run them (`keras_ps.LocalCluster`:
`python -m keras_ps.server` per task, a plain `tf.distribute.Server`, which
TF's native coordinator drives as well). The coordinator is the measuring
process; each system runs in its own process, one at a time. `--in-process`
puts the tasks in the measuring process instead (the in-process cluster).

Model as benchmarks/fit_large_tables.py: Embedding(R, 64) on 2 ps
(FixedShardsPartitioner(2)), 2 workers, batch 256 x 16 Zipf-like ids over the
whole table, MLP 128-64-1, steps_per_execution=10 (`--dim` and `--tower`
change the row width and the MLP's hidden layers). One DatasetCreator object
for every call of a process (a user defines the input once).

Calls, in this order, in one process:
  1. fit(100 steps)                     warm-up: the first call traces
                                        (--first-call-steps: more)
  2. fit(240 steps)                     a whole later call, start-up included
  3. fit(4 epochs x 100 steps)          start-up = epoch 1 - median(epochs 2-4);
                                        steady state = 300 steps / epochs 2-4
  4. fit(240 steps)                     a whole later call again
  5. evaluate(steps=100) twice          the second one's time

Peak RSS: each process' high-water mark (VmHWM) at the end: the coordinator
and each ps and worker task. CPU per step: each process' user and system
time (/proc/PID/stat) over epochs 2-4 of call 3, per step; a host that
steals time or changes speed moves it far less than steps/s.

Under the table, the ratios of the runs of each repeat (keras_ps against TF
native; LazyAdam against Adagrad, also as the ratio of the systems' medians).
`--from-json a.json,b.json` formats saved runs, pooled.

    .venv/bin/python benchmarks/fit_calls.py --rows 1000000 --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fit_large_tables import STEPS_PER_EXECUTION  # noqa: E402
from fit_large_tables import dataset_fn_for, table_model  # noqa: E402
from fit_large_tables import ID_DISTRIBUTIONS, IDS_ENV_VAR  # noqa: E402
from fit_large_tables import DIM, TOWER, DIM_ENV_VAR, TOWER_ENV_VAR  # noqa: E402
from step_breakdown import _cpu_s as cpu_seconds  # noqa: E402

SYSTEMS = ("tf_native_adagrad", "keras_ps_adagrad", "keras_ps_lazyadam",
           "keras_ps_adagrad_unrolled", "keras_ps_lazyadam_unrolled",
           "keras_ps_adagrad_ungrouped",
           "keras_ps_adagrad_ungrouped_unrolled", "keras_ps_adagrad_unrolled2",
           "keras_ps_adagrad_unrolled3", "keras_ps_adagrad_unrolled5",
           "keras_ps_adagrad_unrolled1", "keras_ps_lazyadam_unrolled1",
           "keras_ps_lazyadam_unrolled5", "keras_ps_lazyadam_tfops",
           "keras_ps_lazyadam_tfops_unrolled5", "keras_ps_adagrad_tfops_unrolled5",
           "keras_ps_adagrad_unrolled_preemptible",
           "keras_ps_lazyadam_unrolled_preemptible")
# A system named "<system>_unrolled" is <system> with its steps_per_execution
# steps written out instead of a tf.while_loop (KERAS_PS_UNROLL_STEPS);
# "<system>_unrolled<K>" writes out K steps in each iteration of the loop
# from the first call ("_unrolled1": one step an iteration, the loop); a
# system without the suffix runs keras_ps' default (the loop for a function's
# first KERAS_PS_UNROLL_AFTER executions, then 5 an iteration: pass
# --first-call-steps 1000 or more to measure the steady state after it);
# "<system>_ungrouped" moves one tensor per variable between processes
# instead of one per ps (KERAS_PS_GROUP_TRANSFERS=0); "<system>_tfops" runs
# LazyAdam's and Adagrad's row updates as TF's ops instead of keras_ps' C++
# kernels (KERAS_PS_NATIVE=0, in the tasks too); "<system>_preemptible" gives
# every fit call a BackupAndRestore(save_freq=False,
# save_before_preemption=True): no backup is written, but fit schedules only
# about 2 s of executions ahead of those that ended.
PREEMPTIBLE = "_preemptible"
_EXTRA_CALLBACKS = []  # build() adds the preemptible system's callback
UNROLLED = "_unrolled"
UNGROUPED = "_ungrouped"
TF_OPS = "_tfops"
WHOLE_CALL_STEPS = 240
EPOCH_STEPS = 100
FIRST_CALL_ENV_VAR = "BENCH_FIRST_CALL_STEPS"  # --first-call-steps, to the children
INTRA_ENV_VAR = "BENCH_INTRA_OP_THREADS"  # --intra-op-threads, to the children
IN_PROCESS_ENV_VAR = "BENCH_IN_PROCESS"  # --in-process, to the children
EVAL_STEPS = 100


def _hwm_gb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class InProcessCluster:
    """`--in-process`: the two ps and two workers as servers in this process
    (keras_ps.create_in_process_cluster; TF's own servers for TF's path, as
    fit_large_tables.py), standing in for LocalCluster."""

    intra_op_threads = None

    def __init__(self, tf, native):
        if native:
            from fit_embedding import start_native_cluster
            self.resolver, self._servers = start_native_cluster(tf, 2, 2)
        else:
            import keras_ps
            self.resolver = keras_ps.create_in_process_cluster(2, 2)
        self.spec = self.resolver.cluster_spec().as_dict()

    def shutdown(self):
        """Nothing: the servers end with the process."""


def task_pids(cluster):
    """{task: pid} of this process (the coordinator) and of `cluster`'s two
    ps and two workers (only this process' for an in-process cluster: every
    task is in it)."""
    pids = {"coordinator": os.getpid()}
    if isinstance(cluster, InProcessCluster):
        return pids
    for job in ("ps", "worker"):
        for i in range(2):
            pids[f"{job}{i}"] = cluster.pid(job, i)
    return pids


def build(system, rows, metrics=("accuracy",)):
    """The cluster (its own processes), the model compiled under `system`'s
    strategy, the DatasetCreator and the Keras module in use; every
    benchmark of later fit calls builds these the same way."""
    native = system.startswith("tf_native")
    preemptible = system.endswith(PREEMPTIBLE)
    system = system.removesuffix(PREEMPTIBLE)
    base, unrolled, per_iteration = system.partition(UNROLLED)
    if base.endswith(TF_OPS):
        os.environ["KERAS_PS_NATIVE"] = "0"  # LocalCluster's tasks inherit it
        base = base.removesuffix(TF_OPS)
    optimizer_name = base.removesuffix(UNGROUPED).rsplit("_", 1)[1]
    if unrolled:
        os.environ["KERAS_PS_UNROLL_STEPS"] = per_iteration or str(
            STEPS_PER_EXECUTION)
        os.environ["KERAS_PS_UNROLL_AFTER"] = "0"
    if base.endswith(UNGROUPED):
        os.environ["KERAS_PS_GROUP_TRANSFERS"] = "0"
    if native:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TF is imported
    import tensorflow as tf

    import keras_ps  # LocalCluster starts plain tf.distribute.Server tasks
    # Every system runs on the same LocalCluster processes; by default they
    # share the cores (LocalCluster's intra_op_threads=None).
    intra = os.environ.get(INTRA_ENV_VAR)
    if os.environ.get(IN_PROCESS_ENV_VAR) == "1":
        cluster = InProcessCluster(tf, native)
    else:
        cluster = keras_ps.LocalCluster(
            num_workers=2, num_ps=2,
            intra_op_threads=None if intra in (None, "") else int(intra))
    if native:
        import tf_keras as keras
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.spec), rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental
            .partitioners.FixedShardsPartitioner(2))
        creator = keras.utils.experimental.DatasetCreator(
            dataset_fn_for(tf, rows))
    else:
        import keras
        from keras_ps.partitioners import FixedShardsPartitioner
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
        creator = keras_ps.DatasetCreator(dataset_fn_for(tf, rows))
        if preemptible:
            import tempfile
            _EXTRA_CALLBACKS.append(keras_ps.callbacks.BackupAndRestore(
                tempfile.mkdtemp(), save_freq=False,
                save_before_preemption=True))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        if optimizer_name == "lazyadam":
            optimizer = keras_ps.optimizers.LazyAdam(0.01)
        else:
            optimizer = keras.optimizers.Adagrad(0.1)
        model = table_model(keras, rows, optimizer, list(metrics))
    return cluster, model, creator, keras


def timed_fit(keras, model, creator, epochs, steps, cpu_marks=None):
    """fit(epochs x steps); each epoch's seconds (the first with the call's
    start-up). `cpu_marks`: None, or a pair ({task: pid}, marks) where each
    epoch's end appends {task: CPU seconds so far} to the list `marks`."""
    epoch_ends = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter())
            if cpu_marks is not None:
                cpu_marks[1].append(
                    {task: cpu_seconds(pid)
                     for task, pid in cpu_marks[0].items()})

    start = time.perf_counter()
    model.fit(creator, epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[EpochTimer()] + _EXTRA_CALLBACKS)
    marks = [start] + epoch_ends
    return [b - a for a, b in zip(marks, marks[1:])]


def run_one(system, rows):
    cluster, model, creator, keras = build(system, rows)
    timed = lambda epochs, steps: timed_fit(keras, model, creator, epochs, steps)  # noqa: E731

    first_call_s = sum(timed(1, int(os.environ.get(FIRST_CALL_ENV_VAR,
                                                   EPOCH_STEPS))))
    whole = [sum(timed(1, WHOLE_CALL_STEPS))]
    pids = task_pids(cluster)
    cpu_marks = (pids, [])
    epochs = timed_fit(keras, model, creator, 4, EPOCH_STEPS, cpu_marks)
    cpu_ms_per_step = {
        task: 1000 * (cpu_marks[1][-1][task] - cpu_marks[1][0][task])
        / (3 * EPOCH_STEPS) for task in pids}
    whole.append(sum(timed(1, WHOLE_CALL_STEPS)))
    steady = 3 * EPOCH_STEPS / sum(epochs[1:])
    evaluate_s = []
    for _ in range(2):
        start = time.perf_counter()
        model.evaluate(creator, steps=EVAL_STEPS, verbose=0)
        evaluate_s.append(time.perf_counter() - start)
    rss = {task: _hwm_gb(pid) for task, pid in pids.items()}
    iterations = int(model.optimizer.iterations.numpy())
    forms = []
    if not system.startswith("tf_native"):
        # Which train functions ran: (steps, written out) per function.
        from keras_ps.training import _step_functions
        forms = sorted(_step_functions.for_model(model, "train_step")._functions)
    cluster.shutdown()
    return {
        "system": system, "rows": rows,
        "ids": os.environ.get(IDS_ENV_VAR, "zipf"),
        "dim": DIM, "tower": list(TOWER),
        "in_process": isinstance(cluster, InProcessCluster),
        "intra_op_threads": cluster.intra_op_threads,
        "steady_steps_per_s": steady,
        "steady_cpu_ms_per_step": cpu_ms_per_step,
        "epoch_s": epochs,
        "startup_s": epochs[0] - statistics.median(epochs[1:]),
        "first_call_s": first_call_s,
        "whole_call_s": whole,
        "whole_call_steps_per_s": [WHOLE_CALL_STEPS / s for s in whole],
        "evaluate_s": evaluate_s,
        "peak_rss_gb": rss,
        "iterations": iterations,
        "train_functions": forms,
    }


def run_child(system, rows, timeout=1800):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.pop("KERAS_PS_UNROLL_STEPS", None)
    env.pop("KERAS_PS_UNROLL_AFTER", None)
    env.pop("KERAS_PS_GROUP_TRANSFERS", None)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", system,
         str(rows)], capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"system": system, "rows": rows,
                "error": f"exit {out.returncode}: " + out.stderr[-1500:]}
    return json.loads(lines[-1][len("RESULT "):])


def load():
    return os.getloadavg()


def measure(rows, systems, repeats, log):
    runs = []
    for r in range(repeats):
        for system in systems:
            before = load()
            result = run_child(system, rows)
            result.update(repeat=r, load_before=before, load_after=load())
            runs.append(result)
            if "error" in result:
                log(f"{system} R={rows:,} run {r}: FAILED {result['error'][-400:]}")
                continue
            log(f"{system:18s} R={rows:>10,} run {r}: steady "
                f"{result['steady_steps_per_s']:6.1f} steps/s, 240-step call "
                f"{'/'.join(f'{s:.2f}' for s in result['whole_call_s'])} s, "
                f"start-up {result['startup_s']:.2f} s, evaluate "
                f"{result['evaluate_s'][1]:.2f} s, load {before[0]:.1f}")
    return runs


def spread(values, digits=2):
    if not values:
        return "-"
    return (f"{min(values):.{digits}f} / **{statistics.median(values):.{digits}f}**"
            f" / {max(values):.{digits}f}")


def markdown(runs, label=""):
    lines = [
        "| system | steady steps/s | call 2: fit(240), s (steps/s) "
        "| call 4: fit(240), s (steps/s) | start-up of call 3, s "
        "| 2nd evaluate(100 steps), s "
        "| peak RSS GB (coord / ps0 / ps1 / w0 / w1) | load (1 min) "
        "| CPU ms a step, all tasks (the two ps) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system in SYSTEMS:
        ok = [x for x in runs if x["system"] == system and "error" not in x]
        if not ok:
            continue
        rss = max(ok, key=lambda x: sum(x["peak_rss_gb"].values()))["peak_rss_gb"]
        lines.append(
            f"| {label}{system} | {spread([x['steady_steps_per_s'] for x in ok], 1)} "
            f"| {spread([x['whole_call_s'][0] for x in ok])} "
            f"({spread([x['whole_call_steps_per_s'][0] for x in ok], 1)}) "
            f"| {spread([x['whole_call_s'][1] for x in ok])} "
            f"({spread([x['whole_call_steps_per_s'][1] for x in ok], 1)}) "
            f"| {spread([x['startup_s'] for x in ok])} "
            f"| {spread([x['evaluate_s'][1] for x in ok])} "
            f"| {' / '.join(f'{v:.1f}' for v in rss.values())} "
            f"| {spread([x['load_before'][0] for x in ok], 1)} "
            f"| {_cpu_cell(ok)} |")
    return lines


def _cpu_ms(run, tasks=None):
    """CPU ms a step of `run`'s tasks (all of them by default), or None for
    a run saved before the benchmark measured it."""
    cpu = run.get("steady_cpu_ms_per_step")
    if cpu is None:
        return None
    return sum(v for task, v in cpu.items() if tasks is None or task in tasks)


def _cpu_cell(runs):
    total = [_cpu_ms(x) for x in runs if _cpu_ms(x) is not None]
    # An in-process run has one process: its ps' share is not apart.
    ps = [_cpu_ms(x, ("ps0", "ps1")) for x in runs
          if _cpu_ms(x) is not None and "ps0" in x["steady_cpu_ms_per_step"]]
    if not total:
        return "-"
    return f"{spread(total, 1)} ({spread(ps, 1)})"


TF_NATIVE = "tf_native_adagrad"


def _pairs(runs, first, second):
    """[(run of `first`, run of `second`)] for each repeat where both ran."""
    by_repeat = {}
    for run in runs:
        if "error" not in run:
            by_repeat.setdefault(run["repeat"], {})[run["system"]] = run
    return [(both[first], both[second]) for _, both in sorted(by_repeat.items())
            if first in both and second in both]


def _twin(system):
    """The Adagrad system run like LazyAdam system `system`, or None."""
    if "_lazyadam" not in system:
        return None
    return system.replace("_lazyadam", "_adagrad")


def _against(system, other, pairs, whose):
    """The line of `system` over `other`: steady steps/s and call 2's time."""
    steady = [ours["steady_steps_per_s"] / theirs["steady_steps_per_s"]
              for ours, theirs in pairs]
    whole = [theirs["whole_call_s"][0] / ours["whole_call_s"][0]
             for ours, theirs in pairs]
    return (f"- {system} / {other}, {len(pairs)} pairs: steady steps/s "
            f"{spread(steady)}x; whole call 2, {whose} time / ours "
            f"{spread(whole)}x")


def ratios(runs):
    """Bullet lines of the ratios a repeat's runs give (each system ran in its
    own process, the systems of a repeat one after the other): every keras_ps
    system against TF native, and each LazyAdam system against its Adagrad
    twin, as min / **median** / max over the pairs; for the twins also the
    ratio of the two systems' medians, which a noisy pair moves less."""
    ran = {run["system"] for run in runs if "error" not in run}
    lines = []
    for system in (s for s in SYSTEMS if s in ran and s != TF_NATIVE):
        pairs = _pairs(runs, system, TF_NATIVE)
        if pairs:
            shorter = sum(ours["startup_s"] < tf["startup_s"]
                          for ours, tf in pairs)
            lines.append(
                _against(system, TF_NATIVE, pairs, "TF's")
                + f"; start-up of call 3 shorter than TF's in {shorter} of "
                f"{len(pairs)}")
    for system in (s for s in SYSTEMS if s in ran and s.endswith(PREEMPTIBLE)
                   and s.removesuffix(PREEMPTIBLE) in ran):
        base = system.removesuffix(PREEMPTIBLE)
        pairs = _pairs(runs, system, base)
        if pairs:
            lines.append(_against(system, base, pairs, f"{base}'s"))
    for system in (s for s in SYSTEMS if s in ran and _twin(s) in ran):
        pairs = _pairs(runs, system, _twin(system))
        if not pairs:
            continue
        steady = [lazy["steady_steps_per_s"] / ada["steady_steps_per_s"]
                  for lazy, ada in pairs]
        medians = (statistics.median(lazy["steady_steps_per_s"] for lazy, _ in pairs)
                   / statistics.median(ada["steady_steps_per_s"] for _, ada in pairs))
        line = (
            f"- {system} / {_twin(system)}, {len(pairs)} pairs: steady steps/s "
            f"{spread(steady)}x; the systems' medians {medians:.2f}x; "
            f"{sum(r < 0.9 for r in steady)} pairs under 0.9x")
        timed = [(lazy, ada) for lazy, ada in pairs
                 if _cpu_ms(lazy) is not None and _cpu_ms(ada) is not None]
        if timed:
            cpu = [_cpu_ms(lazy) / _cpu_ms(ada) for lazy, ada in timed]
            line += (f"; CPU a step of all tasks, {system} / {_twin(system)}: "
                     f"{spread(cpu)}x over {len(timed)} pairs")
        lines.append(line)
    return lines


def load_runs(paths):
    """The runs saved by --json in each of `paths`, pooled: a repeat is named
    by its file and its number there, so pairs stay within one run."""
    runs = []
    for i, path in enumerate(paths):
        with open(path) as f:
            runs += [dict(run, repeat=(i, run["repeat"])) for run in json.load(f)]
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--ids", choices=ID_DISTRIBUTIONS, default="zipf",
                        help="how a batch's ids are drawn")
    parser.add_argument("--dim", type=int, default=DIM,
                        help="the embedding's row width")
    parser.add_argument("--tower", default=",".join(map(str, TOWER)),
                        help="units of the Dense layers under the output, "
                             "comma-separated")
    parser.add_argument("--json", help="also write the raw runs here")
    parser.add_argument("--from-json",
                        help="format saved runs instead: a --json file, or "
                             "several separated by commas, pooled")
    parser.add_argument("--first-call-steps", type=int, default=EPOCH_STEPS,
                        help="steps of the first fit call (warm-up)")
    parser.add_argument("--intra-op-threads", type=int, default=None,
                        help="each task's intra-op threads (LocalCluster's "
                             "intra_op_threads; default: the cores shared "
                             "between the tasks; 0: TF's default)")
    parser.add_argument("--in-process", action="store_true",
                        help="every task in the measuring process (the "
                             "in-process cluster) instead of LocalCluster's "
                             "processes")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        system, rows = args._child
        print("RESULT " + json.dumps(run_one(system, int(rows))), flush=True)
        os._exit(0)
    if args.in_process and args.intra_op_threads is not None:
        parser.error(f"--intra-op-threads {args.intra_op_threads} sets "
                     "LocalCluster's tasks; with --in-process there are none "
                     "(every task is in the measuring process): drop one")
    tower = args.tower.split(",")
    if args.dim < 1 or not all(u.isdigit() and int(u) > 0 for u in tower):
        parser.error(f"--dim {args.dim} --tower {args.tower!r}: the row width "
                     "and each Dense layer's units must be positive integers "
                     "(e.g. --dim 32 --tower 256,128)")
    os.environ[IDS_ENV_VAR] = args.ids  # the children inherit these
    os.environ[DIM_ENV_VAR] = str(args.dim)
    os.environ[TOWER_ENV_VAR] = args.tower
    os.environ[IN_PROCESS_ENV_VAR] = "1" if args.in_process else ""
    os.environ[FIRST_CALL_ENV_VAR] = str(args.first_call_steps)
    if args.intra_op_threads is not None:
        os.environ[INTRA_ENV_VAR] = str(args.intra_op_threads)
    if args.from_json:
        runs = load_runs(args.from_json.split(","))
    else:
        runs = measure(args.rows, args.systems.split(","), args.repeats,
                       lambda *a: print(*a, file=sys.stderr, flush=True))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(runs, f)
    print("\n".join(markdown(runs) + [""] + ratios(runs)))


if __name__ == "__main__":
    main()
