"""A coordinator process for the network-cut tests; prints one JSON line.

Usage: python tests/_cut_off_job.py HOLD_SECONDS [drop]

On its own LocalCluster (2 workers, 2 ps), with real firewall rules
(tests/_kills.py NetworkCut: worker processes' packets to ps 0's port are
rejected, every other path works, the coordinator's included):

1. A custom loop (`coordinator.schedule`, a step that adds 1 to a variable
   on each ps): worker 1 is cut off from ps 0 for HOLD_SECONDS of steps,
   then healed; steps go on until worker 1 has run 20 more. Reports the
   re-admissions and failed calls of worker 1 while it was cut, the
   coordinator's warnings, the steps scheduled and the variables' values.
2. Model.fit: at batch 4 of epoch 1, both workers are cut off from ps 0 for
   good. Reports what fit raised and how long after the cut
   (KERAS_PS_CUT_OFF_TIMEOUT comes from the test).
With `drop`, only 1, its packets dropped without an answer instead
(KERAS_PS_PEER_TIMEOUT comes from the test).
"""

import logging
import sys
import time

import tensorflow as tf

import keras
import keras_ps
from _fit_job import build
from _fit_job import dataset_creator
from _kills import NetworkCut
from _results import say


class _Log(logging.Handler):
    """Keeps the messages of keras_ps' coordinator from INFO up."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []
        for name in ("keras_ps.coordinator.worker",
                     "keras_ps.coordinator.failure_handling",
                     "keras_ps.coordinator.cut_off"):
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def count(self, text):
        return sum(text in m for m in self.messages)


def _steps(coordinator, step, iterator, n=20):
    for _ in range(n):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    return n


def custom_loop(cluster, strategy, log, hold, drop=False):
    coordinator = keras_ps.ClusterCoordinator(strategy)
    with strategy.scope():
        on_ps0 = tf.Variable(0.0)  # variables go to the ps in turn
        on_ps1 = tf.Variable(0.0)
    devices = [on_ps0.device, on_ps1.device]
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors(1.0).repeat()))

    @tf.function
    def step(it):
        x = next(it)
        on_ps0.assign_add(x)
        on_ps1.assign_add(x)
        return x

    worker = coordinator.workers[1]
    scheduled = 0
    deadline = time.monotonic() + 60
    while worker.closures_run < 20 and time.monotonic() < deadline:
        scheduled += _steps(coordinator, step, iterator)
    ran_before = worker.closures_run
    port = int(cluster.address("ps", 0).rsplit(":", 1)[1])
    readmitted_before = log.count("[worker:1] rebuilt in")
    cut = NetworkCut([cluster.pid("worker", 1)], port, drop=drop)
    try:
        cut_at = time.monotonic()
        while time.monotonic() - cut_at < hold:  # the fault lasts `hold` s
            scheduled += _steps(coordinator, step, iterator)
    finally:
        cut.heal()
    readmitted_while_cut = log.count("[worker:1] rebuilt in") - \
        readmitted_before
    ran_while_cut = worker.closures_run - ran_before
    back = worker.closures_run
    deadline = time.monotonic() + 120
    while worker.closures_run < back + 20 and time.monotonic() < deadline:
        scheduled += _steps(coordinator, step, iterator)
    return dict(scheduled=scheduled, on_ps0=float(on_ps0.numpy()),
                on_ps1=float(on_ps1.numpy()), devices=devices,
                readmitted_while_cut=readmitted_while_cut,
                failed_calls=log.count("[worker:1] closure failed with"),
                max_pack=coordinator.max_pack,
                ran_while_cut=ran_while_cut,
                ran_after_heal=worker.closures_run - back,
                state=worker.state.value)


class _CutBoth(keras.callbacks.Callback):
    """Cuts both workers off from ps 0 at batch 4 of epoch 1, for good."""

    def __init__(self, cluster):
        super().__init__()
        self.cluster, self.cut, self.at, self._epoch = cluster, None, None, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 1 and batch >= 4 and self.cut is None:
            port = int(self.cluster.address("ps", 0).rsplit(":", 1)[1])
            self.cut = NetworkCut([self.cluster.pid("worker", i)
                                   for i in (0, 1)], port)
            self.at = time.monotonic()


def fit_cut_off(cluster, strategy):
    model = build(strategy)
    callback = _CutBoth(cluster)
    raised = message = None
    try:
        model.fit(dataset_creator(), epochs=3, steps_per_epoch=40,
                  callbacks=[callback], verbose=0)
    except Exception as error:  # reported to the test
        raised, message = type(error).__name__, str(error)
    finally:
        if callback.cut is not None:
            callback.cut.heal()
    return dict(raised=raised, message=message,
                seconds=None if callback.at is None
                else time.monotonic() - callback.at)


def main(hold, drop):
    log = _Log()
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        report = custom_loop(cluster, strategy, log, hold, drop)
        if not drop:
            report.update(fit=fit_cut_off(cluster, strategy))
        report.update(workers=[cluster.address("worker", i) for i in (0, 1)],
                      warnings=[m for m in log.messages
                                if "cut off" in m or "runs calls again" in m])
        say(**report)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2:] == ["drop"])
