"""Keeps keras_ps' threads out of TF's C++ calls while the process exits.

When Python exits, a daemon thread that comes back from a C call which let
the GIL go is ended where it stands (`pthread_exit`), inside that call. In
TF's calls that make a function from a traced graph, or register it on the
tasks, that unwind meets a frame that may not throw and the process aborts
("terminate called ... FATAL: exception not rethrown", exit code -6) after
the job itself ended, its error printed. keras_ps' worker threads trace new
pack sizes while training runs, so a script that ends just after an error
(a lost ps) could abort that way, and the backups' threads trace the
functions that write a backup's blocks. Every such trace on a keras_ps thread
runs inside `tf_section()`: at exit, before Python ends its threads, the
interpreter waits for the sections under way (up to `_EXIT_WAIT` seconds),
and a keras_ps thread that reaches a section from then on stops there for
good (it holds none of the locks the exit needs). Long work in a section (a
full backup written block by block) asks `exiting()` between its steps and
stops early, so that the exit waits for one step, not for all of it.
"""

import atexit
import contextlib
import logging
import threading

logger = logging.getLogger(__name__)

# The longest the process' exit waits for the sections under way. A trace
# takes a second or a few, a delta's write about as long, a compaction until
# its next block; one waiting on a hung worker or ps may take until that task
# continues, and is not waited for longer.
_EXIT_WAIT = 30.0

_lock = threading.Condition()
_under_way = 0
_exiting = False
_never = threading.Event()
_depth = threading.local()  # sections the calling thread is in


def exiting():
    """Whether the process' exit has begun (its wait for the sections)."""
    return _exiting


def tf_section():
    """A context manager around a TF call that must not be cut short by the
    interpreter's exit (a trace, a function's registration). A section
    inside another of the same thread is part of it: it never stops there."""
    global _under_way
    if getattr(_depth, "value", 0):
        return _inside(counted=False)
    with _lock:  # checked and counted at once: the exit sees every section
        stop = _exiting and threading.current_thread() is not \
            threading.main_thread()
        if not stop:
            _under_way += 1
    if stop:
        _never.wait()  # a daemon thread: the process ends around it
    return _inside(counted=True)


def helper_sections(count):
    """`count` sections, counted now, for helper threads that the calling
    thread (inside a section) is about to start: each helper enters one
    around its TF calls and never stops at it. The exit waits for them as
    for any section, even when the caller no longer waits (an interrupted
    join)."""
    global _under_way
    with _lock:
        _under_way += count
    return [_inside(counted=True) for _ in range(count)]


@contextlib.contextmanager
def _inside(counted):
    """The calling thread inside a section; `counted`: the section's count
    ends when the thread leaves it."""
    global _under_way
    depth = getattr(_depth, "value", 0)
    _depth.value = depth + 1
    try:
        yield
    finally:
        _depth.value = depth
        if counted:
            with _lock:
                _under_way -= 1
                _lock.notify_all()


@atexit.register
def wait_for_sections(timeout=_EXIT_WAIT):
    """At exit: waits for the sections under way; returns whether none is."""
    global _exiting
    with _lock:
        _exiting = True
        if _under_way and not _lock.wait_for(lambda: _under_way == 0,
                                             timeout):
            logger.warning(
                "keras_ps: exiting while %d trace(s) or backup write(s) "
                "still run after %.0f s (most likely waiting for a stopped "
                "worker or ps); the process may abort as Python ends them",
                _under_way, timeout)
            return False
    return True
