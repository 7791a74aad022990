"""The keras_ps error hierarchy.

Every error class keras_ps defines derives from `KerasPSError`, so a user can
catch them all at once: the ones here, the rendezvous' (rooted in
`keras_ps.elastic.RendezvousError`) and the sidecar evaluator's
(`SidecarTimeoutError`, `CheckpointMismatchError`). Each also derives from
the standard error it stands for (`ClusterConfigError` is a `ValueError`,
`ParameterServerUnavailableError` a `tf.errors.UnavailableError`), so code
written against TF's native strategy keeps working. All are picklable.

A bad argument to a function or constructor raises Python's own `ValueError`
or `TypeError`, as Keras does; the message names the argument, what was
received and what is expected.
"""

import tensorflow as tf

from keras_ps._base_errors import BackupDirInUseError  # noqa: F401
from keras_ps._base_errors import BackupWriteError  # noqa: F401
from keras_ps._base_errors import CheckpointMismatchError  # noqa: F401
from keras_ps._base_errors import ClusterConfigError  # noqa: F401
from keras_ps._base_errors import KerasPSError
from keras_ps._base_errors import LoadedFunctionError  # noqa: F401
from keras_ps._base_errors import PartitionerError  # noqa: F401
from keras_ps._base_errors import RepeatedFailureError  # noqa: F401
from keras_ps._base_errors import ScheduleUsageError  # noqa: F401
from keras_ps._base_errors import SidecarTimeoutError  # noqa: F401


class _TFErrorMixin(KerasPSError):
    """Makes a `tf.errors.OpError` subclass picklable with its message."""

    def __reduce__(self):
        return (type(self), (self.message,))


class ParameterServerUnavailableError(_TFErrorMixin, tf.errors.UnavailableError):
    """A parameter server was lost (unreachable, or restarted without the
    variables this job placed there).

    PS tasks hold the model's state, so no step is retried around them.
    `Model.fit` with `keras_ps.callbacks.BackupAndRestore` recovers in the
    same call once the ps answers again; a custom loop calls
    `coordinator.recover_parameter_servers()` and restores its checkpoint.
    Otherwise restart the job and resume from the last checkpoint.
    """

    def __init__(self, message):
        super().__init__(None, None, message)


class ParameterServerRecoveryError(ParameterServerUnavailableError):
    """A lost parameter server could not be given its variables back: it
    did not answer again within `KERAS_PS_PS_RECOVERY_TIMEOUT` seconds, or
    the calls in flight at its loss did not end. Final: `Model.fit` stops
    recovering and raises it; restart the job (the message says what else
    to check) and resume from the last backup.
    """


class ClusterUnreachableError(_TFErrorMixin, tf.errors.UnavailableError):
    """Some task did not answer when the strategy connected to the cluster."""

    def __init__(self, message):
        super().__init__(None, None, message)


class NoWorkersAvailableError(_TFErrorMixin, tf.errors.UnavailableError):
    """No worker can train: every worker has been unreachable for longer
    than `KERAS_PS_NO_WORKER_TIMEOUT`, or every worker's calls have failed on
    a connection to a ps that the coordinator reaches (cut off by the
    network) for `KERAS_PS_CUT_OFF_TIMEOUT` seconds."""

    def __init__(self, message):
        super().__init__(None, None, message)


class ClosureCancelledError(_TFErrorMixin, tf.errors.CancelledError):
    """A scheduled function was cancelled because another one failed first."""

    def __init__(self, message):
        super().__init__(None, None, message)


class ClosureInputError(_TFErrorMixin, tf.errors.InvalidArgumentError):
    """A scheduled function's input is a RemoteValue whose function failed."""

    def __init__(self, message):
        super().__init__(None, None, message)


class StuckCallError(_TFErrorMixin, tf.errors.DeadlineExceededError):
    """A scheduled call was given up as stuck on two workers that answer.

    Each time it ran far longer than calls of its function had (or than
    `KERAS_PS_STUCK_TIMEOUT`), while its worker and every ps answered: the
    function itself most likely blocks (a read that never returns). The
    message names the function, the workers and what to do.
    """

    def __init__(self, message):
        super().__init__(None, None, message)


class BackupCorruptError(_TFErrorMixin, tf.errors.DataLossError):
    """A file of a backup is missing, truncated or altered.

    The message names the file. `keras_ps.IncrementalBackup.restore` then
    falls back to the newest backup whose files are all intact (unless
    asked not to), and `keras_ps.callbacks.BackupAndRestore` does the same;
    a backup written as a Keras weights file falls back to the one before
    it with `double_checkpoint=True`, and is raised otherwise.
    """

    def __init__(self, message):
        super().__init__(None, None, message)
