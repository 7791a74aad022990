"""A preemption notice (SIGTERM) held back until a backup is written.

A cloud's preemption, a Kubernetes pod deletion or a Docker stop sends the
process SIGTERM and kills it some seconds later (30 s by default on
Kubernetes and Google Cloud). `PreemptionNotice` takes SIGTERM over while
`fit` runs: the handler only notes the signal; `BackupAndRestore` writes a
backup at the next step boundary and then hands the signal to whatever
handled it before, so the process ends as it would have, minus the steps it
would have lost. Python runs signal handlers in the main thread only, so
`fit` must run there.

A ps' own SIGTERM is heard through `PsNotices` (keras_ps.cluster.ps_notices):
the ps serves on while a backup is written at the next step boundary, then
it is released and stops; `fit` waits for it to be gone and recovers it from
that backup before it schedules another step, so no step is trained twice.
"""

import logging
import signal
import threading
import time

from keras_ps.cluster.ps_notices import PsNoticeWatch
from keras_ps.coordinator import ClusterCoordinator
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.strategy import ParameterServerStrategy

logger = logging.getLogger(__name__)

SIGNAL = signal.SIGTERM
# Seconds a released ps has to stop before `fit` recovers it at once (it
# stops within a fraction of a second; one still there is found by a step).
GONE_TIMEOUT_S = 5.0


class PreemptionNotice:
    """SIGTERM noted while installed; `deliver()` passes it on."""

    def __init__(self):
        self.received = False
        self._previous = None
        self._installed = False

    def install(self):
        """Takes SIGTERM over until `uninstall()`.

        Raises:
            ValueError: not called from the main thread, where Python runs
                signal handlers.
        """
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "BackupAndRestore(save_before_preemption=True) needs fit to "
                "run in the main thread: Python delivers SIGTERM there only. "
                f"Received: fit in thread {threading.current_thread().name!r}."
                " Fix: call fit from the main thread, or pass "
                "save_before_preemption=False.")
        self.received = False
        self._previous = signal.signal(SIGNAL, self._note)
        self._installed = True

    def _note(self, signum, frame):
        # Nothing else here: a handler runs between two bytecodes of the
        # main thread, which may be writing the same log stream.
        self.received = True

    def uninstall(self):
        """Gives SIGTERM back to its previous handler."""
        if self._installed:
            # None: a handler set outside Python; the default stands in.
            signal.signal(SIGNAL, signal.SIG_DFL if self._previous is None
                          else self._previous)
            self._installed = False

    def deliver(self):
        """Uninstalls, then raises the noted SIGTERM again for the previous
        handler: with Python's default the process ends by the signal (exit
        status 143); a handler of the program's runs (and may raise).

        Raises:
            SystemExit: (status 143) the default action was dropped: the
                kernel ignores a signal without a handler sent to the first
                process of a PID namespace, which a container's command is
                (`docker stop` would otherwise wait for its SIGKILL).
        """
        default = self._previous in (None, signal.SIG_DFL)
        self.uninstall()
        self.received = False
        signal.raise_signal(SIGNAL)
        if default:
            raise SystemExit(128 + SIGNAL)


class PsNotices:
    """The ps' preemption notices during one `fit` (none outside a keras_ps
    ParameterServerStrategy)."""

    def __init__(self):
        self._watch = None
        self._released = []

    def start(self, strategy):
        self._strategy = strategy
        if isinstance(strategy, ParameterServerStrategy):
            self._watch = PsNoticeWatch(strategy)
            if not self._watch.start():
                self._watch = None

    def due(self):
        """Whether a ps got a notice that no backup has answered yet."""
        return self._watch is not None and bool(self._watch.noticed())

    def release(self, published, serial, epoch, step):
        """After backup `serial` (at `epoch`, `step`) is written: once
        `published()` returns (a delta still being written is published),
        the noticed ps are released."""
        noticed = self._watch.noticed() if self._watch is not None else []
        if noticed:
            published()
            self._watch.release(noticed)
            self._released = noticed
            logger.warning("[chief] backup %d (epoch %d, step %d) written "
                           "after the preemption notice of ps %s: released",
                           serial, epoch, step, noticed)

    def raise_once_gone(self):
        """After a release within training: waits for the released ps to
        stop, then raises the loss that `fit` recovers from at once. Waited
        for here, `fit` schedules no step that would fail on the leaving ps,
        so the recovery trains no step again (the backup holds every step
        scheduled so far).

        Raises:
            ParameterServerUnavailableError: a released ps has stopped.
        """
        released, self._released = self._released, []
        if not released:
            return
        coordinator = ClusterCoordinator(self._strategy)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while not set(released) <= set(coordinator.lost_parameter_servers()):
            if time.monotonic() >= deadline:
                return  # still there: the step that finds it gone recovers
            time.sleep(0.05)
        raise ParameterServerUnavailableError(
            f"Parameter server(s) {released} stopped after their preemption "
            "notice, once the backup was written.")

    def stop(self):
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
