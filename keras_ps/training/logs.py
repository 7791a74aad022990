"""Batch-level logs of scheduled executions, fetched only when read.

Keras passes `logs` to every `on_*_batch_end`. Here they are a read-only
mapping over the execution's RemoteValue: a callback that reads a value waits
for that execution (and gets real numbers); a callback that ignores the logs
costs no synchronisation, so the coordinator keeps many steps in flight.
"""

import collections
import threading

import numpy as np

from keras_ps.coordinator.values import RemoteValueStatus


def python_logs(logs):
    """Metric results as Python floats (arrays stay arrays), in their order."""
    out = {}
    for key, value in logs.items():
        value = np.asarray(value)
        out[key] = float(value) if value.size == 1 else value
    return out


class StepLogsTracker:
    """Remembers the newest logs that have arrived, for the progress bar."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = collections.deque()
        self._latest = {}

    def add(self, step_logs):
        with self._lock:
            self._pending.append(step_logs)

    def resolved(self, values):
        with self._lock:
            self._latest = values

    def latest(self):
        """The newest logs already in, without waiting (empty at first)."""
        while True:
            with self._lock:
                if not self._pending:
                    return dict(self._latest)
                head = self._pending[0]
                status = head.remote_value.status
                if status is RemoteValueStatus.PENDING:
                    return dict(self._latest)
                self._pending.popleft()
            if status is RemoteValueStatus.READY:
                head._resolve()


class StepLogs(dict):
    """The logs of one scheduled execution; reading them waits for it.

    A `dict` (Keras callbacks such as TensorBoard check for one) whose
    contents are fetched on first read. Raises, on first read, what the
    execution raised (e.g. `tf.errors.CancelledError`).
    """

    def __init__(self, remote_value, tracker):
        super().__init__()
        self.remote_value = remote_value
        self.tracker = tracker
        self._resolved = False
        tracker.add(self)

    def _resolve(self):
        if not self._resolved:
            values = python_logs(dict(sorted(self.remote_value.fetch().items())))
            dict.update(self, values)
            self._resolved = True
            self.tracker.resolved(values)
        return self

    def __getitem__(self, key):
        return dict.__getitem__(self._resolve(), key)

    def __iter__(self):
        return dict.__iter__(self._resolve())

    def __len__(self):
        return dict.__len__(self._resolve())

    def __contains__(self, key):
        return dict.__contains__(self._resolve(), key)

    def get(self, key, default=None):
        return dict.get(self._resolve(), key, default)

    def keys(self):
        return dict.keys(self._resolve())

    def values(self):
        return dict.values(self._resolve())

    def items(self):
        return dict.items(self._resolve())

    def copy(self):
        return dict(self.items())

    def __repr__(self):
        if not self._resolved:
            return f"<StepLogs {self.remote_value.status.value}>"
        return dict.__repr__(self)
