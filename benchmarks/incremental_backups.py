"""Incremental backups of a large embedding table: bytes and time.

The model and data of fit_large_tables.py: Embedding(R, 64) sharded over 2 ps
(FixedShardsPartitioner(2)), 2 workers, in-process cluster, batch 256 x 16
Zipf-like ids over the whole table, MLP 128-64-1, steps_per_execution=10,
keras_ps.optimizers.LazyAdam. A backup every 100 steps (--every) (after
`coordinator.join()`, as BackupAndRestore does), in runs of these modes,
each in its own process:

  none         no backup: the reference training time
  incremental  keras_ps.IncrementalBackup.save(): a full backup first, then
               deltas (a new full backup when the deltas add up to one or
               after --max-deltas, 20 by default: compaction, written by the
               ps while training goes on and published with the next
               delta), training waiting for each delta to be published
  blocking     the same with background_compaction=False: training waits
               while the compaction's full backup is written
  background   the same with background_deltas=True: training waits only
               while each ps copies a delta's rows; the files are written
               and the delta is published while training goes on; a
               compaction merges the deltas into one (rows changed since
               the full backup) while they are under a quarter of the table
               (IncrementalBackup's default merge_below)
  background_full
               the same, but each compaction writes a full backup
               (merge_below=0)
  background_blocking
               background deltas, background_compaction=False
  join         no backup, but the join every 100 steps that each backup
               starts with: what draining the steps in flight costs alone
  track        the join, and the tables' changed rows marked on the ps
               from the first join on (IncrementalBackup.check()), as
               they are for deltas, but nothing written: what marking
               the rows costs the steps
  keras_h5     model.save_weights(...weights.h5): the full Keras weights file
               BackupAndRestore writes without `incremental` (R <= 1M only:
               at 10M each would write 7.7 GB)

For each delta: its bytes, the rows of the table it holds, and the minimum
a delta can be: the rows touched since the previous backup (counted
independently, from LazyAdam's per-row step slot) x the bytes of a row with
its slots (64 x 4 x 3 + 8), plus every other variable whole. Training time:
steps/s of the measured epochs (the first epoch, with the tracing and the
first full backup, is warm-up), without the time spent counting touched rows.
Per backup, "s per backup" is the time training waits for it after the
join of the steps in flight (the join's own time given beside it). Then
one restore of the newest chain (full + deltas) into the same model, with
the process' peak RSS during it over its RSS before (the whole in-process
cluster: both ps' shares and the rest).

    .venv/bin/python benchmarks/incremental_backups.py --rows 1000000 --repeats 3
    .venv/bin/python benchmarks/incremental_backups.py --rows 10000000 \\
        --modes none,background --repeats 2
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fit_large_tables as large  # noqa: E402  (the model's data)

EVERY = 100  # steps between backups (--every)
MODES = ("none", "join", "track", "incremental", "blocking", "background",
         "background_full", "background_blocking", "keras_h5")
ROW_BYTES = 64 * 4 * 3 + 8  # a row, its two moments and its row step


def _model(keras, keras_ps, strategy, rows):
    with strategy.scope():
        return large.table_model(keras, rows,
                                 keras_ps.optimizers.LazyAdam(0.01), None)


def run_child(mode, rows, epochs, steps, directory, max_deltas, every):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_ps
    from keras_ps.tables import _sharded_weights
    from keras_ps.partitioners import FixedShardsPartitioner

    resolver = keras_ps.create_in_process_cluster(2, 2)
    strategy = keras_ps.ParameterServerStrategy(
        resolver, variable_partitioner=FixedShardsPartitioner(2))
    keras.utils.set_random_seed(0)
    model = _model(keras, keras_ps, strategy, rows)
    coordinator = keras_ps.ClusterCoordinator(strategy)
    table = model.layers[0].embeddings
    optimizer = model.optimizer
    sizes = {}

    def measure_model():
        """Bytes of the variables that are not the table or its slots, and
        LazyAdam's per-row step slot of each shard (the optimizer is built
        by fit)."""
        table_and_slots = {id(table)} | {
            id(v) for v in _sharded_weights.collapse(optimizer.variables)
            if getattr(v, "path", "").startswith(table.path + "_")}
        sizes["dense_bytes"] = sum(
            int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
            for v in _sharded_weights.collapse(model.weights)
            + _sharded_weights.collapse(optimizer.variables)
            if id(v) not in table_and_slots)
        sizes["row_steps"] = [
            optimizer._row_steps[optimizer._get_variable_index(shard)]
            for shard in model.layers[0].weights]

    backup = None
    if mode in ("incremental", "blocking", "background", "background_full",
                "background_blocking", "track"):
        backup = keras_ps.IncrementalBackup(
            model, directory, background_deltas=mode.startswith("background"),
            background_compaction=not mode.endswith("blocking"),
            max_deltas=max_deltas,
            **(dict(merge_below=0) if mode == "background_full" else {}))
    records, ends, compactions = [], [], []
    state = {"step": 0, "last_iterations": 0, "overhead": 0.0}

    def touched_since(iterations):
        """Rows updated after step `iterations`, counted on the ps holding
        each shard's row steps: only a scalar comes here (copying the row
        steps moved 80 MB per backup over gRPC at 10M rows)."""
        count = 0
        for steps in sizes["row_steps"]:
            steps = steps.value  # the tf.Variable of the Keras variable
            with tf.device(steps.device):
                count += int(tf.math.count_nonzero(
                    steps > iterations, dtype=tf.int64))
        return count

    class Backups(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            measure_model()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            step = self.epoch * steps + batch + 1
            if step // every == state["step"] // every:
                state["step"] = step
                return
            state["step"] = step
            if mode == "none":
                return
            started = time.perf_counter()
            coordinator.join()
            joined = time.perf_counter()
            if mode in ("join", "track"):
                if mode == "track" and not state.get("tracking"):
                    backup.check()  # the rows are marked from now on
                    state["tracking"] = True
                records.append(dict(step=step, kind=mode,
                                    join_s=joined - started))
            elif backup is not None:
                # A compaction whose write ended is sealed by this save.
                compaction = backup._compaction
                if compaction is not None and compaction.entry is not None:
                    compactions.append(dict(
                        step=step, kind=compaction.kind,
                        bytes=compaction.entry["bytes"],
                        table_rows=compaction.entry["table_rows"],
                        seconds=compaction.seconds))
                entry = backup.save()
                seconds = time.perf_counter() - joined
                counting = time.perf_counter()
                iterations = int(optimizer.iterations.numpy())
                touched = touched_since(state["last_iterations"])
                state["last_iterations"] = iterations
                records.append(dict(
                    step=step, id=entry.id, kind=entry.kind,
                    deltas=entry.deltas, compacting=backup.compacting,
                    bytes=entry.bytes, join_s=joined - started,
                    seconds=seconds, touched=touched,
                    minimum=touched * ROW_BYTES + sizes["dense_bytes"]))
                # The delta written in the background before this one is
                # published now: its size (a full backup is, at once).
                for record in records:
                    if "table_rows" not in record:
                        _complete(backup, record)
                state["overhead"] += time.perf_counter() - counting
            else:
                path = os.path.join(directory, "backup.weights.h5")
                model.save_weights(path, overwrite=True)
                records.append(dict(step=step, kind="keras_h5",
                                    bytes=os.path.getsize(path),
                                    join_s=joined - started,
                                    seconds=time.perf_counter() - joined))

        def on_epoch_end(self, epoch, logs=None):
            ends.append((time.perf_counter(), state["overhead"]))

    model.fit(keras_ps.DatasetCreator(large.dataset_fn_for(tf, rows)),
              epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[Backups()])
    (t0, o0), (t1, o1) = ends[0], ends[-1]
    result = dict(mode=mode, rows=rows, every=every, records=records,
                  compactions=compactions,
                  steps_per_s=(epochs - 1) * steps / (t1 - t0 - (o1 - o0)),
                  dense_bytes=sizes["dense_bytes"], row_bytes=ROW_BYTES)
    if backup is not None and mode != "track":
        backup.wait()
        for record in records:
            if "table_rows" not in record:
                _complete(backup, record)
        rss = _RssPeak()
        started = time.perf_counter()
        entry = backup.restore()
        seconds = time.perf_counter() - started
        before, peak = rss.stop()
        # One process holds the whole cluster here: its RSS before the
        # restore is the steady state of both ps (and the rest).
        result["restore"] = dict(seconds=seconds, deltas=entry.deltas,
                                 id=entry.id, rss_before=before,
                                 rss_peak=peak)
    return result


class _RssPeak:
    """The RSS of this process now, and its peak until `stop()` (sampled
    every 10 ms in a thread)."""

    def __init__(self):
        import threading

        import psutil
        self._process = psutil.Process()
        self.before = self.peak = self._process.memory_info().rss
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stopped.wait(0.01):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self):
        self._stopped.set()
        self._thread.join()
        return self.before, self.peak


def _complete(backup, record):
    """Adds the bytes and table rows of the backup of `record` once the
    manifest lists it (a delta written in the background is listed once
    published)."""
    from keras_ps.backups import _chain as _backup_chain

    manifest = _backup_chain.read(backup.directory)
    for chain in manifest["chains"]:
        for entry in chain:
            if entry["id"] == record["id"]:
                record["bytes"] = entry["bytes"]
                record["table_rows"] = sum(
                    r["rows"] for r in entry["files"]
                    if r["keys"][0] == "model/0")


def run(mode, rows, epochs, steps, parent, max_deltas, every,
        timeout=7200):
    directory = tempfile.mkdtemp(prefix=f"incremental-{mode}-", dir=parent)
    try:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_child", mode,
             str(rows), str(epochs), str(steps), directory, str(max_deltas),
             str(every)],
            capture_output=True, text=True, env=env, timeout=timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"mode": mode, "rows": rows, "every": every,
                "error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def _median(values, digits=2):
    values = list(values)
    return f"{statistics.median(values):,.{digits}f}" if values else "-"


def _spread(values, digits=2, suffix=""):
    """min / **median** / max."""
    values = sorted(values)
    if not values:
        return "-"
    return (f"{values[0]:.{digits}f} / **{statistics.median(values):.{digits}f}**"
            f" / {values[-1]:.{digits}f}{suffix}")


def summary(results):
    """Markdown lines for RESULTS.md: per-backup figures pooled over the
    repeats (medians); steps/s as min / median / max over the repeats, and
    each repeat's ratio to the run without backups of the same repeat."""
    ok = [r for r in results if "error" not in r]
    runs = {m: [r for r in ok if r["mode"] == m] for m in MODES}
    rows = results[0]["rows"]
    every = results[0]["every"]
    base = {r["repeat"]: r["steps_per_s"] for r in runs["none"]}

    def speed(mode):
        mine = runs[mode]
        ratios = [r["steps_per_s"] / base[r["repeat"]] for r in mine
                  if r["repeat"] in base]
        return (f"{_spread([r['steps_per_s'] for r in mine], 1)} | "
                f"{_spread(ratios, 2, 'x')}")

    lines = [f"R = {rows:,} (table + slots {rows * ROW_BYTES / 2**30:.2f} "
             f"GiB), {len(runs['none'])} repeats:", "",
             "| | per backup (median) | / minimum | s per backup (median) "
             "| steps/s | / no backup |", "|---|---|---|---|---|---|"]
    if runs["none"]:
        lines.append(f"| no backup | | | | {speed('none')} |")
    if runs["join"]:
        lines.append(f"| no backup, a join every {every} steps | | | | "
                     f"{speed('join')} |")
    if runs["track"]:
        lines.append(f"| no backup, a join every {every} steps, rows "
                     f"marked | | | | {speed('track')} |")
    for mode, label in (("incremental", "incremental"),
                        ("blocking", "incremental, compaction blocking"),
                        ("background", "incremental, deltas written in "
                         "the background"),
                        ("background_full", "background deltas, "
                         "compaction always a full backup"),
                        ("background_blocking", "background deltas, "
                         "compaction blocking")):
        records = [x for r in runs[mode] for x in r["records"]]
        # A sealing delta holds the rows changed since its compaction
        # began, not since the previous backup: listed apart.
        seals = [x for previous, x in zip(records, records[1:])
                 if x["kind"] == "delta" and x["deltas"] < previous["deltas"]]
        compactions = [x for r in runs[mode] for x in r.get("compactions",
                                                             ())]
        deltas = [x for x in records if x["kind"] == "delta"
                  and not any(x is y for y in seals)]
        fulls = [x for x in records if x["kind"] == "full"]
        if deltas:
            lines.append(
                f"| {label}: delta | "
                f"{_mb(statistics.median(x['bytes'] for x in deltas))}"
                f" ({_median((x['table_rows'] for x in deltas), 0)} table "
                f"rows; touched {_median((x['touched'] for x in deltas), 0)})"
                f" | {_spread([x['bytes'] / x['minimum'] for x in deltas])}x"
                f" | {_median(x['seconds'] for x in deltas)} (join "
                f"{_median(x['join_s'] for x in deltas)}) | {speed(mode)} |")
        if seals:
            lines.append(
                f"| {label}: compactions written while training, "
                f"{len(seals)} sealed; the sealing delta | "
                f"{_mb(statistics.median(x['bytes'] for x in seals))} "
                f"({_median((x['table_rows'] for x in seals), 0)} table rows)"
                f" | | {_median(x['seconds'] for x in seals)} | | |")
        for kind in ("full", "delta"):
            done = [x for x in compactions if x["kind"] == kind]
            if done:
                lines.append(
                    f"| {label}: {len(done)} compaction(s) written while "
                    f"training, as a "
                    f"{'full backup' if kind == 'full' else 'merged delta'} | "
                    f"{_mb(statistics.median(x['bytes'] for x in done))} "
                    f"({_median((x['table_rows'] for x in done), 0)} table "
                    f"rows) | | {_median(x['seconds'] for x in done)} "
                    "(its write) | | |")
        if fulls:
            lines.append(
                f"| {label}: full | "
                f"{_mb(statistics.median(x['bytes'] for x in fulls))}"
                f" ({len(fulls)} of {len(records)} backups) | | "
                f"{_median(x['seconds'] for x in fulls)} | | |")
        restores = [r["restore"] for r in runs[mode] if "restore" in r]
        if restores:
            lines.append(
                f"| {label}: restore full + "
                f"{_median((x['deltas'] for x in restores), 0)} deltas "
                f"(peak RSS / RSS before: "
                f"{_spread([x['rss_peak'] / x['rss_before'] for x in restores if 'rss_peak' in x], 3, 'x')}) | | | "
                f"{_median(x['seconds'] for x in restores)} | | |")
    h5 = [x for r in runs["keras_h5"] for x in r["records"]]
    if h5:
        lines.append(
            f"| Keras weights file (full, through the chief) | "
            f"{_mb(statistics.median(x['bytes'] for x in h5))} | | "
            f"{_median(x['seconds'] for x in h5)} | {speed('keras_h5')} |")
    return lines


def _mb(value):
    return f"{value / 2**20:,.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500,
                        help="steps per epoch; the first epoch is warm-up")
    parser.add_argument("--dir", default=None,
                        help="where backups are written (a temporary folder)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="each mode this many times, interleaved")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--max-deltas", type=int, default=20)
    parser.add_argument("--every", type=int, default=EVERY,
                        help="steps between backups (and joins)")
    parser.add_argument("--_child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        mode, rows, epochs, steps, directory, max_deltas, every = args._child
        result = run_child(mode, int(rows), int(epochs), int(steps), directory,
                           int(max_deltas), int(every))
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for repeat in range(args.repeats):
        for mode in args.modes.split(","):
            started = time.perf_counter()
            result = run(mode, args.rows, args.epochs, args.steps, args.dir,
                         args.max_deltas, args.every)
            result["repeat"] = repeat
            print(f"{mode} run {repeat}: {time.perf_counter() - started:.0f} s"
                  + (f" FAILED {result['error'][-800:]}" if "error" in result
                     else f", {result['steps_per_s']:.1f} steps/s"), flush=True)
            results.append(result)
            if args.json:  # each run as it ends: kept if the rest is stopped
                print("RUN " + json.dumps(result), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
