"""A preemption notice (SIGTERM) held back until a backup is written.

A cloud's preemption, a Kubernetes pod deletion or a Docker stop sends the
process SIGTERM and kills it some seconds later (30 s by default on
Kubernetes and Google Cloud). `PreemptionNotice` takes SIGTERM over while
`fit` runs: the handler only notes the signal; `BackupAndRestore` writes a
backup at the next step boundary and then hands the signal to whatever
handled it before, so the process ends as it would have, minus the steps it
would have lost. Python runs signal handlers in the main thread only, so
`fit` must run there.
"""

import signal
import threading

SIGNAL = signal.SIGTERM


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
