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
    RETRY = "retry"  # transient error on a live worker: requeue, stay healthy
    RAISE_PS_FAILURE = "raise_ps_failure"  # a ps is gone: fatal for the job
    RAISE = "raise"  # the user's function failed


def is_connectivity_error(error):
    return isinstance(error, _CONNECTIVITY_ERRORS)


MAX_TRANSIENT_RETRIES = 3


def decide(error, worker_alive, dead_ps, context_lost=False,
           consecutive_failures=1):
    """Returns the Decision for a closure that raised `error`.

    Args:
        error: the exception the remote call raised.
        worker_alive: whether the worker answered a probe after the failure.
        dead_ps: list of ps indices that did not answer a probe.
        context_lost: the worker answers but lost our eager context (it was
            restarted); its state must be rebuilt before it runs again.
        consecutive_failures: failures of this worker in a row, this one
            included.
    """
    if dead_ps:
        return Decision.RAISE_PS_FAILURE
    if not worker_alive or context_lost:
        return Decision.RETRY_ELSEWHERE
    if is_connectivity_error(error):
        # A live worker with a connection error: a blip, or a restart that
        # lost our context. Retry a few times, then rebuild its context.
        if consecutive_failures > MAX_TRANSIENT_RETRIES:
            return Decision.RETRY_ELSEWHERE
        return Decision.RETRY
    return Decision.RAISE
