"""Sidecar evaluation: training plus an evaluator task in its own process.

TensorFlow's parameter-server tutorial evaluates "side by side" with a
sidecar evaluator that reads the checkpoints training writes. This is the
keras_ps version, on Keras 3:

1. the evaluator task starts first, as its own process:
   `python -m keras_ps.evaluator --model_fn THIS_FILE:eval_model ...`
   (TF_CONFIG task type `evaluator`). It holds a plain Keras model (no
   strategy, no cluster) and waits for checkpoints;
2. training (the chief) runs `model.fit` on a local cluster of 2 ps and 2
   workers with an Embedding sharded over both ps, and writes one checkpoint
   per epoch with `keras_ps.callbacks.SidecarCheckpoint`;
3. the evaluator restores each new checkpoint (sharded weights load into its
   unsharded model), evaluates it on held-out data, writes TensorBoard events
   next to training's, exports the best model so far
   (`--export_filepath`, `--monitor`), and stops after the final checkpoint;
4. the exported model is a plain `.keras` file: it is loaded and evaluated
   here without a cluster.

Run:
    python tutorials/sidecar_evaluation.py --epochs 4 --steps_per_epoch 20 \\
        --output_dir /tmp/sidecar
    tensorboard --logdir /tmp/sidecar/logs   # train/ and validation/ curves
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading

# TF's C++ runtime logs every RPC to a task that is gone (at shutdown).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

VOCAB, LENGTH = 64, 6


def data(seed, n):
    """Sequences of LENGTH token ids; the label is 1 when their sum is below
    the middle (a rule the model can learn, so accuracy means something)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    y = (x.sum(1, keepdims=True) < LENGTH * (VOCAB - 1) / 2).astype("float32")
    return x, y


def build_model():
    """The same network for training (sharded, under the strategy's scope)
    and for the evaluator (plain)."""
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy",
                  metrics=["accuracy"], steps_per_execution=5)
    return model


def eval_model():
    """`--model_fn` of the evaluator: (plain compiled model, held-out data)."""
    return build_model(), data(seed=9, n=1024)


def start_evaluator(out):
    """Starts the evaluator task: its own process, as on a real cluster."""
    command = [
        sys.executable, "-m", "keras_ps.evaluator",
        "--model_fn", f"{os.path.abspath(__file__)}:eval_model",
        "--checkpoint_dir", os.path.join(out, "checkpoints"),
        "--log_dir", os.path.join(out, "logs"),
        "--export_filepath", os.path.join(out, "export",
                                          "best-{epoch:02d}.keras"),
        "--monitor", "accuracy", "--mode", "max",
        "--poll_interval", "0.5", "--timeout", "600"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CONFIG=json.dumps(
        {"task": {"type": "evaluator", "index": 0}}))
    print("Evaluator task:", " ".join(command[1:]), flush=True)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines, watching = [], threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "watching" in line:
                watching.set()
        watching.set()  # it exited

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return process, reader, lines, watching


def train(args):
    """The chief: fit on a local cluster, one SidecarCheckpoint per epoch."""
    import keras
    import tensorflow as tf

    import keras_ps

    tf.get_logger().setLevel("ERROR")
    x, y = data(seed=0, n=4096)

    def dataset_fn(context):
        # Runs on each worker: its own part of the data.
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .shuffle(512).batch(32).repeat())

    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        print("Started a local cluster: 2 ps, 2 workers", flush=True)
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=keras_ps.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            model = build_model()
        print("embedding shards:", [tuple(w.shape)
                                    for w in model.layers[0].weights])
        model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=args.epochs,
                  steps_per_epoch=args.steps_per_epoch, verbose=2,
                  callbacks=[
                      keras.callbacks.TensorBoard(
                          os.path.join(args.output_dir, "logs")),
                      keras_ps.callbacks.SidecarCheckpoint(
                          os.path.join(args.output_dir, "checkpoints"),
                          max_to_keep=None)])
        print(f"Training steps: {int(model.optimizer.iterations.numpy())}",
              flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps_per_epoch", type=int, default=20)
    parser.add_argument("--output_dir", default=os.path.join(
        tempfile.gettempdir(), "keras_ps_sidecar"))
    args = parser.parse_args(argv)
    os.environ.pop("TF_CONFIG", None)  # this script runs everything locally

    evaluator, reader, output, watching = start_evaluator(args.output_dir)
    try:
        # Train once the evaluator watches the directory (it imports
        # TensorFlow and builds its model first). A checkpoint that is
        # superseded before the evaluator gets to it is skipped, with a log
        # line: the evaluator always takes the newest.
        watching.wait(120)
        train(args)
        # The evaluator stops by itself after the final checkpoint.
        evaluator.wait(timeout=300)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
        evaluator.wait()
    reader.join(10)  # the rest of its output
    print("Evaluator output:")
    for line in output:
        if line.startswith("keras_ps.evaluator: "):
            print("  " + line)
    if evaluator.returncode != 0:
        print(f"The evaluator failed (exit code {evaluator.returncode})")
        return 1

    # The best model, exported by the evaluator, needs no cluster.
    import keras

    exported = sorted(glob.glob(os.path.join(args.output_dir, "export",
                                             "*.keras")))
    print(f"Exported: {[os.path.basename(p) for p in exported]}")
    best = keras.saving.load_model(exported[-1], compile=False)
    x, y = data(seed=9, n=1024)
    accuracy = float(((best.predict(x, verbose=0) > 0.5) == (y > 0.5)).mean())
    print(f"Best model {os.path.basename(exported[-1])} reloaded without a "
          f"cluster: accuracy {accuracy:.4f} on 1024 held-out examples")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip TF's teardown: it would try to reach the tasks we just stopped.
    os._exit(code)
