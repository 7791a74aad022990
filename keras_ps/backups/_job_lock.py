"""The lock that keeps two training jobs out of one backup directory.

`BackupAndRestore` takes it on the chief when `fit` starts and gives it back
when `fit` ends: an exclusive `flock` on the file `backup.lock` in the
directory, held through a descriptor kept open while `fit` runs. The kernel
lets go of it when the process ends, however it ends, so a chief that was
SIGKILLed and started again takes it again at once. The file holds the
holder's pid and host, for the message a second job gets.

The lock is between jobs, not between the processes of one job: the ps,
which write their own row files of an incremental backup into the same
directory, never take it (a `flock` binds only those who ask for it).
"""

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time

from keras_ps import _constants
from keras_ps.errors import BackupDirInUseError

logger = logging.getLogger(__name__)

FILE_NAME = "backup.lock"
# What flock answers on a file system without locks (NFS without its lock
# daemon, some FUSE mounts): the job goes on unlocked, with a warning.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class JobLock:
    """The lock of one backup directory, as one holder takes it.

    Two `JobLock`s exclude each other in one process too (each opens the
    file on its own), as two callbacks in two threads would need.
    """

    def __init__(self, directory):
        self.directory = directory
        self.path = os.path.join(directory, FILE_NAME)
        self._file = None

    @property
    def held(self):
        return self._file is not None

    def acquire(self):
        """Takes the lock (a no-op when this object holds it already).

        Raises:
            BackupDirInUseError: another holder has it; the message names
                the directory, the holder (pid and host) and the fix.
        """
        if self._file is not None:
            return
        wait = _constants.env_float(_constants.BACKUP_LOCK_WAIT_ENV_VAR,
                                    _constants.DEFAULT_BACKUP_LOCK_WAIT,
                                    minimum=0)
        started = time.monotonic()
        warned = False
        while True:
            file = open(self.path, "a+")  # descriptors are not inherited
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read()
                file.close()
                waited = time.monotonic() - started
                if _other_host(holder) and waited < wait:
                    if not warned:
                        logger.warning(
                            "[chief] %s is locked by %s; waiting up to %.0f s "
                            "(%s) in case that machine was lost and its "
                            "network file system still holds its lock",
                            self.directory, _describe(holder), wait,
                            _constants.BACKUP_LOCK_WAIT_ENV_VAR)
                        warned = True
                    time.sleep(min(1.0, wait - waited))
                    continue
                raise BackupDirInUseError(_message(
                    self.directory, self.path, holder,
                    waited if _other_host(holder) else None)) from None
            except OSError as error:
                file.close()
                if error.errno not in _NO_LOCKS:
                    raise
                logger.warning(
                    "[chief] %s cannot be locked (%s): nothing keeps another "
                    "job from writing backups into it", self.directory,
                    os.strerror(error.errno))
                return
            # A job that ended may have deleted the directory between our
            # open and our lock: locked then is a file nobody else opens.
            if _same_file(file, self.path):
                break
            file.close()
        file.seek(0)
        file.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "since": datetime.datetime.now(datetime.timezone.utc)
                   .strftime("%Y-%m-%d %H:%M:%S UTC")}, file)
        file.flush()
        self._file = file
        logger.info("[chief] locked %s for this job", self.directory)

    def release(self):
        """Gives the lock back (a no-op when not held)."""
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.truncate(0)  # no stale holder left to name
        except OSError:
            pass
        file.close()  # the last descriptor: the kernel drops the lock


def _same_file(file, path):
    try:
        return os.path.samestat(os.fstat(file.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _other_host(holder):
    """Whether the lock file's text names a host other than this one."""
    try:
        return str(json.loads(holder)["host"]) != socket.gethostname()
    except (ValueError, TypeError, KeyError):
        return False


def _describe(holder):
    """Who holds the lock, from the lock file's text."""
    try:
        found = json.loads(holder)
        pid, host = int(found["pid"]), str(found["host"])
    except (ValueError, TypeError, KeyError):
        return "a job that has not written its pid and host yet"
    since = f", since {found['since']}" if found.get("since") else ""
    if host != socket.gethostname():
        return f"pid {pid} on host {host}{since}"
    if pid == os.getpid():
        return (f"pid {pid} on host {host}{since} (this process: another "
                "BackupAndRestore on the same directory, whose fit has not "
                "ended)")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return (f"pid {pid} on host {host}{since} (no longer running: a "
                "process it forked holds the lock still)")
    except PermissionError:
        pass  # another user's process: it runs
    return f"pid {pid} on host {host}{since}"


def _message(directory, path, holder, waited=None):
    waited = (f" (waited {waited:.0f} s for it, "
              f"{_constants.BACKUP_LOCK_WAIT_ENV_VAR})"
              if waited is not None else "")
    return (
        f"backup_dir {directory!r} is in use by another training job, "
        f"which holds its lock file {path!r}: {_describe(holder)}{waited}. "
        "Two jobs "
        "writing backups into one directory would each restore the other's. "
        f"Received: backup_dir={directory!r}. Fix: give this job a different "
        "backup_dir, or stop the other job first (a job that ends, or is "
        "killed, lets go of the lock at once). A network file system may "
        "keep the lock of a machine that was lost for a while (about 90 s "
        "on NFSv4; a holder on another host is waited for, up to "
        f"{_constants.BACKUP_LOCK_WAIT_ENV_VAR} seconds); once sure no job "
        f"uses the directory, delete {FILE_NAME!r} in it.")
