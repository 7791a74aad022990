"""The keras_ps errors that need no TensorFlow (all re-exported, and
documented, by keras_ps.errors).

They live apart so the processes that never run TensorFlow code (the elastic
agent, the rendezvous server) and `python -m keras_ps.server` before it starts
TF's server can raise them without importing TensorFlow's Python API; the
errors derived from `tf.errors` are in keras_ps.errors itself.
"""


class KerasPSError(Exception):
    """Base class of every error keras_ps raises on purpose."""


class ClusterConfigError(KerasPSError, ValueError):
    """A cluster spec, TF_CONFIG or resolver that keras_ps cannot use."""


class PartitionerError(KerasPSError, ValueError):
    """A variable partitioner returned a spec keras_ps cannot apply."""


class ScheduleUsageError(KerasPSError, TypeError, ValueError):
    """A coordinator API used in a way it cannot run: a function given to
    `schedule` that is not a `tf.function`, a `RemoteValue` passed as its
    argument, a distributed dataset iterated on the coordinator.

    TF's coordinator raises `ValueError` for these; keras_ps raised
    `TypeError` (the type of the argument is wrong). This error is both, so
    code written against either catches it.
    """


class RepeatedFailureError(KerasPSError, RuntimeError):
    """A worker was restarted again right after each of its last
    re-admissions (this job's context on it was gone at its first call):
    re-admitting it cannot help, so the failure is raised instead of
    retried forever."""


class SidecarTimeoutError(KerasPSError, TimeoutError):
    """No new checkpoint appeared within the evaluator's `timeout`."""


class CheckpointMismatchError(KerasPSError, ValueError):
    """A checkpoint's weights do not fit the evaluator's model."""


class LoadedFunctionError(KerasPSError, ValueError):
    """A function loaded from a SavedModel writes a variable that
    `tf.saved_model.load` made sharded (under a `variable_partitioner`):
    traced with one variable, it cannot update shards (a function that only
    reads one runs). TF raises a `ValueError` for the same call; this is
    one, naming the variable and how to load to call it."""


class BackupWriteError(KerasPSError, OSError):
    """A backup could not be written (its volume is full, or not writable).

    Nothing of it was published and its files were removed: the newest
    backup before it still restores. The message names the directory, the
    reason and the fix.
    """


class BackupDirInUseError(KerasPSError, RuntimeError):
    """Another training job holds the backup directory's lock.

    `keras_ps.callbacks.BackupAndRestore` locks its `backup_dir` while `fit`
    runs, and `keras_ps.IncrementalBackup` its directory from its first
    operation until `close()`, so that two jobs never write backups into
    one directory and restore each other's. The message names the
    directory, the job holding it (its pid and host) and the fix.
    """


# Shown (and pickled) under the public module that re-exports them.
for _error in (KerasPSError, ClusterConfigError, PartitionerError,
               ScheduleUsageError, RepeatedFailureError, SidecarTimeoutError,
               CheckpointMismatchError, BackupWriteError,
               LoadedFunctionError, BackupDirInUseError):
    _error.__module__ = "keras_ps.errors"
del _error
