"""Fault injection shared by the test jobs (coordinator processes)."""

import json
import os
import subprocess
import sys

import keras


def start_task(spec, job, index, log=None, flags=(), **env):
    """Starts task `job`:`index` of `spec` ({job: [address, ...]}) with
    `python -m keras_ps.server` and its `flags`, outside any LocalCluster (as
    a replacement machine would), its output into `log` (a file) and with
    `env` added to this process' environment; it ends with this process."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_ps.server", "--cluster_spec",
         json.dumps(spec), "--job_name", job, "--task_index", str(index),
         "--exit_with_parent", *flags], stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
        env=dict(os.environ, **env))


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
