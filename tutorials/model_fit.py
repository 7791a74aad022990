"""Parameter-server training with Keras 3 `Model.fit`.

The Model.fit half of TensorFlow's parameter-server tutorial
(tensorflow.org/tutorials/distribute/parameter_server_training), on Keras 3
with keras_ps in place of `tf.distribute.ParameterServerStrategy`:

1. a cluster: 2 ps and 2 workers as real local processes, or the cluster in
   TF_CONFIG (this one script plays every role of a real cluster: see
   `run_task` and tutorials/real_cluster.md);
2. StringLookup preprocessing created under `strategy.scope()` and applied
   inside the DatasetCreator's `dataset_fn`, on the workers;
3. a model whose Embedding is split over both ps by FixedShardsPartitioner,
   compiled with `steps_per_execution`;
4. `model.fit` with TensorBoard, ModelCheckpoint and keras_ps'
   BackupAndRestore (kill this script and start it again with the same
   `--workdir`: it resumes from the last backup; stop it with SIGTERM, as
   `docker stop` or a preemption notice does, and it first writes a backup
   at the next step, so it resumes there);
5. exactly-once `model.evaluate`, and the saved `.keras` file loaded as a
   plain Keras model, with no cluster;
6. checkpoints for a sidecar evaluator (`keras_ps.callbacks.SidecarCheckpoint`);
   the evaluator task runs `python -m keras_ps.evaluator --model_fn
   tutorials/model_fit.py:eval_model --checkpoint_dir WORKDIR/sidecar`.

With `--input shards` the data are TFRecord files read through
`keras_ps.ShardedInput`: the coordinator hands the files out one at a time
to whichever worker is free, every record is trained once per epoch (even if
a worker dies, hangs, joins or leaves), and `fit` needs no
`steps_per_epoch`: an epoch is every file once.

Run:
    python tutorials/model_fit.py --epochs 5 --steps_per_epoch 20
    python tutorials/model_fit.py --epochs 5 --input shards
"""

import argparse
import glob
import json
import logging
import os
import random
import sys
import tempfile

# TF's C++ runtime logs every RPC to a task that is gone (at shutdown).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

FEATURE_VOCAB = ["avenger", "ironman", "batman", "hulk", "spiderman",
                 "kingkong", "wonder_woman"]
LABEL_VOCAB = ["yes", "no"]


def feature_and_label_gen(num_examples, seed):
    """The tutorial's toy data: 3 distinct heroes; the label is "yes" when
    "avenger" is one of them."""
    rng = random.Random(seed)
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = rng.sample(FEATURE_VOCAB, 3)
        examples["features"].append(features)
        examples["label"].append(["yes"] if "avenger" in features else ["no"])
    return examples


def task_type():
    """This process' role: TF_CONFIG's task type, or "chief" without it."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return "chief"
    return json.loads(raw).get("task", {}).get("type", "chief")


def run_task(role, args):
    """Every role of a real cluster runs this script (as TF's guide shows);
    all but the chief just serve."""
    if role in ("ps", "worker"):
        from keras_ps import server

        return server.main([])  # serves TF_CONFIG's task until SIGTERM
    if role == "evaluator":
        from keras_ps import evaluator

        return evaluator.main([
            "--model_fn", f"{os.path.abspath(__file__)}:eval_model",
            "--checkpoint_dir", os.path.join(args.workdir, "sidecar"),
            "--log_dir", os.path.join(args.workdir, "logs")])
    return None  # the chief trains


def build_model(vocabulary_size):
    """The model: an Embedding (split over the ps under the tutorial's
    strategy) averaged over the 3 heroes, and a logistic output."""
    import keras

    model_input = keras.Input(shape=(3,), dtype="int64", name="features")
    embedding = keras.layers.Embedding(input_dim=vocabulary_size,
                                       output_dim=16384)
    pooled = keras.layers.GlobalAveragePooling1D()(embedding(model_input))
    output = keras.layers.Dense(1, activation="sigmoid")(pooled)
    return keras.Model({"features": model_input}, output)


def preprocessing():
    """StringLookup layers for the features and the label."""
    import keras

    feature_lookup = keras.layers.StringLookup(
        vocabulary=FEATURE_VOCAB, mask_token=None)
    label_lookup = keras.layers.StringLookup(
        vocabulary=LABEL_VOCAB, num_oov_indices=0, mask_token=None)

    def preprocess(x):
        return ({"features": feature_lookup(x["features"])},
                label_lookup(x["label"]))

    return feature_lookup, preprocess


def eval_dataset(preprocess, num_examples):
    """Held-out examples, preprocessed on this process, as a finite dataset."""
    import tensorflow as tf

    examples = feature_and_label_gen(num_examples, seed=1)
    features, labels = preprocess({
        "features": tf.constant(examples["features"]),
        "label": tf.constant(examples["label"])})
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)


def eval_model():
    """For the sidecar evaluator: a plain (unsharded) model and its data."""
    feature_lookup, preprocess = preprocessing()
    model = build_model(feature_lookup.vocabulary_size())
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    return model, eval_dataset(preprocess, 200)


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps_per_epoch", type=int, default=20)
    parser.add_argument("--steps_per_execution", type=int, default=10)
    parser.add_argument("--backup_freq", default="epoch",
                        help='BackupAndRestore save_freq: "epoch" or a step count')
    parser.add_argument("--eval_examples", type=int, default=200)
    parser.add_argument("--input", choices=["dataset_fn", "shards"],
                        default="dataset_fn",
                        help="a DatasetCreator (each worker reads its part) "
                        "or TFRecord files handed out as dynamic shards")
    parser.add_argument("--workdir", default=os.path.join(
        tempfile.gettempdir(), "keras_ps_model_fit"))
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    code = run_task(task_type(), args)
    if code is not None:
        return code

    import tensorflow as tf

    import keras_ps

    tf.get_logger().setLevel("ERROR")
    # keras_ps' own log lines: workers failing and re-admitted, backups
    # written and restored (a few lines per event, none per step).
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("keras_ps").setLevel(logging.INFO)
    if os.environ.get("TF_CONFIG"):
        resolver, cluster = keras_ps.cluster.resolver_from_tf_config(), None
    else:
        cluster = keras_ps.LocalCluster(num_workers=2, num_ps=2)
        resolver = cluster.resolver
        print("Started a local cluster: 2 ps, 2 workers")
    try:
        return train(args, resolver)
    finally:
        if cluster is not None:
            cluster.shutdown()


def sharded_input(examples, preprocess, workdir, num_files=8):
    """The examples as TFRecord files, read as dynamic shards.

    The data are stated once (the files) with how to read one file
    (`read_fn`, run on whichever worker the coordinator hands the file to).
    """
    import tensorflow as tf

    import keras_ps

    data_dir = os.path.join(workdir, "data")
    os.makedirs(data_dir, exist_ok=True)
    files = [os.path.join(data_dir, f"train-{i:02d}.tfrecord")
             for i in range(num_files)]
    count = len(examples["label"])
    for i, path in enumerate(files):
        with tf.io.TFRecordWriter(path) as writer:
            for j in range(i * count // num_files, (i + 1) * count // num_files):
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature={
                        key: tf.train.Feature(bytes_list=tf.train.BytesList(
                            value=[v.encode() for v in examples[key][j]]))
                        for key in ("features", "label")})).SerializeToString())

    spec = {"features": tf.io.FixedLenFeature([3], tf.string),
            "label": tf.io.FixedLenFeature([1], tf.string)}

    def read_fn(filename):
        # One file's records, parsed and preprocessed (no batching: the
        # ShardedInput batches, shard by shard).
        return tf.data.TFRecordDataset(filename).map(
            lambda record: preprocess(tf.io.parse_single_example(record, spec)))

    return keras_ps.ShardedInput(files, read_fn=read_fn, batch_size=32, seed=0)


def train(args, resolver):
    import keras
    import tensorflow as tf

    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner

    keras.utils.set_random_seed(0)
    strategy = keras_ps.ParameterServerStrategy(
        resolver, variable_partitioner=FixedShardsPartitioner(num_shards=2))

    # -- preprocessing: created under the scope, used inside dataset_fn ------
    with strategy.scope():
        feature_lookup, preprocess = preprocessing()

    examples = feature_and_label_gen(num_examples=1000, seed=0)

    def dataset_fn(context):
        # Runs on each worker: read this worker's part of the data.
        return (tf.data.Dataset.from_tensor_slices(examples)
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .map(preprocess).shuffle(200).batch(32).repeat().prefetch(2))

    # -- the model: its variables live on the ps ------------------------------
    with strategy.scope():
        model = build_model(feature_lookup.vocabulary_size())
        model.compile(keras.optimizers.RMSprop(learning_rate=0.01),
                      loss="binary_crossentropy", metrics=["accuracy"],
                      steps_per_execution=args.steps_per_execution)
    embedding = next(layer for layer in model.layers
                     if isinstance(layer, keras.layers.Embedding))
    # 8 rows (7 heroes + 1 out-of-vocabulary) split 4 + 4 over the two ps.
    print("embedding shards:", [(tuple(w.shape), w.value.device.split("/")[1])
                                for w in embedding.weights])

    # -- fit ---------------------------------------------------------------------
    log_dir = os.path.join(args.workdir, "logs")
    ckpt_dir = os.path.join(args.workdir, "ckpt")
    backup_dir = os.path.join(args.workdir, "backup")
    backup_freq = (args.backup_freq if args.backup_freq == "epoch"
                   else int(args.backup_freq))
    os.makedirs(ckpt_dir, exist_ok=True)
    callbacks = [
        keras.callbacks.TensorBoard(log_dir=log_dir),
        keras.callbacks.ModelCheckpoint(
            os.path.join(ckpt_dir, "model-{epoch:02d}.keras")),
        keras_ps.callbacks.BackupAndRestore(backup_dir, save_freq=backup_freq,
                                            save_before_preemption=True),
        # For the sidecar evaluator (the evaluator task), if one runs.
        keras_ps.callbacks.SidecarCheckpoint(
            os.path.join(args.workdir, "sidecar")),
    ]
    if args.input == "shards":
        history = model.fit(sharded_input(examples, preprocess, args.workdir),
                            epochs=args.epochs, callbacks=callbacks, verbose=2)
        # Each epoch's logs count the shards and records it trained.
        print(f"Records trained per epoch: "
              f"{[int(n) for n in history.history['records_trained']]} "
              f"({int(history.history['shards'][-1])} files); "
              f"{int(sum(history.history['records_retrained']))} trained "
              "twice")
    else:
        history = model.fit(keras_ps.DatasetCreator(dataset_fn),
                            epochs=args.epochs,
                            steps_per_epoch=args.steps_per_epoch,
                            callbacks=callbacks, verbose=2)
    print(f"Training steps: {int(model.optimizer.iterations.numpy())}")
    # What each worker ran in this process (a restarted chief counts anew).
    workers = keras_ps.ClusterCoordinator(strategy).workers
    print("Steps per worker: " + ", ".join(
        f"worker {w.index}: {w.closures_run * args.steps_per_execution} "
        f"({w.state.value})" for w in workers))
    if history.history:
        print(f"Final training accuracy: {history.history['accuracy'][-1]:.4f}")

    # -- exactly-once evaluation ---------------------------------------------------
    # A finite dataset and no `steps`: every example is evaluated once, on
    # the workers, even if one of them dies meanwhile.
    eval_data = eval_dataset(preprocess, args.eval_examples)
    logs = model.evaluate(eval_data, verbose=0, return_dict=True)
    print(f"Evaluation accuracy: {logs['accuracy']:.4f} "
          f"on {args.eval_examples} examples")

    # -- the checkpoint is a plain Keras model ----------------------------------------
    saved = sorted(glob.glob(os.path.join(ckpt_dir, "*.keras")))
    print(f"TensorBoard logs: {log_dir}")
    print(f"Checkpoints: {[os.path.basename(p) for p in saved]}")
    if saved:
        # Sharded weights were saved whole: no strategy needed to load them.
        plain = keras.models.load_model(saved[-1])
        plain_logs = plain.evaluate(eval_data, verbose=0, return_dict=True)
        print(f"Reloaded {os.path.basename(saved[-1])} without a cluster: "
              f"accuracy {plain_logs['accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip TF's teardown: it would try to reach the tasks we just stopped.
    os._exit(code)
