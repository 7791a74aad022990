"""Writing a file so that readers see the old content or the new, never half."""

import os


def write_atomically(path, data):
    """Writes `data` (str or bytes) to `path` via a temporary file and rename."""
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.tmp-{os.getpid()}")
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(tmp, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
