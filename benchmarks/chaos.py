"""Fault injection under Model.fit: real processes, real signals.

Runs Model.fit on a LocalCluster (2 ps, 3 workers) while a chaos thread
repeatedly SIGKILLs a random worker and restarts it after a random delay, and
SIGSTOPs a worker for longer than the hang timeout before SIGCONT. Then runs
the same number of epochs undisturbed and compares. Report (stdout and, with
--out, a markdown file):

- steps planned vs `optimizer.iterations` (only at-least-once slack allowed:
  a lost in-flight packed execution may run twice);
- final loss/accuracy vs the undisturbed run;
- per failure: seconds from the signal to the worker counted failed, to the
  other workers running closures again, and from restart (or SIGCONT) to the
  worker running steps again;
- coordinator memory (RSS) before the first failure and after the last.

    .venv/bin/python benchmarks/chaos.py --kills 6 --stops 2 --out benchmarks/CHAOS.md

tests/system/test_chaos.py runs a short version (1 kill, 1 stop) in the suite
and a long one (8 kills, 3 stops) apart (-m slow).
"""

import argparse
import json
import logging
import os
import random
import sys
import threading
import time

# Short enough that a SIGSTOP longer than it fits a quick run.
os.environ.setdefault("KERAS_PS_HANG_TIMEOUT", "3")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ps  # noqa: E402
from keras_ps.coordinator import WorkerState  # noqa: E402

STEPS_PER_EPOCH, PER_EXECUTION, BATCH = 50, 2, 64
NUM_WORKERS = 3


def _data(seed, n=8192):
    """A known rule: label 1 when the first half of the features outweighs
    the second half."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).astype("float32")[:, None]
    return x, y


def _build(strategy):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.Adam(0.005), "binary_crossentropy",
                      metrics=["accuracy"], steps_per_execution=PER_EXECUTION)
    return model


def _dataset_creator(step_ms):
    from tensorflow.python.data.experimental.ops import testing

    x, y = _data(seed=0)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        ds = ds.shuffle(1024, seed=context.input_pipeline_id).batch(BATCH)
        # Paces the steps so the chaos has a run to disturb.
        return ds.repeat().apply(testing.sleep(step_ms * 1000))

    return keras_ps.DatasetCreator(dataset_fn)


def _wait(condition, timeout, poll=0.01):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


class Chaos(threading.Thread):
    """Kills/stops workers in a random order; records what each cost."""

    def __init__(self, cluster, coordinator, kills, stops, seed, hang_timeout):
        super().__init__(daemon=True, name="chaos")
        self.cluster, self.coordinator = cluster, coordinator
        self.plan = ["kill"] * kills + ["stop"] * stops
        self.rng = random.Random(seed)
        self.rng.shuffle(self.plan)
        self.hang_timeout = hang_timeout
        self.events, self.error = [], None
        self.rss_before = self.rss_after = None
        self.finished = threading.Event()

    def run(self):
        try:
            self.rss_before = _rss_mb()
            # Faults in training, not in its start: until every worker ran a
            # step, the step function is being traced, and a new function
            # waits for a stopped worker to register it (a TF limit, in
            # docs/known_limits.md), which holds every worker at the start.
            if not _wait(lambda: all(w.closures_run > 0
                                     for w in self.coordinator.workers), 300):
                raise RuntimeError("not every worker ran a step in 300s")
            for kind in self.plan:
                time.sleep(self.rng.uniform(1.0, 2.5))  # let training run
                index = self.rng.randrange(NUM_WORKERS)
                self.events.append(self._one(kind, index))
            self.rss_after = _rss_mb()
        except Exception as error:  # reported, never swallowed
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.finished.set()

    def _others_ran(self, index):
        return sum(w.closures_run for i, w in enumerate(self.coordinator.workers)
                   if i != index)

    def _one(self, kind, index):
        worker = self.coordinator.workers[index]
        event = {"kind": kind, "worker": index}
        start = time.monotonic()
        if kind == "kill":
            self.cluster.kill("worker", index)
        else:
            self.cluster.pause("worker", index)
        timeout = 60 + self.hang_timeout
        if _wait(lambda: worker.state is not WorkerState.HEALTHY, timeout):
            event["failed_after_s"] = round(time.monotonic() - start, 2)
            others = self._others_ran(index)
            if _wait(lambda: self._others_ran(index) > others, 60):
                event["others_running_after_s"] = round(
                    time.monotonic() - start, 2)
        if kind == "kill":
            time.sleep(self.rng.uniform(0.5, 2.0))  # the restart delay
            back = time.monotonic()
            self.cluster.restart("worker", index)
        else:
            # Stopped beyond the hang timeout, then continued.
            time.sleep(max(0.0, self.hang_timeout + 1 - (time.monotonic() - start)))
            back = time.monotonic()
            self.cluster.resume("worker", index)
        ran = worker.closures_run
        if _wait(lambda: worker.state is WorkerState.HEALTHY
                 and worker.closures_run > ran, 90):
            event["running_again_after_s"] = round(time.monotonic() - back, 2)
        return event


class _StopWhenDone(keras.callbacks.Callback):
    """Starts the chaos with training; ends training at the first epoch end
    after the chaos finished (a fixed plan, not a fixed time)."""

    def __init__(self, make_chaos):
        super().__init__()
        self.make_chaos, self.chaos = make_chaos, None

    def on_train_begin(self, logs=None):
        self.chaos = self.make_chaos()
        self.chaos.start()

    def on_epoch_end(self, epoch, logs=None):
        if self.chaos.finished.is_set():
            self.model.stop_training = True


def _rss_mb():
    return round(psutil.Process().memory_info().rss / 2**20, 1)


def _evaluate(model):
    x, y = _data(seed=7, n=2048)
    return model.evaluate(x, y, batch_size=256, verbose=0, return_dict=True)


def _fit(epochs, step_ms, chaos_args=None):
    with keras_ps.LocalCluster(num_workers=NUM_WORKERS, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = _build(strategy)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        callbacks = []
        if chaos_args is not None:
            stopper = _StopWhenDone(lambda: Chaos(cluster, coordinator,
                                                  **chaos_args))
            callbacks.append(stopper)
        started = time.monotonic()
        history = model.fit(_dataset_creator(step_ms), epochs=epochs,
                            steps_per_epoch=STEPS_PER_EPOCH,
                            callbacks=callbacks, verbose=0)
        seconds = time.monotonic() - started
        result = {
            "epochs": len(history.epoch),
            "planned_steps": len(history.epoch) * STEPS_PER_EPOCH,
            "iterations": int(model.optimizer.iterations.numpy()),
            "seconds": round(seconds, 1),
            "per_worker_closures": [w.closures_run for w in coordinator.workers],
            "states": [w.state.value for w in coordinator.workers],
            **{f"final_{k}": round(float(v), 4)
               for k, v in _evaluate(model).items()},
        }
        if chaos_args is not None:
            chaos = stopper.chaos
            result.update(events=chaos.events, chaos_error=chaos.error,
                          rss_mb_before=chaos.rss_before,
                          rss_mb_after=chaos.rss_after)
        return result


def run(kills, stops, seed, step_ms, max_epochs=200):
    hang_timeout = float(os.environ["KERAS_PS_HANG_TIMEOUT"])
    disturbed = _fit(max_epochs, step_ms, dict(
        kills=kills, stops=stops, seed=seed, hang_timeout=hang_timeout))
    undisturbed = _fit(disturbed["epochs"], step_ms)
    failures = kills + stops
    return {"machine_cores": os.cpu_count(), "hang_timeout_s": hang_timeout,
            "failures": failures, "per_execution": PER_EXECUTION,
            "disturbed": disturbed, "undisturbed": undisturbed}


def _markdown(report):
    d, u = report["disturbed"], report["undisturbed"]
    lines = [
        "# Chaos run (benchmarks/chaos.py)",
        "",
        f"{report['machine_cores']} cores; 2 ps, {NUM_WORKERS} workers; "
        f"hang timeout {report['hang_timeout_s']} s; "
        f"{report['failures']} failures.",
        "",
        "| | disturbed | undisturbed |",
        "|---|---|---|",
        f"| epochs | {d['epochs']} | {u['epochs']} |",
        f"| steps planned | {d['planned_steps']} | {u['planned_steps']} |",
        f"| optimizer.iterations | {d['iterations']} | {u['iterations']} |",
        f"| final loss | {d['final_loss']} | {u['final_loss']} |",
        f"| final accuracy | {d['final_accuracy']} | {u['final_accuracy']} |",
        f"| wall seconds | {d['seconds']} | {u['seconds']} |",
        "",
        f"Coordinator RSS: {d['rss_mb_before']} MB before the first failure, "
        f"{d['rss_mb_after']} MB after the last.",
        "",
        "| # | signal | worker | counted failed (s) | others running (s) "
        "| running again after restart/SIGCONT (s) |",
        "|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(d["events"]):
        lines.append(
            f"| {i} | {'SIGKILL' if e['kind'] == 'kill' else 'SIGSTOP'} "
            f"| {e['worker']} | {e.get('failed_after_s', 'never')} "
            f"| {e.get('others_running_after_s', 'never')} "
            f"| {e.get('running_again_after_s', 'never')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--stops", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step_ms", type=int, default=20,
                        help="input sleep per batch (paces the steps)")
    parser.add_argument("--out", help="also write the report as markdown")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tf.get_logger().setLevel("ERROR")
    report = run(args.kills, args.stops, args.seed, args.step_ms)
    print("RESULT " + json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
