"""Fault injection shared by the test jobs (coordinator processes)."""

import keras


class KillAndRestartPs(keras.callbacks.Callback):
    """SIGKILLs ps 0 of `cluster` (a LocalCluster) and starts it again on its
    address at once, as a restart policy would, at the end of batch `at`
    (epoch, batch); `done` says it happened."""

    def __init__(self, cluster, at):
        super().__init__()
        self.cluster, self.at, self.done, self._epoch = cluster, at, False, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self.at and not self.done:
            self.done = True
            self.cluster.kill("ps", 0)
            self.cluster.restart("ps", 0)
            print("KILLED AND RESTARTED ps 0", flush=True)
