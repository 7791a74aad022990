"""A parameter server's preemption notice, heard by the coordinator.

A preemptible machine, a Kubernetes pod deletion or `docker stop` sends a
task SIGTERM and kills it some seconds later (30 s on Kubernetes and Google
Cloud by default, 10 s for `docker stop`). A ps that exits at once on it is
lost as if SIGKILLed, and the recovery rolls training back to the last
backup. `python -m keras_ps.server` instead serves on after SIGTERM while a
coordinator watches its notices, so that the coordinator can write a backup
first. It stops at the first of: that coordinator releases it; `grace`
seconds pass after the signal (`--preemption_grace`,
`KERAS_PS_PREEMPTION_GRACE`, DEFAULT_GRACE_S); a second SIGTERM, or SIGINT;
no coordinator has asked for WATCHED_WITHIN_S (its `fit` ended, or it
died). A ps no coordinator watches stops at once, as before.

TF's server gives a task's own process no channel to its clients, so the
notice passes through keras_ps' C++ library (keras_ps/_native/notices.cc):
the ps' signal handler records it there (`ServerNotices`), and the
coordinator's `PsNoticeWatch` runs a small op on each ps about once a second
that reads it. A ps without the library loaded (`KERAS_PS_NATIVE=0`, a
plain `tf.distribute.Server`) is not watched and stops at once.

This module imports TensorFlow only inside the watch's functions: the server
side runs in `python -m keras_ps.server`, which loads TF's server alone.
"""

import ctypes
import logging
import threading
import time

from keras_ps import _native
from keras_ps import _tf_adapter
from keras_ps.cluster import _network

logger = logging.getLogger(__name__)

# How often the watch asks each ps.
ASK_EVERY_S = 1.0
# A ps asked within this many seconds counts itself watched when SIGTERM
# comes: a few questions missed (a busy machine) do not make it stop at once.
WATCHED_WITHIN_S = 5.0
# The longest a watched ps serves on after SIGTERM without being released:
# under the 30 s Kubernetes and Google Cloud give, so that its own stop line
# is printed before their SIGKILL.
DEFAULT_GRACE_S = 25.0
# Seconds `start` waits for each ps to be asked once (a ps that does not
# answer is not waited for longer).
FIRST_ASK_TIMEOUT_S = 5.0
# Seconds a stopping watch gives each ps to hear that it is no longer
# watched (a ps that does not answer is not waited for).
UNWATCH_TIMEOUT_S = 2.0


class ServerNotices:
    """The ps process' side: what its SIGTERM handler records, and whether
    the coordinator released it. `library` is keras_ps' C++ library, loaded
    with ctypes."""

    def __init__(self, library):
        self._watched_ago = library.KerasPsNoticeWatchedAgo
        self._watched_ago.restype = ctypes.c_double
        self._given = library.KerasPsNoticeGiven
        self._given.argtypes = [ctypes.c_double]
        self._released = library.KerasPsNoticeReleased

    def watched(self):
        """Whether a coordinator asked for notices within WATCHED_WITHIN_S."""
        ago = self._watched_ago()
        return 0 <= ago <= WATCHED_WITHIN_S

    def give(self, grace):
        """Records the notice: the ps stops within `grace` seconds."""
        self._given(float(grace))

    def released(self):
        return bool(self._released())


def serve_out_notice(notices, grace, stop, say):
    """After SIGTERM: serves on until the coordinator releases this ps,
    `grace` seconds pass or `stop` is set again (a second signal).

    Returns:
        Why the ps stops, as a clause for its stop line.
    """
    notices.give(grace)
    say(f"SIGTERM: a coordinator watches this ps; serving on for its backup "
        f"(at most {grace:g} s)")
    deadline = time.monotonic() + grace
    while not notices.released():
        if stop.wait(0.05):
            return "on a second signal, before the coordinator's backup"
        if time.monotonic() >= deadline:
            return (f"{grace:g} s after SIGTERM, not released by the "
                    "coordinator")
        if not notices.watched():  # it stopped watching, or is gone
            return "on SIGTERM, no coordinator watching any more"
    return "on SIGTERM, released by the coordinator after its backup"


class PsNoticeWatch:
    """The coordinator's side: asks each ps of `strategy` about once a second
    whether it got a preemption notice, each ps from a thread of its own (a
    ps that does not answer holds only its own questions)."""

    def __init__(self, strategy):
        self._devices = list(strategy.extended.parameter_devices)
        self._strategy = strategy  # its ps' addresses (a ps may move)
        self._library = None
        self._noticed = set()  # ps indices: a notice, not released yet
        self._released = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = []

    def start(self):
        """Starts watching, and returns once each ps was asked (from then on
        its SIGTERM is heard). Returns False (and logs why) where a ps has
        not loaded keras_ps' C++ library: its notices cannot be heard."""
        self._library = _native.kernels_on(self._devices)
        if self._library is None:
            logger.warning(
                "[chief] the ps' preemption notices are not watched: a ps "
                "has not loaded keras_ps' C++ kernels (start every ps with "
                "`python -m keras_ps.server`, KERAS_PS_NATIVE not 0). A ps "
                "that gets SIGTERM stops at once and rolls training back to "
                "the last backup.")
            return False
        asked = [threading.Event() for _ in self._devices]
        for index in range(len(self._devices)):
            thread = threading.Thread(target=self._watch,
                                      args=(index, asked[index]), daemon=True,
                                      name=f"keras_ps-ps-notices-{index}")
            thread.start()
            self._threads.append(thread)
        # Once each ps was asked, a SIGTERM it gets is heard.
        deadline = time.monotonic() + FIRST_ASK_TIMEOUT_S
        for event in asked:
            event.wait(max(0.0, deadline - time.monotonic()))
        return True

    def _on_ps(self, index, op, *args):
        """op(*args) run on ps `index`, its result as a number, or None when
        the ps does not answer (gone, or restarting). Each thread runs these
        under an executor of its own, whose error is forgotten: the next
        question is asked afresh, and no error is printed when the executor
        goes."""
        import tensorflow as tf

        executor = _tf_adapter.new_executor(asynchronous=False)
        try:
            with _tf_adapter.executor_scope(executor), \
                    tf.device(self._devices[index]):
                return float(op(*args))
        except tf.errors.OpError:
            return None
        finally:
            _tf_adapter.clear_executor_error(executor)

    def _watch(self, index, asked):
        ask = self._library.keras_ps_preemption_notice
        while not self._stop.is_set():
            # A ps that does not answer a probe (stopped, hung) is not asked:
            # the question would wait for it, with no deadline.
            left = (self._on_ps(index, ask, True)
                    if _network.probe(self._strategy.cluster_spec["ps"][index],
                                      ASK_EVERY_S)
                    else None)
            asked.set()
            with self._lock:
                if left is None or left < 0:
                    # Gone (a notice is not answered for), or a new process.
                    self._noticed.discard(index)
                    if left is not None:
                        self._released.discard(index)
                elif index not in self._released | self._noticed:
                    logger.warning("[chief] ps %d got a preemption notice "
                                   "(SIGTERM); it serves on until released, "
                                   "at most %.0f s", index, left)
                    self._noticed.add(index)
            self._stop.wait(ASK_EVERY_S)

    def noticed(self):
        """The ps (indices) that got a notice and are not released yet."""
        with self._lock:
            return sorted(self._noticed)

    def release(self, indices):
        """Tells the ps in `indices` that the backup is written: they stop.
        A ps that is already gone is passed over."""
        for index in indices:
            if self._on_ps(index,
                           self._library.keras_ps_release_preempted) is None:
                logger.info("[chief] ps %d did not answer its release: gone "
                            "already", index)
            with self._lock:
                self._noticed.discard(index)
                self._released.add(index)

    def stop(self):
        """Stops watching; each ps is told, so that a SIGTERM from now on
        stops it at once (a ps that does not answer within
        UNWATCH_TIMEOUT_S is left to its WATCHED_WITHIN_S)."""
        if self._stop.is_set() or self._library is None:
            return
        self._stop.set()
        deadline = time.monotonic() + UNWATCH_TIMEOUT_S
        for thread in self._threads:  # no question of theirs after ours
            thread.join(max(0.0, deadline - time.monotonic()))
        ask = self._library.keras_ps_preemption_notice
        threads = [threading.Thread(target=self._on_ps, args=(i, ask, False),
                                    daemon=True,
                                    name=f"keras_ps-ps-unwatch-{i}")
                   for i in range(len(self._devices))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + UNWATCH_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
