"""The cluster coordinator: scheduling, retries and per-worker values."""

from keras_ps.coordinator.coordinator import ClusterCoordinator
from keras_ps.coordinator.coordinator import num_workers
from keras_ps.coordinator.coordinator import worker_index
from keras_ps.coordinator.values import PerWorkerValues
from keras_ps.coordinator.values import RemoteValue
from keras_ps.coordinator.values import RemoteValueStatus
from keras_ps.coordinator.worker import WorkerState

__all__ = [
    "ClusterCoordinator",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
    "WorkerState",
    "num_workers",
    "worker_index",
]
