"""A worker's lifecycle: its states and the moves allowed between them;
and its remote call in flight, with what that call waits on now.

`Worker.transition` (keras_ps/coordinator/worker.py) is the only place a
worker's state changes; it checks each move against `ALLOWED_TRANSITIONS`.
"""

import enum
import time


class WorkerState(enum.Enum):
    JOINING = "joining"  # new member; admitted once it answers
    HEALTHY = "healthy"  # runs closures
    # Runs closures; (re)admitted and its first call not done yet (an error
    # of the function now gets a note on what a re-admission rebuilds).
    READMITTED = "readmitted"
    FAILED = "failed"  # unreachable; its closures go to other workers
    HUNG = "hung"  # a call was given up (no answer); no new trace until it is back
    # A call was given up as stuck: it ran far longer than calls of its
    # function do, on a worker that answers. Its closures go to other
    # workers; re-admitted once the call returns (or its process restarts).
    STUCK = "stuck"
    RECOVERING = "recovering"  # answers again; context and datasets being rebuilt
    # A new member whose address is no worker task's (another service, or a
    # ps): never admitted, asked once; out until its place gets another.
    REFUSED = "refused"
    LEFT = "left"  # no longer a member; its closures go to other workers
    STOPPED = "stopped"  # the coordinator shut down


_S = WorkerState
# States a worker's thread ends in: it takes no closures and is not probed.
GONE = (_S.REFUSED, _S.LEFT, _S.STOPPED)
# States a worker leaves by being re-admitted once it answers.
OUT = (_S.FAILED, _S.HUNG, _S.STUCK)
_ENDS = (_S.LEFT, _S.STOPPED)  # reachable from any state
# Every move a worker may make. REFUSED, LEFT and STOPPED are final (REFUSED
# may still leave, either may be stopped); only a joining worker is
# refused; a move not listed is ignored with a warning.
ALLOWED_TRANSITIONS = {
    _S.JOINING: {_S.RECOVERING, _S.REFUSED, *_ENDS},
    _S.HEALTHY: {*OUT, *_ENDS},
    _S.READMITTED: {_S.HEALTHY, *OUT, *_ENDS},
    _S.FAILED: {_S.RECOVERING, *_ENDS},
    _S.HUNG: {_S.RECOVERING, *_ENDS},
    _S.STUCK: {_S.RECOVERING, *_ENDS},
    _S.RECOVERING: {_S.READMITTED, _S.FAILED, *_ENDS},
    _S.REFUSED: {*_ENDS},
    _S.LEFT: {_S.STOPPED},
    _S.STOPPED: set(),
}
# States in which a worker takes closures.
RUNNABLE = (_S.HEALTHY, _S.READMITTED)
# States in which a worker is part of the cluster definition TF holds.
IN_CLUSTER = (_S.HEALTHY, _S.READMITTED, _S.RECOVERING)


class Call:
    """One remote call in flight: its batch, when it started, its gate hold."""

    def __init__(self, batch):
        self.batch = batch
        self.started = time.monotonic()
        self.gate_hold = None
        self.tracing = False  # in its trace: waits on every worker, not this
        self.settled = False  # its outcome was handled, or it was given up
        self.abandoned = False  # given up by the watchdog
        self.sent = False  # its function was sent to the worker
        self.ran = False  # it ran on the worker; its outputs may be on the way

    def describe(self, index, address):
        """One line for a person reading a warning: the worker, how many
        closures of which function, and what the call waits on now."""
        return (f"worker {index} ({address}): {len(self.batch)} closures of "
                f"'{self.batch[0].name}' {self._doing()}")

    def _doing(self):
        if self.gate_hold is None:
            return "waits for a cluster update to end"
        if self.tracing:
            return "is being traced"
        if self.ran:
            return "copies its outputs back"
        if self.sent:
            return (f"has run on the worker for "
                    f"{time.monotonic() - self.started:.1f}s")
        return "is about to be sent"
