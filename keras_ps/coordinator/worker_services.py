"""All a worker thread uses of its coordinator, in one frozen dataclass.

`Worker` (worker.py) sees the rest of the coordinator only through this;
`ClusterCoordinator` (coordinator.py) builds it once and hands the same one
to every worker.
"""

import dataclasses
from typing import Callable

from keras_ps.coordinator.closures import ClosureQueue
from keras_ps.coordinator.config import CoordinatorConfig
from keras_ps.coordinator.cut_off import CutOffWorkers
from keras_ps.coordinator.failure_handling import Readmission
from keras_ps.coordinator.gate import SharedExclusiveLock
from keras_ps.coordinator.packing import PackedFunctions


@dataclasses.dataclass(frozen=True)
class WorkerServices:
    """All a worker thread uses of its coordinator.

    Attributes:
        queue: the closures to run.
        packing: the packed functions.
        gate: held shared during every remote call.
        readmission: re-admits this worker when it answers again.
        cut_off: the workers whose calls fail on a connection while they
            and every ps answer (rounds, waits before re-admission).
        config: the coordinator's settings.
        num_workers: () -> the number of worker places.
        num_healthy: () -> how many workers take closures now.
        dead_ps: () -> {index: address} of ps tasks that do not answer a probe.
        trace_is_safe: () -> False while some worker may be hung.
        on_admitted: called when this worker is (re)admitted.
        local_device: the coordinator's device, where results are copied.
    """

    queue: ClosureQueue
    packing: PackedFunctions
    gate: SharedExclusiveLock
    readmission: Readmission
    cut_off: CutOffWorkers
    config: CoordinatorConfig
    num_workers: Callable[[], int]
    num_healthy: Callable[[], int]
    dead_ps: Callable[[], dict]
    trace_is_safe: Callable[[], bool]
    on_admitted: Callable[[], None]
    local_device: str
