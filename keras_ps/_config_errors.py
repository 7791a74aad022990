"""The keras_ps errors that need no TensorFlow (see keras_ps.errors).

They live apart so the processes that never run TensorFlow code (the elastic
agent, the rendezvous server) and `python -m keras_ps.server` before it starts
TF's server can raise them without importing TensorFlow's Python API.
"""


class KerasPSError(Exception):
    """Base class of every error keras_ps raises on purpose."""


class ClusterConfigError(KerasPSError, ValueError):
    """A cluster spec, TF_CONFIG or resolver that keras_ps cannot use."""


class PartitionerError(KerasPSError, ValueError):
    """A variable partitioner returned a spec keras_ps cannot apply."""


# Shown (and pickled) under the public module that re-exports them.
for _error in (KerasPSError, ClusterConfigError, PartitionerError):
    _error.__module__ = "keras_ps.errors"
del _error
