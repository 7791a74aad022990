"""What following BackupAndRestore's advice on save_freq costs training.

BackupAndRestore warns when an epoch's backups held training for a quarter
of it or more, naming the least save_freq that could bring that near 5%
(each backup costing what it did). This runs
`Model.fit` as a user would, with `keras_ps.callbacks.BackupAndRestore` (its
default `incremental="auto"`: incremental at these sizes), on the model and
data of incremental_backups.py (Embedding(R, 64) over 2 ps, 2 workers,
in-process cluster, LazyAdam, Zipf ids), each run in its own process:

  1. no backup (the reference steps/s);
  2. each of `--save-freqs` in turn (`100,advised` by default): a number
     of steps, or `advised`: the save_freq named by the warning of the run
     before (skipped when it gave none);
  3. no backup again (the machine's drift over the runs).

For each run with backups: steps/s over the epochs after the first (the
first holds the traces and the first, full, backup) against the mean of
the two runs without backups, and what the callback logged: the time each
backup held training, its warning, and its line at the end of `fit`.

    .venv/bin/python benchmarks/backup_advice.py --rows 10000000 --json
    .venv/bin/python benchmarks/backup_advice.py --rows 10000000 \
        --epochs 3 --steps 6000 --save-freqs 2000,6000 --json
"""

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fit_large_tables as large  # noqa: E402  (the model's data)


def run_child(rows, epochs, steps, save_freq, directory):
    import keras
    import tensorflow as tf

    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    for name in ("keras_ps.callbacks.backup_and_restore",
                 "keras_ps.callbacks._backup_cost"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(Keep())
    resolver = keras_ps.create_in_process_cluster(2, 2)
    strategy = keras_ps.ParameterServerStrategy(
        resolver, variable_partitioner=FixedShardsPartitioner(2))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = large.table_model(keras, rows,
                                  keras_ps.optimizers.LazyAdam(0.01), None)
    ends = []

    class Ends(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            ends.append(time.perf_counter())

    callbacks = [Ends()]
    if save_freq:
        # After Ends: an epoch's time includes its last backup.
        callbacks.append(keras_ps.callbacks.BackupAndRestore(
            directory, save_freq=save_freq))
    model.fit(keras_ps.DatasetCreator(large.dataset_fn_for(tf, rows)),
              epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=callbacks)
    waited = [float(m) for line in lines for m in re.findall(
        r"training waited ([0-9.]+) s", line)]
    warnings = [line for line in lines if "Backups held training" in line]
    named = [int(m) for line in warnings for m in re.findall(
        r"save_freq must be (\d+) at the very least", line)]
    return dict(save_freq=save_freq, rows=rows,
                steps_per_s=(epochs - 1) * steps / (ends[-1] - ends[0]),
                waited=waited, warnings=warnings,
                named=named[0] if named else None,
                summary=[line for line in lines if "held training for" in line
                         and "Backups" not in line])


def run(rows, epochs, steps, save_freq, parent, timeout=7200):
    directory = tempfile.mkdtemp(prefix="advice-", dir=parent)
    try:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_child", str(rows),
             str(epochs), str(steps), str(save_freq), directory],
            capture_output=True, text=True, timeout=timeout,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    found = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not found:
        raise RuntimeError(f"save_freq={save_freq}: exit {out.returncode}: "
                           f"{out.stderr[-3000:]}")
    return json.loads(found[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--save-freqs", default="100,advised")
    parser.add_argument("--dir", default=None,
                        help="where backups go (a temporary folder)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        rows, epochs, steps, save_freq = map(int, args._child[:4])
        print("RESULT " + json.dumps(run_child(rows, epochs, steps,
                                               save_freq, args._child[4])),
              flush=True)
        return
    common = (args.rows, args.epochs, args.steps)
    runs = [run(*common, 0, args.dir)]
    for save_freq in args.save_freqs.split(","):
        if save_freq == "advised":
            save_freq = runs[-1].get("named")
            if save_freq is None:
                continue
        runs.append(run(*common, int(save_freq), args.dir))
    runs.append(run(*common, 0, args.dir))
    reference = statistics.mean(r["steps_per_s"] for r in runs
                                if not r["save_freq"])
    plain = ", ".join(f"{r['steps_per_s']:.1f}" for r in runs
                      if not r["save_freq"])
    print(f"R={args.rows:,}, {args.epochs} epochs of {args.steps} steps; "
          f"no backup: {plain} steps/s")
    print("| save_freq | steps/s | / no backup | training waited per backup "
          "(after the first), s | the callback's warning | its fit summary |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        if not r["save_freq"]:
            continue
        waited = sorted(r["waited"][1:])
        spread = (f"{waited[0]:.2f} / **{statistics.median(waited):.2f}** / "
                  f"{waited[-1]:.2f}" if waited else "-")
        print(f"| {r['save_freq']} | {r['steps_per_s']:.1f} | "
              f"{r['steps_per_s'] / reference:.2f}x | {spread} | "
              f"{r['warnings'][0] if r['warnings'] else 'none'} | "
              f"{'; '.join(r['summary'])} |")
    if args.json:
        print("JSON " + json.dumps(runs))


if __name__ == "__main__":
    main()
