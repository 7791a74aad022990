"""A coordinator process for the vanished-machine tests; prints one JSON line.

Usage: python tests/_vanish_job.py

On its own LocalCluster (2 workers, 2 ps), worker 1's machine vanishes for
good: every packet to or from its port is dropped (tests/_kills.py Vanish)
and its process is SIGKILLed, so no reset tells anyone; it never comes back.

1. Model.fit: it vanishes at batch 30 of epoch 1, when fit hands its steps
   to 2 steps an iteration, a function traced on the way (TF registers each
   new function on every worker). Reports the steps trained against those
   planned and the seconds from the loss to fit's end.
2. A custom loop on the same coordinator: a function never traced before,
   scheduled 8 times (its trace is registered on every worker, the
   vanished one too). Reports the values it returned and what the variable
   holds.
KERAS_PS_PEER_TIMEOUT and the hang timeout come from the test.
"""

import logging
import time

import tensorflow as tf

import keras
import keras_ps
from _fit_job import build
from _fit_job import dataset_creator
from _kills import Vanish
from _results import say

STEPS, EPOCHS, AT_BATCH = 60, 3, 30


class _Vanish(keras.callbacks.Callback):
    def __init__(self, cluster):
        super().__init__()
        self.cluster, self.vanish, self.at, self._epoch = cluster, None, None, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 1 and batch >= AT_BATCH and self.vanish is None:
            address = self.cluster.address("worker", 1)
            self.vanish = Vanish(int(address.rsplit(":", 1)[1]))
            self.cluster.kill("worker", 1)
            self.at = time.monotonic()


def fit_losing_a_machine(cluster, strategy):
    model = build(strategy)
    callback = _Vanish(cluster)
    model.fit(dataset_creator(), epochs=EPOCHS, steps_per_epoch=STEPS,
              callbacks=[callback], verbose=0)
    return dict(iterations=int(model.optimizer.iterations.numpy()),
                planned=EPOCHS * STEPS, vanished=callback.vanish is not None,
                seconds=time.monotonic() - callback.at), callback.vanish


def new_function_while_gone(strategy):
    coordinator = keras_ps.ClusterCoordinator(strategy)
    with strategy.scope():
        total = tf.Variable(0.0)

    @tf.function
    def step(x):
        total.assign_add(x)
        return x * 2.0

    started = time.monotonic()
    results = [coordinator.schedule(step, args=(float(i),)) for i in range(8)]
    coordinator.join()
    return dict(values=[float(r.fetch()) for r in results],
                total=float(total.numpy()),
                seconds=time.monotonic() - started,
                states=[w.state.value for w in coordinator.workers])


def main():
    messages = []

    class _Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("keras_ps.cluster._dead_peers").setLevel(logging.INFO)
    logging.getLogger("keras_ps.cluster._dead_peers").addHandler(_Keep())
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        vanish = None
        try:
            fit, vanish = fit_losing_a_machine(cluster, strategy)
            loop = new_function_while_gone(strategy)
        finally:
            if vanish is not None:
                vanish.heal()
        say(fit=fit, loop=loop, told=messages)


if __name__ == "__main__":
    main()
