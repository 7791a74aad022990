"""A coordinator process for tests of keras_ps' C++ kernels (keras_ps/_native)
where they cannot be used; prints RESULT lines the test reads.

Usage: python tests/_native_job.py no_compiler|tasks_without_kernels|
       worker_stopped_when_asked
       python tests/_native_job.py back_without_kernels ps|worker BACKUP_DIR
"""

import logging
import os
import sys
import time

import numpy as np
import tensorflow as tf

import keras
import keras_ps
from keras_ps import _native
from _kills import start_task
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


class _ReplaceWithoutKernels(keras.callbacks.Callback):
    """At AT (epoch, batch), SIGKILLs `job`:0 and starts it again on its
    address as a server without keras_ps' kernels (KERAS_PS_NATIVE=0), as
    a replacement machine of another keras_ps version would be."""

    AT = (0, 13)
    AGAIN_AT = (1, 13)

    def __init__(self, cluster, job, warnings, again=False):
        super().__init__()
        self.cluster, self.job, self.process = cluster, job, None
        self.warnings, self.again, self.with_kernels = warnings, again, None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if epoch == 1:
            # A replaced worker is re-admitted when its server answers; the
            # other worker could end fit first. Epoch 1 waits for it, so
            # that its steps run on the new server too.
            deadline = time.monotonic() + 120
            while not any("came back without" in w for w in self.warnings):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.job}:0 was not taken back "
                                       "within 120 s")
                time.sleep(0.1)
            self.run_before = keras_ps.ClusterCoordinator(
                self.model.distribute_strategy).workers[0].closures_run

    def on_train_batch_end(self, batch, logs=None):
        if self.process is None and (self._epoch, batch) >= self.AT:
            self.cluster.kill(self.job, 0)
            self.process = start_task(self.cluster.spec, self.job, 0,
                                      KERAS_PS_NATIVE="0")
        elif (self.again and self.with_kernels is None
              and (self._epoch, batch) >= self.AGAIN_AT):
            # Replaced in turn, by a server with the kernels.
            self.process.kill()
            self.process.wait()
            self.with_kernels = start_task(self.cluster.spec, self.job, 0)


def back_without_kernels(job, backup_dir, again=""):
    """LazyAdam on a table split over 2 ps, incremental backups; `job`:0
    is replaced mid-fit by a server without the kernels the step functions
    and the backups' writers were traced with; with `again` ("again"),
    that server is replaced in turn in epoch 1 by one with them."""
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("keras_ps").addHandler(handler)
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=keras_ps.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            model = _model()
            model.compile(optimizer=keras_ps.optimizers.LazyAdam(0.05),
                          loss="mse", steps_per_execution=2)
        traced_with_kernels = _native.kernels_for(strategy) is not None
        x, y = _data()

        def dataset_fn(context):
            return tf.data.Dataset.from_tensor_slices((x, y)).shard(
                context.num_input_pipelines,
                context.input_pipeline_id).batch(8).repeat()

        replace = _ReplaceWithoutKernels(cluster, job, warnings,
                                         again == "again")
        try:
            history = model.fit(
                keras_ps.DatasetCreator(dataset_fn), epochs=2,
                steps_per_epoch=40, verbose=0, callbacks=[
                    replace, keras_ps.callbacks.BackupAndRestore(
                        backup_dir, save_freq=8, incremental=True)])
        finally:
            for process in (replace.process, replace.with_kernels):
                if process is not None:
                    process.kill()
                    process.wait()
        say(traced_with_kernels=traced_with_kernels,
            for_strategy=_native.kernels_for(strategy) is not None,
            iterations=int(model.optimizer.iterations.numpy()), planned=80,
            loss=float(history.history["loss"][-1]),
            recoveries=history.history.get("ps_recoveries"),
            came_back=[w for w in warnings if "came back without" in w],
            kernels_again=[w for w in warnings if "kernels again" in w],
            worker_0_ran_after=keras_ps.ClusterCoordinator(strategy).workers[
                0].closures_run - replace.run_before)


if __name__ == "__main__":
    {"no_compiler": no_compiler,
     "tasks_without_kernels": tasks_without_kernels,
     "worker_stopped_when_asked": worker_stopped_when_asked,
     "back_without_kernels": back_without_kernels}[sys.argv[1]](*sys.argv[2:])
