"""The hang watchdog: gives up a worker's call that will not return, and
names a parameter server that does not answer.

A call on a worker that does not answer probes (a stopped or hung process) is
given up after the hang timeout, and so is an idle worker that does not answer
while another worker's trace waits for it (with the waiting call, when its
closures can run elsewhere without a new trace); a call on a worker that
answers is given up as stuck only when it has run far longer than finished
calls of its function (`stuck_after`). The worker thread then requeues the
call's closures (`Worker.abandon_in_flight`). A closure stuck on two workers,
or a stuck call on every worker, fails the job with `StuckCallError` naming the
calls and the fix.

A ps that does not answer (stopped, a frozen machine, a network partition)
holds every worker's calls: none is given up then, and the ps is named
instead, once and at each doubling of its silence. Once it answers again
with its variables training goes on where it was; once it has not answered
for `ps_recovery_timeout` seconds, it is given up as lost
(`ParameterServerUnavailableError`): `Model.fit` with `BackupAndRestore`
then recovers it like a ps that died, anything else raises.
"""

import contextlib
import logging
import threading
import time
import weakref

from keras_ps import _constants
from keras_ps.cluster._network import probe
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.errors import StuckCallError
from keras_ps.coordinator.worker_states import GONE
from keras_ps.coordinator.worker_states import RUNNABLE
from keras_ps.coordinator.worker_states import WorkerState

logger = logging.getLogger(__name__)

# A call that has run this long (or 6 hang timeouts, if longer) on a worker
# that answers probes is logged, then again at each doubling of its age.
STUCK_WARNING_S = 60.0
# Workers a closure may be given up as stuck on before the job fails: stuck
# on two, the closure itself most likely blocks, wherever it runs.
STUCK_GIVE_UPS = 2


# Strategy -> its Model.fit and evaluate calls under way (`ps_watched`).
_calls_under_way = weakref.WeakKeyDictionary()
_calls_lock = threading.Lock()


@contextlib.contextmanager
def ps_watched(strategy):
    """Marks a `Model.fit` or `evaluate` call under way on `strategy`: the
    watchdog of its coordinator asks throughout whether every ps answers,
    also while no worker call waits (a backup the chief writes, a restore:
    its reads wait for a silent ps with no call in flight)."""
    with _calls_lock:
        _calls_under_way[strategy] = _calls_under_way.get(strategy, 0) + 1
    try:
        yield
    finally:
        with _calls_lock:
            _calls_under_way[strategy] -= 1


def call_under_way(strategy):
    """Whether a `ps_watched` call on `strategy` is under way."""
    return _calls_under_way.get(strategy, 0) > 0


def stuck_after(stuck_timeout, longest_per_closure, closures):
    """Seconds after which a call of `closures` closures is given up as stuck
    on a worker that answers, or None for never.

    Args:
        stuck_timeout: the setting: seconds, 0 (never) or None (auto).
        longest_per_closure: the longest a finished call of the same function
            took per closure, on any worker (None: none finished yet).
        closures: how many closures the call holds.
    """
    if stuck_timeout is not None:
        return stuck_timeout or None
    if longest_per_closure is None:
        return None  # nothing to compare with: a first call may be long
    return max(_constants.STUCK_FLOOR_S,
               _constants.STUCK_FACTOR * longest_per_closure * closures)


def _reading(closure):
    """The shard of data `closure` reads, named, or None."""
    return closure.listener.describe() if closure.listener else None


def _stuck_call(closure):
    """Names a stuck call: its function and, for a shard of data, the shard
    and what it reads."""
    fn_name = getattr(closure.fn, "__name__", "a scheduled function")
    reading = _reading(closure)
    return f"a call of {fn_name}" + (f" on {reading}" if reading else "")


def _stuck_fix(cause):
    return (f"{cause}; a dump of the task's threads (py-spy dump, gdb) "
            "shows where. If calls are this long on purpose, set "
            f"{_constants.STUCK_TIMEOUT_ENV_VAR} to more seconds than one "
            "takes (0 never gives a call up).")


def stuck_failure(closure, workers, reason):
    """The error of `closure`, given up as stuck on `workers`."""
    if _reading(closure) is None:
        cause = ("The function most likely blocks wherever it runs: a "
                 "dataset read that never returns (a stalled network "
                 "filesystem, a pipe or socket with no writer), or a "
                 "deadlock in TF's runtime")
    else:
        cause = ("Reading that shard most likely blocks on every worker: "
                 "check that it can be read there (a stalled network "
                 "filesystem, a pipe or socket with no writer), or remove it "
                 "from the data; else a deadlock in TF's runtime")
    what = _stuck_call(closure)
    return StuckCallError(
        f"{what[0].upper()}{what[1:]} was given up as stuck on workers "
        f"{workers} (the last call {reason}, and every ps answered probes). "
        + _stuck_fix(cause))


def silent_ps_lost(index, address, seconds):
    """The error of ps `index`, silent for `seconds` while calls waited."""
    return ParameterServerUnavailableError(
        f"Parameter server {index} at {address} has not answered for "
        f"{seconds:.0f}s (a stopped or hung process, a frozen machine, a "
        "network partition) while every step waited for it, so keras_ps gives "
        "it up as lost. Kill its process: a restart policy brings it back, "
        "and Model.fit with keras_ps' BackupAndRestore gives it its variables "
        "back from the backup in the same call (a custom loop calls "
        "coordinator.recover_parameter_servers() and restores its "
        "checkpoint); else restart the job. Raise "
        f"{_constants.PS_RECOVERY_TIMEOUT_ENV_VAR} to wait longer.")


def every_worker_stuck(stuck_calls):
    """The error when every worker has a call given up as stuck: none is
    left to train. `stuck_calls`: {worker index: what it is stuck on}."""
    calls = "; ".join(f"worker {i}: {what}"
                      for i, what in sorted(stuck_calls.items()))
    return StuckCallError(
        "Every worker has a call given up as stuck, so none is left to "
        f"train ({calls}; every ps answered probes). What blocks is most "
        "likely common to the workers: " + _stuck_fix(
            "a read of a stalled network filesystem, a pipe or socket with "
            "no writer, a parameter server that answers probes but runs no "
            "op, or a deadlock in TF's runtime"))


class HangWatchdog:
    """Watches every worker's call in flight.

    A call that has run `hang_timeout` seconds on a worker that does not
    answer a probe is given up and the worker declared hung: a stopped or
    hung process never returns the call, and would hold its closures
    forever. A worker that answers is busy or stuck: its call is given up
    as stuck (`WorkerState.STUCK`) only past `stuck_after` and while every
    ps answers (a ps that does not holds every worker's calls: not this
    worker's fault); before that, a call past `STUCK_WARNING_S` is logged.
    """

    def __init__(self, workers, config, dead_ps=dict, queue=None,
                 packing=None, silent_ps=dict, watched=lambda: False):
        self._workers = workers  # () -> the current Worker objects
        self._config = config
        # () -> {index: address} of ps that lost their variables (silent, or
        # answering after a restart), and of those that do not answer.
        self._dead_ps = dead_ps
        self._silent_ps = silent_ps
        self._watched = watched  # () -> whether the ps are watched now
        # ps index -> (when it was first seen silent, its silence when last
        # logged).
        self._silent_since = {}
        # Failed (mark_fatal) when every worker is stuck; None: never.
        self._queue = queue
        # The PackedFunctions: whether a call waiting in its trace can run
        # elsewhere without one (None: never assumed).
        self._packing = packing
        # Worker index -> the call it was last given up as stuck on.
        self._stuck = {}
        self._stopping = threading.Event()
        # Worker index -> the age of its call when last logged as stuck.
        self._warned = {}
        self._thread = threading.Thread(
            target=self._run, daemon=True, name="keras_ps-hang-watchdog")

    def start(self):
        self._thread.start()

    def stop(self):
        self._stopping.set()

    def _run(self):
        interval = min(1.0, self._config.hang_timeout / 2)
        while not self._stopping.wait(interval):
            try:
                self.check()
            except Exception:  # never let hangs go unwatched after a bug
                logger.exception("[chief] the hang watchdog's check failed; "
                                 "it looks again in %.1fs", interval)

    def check(self):
        """One look at every worker's call in flight."""
        workers = self._workers()
        silent = None  # the ps that do not answer, asked once a look
        waited = 0.0  # the longest call that waits for them
        for w in workers:
            call = w.in_flight_call()
            if call is None:
                continue
            age = time.monotonic() - call.started
            if age < self._config.hang_timeout:
                continue
            if not probe(w.address, self._config.probe_timeout):
                w.abandon_in_flight(
                    f"call running {age:.0f}s and the worker does not answer",
                    WorkerState.HUNG, call)
                continue
            if silent is None:
                silent = self._silent_ps()
            if silent:  # every call waits for it: named below, not the worker
                waited = max(waited, age)
                continue
            if call.tracing:  # it waits on every worker, not on this one
                if not self._set_aside_for_trace(w, call, age, workers):
                    self._warn_if_long(w, age, _TRACE_WAITS, w.index, age)
                continue
            fn = call.batch[0].fn
            seen = [t for t in (v.seconds_per_closure(fn) for v in workers)
                    if t is not None]
            limit = stuck_after(self._config.stuck_timeout,
                                max(seen, default=None), len(call.batch))
            if limit is not None and age >= limit and not self._dead_ps():
                reason = (f"ran {age:.0f}s (limit {limit:.0f}s) on a worker "
                          "that answers")
                w.abandon_in_flight(reason, WorkerState.STUCK, call)
                self._stuck[w.index] = f"{_stuck_call(call.batch[0])} {reason}"
            else:
                self._warn_if_long(w, age, _STUCK_WARNING, w.index, age,
                                   w.address, self._then(limit))
        if silent is None and (self._silent_since or self._watched()):
            silent = self._silent_ps()
        self._watch_silent_ps(silent or {}, waited)
        self._fail_if_every_worker_is_stuck(workers)

    def _watch_silent_ps(self, silent, waited):
        """Names each ps in `silent` ({index: address}), for which calls
        have waited `waited` s when first seen, and gives one up as lost
        past `ps_recovery_timeout` seconds of silence."""
        now = time.monotonic()
        for index in list(self._silent_since):
            if index not in silent:
                since, logged = self._silent_since.pop(index)
                if logged is not None:  # said once it was silent that long
                    logger.warning("[chief] ps %d answers again after %.0fs; "
                                   "training goes on", index, now - since)
        limit = self._config.ps_recovery_timeout
        for index, address in sorted(silent.items()):
            since, logged = self._silent_since.get(index, (now - waited, None))
            seconds = now - since
            if seconds >= self._config.hang_timeout and (
                    logged is None or seconds >= 2 * logged):
                logged = max(seconds, self._config.hang_timeout)
                logger.warning(_PS_SILENT, index, address, seconds,
                               _constants.PS_RECOVERY_TIMEOUT_ENV_VAR, limit)
            self._silent_since[index] = (since, logged)
            if (seconds >= limit and self._queue is not None
                    and not probe(address, self._config.probe_timeout)):
                self._queue.mark_fatal(0, silent_ps_lost(index, address,
                                                         seconds))

    def _set_aside_for_trace(self, tracing, call, age, workers):
        """`tracing`'s call has waited `age` s in its trace, which TF makes
        wait for every worker. Workers that do not answer are set aside as
        hung, idle ones too (nothing else would notice them: no call of
        theirs ages). If the call's closures can run elsewhere without a
        new trace, the waiting call is given up as well, so training goes
        on without the silent workers instead of waiting for them (the
        tracing thread itself waits on; its worker is re-admitted once the
        trace returns). False when every other worker answers."""
        # Stopped or hung ones (a FAILED one was seen dead, not stopped).
        silent = [m for m in workers if m is not tracing
                  and m.state in (*RUNNABLE, WorkerState.HUNG)
                  and not probe(m.address, self._config.probe_timeout)]
        if not silent:
            return False
        names = [m.index for m in silent]
        for m in silent:
            # One with a call is given up by the look at its own call.
            if m.state in RUNNABLE and m.in_flight_call() is None:
                m.transition(WorkerState.HUNG, (
                    f"does not answer while worker {tracing.index}'s trace "
                    f"has waited {age:.0f}s for it"))
        if self._packing is not None and \
                self._packing.has_fallback(call.batch[0].fn):
            tracing.abandon_in_flight(
                f"its trace has waited {age:.0f}s for workers {names}, which "
                "do not answer; its closures run on the others, with a form "
                "traced already", WorkerState.HUNG, call)
        else:
            self._warn_if_long(tracing, age, _TRACE_WAITS, tracing.index, age)
        return True

    def _fail_if_every_worker_is_stuck(self, workers):
        """Stuck workers come back only when their calls return: with no
        other worker left (failed or hung ones may be restarted), the job
        would wait forever. It fails naming each worker's call (again at
        each look while that lasts: a later fit or join fails too)."""
        if self._queue is None:
            return
        members = [w for w in workers if w.state not in GONE]
        if not members or any(w.state is not WorkerState.STUCK
                              for w in members):
            return
        self._queue.mark_fatal(0, every_worker_stuck(
            {w.index: self._stuck.get(w.index, "a call") for w in members}))

    def _warn_if_long(self, worker, age, message, *args):
        """Logs `message % args` once a call is long (see STUCK_WARNING_S),
        then again at each doubling of its age."""
        last = self._warned.get(worker.index)
        if last is not None and age < last:
            last = None  # a later call
        if age < max(STUCK_WARNING_S, 6 * self._config.hang_timeout) or (
                last is not None and age < 2 * last):
            return
        self._warned[worker.index] = age
        logger.warning(message, *args)

    def _then(self, limit):
        if limit is not None:
            return (f"keras_ps gives it up as stuck at {limit:.0f}s (its "
                    "closures then run on the other workers) unless a ps "
                    "does not answer")
        if self._config.stuck_timeout == 0:
            return ("keras_ps waits for it: "
                    f"{_constants.STUCK_TIMEOUT_ENV_VAR}=0 never gives a call up")
        return ("keras_ps waits for it: no call of this function has "
                "finished yet to compare it with (set "
                f"{_constants.STUCK_TIMEOUT_ENV_VAR} to bound such a call)")


_STUCK_WARNING = (
    "[worker:%d] a call has run %.0fs on %s, which answers probes; %s. If "
    "this job's steps are not that long, that worker's call may be stuck (a "
    "dump of its threads, e.g. py-spy dump or gdb, shows where); restarting "
    "its process lets training go on: its closures run on the other "
    "workers, and it is re-admitted.")
_PS_SILENT = (
    "[chief] ps %d at %s has not answered for %.0fs: every step that uses "
    "it waits, and so does any read of the chief's (a backup being "
    "written). A stopped or hung process, a frozen machine, a network "
    "partition? Training goes on where it was once it answers with its "
    "variables. After %s=%gs it is given up as lost: Model.fit with "
    "keras_ps' BackupAndRestore then restores it from the backup once it "
    "answers, a custom loop's join raises. Kill a ps that stays hung: a "
    "restart policy brings it back.")
_TRACE_WAITS = (
    "[worker:%d] a new function has waited %.0fs to be registered: TF "
    "registers it on every worker and waits for each, and one does not "
    "answer (a stopped or hung process). It goes on when that worker "
    "continues or dies; restart a worker that stays hung.")
