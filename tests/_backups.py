"""Reading keras_ps.callbacks.BackupAndRestore's state file, for tests."""

import json
import os


def read_backup_state(backup_dir):
    """The newest backup's state (epoch, step, ...), or None while there is
    none or it is being replaced."""
    try:
        with open(os.path.join(backup_dir, "backup_state.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
