"""The cluster coordinator: scheduling, retries and per-worker values.

Modules: `coordinator` (the public ClusterCoordinator), `closures` (the
queue), `packing` (several calls in one remote call), `worker` (one thread
per worker task), `worker_states` (its states and moves), `worker_services`
(all a worker uses of the coordinator), `membership` (the workers by index:
who joins, leaves, is healthy), `failure_handling` (the failure policy,
re-admission), `ps_addresses` (where a lost ps answers again),
`watchdog` (calls that never return: hung and stuck ones),
`datasets` (per-worker datasets), `iterator_release` (the iterators of
earlier calls), `worker_context` (the worker's index inside a function),
`values` (RemoteValue), `config` (settings), `gate` (calls vs cluster
updates).
"""

from keras_ps.strategy._per_worker import PerWorkerValues
from keras_ps.coordinator.coordinator import ClusterCoordinator
from keras_ps.coordinator.values import RemoteValue
from keras_ps.coordinator.values import RemoteValueStatus
from keras_ps.coordinator.worker import WorkerState
from keras_ps.coordinator.worker_context import num_workers
from keras_ps.coordinator.worker_context import worker_index

__all__ = [
    "ClusterCoordinator",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
    "WorkerState",
    "num_workers",
    "worker_index",
]
