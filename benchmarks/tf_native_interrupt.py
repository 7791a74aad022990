"""What TF's native path does with the steps of a `fit` that Ctrl-C ends:
tf_keras' fit under TF's ParameterServerStrategy is interrupted (SIGINT, as
Ctrl-C sends it) one second into a long epoch; the optimizer's step count is
read at the interrupt and again after `coordinator.join()`. A higher count
after the join means the steps it had scheduled ran on. (keras_ps' fit
cancels them: tests/fit/test_fit_raised.py.)

Needs tf_keras (`pip install "tf_keras>=2.21,<2.22"`):

    .venv/bin/python benchmarks/tf_native_interrupt.py
"""

import json
import os
import signal
import threading

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TF is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import keras_ps  # noqa: E402  (its LocalCluster: plain tf.distribute.Server tasks)

RECORDS = 1024


def dataset_fn(context):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(RECORDS, 4)).astype("float32")
    y = rng.normal(size=(RECORDS, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(1).repeat()


def main():
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.spec), rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator \
            .ClusterCoordinator(strategy)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(1)])
            model.compile("sgd", "mse", steps_per_execution=2)
        creator = keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(creator, epochs=1, steps_per_epoch=8, verbose=0)  # traces
        timer = threading.Timer(
            1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            model.fit(creator, epochs=1, steps_per_epoch=20000, verbose=0)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        at_interrupt = int(model.optimizer.iterations.numpy())
        coordinator.join()
        print(json.dumps({
            "interrupted": interrupted,
            "iterations_at_interrupt": at_interrupt,
            "iterations_after_join": int(model.optimizer.iterations.numpy())}))


if __name__ == "__main__":
    main()
