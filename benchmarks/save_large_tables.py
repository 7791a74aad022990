"""Save and restore of a large sharded embedding: time and peak memory per process.

A multi-process LocalCluster (2 ps, 1 worker; this process is the
coordinator), Embedding(R, 64) split over the 2 ps, Dense(1) on top,
keras_ps.optimizers.LazyAdam (two float slots and a row step per row) or,
with --optimizer adagrad, keras.optimizers.Adagrad (one slot), one training
step so every slot exists. Then, one at a time:

  checkpoint_save / checkpoint_restore   tf.train.Checkpoint(model=, optimizer=)
                                         (what BackupAndRestore and the sidecar
                                         checkpoint write)
  save_weights / load_weights            model.save_weights("x.weights.h5"),
                                         model.load_weights of it
  model_save                             model.save("x.keras")
  load_weights_keras                     model.load_weights("x.keras")
  load_model                             keras.models.load_model("x.keras")
                                         under the strategy's scope

  predict / evaluate                     1,024 examples of 4 random ids: they
                                         must read only the rows they look up
                                         (loopback bytes, /proc/net/dev `lo`)

For each: seconds, GB written (the file sizes), seconds per GB, and the peak
RSS (VmHWM, reset before each operation) of the coordinator and of each ps,
against the table + slots size.

    .venv/bin/python benchmarks/save_large_tables.py --rows 4000000 \
        --optimizer lazyadam
"""

import argparse
import json
import os
import shutil
import tempfile
import time

DIM = 64


def status_gb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError(field)


def reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as f:  # resets VmHWM
        f.write("5")


def lo_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])
    raise RuntimeError("no loopback interface")


def size_gb(path):
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**30
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(path) for f in files) / 2**30


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--ops", default="predict,evaluate,checkpoint_save,"
                        "checkpoint_restore,save_weights,load_weights,model_save,"
                        "load_weights_keras,load_model")
    parser.add_argument("--optimizer", choices=("lazyadam", "adagrad"),
                        default="lazyadam")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner

    out_dir = args.dir or tempfile.mkdtemp(prefix="keras_ps_save_")
    results = {"rows": args.rows, "optimizer": args.optimizer, "ops": {}}
    with keras_ps.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
        pids = {"coordinator": os.getpid(),
                "ps0": cluster.pid("ps", 0), "ps1": cluster.pid("ps", 1)}
        start = time.perf_counter()
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((4,), dtype="int64"),
                keras.layers.Embedding(args.rows, DIM),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ])
            optimizer = (keras_ps.optimizers.LazyAdam(0.01)
                         if args.optimizer == "lazyadam"
                         else keras.optimizers.Adagrad(0.01))
            model.compile(optimizer, "mse", steps_per_execution=1)
        results["build_s"] = time.perf_counter() - start
        ids = np.array([[0, 1, args.rows // 2, args.rows - 1]] * 8, np.int64)
        model.fit(ids, np.ones((8, 1), np.float32), batch_size=8, epochs=1,
                  steps_per_epoch=1, verbose=0)
        row_bytes = (DIM * 4 * 3 + 8 if args.optimizer == "lazyadam"
                     else DIM * 4 * 2)
        results["table_and_slots_gb"] = args.rows * row_bytes / 2**30
        results["rss_after_build_gb"] = {k: status_gb(p, "VmRSS") for k, p in pids.items()}
        # Each process' peak since it started: the build and one training step.
        results["peak_after_build_gb"] = {k: status_gb(p, "VmHWM") for k, p in pids.items()}
        print("build and one step: peak RSS " + ", ".join(
            f"{k} {v:.2f} GB" for k, v in results["peak_after_build_gb"].items())
            + f" (table + slots {results['table_and_slots_gb']:.2f} GB, "
            f"{results['table_and_slots_gb'] / 2:.2f} GB per ps)", flush=True)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        prefix = os.path.join(out_dir, "ckpt", "c")
        probe = np.random.default_rng(0).integers(0, args.rows, (1024, 4))
        loaded = []

        def load_model(path):
            loaded.clear()  # free the previous copy on the ps first
            with strategy.scope():
                loaded.append(keras.models.load_model(path))

        operations = {
            "predict": (lambda: model.predict(probe, batch_size=256, verbose=0), None),
            "evaluate": (lambda: model.evaluate(
                probe, np.ones((1024, 1), np.float32), batch_size=256, verbose=0),
                None),
            "checkpoint_save": (lambda: checkpoint.write(prefix),
                                os.path.join(out_dir, "ckpt")),
            "checkpoint_restore": (lambda: checkpoint.read(prefix).assert_consumed(),
                                   os.path.join(out_dir, "ckpt")),
            "save_weights": (lambda: model.save_weights(
                os.path.join(out_dir, "w.weights.h5")),
                os.path.join(out_dir, "w.weights.h5")),
            "load_weights": (lambda: model.load_weights(
                os.path.join(out_dir, "w.weights.h5")),
                os.path.join(out_dir, "w.weights.h5")),
            "model_save": (lambda: model.save(os.path.join(out_dir, "m.keras")),
                           os.path.join(out_dir, "m.keras")),
            "load_weights_keras": (lambda: model.load_weights(
                os.path.join(out_dir, "m.keras")),
                os.path.join(out_dir, "m.keras")),
            "load_model": (lambda: load_model(os.path.join(out_dir, "m.keras")),
                           os.path.join(out_dir, "m.keras")),
        }
        for name in args.ops.split(","):
            fn, path = operations[name]
            before = {k: status_gb(p, "VmRSS") for k, p in pids.items()}
            for p in pids.values():
                reset_peak(p)
            t0, lo0 = time.perf_counter(), lo_bytes()
            error = None
            try:
                fn()
            except Exception as e:  # reported, the next operation still runs
                error = f"{type(e).__name__}: {str(e)[:300]}"
            seconds = time.perf_counter() - t0
            wire_gb = (lo_bytes() - lo0) / 2**30
            peak = {k: status_gb(p, "VmHWM") for k, p in pids.items()}
            gb = size_gb(path) if path and os.path.exists(path) else 0.0
            results["ops"][name] = {
                "seconds": seconds, "file_gb": gb, "loopback_gb": wire_gb,
                "s_per_gb": seconds / gb if gb else None,
                "rss_before_gb": before, "peak_rss_gb": peak,
                "peak_growth_gb": {k: peak[k] - before[k] for k in pids},
                "error": error}
            print(f"{name:18s} {seconds:6.1f} s, {gb:5.2f} GB, wire {wire_gb:.3f} GB"
                  + (f" ({seconds / gb:.1f} s/GB)" if gb else "")
                  + " peak RSS " + ", ".join(f"{k} {peak[k]:.2f} GB (+{peak[k] - before[k]:.2f})"
                                             for k in pids)
                  + (f"  ERROR {error}" if error else ""), flush=True)
    if not args.dir:
        shutil.rmtree(out_dir, ignore_errors=True)
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
