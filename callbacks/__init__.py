"""keras_ps.callbacks: Keras callbacks for parameter-server training.

This package owns the callbacks a user passes to `Model.fit`:
`BackupAndRestore` (backups of the whole training state, full or incremental
through `keras_ps.backups`, and resuming from them, a lost ps included) and
the sidecar evaluator's `SidecarCheckpoint` and `SidecarEvaluatorModelExport`.
Installed as `keras_ps.callbacks` (setup.cfg package_dir).
"""

from keras_ps.callbacks.backup_and_restore import BackupAndRestore
from keras_ps.callbacks.sidecar import SidecarCheckpoint
from keras_ps.callbacks.sidecar import SidecarEvaluatorModelExport

__all__ = [
    "BackupAndRestore",
    "SidecarCheckpoint",
    "SidecarEvaluatorModelExport",
]
