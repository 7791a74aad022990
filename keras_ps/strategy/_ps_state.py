"""What lives on each parameter server, and whether it still does.

A ps brought back on its address by a restart policy (Docker's `restart:`,
Kubernetes, a fast preemption replacement) answers every connectivity probe
and, once a worker is re-admitted, even runs ops in this job's context: only
the variables it held are gone. So whether a ps lost its state is asked of a
variable that lives on it: each ps holds a small incarnation marker, read
back on demand. A read that fails means the ps no longer holds what this
job placed there; one that fails on the connection itself is read again
first (a connection dropped under it, the ps holding on: the next read
connects again), while a restarted ps' answer (AbortedError) is final.

The strategy also records every variable it places on a ps (weakly), by
device, so that a ps that lost its state can be given its variables back in
place (`recreate`).
"""

import dataclasses
import logging
import os
import threading
import time
import weakref

import tensorflow as tf

from keras_ps.cluster import _connection
from keras_ps.tables import _blockwise_init
from keras_ps import _tf_adapter

logger = logging.getLogger(__name__)

# A marker read failing on the connection itself is made again, at most
# _MARKER_READS times, _MARKER_REREAD_S apart. Not an AbortedError: that is
# the ps' own answer ("Unable to find a context_id": it knows nothing of
# this job, it was restarted), final at once.
_REREAD_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                  tf.errors.CancelledError)
_MARKER_READS = 3
_MARKER_REREAD_S = 0.2


def ps_device(index):
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


def ps_index(device):
    """The ps task index of a device string, or None if not on a ps."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.job != "ps" or spec.task is None:
        return None
    return spec.task


@dataclasses.dataclass(frozen=True)
class PsRecovery:
    """What `recover_parameter_servers` did, and how long each part took.

    Attributes:
        lost: indices of the ps that had lost their variables.
        variables: how many variables were made again on them.
        waiting_seconds: waiting for calls in flight and for the lost ps
            to answer.
        reconnect_seconds: pushing the cluster to every task again.
        recreate_seconds: making the variables and other resources again.
        restart_seconds: pointing the traced functions at the variables
            made again (or, with resources made again, clearing their
            traces) and restarting the workers' iterators.
    """

    lost: tuple
    variables: int = 0
    waiting_seconds: float = 0.0
    reconnect_seconds: float = 0.0
    recreate_seconds: float = 0.0
    restart_seconds: float = 0.0


class PsMarkers:
    """One scalar variable per ps, holding this job's incarnation number.

    Args:
        num_ps: how many ps tasks the cluster has.
    """

    def __init__(self, num_ps):
        self._incarnation = int.from_bytes(os.urandom(7), "little")
        self._lock = threading.Lock()
        self._markers = [self._create(i) for i in range(num_ps)]

    def _create(self, index):
        # The value is made here and copied: a constant made straight on a
        # remote device holds the GIL until the task answers, so a stopped
        # ps would stop every thread of this process.
        with tf.device(_connection.COORDINATOR_DEVICE):
            value = tf.constant(self._incarnation, tf.int64)
        with tf.device(ps_device(index)):
            return _tf_adapter.plain_variable(
                initial_value=value, trainable=False,
                name=f"keras_ps_marker_ps{index}")

    def holds_state(self, index):
        """Whether ps `index` still holds this job's variables (a read of its
        marker; False when the ps is unreachable or was restarted). A read
        that fails on the connection is tried again, up to
        `_MARKER_READS` reads: a connection dropped under this one (the
        network reset it, the ps holding on) fails a read in flight, and the
        next connects again; a restarted ps answers AbortedError ("Unable to
        find a context_id"), at once final."""
        with self._lock:
            marker = self._markers[index]
        for read in range(_MARKER_READS):
            # Only the error's name is kept: the error itself would hold the
            # callers' frames (its traceback's), and with them what they
            # hold (a recovery's replaced iterators), past this call.
            try:
                return int(marker.read_value().numpy()) == self._incarnation
            except _REREAD_ERRORS as error:
                failed = type(error).__name__
                if read + 1 < _MARKER_READS:
                    time.sleep(_MARKER_REREAD_S)
            except tf.errors.OpError as error:
                failed = type(error).__name__
                break
        logger.info("[ps:%d] its marker variable is gone (%s): the ps was "
                    "restarted or cannot be reached", index, failed)
        return False

    def renew(self, index):
        """Places a new marker on ps `index` (after it was given its state back)."""
        marker = self._create(index)
        with self._lock:
            self._markers[index] = marker


class PlacedVariables:
    """Weak references to the variables a strategy placed on each ps, and to
    what makes its other resources there again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_ps = {}
        self._remakes = {}  # ps index -> [weakref.WeakMethod]

    def add(self, variable):
        index = ps_index(getattr(variable, "device", None))
        if index is None:
            return
        with self._lock:
            # Keyed by id: a tf.Variable is not hashable.
            self._by_ps.setdefault(index, weakref.WeakValueDictionary())[
                id(variable)] = variable

    def on_ps(self, index):
        """The live variables placed on ps `index`."""
        with self._lock:
            return list(self._by_ps.get(index, {}).values())

    def add_resource(self, device, remake):
        """Records `remake`, a bound method that makes a resource that is not
        a variable (a hash table, a mutex) again on ps `device`; held
        weakly, so its object may go."""
        index = ps_index(device)
        if index is None:
            return
        with self._lock:
            self._remakes.setdefault(index, []).append(weakref.WeakMethod(remake))

    def has_resources(self):
        """Whether any live resource that is not a variable is tracked."""
        with self._lock:
            return any(r() is not None for remakes in self._remakes.values()
                       for r in remakes)

    def remake_resources(self, index):
        """Calls the live `remake`s of ps `index`; returns how many."""
        with self._lock:
            remakes = [r() for r in self._remakes.get(index, [])]
            self._remakes[index] = [weakref.WeakMethod(r) for r in remakes if r]
        for remake in remakes:
            if remake is not None:
                remake()
        return sum(r is not None for r in remakes)


@dataclasses.dataclass(frozen=True)
class Recreated:
    """What a ps that lost its state was given again: `variables` (in place,
    `handles` {id(old handle): (old, new)}) and other `resources` (new
    objects: a dynamic table's hash map and lock)."""
    variables: int
    resources: int
    handles: dict


def _zeros(shape, dtype):
    """Zeros of `shape`, made in row blocks on the ps when large."""
    shape = tf.TensorShape(shape)
    return _blockwise_init.BlockInitialValue(
        full=lambda: tf.zeros(shape, dtype),
        block=lambda index, rows: tf.zeros([rows] + shape[1:].as_list(), dtype),
        shape=shape, dtype=dtype)


def recreate(variables, fill=True):
    """Gives each variable a new resource of its shape and dtype, filled with
    zeros, on its own device (a ps that was restarted and lost them).

    The Python objects stay what layers, optimizers and checkpoints hold;
    a checkpoint restored next fills them. A large variable is made in row
    blocks, so the ps peaks at the variable plus one block. With `fill`
    False a large variable is left unwritten (its values are undefined, and
    no page of it is touched): for a restore that writes every row next.

    Returns:
        {id(old handle): (old handle, new handle)} of the variables, for
        `_tf_adapter.rebind_captures`.
    """
    handles = {}
    for variable in variables:
        with tf.device(variable.device):
            initial_value = _zeros(variable.shape, variable.dtype)
            if not fill and initial_value.nbytes >= _blockwise_init.BLOCKWISE_MIN_BYTES:
                shape, dtype = variable.shape.as_list(), variable.dtype
                initial_value = lambda: tf.raw_ops.Empty(  # noqa: E731
                    shape=shape, dtype=dtype, init=False)
            donor = _blockwise_init.create(_tf_adapter.plain_variable, dict(
                initial_value=initial_value,
                dtype=variable.dtype, trainable=variable.trainable,
                name=variable.name.split(":")[0]))
        old = _tf_adapter.rebind_variable(variable, donor)
        handles[id(old)] = (old, variable.handle)
    return handles
