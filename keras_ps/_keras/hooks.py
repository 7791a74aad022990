"""Installs wrappers over Keras functions, once each, and finds the originals."""

import threading

_lock = threading.Lock()


def wrap(owner, name, make_wrapper):
    """Replaces `owner.name` with `make_wrapper(original)`, once per process.

    The wrapper keeps Keras' own function as `__keras_ps_original__`; a second
    call for the same attribute does nothing.
    """
    with _lock:
        current = getattr(owner, name)
        if hasattr(current, "__keras_ps_original__"):
            return
        wrapper = make_wrapper(current)
        wrapper.__keras_ps_original__ = current
        setattr(owner, name, wrapper)


def original(owner, name):
    """Keras' own function behind a hook (for the plain path and for tests)."""
    function = getattr(owner, name)
    return getattr(function, "__keras_ps_original__", function)


def installed(owner, name):
    return hasattr(getattr(owner, name), "__keras_ps_original__")
