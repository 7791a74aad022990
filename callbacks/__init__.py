"""keras_ps.callbacks: Keras callbacks for parameter-server training.

Installed as `keras_ps.callbacks` (setup.cfg package_dir). BackupAndRestore
and the sidecar-evaluation callbacks are planned (issues 4 and 5).
"""

__all__ = []
