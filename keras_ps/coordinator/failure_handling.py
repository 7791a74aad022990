"""Failure handling: deciding what a failure means, and the re-admission of
a worker that answers again (calls that never return: watchdog.py).

Decide apart from act: `decide` is a pure function of what was observed (the
error's type, whether the function had run to its end when the call failed,
probes of the worker and the ps tasks, keras_ps.cluster._network.probe, and
whether the worker still runs the process this job's context was made on,
`Readmission.holds_context`); the worker thread acts on its `Decision` and
logs why. Failures are classified by exception type, that point of the call
and those checks, never by message text.
"""

import enum
import logging
import time

from keras_ps import _native
from keras_ps import _tf_adapter
from keras_ps.cluster import _connection
from keras_ps.cluster import _dead_peers
from keras_ps.cluster._network import incarnation
from keras_ps.cluster._network import why_silent
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.errors import RepeatedFailureError
from keras_ps.strategy import strategy as strategy_lib
from keras_ps.strategy._per_worker import worker_device

logger = logging.getLogger(__name__)

# -- the policy ------------------------------------------------------------------

MAX_TRANSIENT_RETRIES = 3
# Failures in a row, with no call done in between, of a worker that answers
# but has lost this job's context (another incarnation): a worker restarted
# again right after every re-admission (one that crashes at every call) is
# raised, not re-admitted forever.
MAX_FAILED_READMISSIONS = 3
# Times a closure's function ran to its end on a worker but its outputs
# could not be copied back: the first is retried (a worker stopped or
# killed at that moment breaks the copy with errors of any type: an
# InternalError "Unable to parse request" was seen under SIGKILLs and
# SIGSTOPs of workers), a second is the outputs themselves (a dataset or
# resource returned) and is raised.
MAX_LOST_OUTPUT_RETRIES = 1
# Seconds a worker has to say which process it is when it is re-admitted.
_ASK_TIMEOUT_S = 10.0


class Decision(enum.Enum):
    RETRY_ELSEWHERE = "retry_elsewhere"  # worker lost: requeue, recover worker
    RETRY = "retry"  # transient error on a live worker: requeue, stay healthy
    RAISE_PS_FAILURE = "raise_ps_failure"  # a ps is gone: fatal for the job
    # Fails on every re-admission: fatal, with the likely cause named.
    RAISE_REPEATED = "raise_repeated"
    RAISE = "raise"  # the user's function failed


def is_connectivity_error(error):
    """Whether `error` may be a lost or restarted task's, or a dropped
    connection's (any other type is the user's function failing)."""
    return isinstance(error, _connection.CONNECTION_ERRORS)


def decide(error, worker_alive, dead_ps, context_lost=False,
           consecutive_failures=1, failed_readmissions=0, outputs_lost=0):
    """Returns the Decision for a closure that raised `error`.

    Args:
        error: the exception the remote call raised.
        worker_alive: whether the worker answered a probe after the failure.
        dead_ps: list of ps indices that did not answer a probe.
        context_lost: the worker answers but lost our eager context (it was
            restarted); its state must be rebuilt before it runs again.
        consecutive_failures: failures of this worker in a row, this one
            included.
        failed_readmissions: failures of this worker in a row, with no
            call done in between, that found its context lost while it
            answered, this one included.
        outputs_lost: times the call's closures ran their function to its
            end and lost its outputs on the way back to the coordinator,
            this time included; 0 when this call failed before that.
    """
    if dead_ps:
        return Decision.RAISE_PS_FAILURE
    if not worker_alive:
        return Decision.RETRY_ELSEWHERE
    if context_lost:
        if failed_readmissions > MAX_FAILED_READMISSIONS:
            return Decision.RAISE_REPEATED
        return Decision.RETRY_ELSEWHERE
    if is_connectivity_error(error):
        # A live worker with a connection error: a blip, or a restart that
        # lost our context. Retry a few times, then rebuild its context.
        if consecutive_failures > MAX_TRANSIENT_RETRIES:
            return Decision.RETRY_ELSEWHERE
        return Decision.RETRY
    if outputs_lost:
        # The user's function finished; moving its results failed.
        if outputs_lost > MAX_LOST_OUTPUT_RETRIES:
            return Decision.RAISE
        return Decision.RETRY
    return Decision.RAISE


# -- what the user is told ------------------------------------------------------
def ps_failure(dead_ps, error):
    """The error of a job whose ps `dead_ps` ({index: address}) are gone."""
    return ParameterServerUnavailableError(
        f"Parameter server(s) {sorted(dead_ps)} at "
        f"{[dead_ps[i] for i in sorted(dead_ps)]} cannot be reached; the "
        "model's variables there are lost. Restart the job (ps tasks "
        "included) and resume from the last checkpoint, e.g. with "
        "keras_ps.callbacks.BackupAndRestore. Cause: "
        f"{type(error).__name__}")


def repeated_failure(index, address, losses, error):
    """The error of worker `index` found restarted `losses` times in a row
    with no call done in between, the last time failing with `error`."""
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    fatal = RepeatedFailureError(
        f"Worker {index} ({address}) was found restarted {losses} times in "
        "a row (the context this job made on it was gone), each time before "
        "a call could run on it after its re-admission; the last call "
        f"failed with {type(error).__name__}: {first_line}. A worker "
        "process that restarts at every call is most likely crashing or "
        "killed there: read its log (a crash in an op, an out-of-memory "
        "kill, a restart policy's health check), fix that, and resume from "
        "the last checkpoint (e.g. keras_ps.callbacks.BackupAndRestore).")
    fatal.__cause__ = error
    return fatal


def note_after_readmission(error, index):
    """Says on `error`, raised by the first call of worker `index` after its
    re-admission, what a re-admission does not rebuild."""
    error.add_note(
        f"keras_ps: this came from worker {index}'s first call since it was "
        "re-admitted (its process had restarted, or it joined). keras_ps "
        "made its per-worker datasets again; anything else your function "
        "used on that worker (a variable or table placed there with "
        "tf.device) is gone. Make such state in the dataset_fn, or place it "
        "on the parameter servers (create it under strategy.scope()).")


def note_lost_outputs(error, outputs_lost):
    """Says on `error` that the function ran and its outputs were lost."""
    error.add_note(
        f"keras_ps: the function ran to its end {outputs_lost} times, and "
        "each time its outputs could not be copied from the worker to the "
        "coordinator. Return tensors of numbers, booleans or strings from a "
        "scheduled function, not datasets, iterators or resource handles.")


# What an elastic member's address must be, said in both warnings below.
_WORKER_ADDRESS = ("the HOST:PORT a worker task serves on (`python -m "
                   "keras_ps.server --job_name worker`)")


def refused_member(index, address, why):
    """The warning for a new member whose address is no worker task's
    (`why`: keras_ps.cluster._network.look_at_new_worker)."""
    return (
        f"[worker:{index}] {address} joined the membership but is refused as "
        f"worker {index}: {why}. Expected {_WORKER_ADDRESS}, given as its "
        "agent's --address; the rendezvous server's address is the agent's "
        "--rdzv_endpoint, and a ps is no worker. It stays out of training "
        f"until the membership gives place {index} another address; the "
        "other workers go on.")


def silent_member(index, address, seconds, why):
    """The warning for a new member at whose address no TF server answers
    (`why`: keras_ps.cluster._network.why_silent)."""
    return (
        f"[worker:{index}] {address} joined the membership {seconds:.0f}s ago "
        f"and no TensorFlow server answers there yet: {why}. It takes no "
        "steps until one does; the other workers go on. Check that its "
        f"agent's --address is {_WORKER_ADDRESS}, reachable from this "
        "machine, and that the task runs.")


def warn_if_silent(index, address, waited, warn_after, probe_timeout):
    """Warns when new member `index` has not answered at `address` for
    `warn_after` seconds (0: never) since it joined, `waited` seconds ago (a
    wrong --address, a task that does not run); returns when to warn next
    (twice as long)."""
    if not warn_after or waited < warn_after:
        return warn_after
    logger.warning("%s", silent_member(index, address, waited, why_silent(
        address, probe_timeout)))
    return warn_after * 2


# -- re-admission -------------------------------------------------------------------
class Readmission:
    """Makes a restarted (or new) worker usable: pushes the cluster definition
    with the workers that are members now, then rebuilds what lived on that
    worker's process (its datasets and iterators), with no call in flight.

    Pushing the definition creates a fresh eager context on the returning
    task only; ps variables, traced functions and the other workers'
    iterators keep working. Lost workers are left out of the definition: TF
    waits for every listed task when the definition changes.
    """

    def __init__(self, gate, members, num_workers, datasets, release,
                 strategy, packing):
        self._gate = gate
        self._members = members  # () -> {index: address} of workers in the cluster
        self._num_workers = num_workers  # () -> the number of worker places
        self._datasets = datasets  # () -> the live per-worker datasets
        # (index, iterators) -> None: hands iterators replaced on a worker
        # that kept its process to its release line.
        self._release = release
        self._strategy = strategy
        self._packing = packing  # the coordinator's PackedFunctions
        # The cluster as connected; updated copies are pushed.
        self._server_def = _tf_adapter.get_server_def()
        # Bumped by every push: a call that started before a push and failed
        # after it lost its context, whatever its error says.
        self.generation = 0
        # Worker index -> the incarnation of its process when this job's
        # context was made there (keras_ps.cluster._network.incarnation).
        self._incarnations = {}

    def readmit(self, index):
        """Pushes the cluster and makes worker `index`'s datasets again.

        Returns:
            The iterators replaced on that worker when it kept its process
            (a hung or stuck worker that came back): alive there, to be
            released once it takes calls again. Empty when it runs a new
            process (they were lost with the old one).
        """
        started = time.monotonic()
        with self._gate.exclusive():
            gate = time.monotonic()
            recorded = self._incarnations.get(index)
            # Asked before the push: a restart after it is then seen.
            self.record_incarnation(index, self._members().get(index))
            kept_its_process = (recorded is not None
                                and recorded == self._incarnations[index])
            self.reconnect(returned=[worker_device(index)])
            connected = time.monotonic()
            replaced = self.restart_iterators([index])
        logger.info(
            "[worker:%d] rebuilt in %.2fs: %.2fs waiting for calls in flight, "
            "%.2fs server def, %.2fs datasets", index,
            time.monotonic() - started, gate - started, connected - gate,
            time.monotonic() - connected)
        return replaced[index] if kept_its_process else []

    def release(self, index, iterators):
        """Hands `iterators`, replaced on worker `index` by a rebuild, to
        its release line (the worker must take calls again)."""
        self._release(index, iterators)

    def remake_datasets(self, index):
        """Makes worker `index`'s datasets and iterators again, alone (no
        call in flight), with no cluster push: after a call cancelled on a
        worker that kept its process and its context."""
        started = time.monotonic()
        with self._gate.exclusive():
            replaced = self.restart_iterators([index])
        self._release(index, replaced[index])
        logger.info("[worker:%d] datasets made again in %.2fs", index,
                    time.monotonic() - started)

    def record_incarnation(self, index, address):
        """Notes which process worker `index` runs now, before this job's
        context is made on it (None: it left the cluster)."""
        self._incarnations[index] = (
            None if address is None else incarnation(address, _ASK_TIMEOUT_S))

    def holds_context(self, index, address, timeout):
        """Whether worker `index` still runs the process this job's context
        was made on. A worker brought back on its address by a restart
        policy answers every probe, and its calls then fail with errors
        that need not name a connection ("Primary device is not remote"):
        its incarnation tells. False when it does not answer in `timeout`
        seconds, or was never recorded."""
        recorded = self._incarnations.get(index)
        now = incarnation(address, timeout)
        if recorded is not None and now == recorded:
            return True
        logger.info("[worker:%d] runs another process than this job's "
                    "context was made on (incarnation %s, recorded %s)",
                    index, now, recorded)
        return False

    def restart_iterators(self, indices):
        """Makes the datasets and iterators of workers `indices` again, under
        the caller's exclusive gate: their iterators start over.

        After a ps loss too: a step that failed on the lost ps has the rest
        of it cancelled by TF, and one cancelled inside its iterator's
        next() leaves that iterator ended for good (it raises End of
        sequence at the next step).

        Returns:
            {index: the iterators replaced on that worker}. Dropped the
            plain way, one still alive on its worker stalls the worker's
            next requests for up to a minute (TF destroys it on the thread
            serving them: keras_ps/coordinator/iterator_release.py); on a
            worker that kept its process, release them instead.
        """
        replaced = {}
        for index in indices:
            replaced[index] = [
                old for dataset in self._datasets()
                for old in dataset.rebuild(index, self._num_workers())]
        return replaced

    def reconnect(self, returned=()):
        """Pushes the cluster to every task again, under the caller's
        exclusive gate: a restarted ps gets this job's context back (its
        variables are not). The other tasks keep theirs.

        Args:
            returned: devices of the tasks that came back (started again,
                or new). One without keras_ps' C++ kernels that this job's
                functions were traced with could run none of them ("Op
                type not registered"): every function is then traced again
                with TF's ops (slower, same results).

        Returns:
            The number of functions to trace again for that (or for tasks
            that all have the kernels again, after one without), or 0.
        """
        server_def = self.membership_def()
        _tf_adapter.update_server_def(server_def)
        _dead_peers.watch([address for job in server_def.cluster.job
                           for address in job.tasks.values()])
        self.generation += 1
        missing = _native.recheck(self._strategy, returned) if returned else []
        if missing:
            why = (f"{', '.join(missing)} came back without keras_ps' C++ "
                   "kernels (another keras_ps version, or none loaded), "
                   "which this job's steps were traced with: every function "
                   "(%d) is traced again with TF's ops, slower per step, "
                   "with the same results. Start every task with `python -m "
                   "keras_ps.server` of this keras_ps version to keep them.")
        elif returned and _native.regain(self._strategy):
            why = (f"every task has keras_ps' C++ kernels again "
                   f"({', '.join(_native.task_names(returned))} came back "
                   "with them): every function (%d) is traced again with "
                   "them.")
        else:
            return 0
        self._packing.clear()
        count = _tf_adapter.retrace_all_functions()
        logger.warning("[chief] " + why, count)
        return count

    def move_ps(self, index, address):
        """Ps `index` serves at `address` now: pushed from the next
        `reconnect` on."""
        for job in self._server_def.cluster.job:
            if job.name == "ps":
                job.tasks[index] = address

    def membership_def(self):
        """The connected server def with the worker job reduced to the
        workers that are in the cluster now."""
        server_def = type(self._server_def)()
        server_def.CopyFrom(self._server_def)
        members = self._members()
        for job in server_def.cluster.job:
            if job.name == "worker":
                job.ClearField("tasks")
                for index, address in members.items():
                    job.tasks[index] = address
        for job in server_def.cluster_device_filters.jobs:
            if job.name == "worker":
                job.ClearField("tasks")
                for index in members:
                    job.tasks[index].device_filters.extend(
                        strategy_lib.WORKER_DEVICE_FILTERS)
        return server_def
