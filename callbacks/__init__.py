"""keras_ps.callbacks: Keras callbacks for parameter-server training.

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
