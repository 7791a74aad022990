"""What to do when a closure fails: a pure decision, acted on by the worker.

Failures are classified by exception type only (never by message text), then
confirmed by probing the tasks involved over gRPC.
"""

import enum

import tensorflow as tf

# Errors a lost or restarted task can surface as. Any other error type is the
# user's function failing.
_CONNECTIVITY_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)


class Decision(enum.Enum):
    RETRY_ELSEWHERE = "retry_elsewhere"  # worker lost: requeue, recover worker
    RAISE_PS_FAILURE = "raise_ps_failure"  # a ps is gone: fatal for the job
    RAISE = "raise"  # the user's function failed


def is_connectivity_error(error):
    return isinstance(error, _CONNECTIVITY_ERRORS)


def decide(error, worker_alive, dead_ps, context_lost=False):
    """Returns the Decision for a closure that raised `error`.

    Args:
        error: the exception the remote call raised.
        worker_alive: whether the worker answered a probe after the failure.
        dead_ps: list of ps indices that did not answer a probe.
        context_lost: the worker answers but lost our eager context (it was
            restarted); its state must be rebuilt before it runs again.
    """
    if dead_ps:
        return Decision.RAISE_PS_FAILURE
    if not worker_alive or context_lost or is_connectivity_error(error):
        # A connection error from a worker that answers again means it was
        # restarted (or the network blipped): either way its eager context
        # must be rebuilt before it runs more closures.
        return Decision.RETRY_ELSEWHERE
    return Decision.RAISE
