"""Parameter-server training with a custom training loop, on Keras 3.

The custom-loop half of TensorFlow's parameter-server tutorial
(tensorflow.org/tutorials/distribute/parameter_server_training), with
keras_ps in place of `tf.distribute.ParameterServerStrategy`:

1. a cluster: 2 ps and 2 workers as real local processes (or the cluster in
   TF_CONFIG, when this script runs as the chief of a real cluster);
2. StringLookup preprocessing created under `strategy.scope()` and applied
   inside `dataset_fn`, on the workers;
3. a model whose Embedding is split over both ps by FixedShardsPartitioner;
4. RMSprop and a Keras Accuracy metric, trained by `coordinator.schedule`
   and `coordinator.join`;
5. inline evaluation (scheduled evaluation steps) and exactly-once
   evaluation (one scheduled closure per shard of a finite dataset);
6. a `tf.train.Checkpoint` after every epoch; run the script again with the
   same `--workdir` and it restarts from the last checkpoint.

Run:
    python tutorials/custom_training_loop.py --epochs 4 --steps_per_epoch 5
"""

import argparse
import os
import random
import sys
import tempfile

# TF's C++ runtime logs every RPC to a task that is gone (at shutdown).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ps  # noqa: E402
from keras_ps.partitioners import FixedShardsPartitioner  # noqa: E402

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


def connect(num_workers, num_ps):
    """The cluster: TF_CONFIG's when it is set, else a local one we start."""
    if os.environ.get("TF_CONFIG"):
        return keras_ps.cluster.resolver_from_tf_config(), None
    cluster = keras_ps.LocalCluster(num_workers=num_workers, num_ps=num_ps)
    print(f"Started a local cluster: {num_ps} ps, {num_workers} workers")
    return cluster.resolver, cluster


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps_per_epoch", type=int, default=5)
    parser.add_argument("--eval_examples", type=int, default=160)
    parser.add_argument("--workdir", default=os.path.join(
        tempfile.gettempdir(), "keras_ps_custom_training_loop"))
    args = parser.parse_args(argv)
    tf.get_logger().setLevel("ERROR")
    keras.utils.set_random_seed(0)

    resolver, cluster = connect(num_workers=2, num_ps=2)
    try:
        return train(args, resolver)
    finally:
        if cluster is not None:
            cluster.shutdown()


def train(args, resolver):
    # Variables with 2+ rows are split in 2 shards, one per ps.
    strategy = keras_ps.ParameterServerStrategy(
        resolver, variable_partitioner=FixedShardsPartitioner(num_shards=2))
    coordinator = keras_ps.ClusterCoordinator(strategy)

    # -- preprocessing: created under the scope, used inside dataset_fn ------
    with strategy.scope():
        feature_lookup = keras.layers.StringLookup(
            vocabulary=FEATURE_VOCAB, mask_token=None)
        label_lookup = keras.layers.StringLookup(
            vocabulary=LABEL_VOCAB, num_oov_indices=0, mask_token=None)

    examples = feature_and_label_gen(num_examples=200, seed=0)

    def preprocess(x):
        return ({"features": feature_lookup(x["features"])},
                label_lookup(x["label"]))

    def dataset_fn(context):
        # Runs on each worker; `context` says which one (for sharding files).
        del context
        return (tf.data.Dataset.from_tensor_slices(examples)
                .map(preprocess).shuffle(200).batch(32).repeat())

    # -- the model: its variables live on the ps ------------------------------
    with strategy.scope():
        model_input = keras.Input(shape=(3,), dtype="int64", name="features")
        embedding = keras.layers.Embedding(
            input_dim=feature_lookup.vocabulary_size(), output_dim=16384)
        pooled = keras.ops.mean(embedding(model_input), axis=1)
        output = keras.layers.Dense(
            1, activation="sigmoid",
            kernel_regularizer=keras.regularizers.L2(1e-4))(pooled)
        model = keras.Model({"features": model_input}, output)
        optimizer = keras.optimizers.RMSprop(learning_rate=0.1)
        accuracy = keras.metrics.Accuracy()
        epoch_counter = tf.Variable(0, dtype=tf.int64, name="epoch")

    # 8 rows (7 heroes + 1 out-of-vocabulary) split 4 + 4 over the two ps.
    print("embedding shards:", [(tuple(w.shape), w.value.device.split("/")[1])
                                for w in embedding.weights])

    # -- checkpoint, and restart from it ---------------------------------------
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                     epoch=epoch_counter)
    manager = tf.train.CheckpointManager(
        checkpoint, os.path.join(args.workdir, "ckpt"), max_to_keep=2)
    if manager.latest_checkpoint:
        # The optimizer is not built yet: its slots (RMSprop's, one per shard,
        # on the shard's ps) are filled from the checkpoint when the first
        # step builds it, as in plain Keras.
        checkpoint.restore(manager.latest_checkpoint) \
            .assert_existing_objects_matched()
        print(f"Restored {manager.latest_checkpoint} at epoch "
              f"{int(epoch_counter.numpy())}")

    # -- the training step -------------------------------------------------------
    loss_fn = keras.losses.BinaryCrossentropy(reduction=None)

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                loss = tf.nn.compute_average_loss(loss_fn(labels, pred))
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(
                        tf.add_n(model.losses))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            accuracy.update_state(labels, tf.cast(pred > 0.5, tf.int64))
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    start_epoch = int(epoch_counter.numpy())
    for epoch in range(start_epoch, args.epochs):
        accuracy.reset_state()
        for _ in range(args.steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()  # wait at epoch boundaries
        epoch_counter.assign(epoch + 1)
        path = manager.save()
        print(f"Finished epoch {epoch}, accuracy is "
              f"{accuracy.result().numpy():.6f} (saved {os.path.basename(path)})")

    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    print(f"Final loss is {loss.fetch():.6f}")
    print(f"Training steps: {int(optimizer.iterations.numpy())}")

    # -- inline evaluation: scheduled evaluation steps ---------------------------
    eval_examples = feature_and_label_gen(args.eval_examples, seed=1)
    with strategy.scope():
        eval_accuracy = keras.metrics.Accuracy()  # lives on a ps

    @tf.function
    def eval_step(iterator):
        batch_data, labels = next(iterator)
        pred = model(batch_data, training=False)
        eval_accuracy.update_state(labels, tf.cast(pred > 0.5, tf.int64))

    def eval_dataset_fn(context):
        del context
        return (tf.data.Dataset.from_tensor_slices(eval_examples)
                .map(preprocess).shuffle(16).repeat().batch(8))

    eval_iterator = iter(coordinator.create_per_worker_dataset(eval_dataset_fn))
    for _ in range(args.eval_examples // 8):
        coordinator.schedule(eval_step, args=(eval_iterator,))
    coordinator.join()
    print(f"Inline evaluation accuracy: {eval_accuracy.result().numpy():.6f}")

    # -- exactly-once evaluation: one scheduled closure per shard ---------------
    # Each closure evaluates its whole shard with local counters and returns
    # them; the coordinator adds each closure's result once. A closure whose
    # worker dies is run again elsewhere, and only its final result counts, so
    # no example is counted twice. (`model.evaluate` without `steps` does the
    # same for a compiled model.) Preprocessing runs on the coordinator here,
    # as the data are small and travel to the workers with the closure.
    features, labels = preprocess({
        "features": tf.constant(eval_examples["features"]),
        "label": tf.constant(eval_examples["label"])})
    num_shards = 4 * strategy.num_workers

    @tf.function
    def eval_shard(shard_index):
        dataset = tf.data.Dataset.from_tensor_slices((features, labels))
        correct = tf.constant(0, tf.int64)
        count = tf.constant(0, tf.int64)
        for batch_data, batch_labels in dataset.shard(
                num_shards, shard_index).batch(8):
            pred = tf.cast(model(batch_data, training=False) > 0.5, tf.int64)
            correct += tf.reduce_sum(
                tf.cast(tf.equal(pred, batch_labels), tf.int64))
            count += tf.shape(batch_labels, out_type=tf.int64)[0]
        return correct, count

    results = [coordinator.schedule(eval_shard, args=(tf.constant(i, tf.int64),))
               for i in range(num_shards)]
    coordinator.join()
    correct = sum(int(r.fetch()[0]) for r in results)
    seen = sum(int(r.fetch()[1]) for r in results)
    print(f"Exactly-once evaluation: accuracy {correct / seen:.6f} on "
          f"{seen} examples (of {args.eval_examples}) in {num_shards} shards")
    coordinator.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip TF's teardown: it would try to reach the tasks we just stopped.
    os._exit(code)
