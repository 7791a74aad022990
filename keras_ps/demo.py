"""`python -m keras_ps.demo` (or `./run.sh demo`): the README's first command.

Starts a local cluster of real processes (2 ps, 2 workers) and a sidecar
evaluator process, trains a Keras model with `Model.fit` whose embedding table
is sharded over both ps, SIGKILLs one worker halfway, shows training carry on
with the other (and the killed worker restarted and re-admitted), prints the
evaluator's results and a summary.

The data follow a known rule: an example is (item, user) and its label is 1
when the item id is even and the user id is in the lower half. Always
answering 0 scores 0.75, so an accuracy near 1 means the model learned the
rule through its sharded embedding.
"""

import argparse
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

# TF's C++ runtime logs every RPC to a task that is gone (the killed worker,
# and every task at shutdown); the demo's own output says what happened.
# (`python -m keras_ps.demo` has imported TF with keras_ps already, so this
# reaches the tasks it starts; main() moves this process' stderr to a file.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NUM_ITEMS, NUM_USERS, EMBEDDING_DIM = 2000, 1000, 16
# What always answering 0 scores: a quarter of the labels are 1.
BASELINE_ACCURACY = 0.75
_EVAL_PREFIX = "keras_ps.evaluator: "


def examples(seed, n):
    """`n` examples of the rule: x = [item, NUM_ITEMS + user], y = label."""
    import tensorflow as tf

    item = tf.random.stateless_uniform([n], [seed, 0], 0, NUM_ITEMS, tf.int32)
    user = tf.random.stateless_uniform([n], [seed, 1], 0, NUM_USERS, tf.int32)
    label = tf.cast((item % 2 == 0) & (user < NUM_USERS // 2), tf.float32)
    return tf.stack([item, NUM_ITEMS + user], axis=1), label[:, None]


def build_model(steps_per_execution=1):
    """The network: one embedding table for items and users, then an MLP."""
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((2,), dtype="int32"),
        keras.layers.Embedding(NUM_ITEMS + NUM_USERS, EMBEDDING_DIM,
                               name="embedding"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def evaluator_model():
    """`--model_fn` of the evaluator task: the plain model and held-out data."""
    x, y = examples(seed=10**6, n=4096)
    return build_model(), (x.numpy(), y.numpy())


def _start_evaluator(checkpoint_dir, log_dir, export_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               TF_CONFIG=json.dumps({"task": {"type": "evaluator", "index": 0}}))
    return subprocess.Popen(
        [sys.executable, "-m", "keras_ps.evaluator",
         "--model_fn", "keras_ps.demo:evaluator_model",
         "--checkpoint_dir", checkpoint_dir, "--log_dir", log_dir,
         "--export_filepath", export_path, "--monitor", "accuracy",
         "--mode", "max", "--poll_interval", "0.5", "--timeout", "600"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class _EvaluatorOutput:
    """Collects the evaluator's result lines on a thread; `drain` returns
    those not shown yet."""

    def __init__(self, process):
        self.lines = queue.Queue()
        self.done = {}
        self.accuracy = None
        self._thread = threading.Thread(target=self._read, args=(process,),
                                        daemon=True)
        self._thread.start()

    def _read(self, process):
        for line in process.stdout:
            line = line.rstrip("\n")
            if not line.startswith(_EVAL_PREFIX):
                continue
            text = line[len(_EVAL_PREFIX):]
            if text.startswith("done "):
                self.done = json.loads(text[len("done "):])
            elif text.startswith("[evaluator] evaluated checkpoint"):
                for field in text.split():
                    if field.startswith("accuracy="):
                        self.accuracy = float(field.split("=", 1)[1])
                self.lines.put(text)
            elif text.startswith("[evaluator] skipped"):
                self.lines.put(text)

    def drain(self):
        out = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                return out

    def join(self, timeout):
        self._thread.join(timeout)


def _show(lines):
    for line in lines:
        print(f"  evaluator: {line}", flush=True)


def _demo_callback(cluster, coordinator, evaluator_output, kill_at_step,
                   restart, steps_per_epoch):
    # TF (and so Keras and keras_ps' coordinator) is imported only after the
    # evaluator process has started: see _run.
    import keras

    from keras_ps.coordinator import WorkerState

    class Demo(keras.callbacks.Callback):
        """Shows the evaluator's lines between epochs; kills (and restarts)
        a worker once `kill_at_step` global steps are done."""

        def __init__(self):
            super().__init__()
            self.killed_at = None
            self.restart_thread = None
            self.training = True

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            _show(evaluator_output.drain())

        def on_train_batch_end(self, batch, logs=None):
            done = self._epoch * steps_per_epoch + batch + 1
            if kill_at_step is None or self.killed_at is not None or \
                    done < kill_at_step:
                return
            cluster.kill("worker", 1)
            self.killed_at = done
            print(f"\n>>> step {done}: killed worker 1 (SIGKILL); its steps "
                  "move to worker 0 and training continues", flush=True)
            if restart:
                self.restart_thread = threading.Thread(
                    target=self._restart, daemon=True)
                self.restart_thread.start()

        def _restart(self):
            # Restart only once the coordinator has seen the loss, so the
            # demo shows one worker carrying on alone first.
            coordinator.workers[1].wait_for_state(WorkerState.FAILED,
                                                  timeout=60)
            cluster.restart("worker", 1)
            print("\n>>> restarted worker 1 on the same address; the "
                  "coordinator re-admits it when it answers", flush=True)
            if coordinator.workers[1].wait_until_runnable(timeout=120) and \
                    self.training:
                print("\n>>> worker 1 re-admitted: it runs steps again",
                      flush=True)

        def on_train_end(self, logs=None):
            self.training = False

    return Demo()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="keras_ps.demo")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps_per_epoch", type=int, default=120)
    parser.add_argument("--steps_per_execution", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output_dir",
                        help="checkpoints, TensorBoard logs, the exported "
                        "model and task logs (default: a new temporary "
                        "directory)")
    parser.add_argument("--no-kill", action="store_true",
                        help="do not kill a worker halfway")
    parser.add_argument("--no-restart", action="store_true",
                        help="do not restart the killed worker")
    args = parser.parse_args(argv)
    for flag in ("epochs", "steps_per_epoch", "steps_per_execution", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be a positive integer. Received: "
                         f"--{flag}={getattr(args, flag)}.")
    if args.output_dir and os.path.isdir(args.output_dir) and \
            os.listdir(args.output_dir):
        # Old checkpoints there would be evaluated and resumed as this run's.
        parser.error(f"--output_dir {args.output_dir} is not empty; pass a "
                     "new or empty directory (or leave it out for a new "
                     "temporary one)")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    out = args.output_dir or tempfile.mkdtemp(prefix="keras_ps_demo_")
    checkpoint_dir = os.path.join(out, "checkpoints")
    log_dir = os.path.join(out, "tensorboard")
    export_path = os.path.join(out, "best.keras")
    task_logs = os.path.join(out, "task_logs")
    os.makedirs(task_logs, exist_ok=True)

    print("Starting a local cluster: 2 ps, 2 workers, 1 evaluator "
          f"(output in {out})", flush=True)
    # TF's C++ logs (every RPC to the killed worker, to every task at
    # shutdown) go to a file; errors are printed to the terminal below.
    terminal_stderr = _stderr_to(os.path.join(task_logs, "coordinator.log"))
    try:
        return _run(args, checkpoint_dir, log_dir, export_path, task_logs)
    except BaseException:
        import traceback
        os.write(terminal_stderr, traceback.format_exc().encode())
        os.write(terminal_stderr, f"(TF's log: {task_logs}/coordinator.log)\n"
                 .encode())
        return 1


def _stderr_to(path):
    """Points file descriptor 2 at `path`; returns a copy of the old one."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    return saved


def _wait_for_evaluator(evaluator, evaluator_output):
    print("Waiting for the evaluator to evaluate the final checkpoint...",
          flush=True)
    try:
        evaluator.wait(timeout=120)
    except subprocess.TimeoutExpired:
        evaluator.kill()
        evaluator.wait()
    evaluator_output.join(10)
    _show(evaluator_output.drain())


def _summary(args, steps, elapsed, coordinator, demo, history, evaluator,
             evaluator_output, paths):
    from keras_ps.coordinator import WorkerState  # TF imported by now

    print("\nSummary")
    print(f"  steps: {steps} in {elapsed:.1f}s ({steps / elapsed:.1f} "
          f"steps/s, {args.batch} examples per step)")
    for w in coordinator.workers:
        note = ""
        if demo.killed_at is not None and w.index == 1:
            note = (f" (killed at step {demo.killed_at}"
                    + (", restarted" if demo.restart_thread else "") + ")")
        state = w.state.value
        if w.state is WorkerState.READMITTED:
            # Runnable, but no call of it had ended when training did.
            state = "re-admitted, training ended before its next call"
        print(f"  worker {w.index}: "
              f"{w.closures_run * args.steps_per_execution} steps, "
              f"{state}{note}")
    train_accuracy = history.history["accuracy"][-1]
    print(f"  training accuracy (last epoch): {train_accuracy:.3f}")
    if evaluator_output.accuracy is not None:
        print("  final accuracy (evaluator, held-out data): "
              f"{evaluator_output.accuracy:.3f} "
              f"(always 0 would score {BASELINE_ACCURACY:.2f})")
    else:
        print("  final accuracy (evaluator, held-out data): none "
              f"(evaluator exit code {evaluator.returncode})")
    print(f"  checkpoints: {paths['checkpoints']}")
    print(f"  best model (exported by the evaluator): {paths['export']}")
    print(f"  TensorBoard logs: {paths['tensorboard']}  "
          f"(tensorboard --logdir {paths['tensorboard']})")
    print(f"  task logs: {paths['task_logs']}")
    sys.stdout.flush()


def _run(args, checkpoint_dir, log_dir, export_path, task_logs):
    # The evaluator imports TF while the cluster starts; it waits for the
    # first checkpoint.
    evaluator = _start_evaluator(checkpoint_dir, log_dir, export_path)
    evaluator_output = _EvaluatorOutput(evaluator)

    # Imported now, not at the top: TF's import (about 2 s) overlaps the
    # evaluator's start, and `--help` needs no TF.
    import keras
    import tensorflow as tf

    import keras_ps

    # Each pack size of the step function is its own trace; TF's retracing
    # warning is noise here.
    tf.get_logger().setLevel("ERROR")
    cluster = keras_ps.LocalCluster(num_workers=2, num_ps=2, log_dir=task_logs)
    try:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=keras_ps.tables.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            model = build_model(args.steps_per_execution)
        shards = model.get_layer("embedding").embeddings.variables
        print(f"Embedding {NUM_ITEMS + NUM_USERS} x {EMBEDDING_DIM} sharded "
              "over the ps: " + ", ".join(
                  f"{tuple(v.shape)} on ps:{tf.DeviceSpec.from_string(v.device).task}"
                  for v in shards), flush=True)
        print("Data rule: label = item id even and user id < "
              f"{NUM_USERS // 2} (always answering 0 scores "
              f"{BASELINE_ACCURACY:.2f})", flush=True)

        def dataset_fn(context):
            seeds = tf.data.Dataset.range(context.input_pipeline_id, 10**9,
                                          context.num_input_pipelines)
            return seeds.map(lambda s: examples(tf.cast(s, tf.int32),
                                                args.batch)).prefetch(2)

        coordinator = keras_ps.ClusterCoordinator(strategy)
        total = args.epochs * args.steps_per_epoch
        demo = _demo_callback(
            cluster, coordinator, evaluator_output,
            kill_at_step=None if args.no_kill else total // 2,
            restart=not args.no_restart, steps_per_epoch=args.steps_per_epoch)
        callbacks = [
            demo,
            keras_ps.callbacks.SidecarCheckpoint(checkpoint_dir,
                                                 max_to_keep=None),
            keras.callbacks.TensorBoard(log_dir, update_freq="epoch"),
        ]
        start = time.perf_counter()
        history = model.fit(keras_ps.DatasetCreator(dataset_fn),
                            epochs=args.epochs,
                            steps_per_epoch=args.steps_per_epoch,
                            callbacks=callbacks, verbose=1)
        elapsed = time.perf_counter() - start
        steps = int(model.optimizer.iterations.numpy())
        if demo.restart_thread is not None:
            # The summary shows worker 1 back: wait for its re-admission
            # (bounded: the thread gives up after 60 + 120 s).
            demo.restart_thread.join(200)

        _wait_for_evaluator(evaluator, evaluator_output)
        _summary(args, steps, elapsed, coordinator, demo, history,
                 evaluator, evaluator_output,
                 dict(checkpoints=checkpoint_dir, export=export_path,
                      tensorboard=log_dir, task_logs=task_logs))
        coordinator.shutdown()
        return 0 if evaluator_output.accuracy is not None else 1
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
        cluster.shutdown()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip TF's teardown: it would try to reach the tasks we just stopped.
    os._exit(code)
