"""The gate between calls in flight and a cluster update.

Many remote calls run at once (shared); pushing a new cluster definition to
TF (re-admitting or adding a worker) runs alone (exclusive), because TF waits
for every listed task when the definition changes and invalidates what was in
flight.
"""

import threading


class SharedExclusiveLock:
    """Many holders in shared mode, or one in exclusive mode."""

    def __init__(self):
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def shared(self):
        return Hold(self._acquire_shared, self._release_shared)

    def exclusive(self):
        return Hold(self._acquire_exclusive, self._release_exclusive)

    def _acquire_shared(self):
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._shared += 1

    def _release_shared(self):
        with self._cv:
            self._shared -= 1
            self._cv.notify_all()

    def _acquire_exclusive(self):
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._exclusive = True
            while self._shared:
                self._cv.wait()

    def _release_exclusive(self):
        with self._cv:
            self._exclusive = False
            self._cv.notify_all()


class Hold:
    """One hold of the lock, released once (by its holder or a watchdog)."""

    def __init__(self, acquire, release):
        self._acquire, self._release = acquire, release
        self._lock = threading.Lock()
        self._released = False

    def __enter__(self):
        self._acquire()
        return self

    def __exit__(self, *exc):
        self.release_early()

    def release_early(self):
        """Releases once, whoever calls first (the holder or a watchdog)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()
