"""`BackupAndRestore`'s state file, backup_state.json: which backup is the
newest (its Keras weights file, or that backups are incremental) and where
training stands. It is only ever replaced whole, by an atomic rename."""

import glob
import json
import logging
import os

from keras_ps.backups import incremental_backup
from keras_ps.callbacks import _weights_files
from keras_ps.errors import BackupCorruptError

logger = logging.getLogger(__name__)

FILE_NAME = "backup_state.json"
_POSITION = ("epoch", "step", "serial")


def read(path, incremental_path):
    """The state in `path`, or None when there is no backup.

    Without the file, or with a damaged one, the newest incremental backup
    published under `incremental_path` is restored (`{"weights": None}` is
    returned): its manifest holds the same position. A damaged file is
    then rewritten by the next backup.

    Raises:
        BackupCorruptError: the file cannot be read, and there is no
            incremental backup, or a Keras weights file beside it says the
            newest backup was one (naming the file and the fix).
    """
    try:
        with open(path) as f:
            state = json.load(f)
        problem = _problem(state)
    except FileNotFoundError:
        # The first incremental backup was published, the state file not
        # yet written.
        if incremental_backup.has_backup(incremental_path):
            return {"weights": None}
        return None
    except (OSError, ValueError) as error:  # ValueError: not JSON
        problem = " ".join(str(error).split())
    if problem is None:
        return state
    directory = os.path.dirname(path)
    weights_files = sorted(glob.glob(os.path.join(
        directory, _weights_files.FILE_PATTERN)))
    if incremental_backup.has_backup(incremental_path) and not weights_files:
        logger.warning(
            "[chief] backup state file %s cannot be read (%s); restoring "
            "the newest incremental backup, whose manifest holds the same "
            "position", path, problem)
        return {"weights": None}
    beside = (f" Beside it: {[os.path.basename(p) for p in weights_files]}"
              ", whose epoch and step were in it." if weights_files else "")
    raise BackupCorruptError(
        f"Backup state file {path!r} cannot be read: {problem}. It names "
        "the newest backup and where training stands, and is only ever "
        f"replaced whole, so something else changed it.{beside} Fix: put "
        "back a copy of the file, or delete the backup directory "
        f"{directory!r} to train from scratch.")


def _problem(state):
    """What is wrong with a state read from the file, or None."""
    if not isinstance(state, dict):
        return f"it holds a JSON {type(state).__name__}, not an object"
    missing = [key for key in ("weights",) + _POSITION if key not in state]
    if missing:
        return f"it has no {', '.join(missing)}"
    if any(isinstance(state[key], bool) or not isinstance(state[key], int)
           for key in _POSITION):
        return (f"its epoch, step and serial are not all integers: "
                f"{[state[key] for key in _POSITION]}")
    return None
