"""The lock that keeps two training jobs out of one backup directory.

`keras_ps.callbacks.BackupAndRestore` takes it on the chief when `fit` starts
and gives it back when `fit` ends; `keras_ps.IncrementalBackup` takes it at
its first save, restore or check and gives it back at `close()`. It is an
exclusive `flock` on the file `backup.lock` in the directory, held through
a descriptor kept open meanwhile. The kernel lets go of it when the process
ends, however it ends, so a chief that was SIGKILLed and started again
takes it again at once. The file holds the holder's pid and host and what
holds it, for the message a second job gets.

The lock is between jobs, not between the processes of one job: the ps,
which write their own row files of an incremental backup into the same
directory, never take it (a `flock` binds only those who ask for it).
"""

import datetime
import enum
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


# What takes the lock: the argument that names the directory (in the
# message), and such a holder of the refused job's own process.
_HOLDERS = {
    "BackupAndRestore": ("backup_dir", "a BackupAndRestore on the same "
                         "directory, whose fit has not ended"),
    "IncrementalBackup": ("directory", "an IncrementalBackup on the same "
                          "directory, not closed yet"),
}


class LockState(enum.Enum):
    FREE = "free"  # not taken yet, or given back
    HELD = "held"
    UNLOCKED = "unlocked"  # the file system has no locks: used without one


class JobLock:
    """The lock of one backup directory, as one holder takes it.

    Two `JobLock`s exclude each other in one process too (each opens the
    file on its own), as two callbacks in two threads would need.

    Args:
        directory: the backup directory (it must exist when the lock is
            taken).
        holder: what takes it, `"BackupAndRestore"` or
            `"IncrementalBackup"`: written into the file, and it names the
            directory's argument in the message a second job gets.
    """

    def __init__(self, directory, holder):
        if holder not in _HOLDERS:
            raise ValueError(f"holder must be one of {sorted(_HOLDERS)}. "
                             f"Received: holder={holder!r}.")
        self.directory = directory
        self.holder = holder
        self.path = os.path.join(directory, FILE_NAME)
        self.state = LockState.FREE
        self._file = None

    @property
    def held(self):
        return self.state is LockState.HELD

    def covers(self, directory):
        """Whether `directory` is this lock's directory or a folder in it."""
        mine = os.path.realpath(self.directory)
        return os.path.commonpath([mine, os.path.realpath(directory)]) == mine

    def _become(self, state, file=None):
        self.state, self._file = state, file
        logger.info("[chief] the lock of %s for this %s: %s", self.directory,
                    self.holder, state.value)

    def acquire(self):
        """Takes the lock (a no-op when this object holds it already, or
        found that the file system has no locks).

        Raises:
            BackupDirInUseError: another holder has it; the message names
                the directory, the holder (pid and host) and the fix.
        """
        if self.state is not LockState.FREE:
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
                text = file.read()
                file.close()
                waited = time.monotonic() - started
                if _other_host(text) and waited < wait:
                    if not warned:
                        logger.warning(
                            "[chief] %s is locked by %s; waiting up to %.0f s "
                            "(%s) in case that machine was lost and its "
                            "network file system still holds its lock",
                            self.directory, _describe(text), wait,
                            _constants.BACKUP_LOCK_WAIT_ENV_VAR)
                        warned = True
                    time.sleep(min(1.0, wait - waited))
                    continue
                raise BackupDirInUseError(_message(
                    self.directory, self.path, text, self.holder,
                    waited if _other_host(text) else None)) from None
            except OSError as error:
                file.close()
                if error.errno not in _NO_LOCKS:
                    raise
                logger.warning(
                    "[chief] %s cannot be locked (%s): nothing keeps another "
                    "job from writing backups into it", self.directory,
                    os.strerror(error.errno))
                self._become(LockState.UNLOCKED)
                return
            # A job that ended may have deleted the directory between our
            # open and our lock: locked then is a file nobody else opens.
            if _same_file(file, self.path):
                break
            file.close()
        file.seek(0)
        file.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "by": self.holder,
                   "since": datetime.datetime.now(datetime.timezone.utc)
                   .strftime("%Y-%m-%d %H:%M:%S UTC")}, file)
        file.flush()
        self._become(LockState.HELD, file)

    def release(self):
        """Gives the lock back (a no-op when not taken)."""
        if self.state is LockState.FREE:
            return
        file = self._file
        self._become(LockState.FREE)
        if file is None:
            return  # a file system without locks
        try:
            file.truncate(0)  # no stale holder left to name
        except OSError:
            pass
        file.close()  # the last descriptor: the kernel drops the lock


def own_lock(directory, lock):
    """The JobLock a `keras_ps.IncrementalBackup` in `directory` takes
    itself, or None when it was given `lock`, held by its caller
    (`BackupAndRestore`'s on its `backup_dir`).

    Raises:
        ValueError: `lock` is not a JobLock of `directory` or of a folder
            above it.
    """
    if lock is None:
        return JobLock(directory, "IncrementalBackup")
    if not (isinstance(lock, JobLock) and lock.covers(directory)):
        raise ValueError(
            "lock must be the lock its caller holds on the directory or a "
            f"folder above it, or None. Received: lock={lock!r} for "
            f"directory={directory!r}. Fix: leave lock out (the backup "
            "locks its directory itself).")
    return None


def _same_file(file, path):
    try:
        return os.path.samestat(os.fstat(file.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _other_host(text):
    """Whether the lock file's text names a host other than this one."""
    try:
        return str(json.loads(text)["host"]) != socket.gethostname()
    except (ValueError, TypeError, KeyError):
        return False


def _describe(text):
    """Who holds the lock, from the lock file's text."""
    try:
        found = json.loads(text)
        pid, host = int(found["pid"]), str(found["host"])
    except (ValueError, TypeError, KeyError):
        return "a job that has not written its pid and host yet"
    by = found.get("by")
    what = f" ({by})" if by in _HOLDERS else ""
    since = f", since {found['since']}" if found.get("since") else ""
    if host != socket.gethostname():
        return f"pid {pid} on host {host}{what}{since}"
    if pid == os.getpid():
        return (f"pid {pid} on host {host}{since} (this process: "
                f"{_HOLDERS.get(by, _HOLDERS['BackupAndRestore'])[1]})")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return (f"pid {pid} on host {host}{what}{since} (no longer running: "
                "a process it forked holds the lock still)")
    except PermissionError:
        pass  # another user's process: it runs
    return f"pid {pid} on host {host}{what}{since}"


def _message(directory, path, text, refused, waited=None):
    """The message `refused` (what asked for the lock) gets while the
    holder the lock file's `text` names holds it."""
    argument = _HOLDERS[refused][0]
    waited = (f" (waited {waited:.0f} s for it, "
              f"{_constants.BACKUP_LOCK_WAIT_ENV_VAR})"
              if waited is not None else "")
    return (
        f"{argument} {directory!r} is in use by another training job, "
        f"which holds its lock file {path!r}: {_describe(text)}{waited}. "
        "Two jobs "
        "writing backups into one directory would each restore the other's. "
        f"Received: {argument}={directory!r}. Fix: give this job a different "
        f"{argument}, or stop the other job first (a job lets go of the "
        "lock at once when it ends or is killed, an IncrementalBackup when "
        "it is closed). A network file system may "
        "keep the lock of a machine that was lost for a while (about 90 s "
        "on NFSv4; a holder on another host is waited for, up to "
        f"{_constants.BACKUP_LOCK_WAIT_ENV_VAR} seconds); once sure no job "
        f"uses the directory, delete {FILE_NAME!r} in it.")
