"""Sidecar evaluation job: the training side, and the evaluator's model_fn.

Usage:
  python tests/_sidecar_job.py train CHECKPOINT_DIR LOG_DIR EPOCHS
      fit on its own LocalCluster (1 ps, 2 workers) with a sharded embedding
      (FixedShardsPartitioner(2)) and SidecarCheckpoint every epoch. Before
      each epoch after the first it waits (60 s at most) until the evaluator
      has logged the previous checkpoint, so every checkpoint gets evaluated.
  python -m keras_ps.evaluator --model_fn tests/_sidecar_job.py:evaluator_model ...
      `evaluator_model()` returns the same network, plain and unsharded, and
      the validation data.
"""

import glob
import logging
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import keras_ps
from _results import say

VOCAB, LENGTH, STEPS = 64, 6, 10




def data(seed=0, n=2048):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    y = (x.sum(1, keepdims=True) < LENGTH * (VOCAB - 1) / 2).astype("float32")
    return x, y


def network():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, activation="sigmoid")])


def compile_model(model):
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy",
                  metrics=["accuracy"], steps_per_execution=2)
    return model


def evaluator_model():
    """model_fn for `python -m keras_ps.evaluator`: (plain model, data)."""
    return compile_model(network()), data(seed=9, n=512)


def evaluated_steps(log_dir):
    """Training steps the evaluator has written events for so far."""
    steps = set()
    for path in glob.glob(os.path.join(log_dir, "validation", "events.*")):
        try:
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                for value in event.summary.value:
                    if value.tag == "evaluation_loss_vs_iterations":
                        steps.add(event.step)
        except tf.errors.DataLossError:
            pass  # a record being appended; read again on the next poll
    return steps


class _Pace(keras.callbacks.Callback):
    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 0:
            return
        step = int(self.model.optimizer.iterations.numpy())
        deadline = time.monotonic() + 60
        while step not in evaluated_steps(self.log_dir):
            if time.monotonic() > deadline:
                print(f"PACE timeout waiting for step {step}", flush=True)
                return
            time.sleep(0.1)


def train(checkpoint_dir, log_dir, epochs):
    x, y = data()

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        return ds.shuffle(256, seed=context.input_pipeline_id).batch(32).repeat()

    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=keras_ps.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            model = compile_model(network())
        shards = len(model.layers[0].weights)
        history = model.fit(
            keras_ps.DatasetCreator(dataset_fn), epochs=epochs,
            steps_per_epoch=STEPS, verbose=0,
            callbacks=[keras_ps.callbacks.SidecarCheckpoint(
                checkpoint_dir, max_to_keep=None), _Pace(log_dir)])
        say(iterations=int(model.optimizer.iterations.numpy()),
            embedding_shards=shards, loss=history.history["loss"])


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], int(sys.argv[4]))
