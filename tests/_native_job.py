"""A coordinator process for tests of keras_ps' C++ kernels (keras_ps/_native)
where they cannot be used; prints RESULT lines the test reads.

Usage: python tests/_native_job.py no_compiler|tasks_without_kernels|
       worker_stopped_when_asked
"""

import logging
import os
import sys

import numpy as np
import tensorflow as tf

import keras
import keras_ps
from keras_ps import _native
from _results import say


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((2,), dtype="int64"),
        keras.layers.Embedding(100, 8),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras_ps.optimizers.LazyAdam(0.05), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 100, (64, 2)).astype("int64"),
            rng.normal(size=(64, 1)).astype("float32"))


def no_compiler():
    """$CXX names no compiler (the test sets it): LazyAdam trains with TF's
    ops, in this process, and the build is not tried again."""
    model = _model()
    before = model.layers[0].embeddings.numpy().copy()
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    try:
        _native.build()
        again = None
    except _native.NativeBuildError as error:
        again = str(error)
    say(library=_native.library() is not None,
        rows_changed=int((model.layers[0].embeddings.numpy() != before)
                         .any(axis=1).sum()),
        loss=float(history.history["loss"][-1]), build_again=again)


def tasks_without_kernels():
    """The tasks do not load the kernels (KERAS_PS_NATIVE=0 in their
    environment only): this process has them, yet LazyAdam's graph must use
    TF's ops, or no task could run it."""
    with keras_ps.LocalCluster(num_workers=1, num_ps=1,
                               env={"KERAS_PS_NATIVE": "0"}) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            model = _model()
        x, y = _data()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
        history = model.fit(dataset, epochs=1, steps_per_epoch=4, verbose=0)
        with open(os.path.join(cluster.log_dir, "ps-0.log")) as f:
            ps_log = f.read()
        say(library=_native.library() is not None,
            for_strategy=_native.kernels_for(strategy) is not None,
            iterations=int(model.optimizer.iterations.numpy()),
            loss=float(history.history["loss"][-1]), ps_log=ps_log)


def worker_stopped_when_asked():
    """Worker 1 is stopped (SIGSTOP) when the coordinator asks every task
    whether it loaded the kernels: the stopped one does not answer, is not
    counted, and the question returns after ASK_TIMEOUT_S."""
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("keras_ps._native").addHandler(handler)
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        stopped = "/job:worker/replica:0/task:1/device:CPU:0"
        # Every op sent so far has run (none waits on worker 1 when it stops).
        with tf.device(stopped):
            tf.constant(0).numpy()
        cluster.pause("worker", 1)
        try:
            for_strategy = _native.kernels_for(strategy) is not None
            on_stopped = _native.kernels_on([stopped]) is not None
        finally:
            cluster.resume("worker", 1)
        say(for_strategy=for_strategy, on_stopped=on_stopped,
            not_answered=[w for w in warnings if "did not answer within" in w])


if __name__ == "__main__":
    {"no_compiler": no_compiler,
     "tasks_without_kernels": tasks_without_kernels,
     "worker_stopped_when_asked": worker_stopped_when_asked}[sys.argv[1]]()
