"""Keeps keras_ps' threads out of TF's C++ calls while the process exits.

When Python exits, a daemon thread that comes back from a C call which let
the GIL go is ended where it stands (`pthread_exit`), inside that call. In
TF's calls that make a function from a traced graph, or register it on the
tasks, that unwind meets a frame that may not throw and the process aborts
("terminate called ... FATAL: exception not rethrown", exit code -6) after
the job itself ended, its error printed. keras_ps' worker threads trace new
pack sizes while training runs, so a script that ends just after an error
(a lost ps) could abort that way. Every such trace on a keras_ps thread runs
inside `tf_section()`: at exit, before Python ends its threads, the
interpreter waits for the sections under way (up to `_EXIT_WAIT` seconds),
and a keras_ps thread that reaches a section from then on stops there for
good (it holds none of the locks the exit needs).
"""

import atexit
import contextlib
import logging
import threading

logger = logging.getLogger(__name__)

# The longest the process' exit waits for traces under way. A trace takes a
# second or a few; one waiting to be registered on a hung worker may take
# until that worker continues, and is not waited for longer.
_EXIT_WAIT = 30.0

_lock = threading.Condition()
_under_way = 0
_exiting = False
_never = threading.Event()


@contextlib.contextmanager
def tf_section():
    """Around a TF call that must not be cut short by the interpreter's exit
    (a trace, a function's registration)."""
    global _under_way
    with _lock:  # checked and counted at once: the exit sees every section
        stop = _exiting and threading.current_thread() is not \
            threading.main_thread()
        if not stop:
            _under_way += 1
    if stop:
        _never.wait()  # a daemon thread: the process ends around it
    try:
        yield
    finally:
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
                "keras_ps: exiting while %d trace(s) still run after %.0f s "
                "(most likely waiting for a stopped worker); the process may "
                "abort as Python ends them", _under_way, timeout)
            return False
    return True
