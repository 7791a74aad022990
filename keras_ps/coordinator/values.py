"""RemoteValue: the result of a scheduled function, filled in when it has run."""

import enum
import threading

import tensorflow as tf

from keras_ps.errors import KerasPSError

# Worker threads copy their calls' results to the coordinator one at a time.
# TF's own coordinator copies results from one thread, when they are fetched;
# here each worker thread copies its call's results at once, and a
# coordinator crashed (SIGSEGV, inside TF) in two such copies running
# together. A copy stuck on a worker stopped mid-copy keeps its turn: the
# others wait at most `_COPY_TURN_WAIT_S` for it, then copy anyway.
_copy_turn = threading.Lock()
_COPY_TURN_WAIT_S = 0.2


def copy_to(result, device):
    """`result`'s tensors copied to `device` (the coordinator's), in turn
    with the other worker threads' copies; other values as they are."""
    if result is None:
        return None
    turn = _copy_turn.acquire(timeout=_COPY_TURN_WAIT_S)
    try:
        with tf.device(device):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                result)
    finally:
        if turn:
            _copy_turn.release()


class RemoteValueStatus(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


class RemoteValue:
    """The future result of a scheduled function.

    `fetch()` blocks until the function has run and returns numpy values;
    `get()` returns the same values as tensors on the coordinator. Both raise
    the function's error if it failed, or `tf.errors.CancelledError` if it
    was cancelled because another function failed first.
    """

    __slots__ = ("_event", "_status", "_values", "_error", "_fn_name",
                 "__weakref__")

    def __init__(self, fn_name=None):
        self._event = threading.Event()
        self._status = RemoteValueStatus.PENDING
        self._values = None
        self._error = None
        self._fn_name = fn_name  # of the scheduled function, for messages

    @property
    def status(self):
        return self._status

    def _set_values(self, values):
        if self._status is RemoteValueStatus.PENDING:
            self._values = values
            self._status = RemoteValueStatus.READY
            self._event.set()

    def _set_error(self, error):
        if self._status is RemoteValueStatus.PENDING:
            _explain(error, self._fn_name)
            self._error = error
            self._status = RemoteValueStatus.FAILED
            self._event.set()

    def _wait(self, timeout=None):
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"The scheduled function did not finish within {timeout}s. "
                "Call coordinator.join() to see errors from the cluster.")
        if self._error is not None:
            raise self._error

    def get(self, timeout=None):
        """The result as tensors on the coordinator (blocks until ready)."""
        self._wait(timeout)
        return self._values

    def fetch(self, timeout=None):
        """The result as numpy values (blocks until ready)."""
        self._wait(timeout)
        return tf.nest.map_structure(_to_numpy, self._values)

    def __repr__(self):
        return f"<RemoteValue {self._status.value}>"


def _explain(error, fn_name):
    """Adds a note saying which scheduled function failed and what to do.

    keras_ps' own errors already say it; the note goes on the user's errors
    (those a scheduled function raised), chosen by exception type. It shows
    in the traceback that join(), done(), fetch() and get() raise.
    """
    if isinstance(error, KerasPSError) or not isinstance(error, Exception):
        return
    name = repr(fn_name) if fn_name else "(unnamed)"
    if isinstance(error, tf.errors.OutOfRangeError):
        note = (f"keras_ps: the scheduled function {name} ran out of data: "
                "its dataset iterator reached the end (OutOfRangeError). Fix: "
                "add .repeat() to the dataset, or schedule no more steps "
                "than the dataset has elements.")
    else:
        note = (f"keras_ps: the scheduled function {name} failed on a worker "
                f"with {type(error).__name__}; functions scheduled after it "
                "were cancelled. Fix the error above, then schedule them again.")
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def _to_numpy(value):
    return value.numpy() if hasattr(value, "numpy") else value
