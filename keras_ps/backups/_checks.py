"""Checks made before a backup or a checkpoint is written: arguments that
must be True or False, the directory to write into, the environment
variables that writing and restoring backups read, and that the ps see the
backup directory. Each runs when training starts (or when the object is
made), so a bad setting fails there, not at the first backup after steps
were trained."""

import os
import uuid

import numpy as np
import tensorflow as tf

from keras_ps import _native
from keras_ps.tables import _row_chunks


def is_bool(value):
    """True for Python's and numpy's bools; False for anything else, 0, 1
    and strings such as "no" (which would read as True) included."""
    return isinstance(value, (bool, np.bool_))


def check_bools(**arguments):
    """Raises ValueError naming the first of `arguments` (name=value) that
    is not True or False (see `is_bool`)."""
    for name, value in arguments.items():
        if not is_bool(value):
            raise ValueError(f"{name} must be True or False. Received: "
                             f"{name}={value!r}.")


def check_directory(path, argument):
    """Raises ValueError when `path` (a directory to write into, given as
    the argument `argument`), or the nearest folder above it that exists,
    is a file."""
    existing = path
    while existing and not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            return
        existing = parent
    if existing and not os.path.isdir(existing):
        what = ("is" if existing == path
                else f"is inside {existing!r}, which is")
        raise ValueError(
            f"{argument} must be a directory (created if missing), but "
            f"{path!r} {what} a file. Received: {argument}={path!r}. Fix: "
            "pass the path of a directory, or move the file away.")


def make_directory(path, argument):
    """Creates directory `path` if missing.

    Raises:
        ValueError: a file is in the way (see `check_directory`).
    """
    check_directory(path, argument)
    os.makedirs(path, exist_ok=True)


def check_environment():
    """Reads now the environment variables that backups read when they are
    written or restored: `KERAS_PS_SAVE_CHUNK_BYTES` (the most bytes of a
    weight moved at once), `KERAS_PS_NATIVE` (keras_ps' C++ kernels) and,
    with those on, `KERAS_PS_DIRECT_IO` (read when they load).

    Raises:
        ValueError: a variable's value is malformed or out of range (the
            message names it, its value and the default).
    """
    _row_chunks.chunk_bytes()
    if _native.enabled():
        _native.check_direct_io()


def check_shared(directory, devices):
    """Each remote device of `devices` writes a file into `directory` that
    this process must read back.

    Raises:
        ValueError: a device's file is not seen here (the folder is not
            shared at the same path).
    """
    for device in devices:
        token = uuid.uuid4().hex
        path = os.path.join(directory, f".probe-{token}")
        with tf.device(device):
            tf.io.write_file(path, token)
        try:
            with open(path) as f:
                seen = f.read()
        except OSError:
            seen = None
        if seen != token:
            raise ValueError(
                f"{device} wrote {path!r}, but this process does not see "
                "that file: the ps write their rows of an incremental "
                "backup themselves, so the directory must be one folder "
                "shared by the chief and every ps at the same path. "
                f"Received: directory={directory!r}. Fix: mount one "
                "shared volume at that path everywhere.")
        os.remove(path)
