"""A worker's lifecycle: its states and the moves allowed between them.

`Worker.transition` (keras_ps/coordinator/worker.py) is the only place a
worker's state changes; it checks each move against `ALLOWED_TRANSITIONS`.
"""

import enum


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
