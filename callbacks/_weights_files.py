"""`BackupAndRestore`'s backups as Keras weights files (the mode for models
without large row-tracked tables): written through the chief, published by
the state file's atomic rename; with `double_checkpoint` the backup before
is kept, and restored when the newest file cannot be read."""

import glob
import json
import logging
import os

import tensorflow as tf

from keras_ps.backups import _chain
from keras_ps.errors import BackupCorruptError

logger = logging.getLogger(__name__)

FILE_PATTERN = "backup-*.weights.h5"


def write(model, directory, state_path, state, previous, keep_previous):
    """Writes the weights file of backup `state` and publishes `state` (with
    the backup before it, `previous`, when `keep_previous`); then removes
    the weights files it no longer lists. Returns the state published.

    Raises:
        BackupWriteError: the file could not be written (removed again; the
            backup before still restores).
    """
    name = f"backup-{state['serial']}.weights.h5"
    state = dict(state, weights=name)
    if keep_previous and previous is not None and previous.get("weights"):
        state["previous"] = {key: value for key, value in previous.items()
                             if key != "previous"}
    still = ("there is no earlier backup to restore" if previous is None
             else f"backup {previous.get('serial')} (epoch "
             f"{previous.get('epoch')}, step {previous.get('step')}) "
             "restores as it did")
    path = os.path.join(directory, name)
    with _chain.write_failures(path, directory, str(state["serial"]), still):
        model.save_weights(path, overwrite=True)
        _chain.write_atomically(state_path, json.dumps(state))
    remove_unlisted(directory, state)
    return state


def remove_unlisted(directory, state):
    """Removes the weights files `state` does not list (those of older
    backups, or all once backups are incremental)."""
    listed = {state.get("weights"), (state.get("previous") or {}).get("weights")}
    for path in glob.glob(os.path.join(directory, FILE_PATTERN)):
        if os.path.basename(path) not in listed:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def load(model, directory, state, mismatch):
    """Loads the weights file of backup `state` into `model`; returns the
    state loaded. A file that cannot be read (damaged, removed) falls back,
    with a warning, to the backup before it when `state` keeps one.

    Raises:
        BackupCorruptError: the file cannot be read and no backup before it
            is kept; it names the file and the fix.
        What `mismatch(path, error)` raises for Keras' ValueError (the file
            is of a different model, or a ps was lost meanwhile).
    """
    path = os.path.join(directory, state["weights"])
    try:
        model.load_weights(path)
        return state
    except ValueError as error:
        mismatch(path, error)
        raise
    except OSError as error:
        previous = state.get("previous")
        reason = " ".join(str(error).split())
        if previous is None:
            raise BackupCorruptError(
                f"Backup file {path!r} of backup {state.get('serial')} "
                f"(epoch {state.get('epoch')}, step {state.get('step')}) "
                f"cannot be read: {reason}. No backup before it is kept. "
                "Fix: delete the backup directory to train from scratch; "
                "pass double_checkpoint=True to keep the backup before each "
                "one, restored when the newest cannot be read.") from error
        logger.warning(
            "[chief] backup file %s cannot be read (%s); restoring the "
            "backup before it: backup %s (epoch %s, step %s)", path, reason,
            previous.get("serial"), previous.get("epoch"),
            previous.get("step"))
    return load(model, directory, previous, mismatch)


def load_keeping(model, path, kept):
    """Loads the weights file at `path` into `model`, except the variables
    in `kept`, which keep their values."""
    # A copy of each kept variable on its own ps (nothing travels through
    # the chief), written back after the file, which holds every variable,
    # was loaded.
    copies = []
    for variable in kept:
        with tf.device(variable.device):
            copies.append(tf.identity(variable))
    model.load_weights(path)
    for variable, copy in zip(kept, copies):
        variable.assign(copy)
