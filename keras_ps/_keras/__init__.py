"""Every use of Keras internals (`keras.src...`) in keras_ps, one module per concern.

Keras 3.15 has no public extension points for what these modules do; each hook
says which one is missing. Each hook leaves models that are not built under a
keras_ps strategy exactly as plain Keras handles them, keeps Keras' own
function as `__keras_ps_original__`, and has its internals pinned in
tests/api/test_keras_internals.py, so a Keras upgrade that moves one fails
loudly there. Supported range: see setup.cfg.

The package itself installs a wrapper over a Keras function, once (`wrap`),
and finds Keras' own function behind it (`original`).

- `fit_routing`: Model.fit/evaluate/predict of a keras_ps model go to keras_ps.
- `atomic_updates`: `assign_add`/`assign_sub` of ps variables as one atomic op.
- `sharding`: sharded layer weights (creation, lookup, saving).
- `optimizers`: how optimizers update variables that live on a ps (and how
  each ps' dense gradients travel: one tensor per ps).
- `lazy_adam`: LazyAdam's per-row step slots and row-wise update.
- `grouped_reads`: a step reads each ps' small weights in one transfer.
- `initializers`: which initializers a large variable can be drawn with in
  row blocks on its ps.
- `saving`: Keras weights files of weights on the ps, a block of rows at a time.
"""

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
