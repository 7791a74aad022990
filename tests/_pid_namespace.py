"""Running a command as the first process of a new PID namespace, as a
container's command runs: the kernel drops a signal sent to that process
for which it has no handler."""

import os
import shutil
import subprocess


def pid_1_prefix():
    """(A command prefix that runs the command as PID 1 of a new namespace,
    None) or (None, the reason it cannot here)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None, "a new PID namespace needs root and unshare(1)"
    probe = subprocess.run(["unshare", "--fork", "--pid", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"unshare --pid fails here: {probe.stderr.strip()}"
    return ["unshare", "--fork", "--pid"], None
