"""The manifest of an incremental backup directory: chains of full + deltas.

A directory holds chains, oldest first. A chain is a full backup followed by
deltas, each delta holding what changed since the entry before it; every
prefix of a chain (its full, then its first k deltas) is one restorable
state, the state when its last entry was written. Each entry's files live
in a folder of their own (`full-000007/`, `delta-000008/`). One exception:
an entry written while training went on (`"fuzzy": true`: a full backup, or
a merged delta of every row changed since its chain's first state) holds
rows from different moments, and is published only with the delta that
makes it one state (every row changed since its write began); no state ends
with a fuzzy entry. A chain made by merging deltas starts with the entries
of the first state of the chain it merged, and shares their folders: it
replaces that chain's deltas, which stay as a fallback until
`keep_chains` newer full backups drop them.

`manifest.json` lists the chains, each entry with its files' lengths and
fingerprints. It is the one thing published: an entry's files are written
first, then a new manifest replaces the old one by an atomic rename, so a
crash while writing leaves the previous manifest, whose files are intact.
Folders the manifest does not name (a crashed entry's, a dropped chain's)
are deleted after each publish, by a `FolderRemoval` in a thread of its
own. Pure Python.
"""

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import time

import tensorflow as tf

from keras_ps.errors import BackupCorruptError
from keras_ps.errors import BackupWriteError

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
FORMAT = 1
_ENTRY_FOLDER = re.compile(r"^(full|delta)-\d{6,}$")


def folder_name(kind, entry_id):
    return f"{kind}-{entry_id:06d}"


def empty():
    return {"format": FORMAT, "next_id": 1, "chains": []}


def read(directory):
    """The manifest of `directory`, or None when it has none.

    Raises:
        BackupCorruptError: the manifest is not one keras_ps wrote.
    """
    path = os.path.join(directory, MANIFEST_FILE)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise BackupCorruptError(
            f"The incremental backup manifest {path!r} cannot be read "
            f"({error}). It is only ever replaced whole, so something else "
            "changed it. Fix: restore it from a copy, or delete the backup "
            "directory to start from scratch.") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BackupCorruptError(
            f"The incremental backup manifest {path!r} has format "
            f"{manifest.get('format') if isinstance(manifest, dict) else None!r}"
            f"; this keras_ps reads format {FORMAT}. Fix: use the keras_ps "
            "version that wrote it, or delete the backup directory.")
    return manifest


def publish(directory, manifest, keep, removal):
    """Replaces the manifest atomically, then has `removal` (a
    FolderRemoval) delete the entry folders it does not name (but those in
    `keep`: being written)."""
    write_atomically(os.path.join(directory, MANIFEST_FILE),
                            json.dumps(manifest, indent=1))
    removal.remove(unlisted(directory, manifest, keep))


def unlisted(directory, manifest, keep=()):
    """Paths of the entry folders of `directory` that `manifest` does not
    list and `keep` does not name."""
    listed = {entry["folder"] for chain in manifest["chains"] for entry in chain}
    listed.update(keep)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [os.path.join(directory, name) for name in sorted(names)
            if _ENTRY_FOLDER.match(name) and name not in listed]


class FolderRemoval:
    """Deletes entry folders no manifest lists any more, in a thread of its
    own, so that publishing a backup does not hold training while the file
    system frees them: deleting a dropped chain of a 10M x 64 LazyAdam table
    (a 7.7 GB full backup and its deltas) takes seconds, mostly waiting on
    the file system, not the CPU. Entry ids only grow, so no new entry is
    written into a folder waiting here; `wait(path)` is for a crashed
    attempt's folder that a retry writes again."""

    def __init__(self):
        self._changed = threading.Condition()
        self._waiting = []
        self._removing = None  # the path being deleted
        self._thread = None

    def remove(self, paths):
        with self._changed:
            self._waiting.extend(p for p in paths if p not in self._waiting
                                 and p != self._removing)
            if self._waiting and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True,
                    name="keras_ps-backup-folder-removal")
                self._thread.start()

    def _run(self):
        while True:
            with self._changed:
                self._removing = None
                self._changed.notify_all()
                if not self._waiting:
                    self._thread = None
                    return
                self._removing = self._waiting.pop(0)
            # A process ending meanwhile leaves the rest of the folder:
            # unlisted, the next publish deletes it.
            shutil.rmtree(self._removing, ignore_errors=True)

    def wait(self, path=None):
        """Returns once every folder given (or `path`) is deleted."""
        def done():
            if path is None:
                return not self._waiting and self._removing is None
            return path not in self._waiting and path != self._removing

        with self._changed:
            self._changed.wait_for(done)


def locate(manifest, entry_id):
    """(chain index, length of the chain up to that entry) of entry
    `entry_id`, or None when the manifest no longer lists it."""
    for c, chain in enumerate(manifest["chains"]):
        for i, entry in enumerate(chain):
            if entry["id"] == entry_id:
                return c, i + 1
    return None


def first_state_length(chain):
    """Entries of `chain` up to its first state: its full backup, with the
    delta sealing it when it is fuzzy."""
    return 2 if chain[0].get("fuzzy") else 1


def states_newest_first(manifest):
    """Every restorable state as (chain index, prefix length), newest
    first (by the id of its last entry, which ids order by time): the
    newest chain whole, then without its last delta, and so on, a prefix
    that ends with a fuzzy entry skipped; a state that two chains share
    (a full backup, alone) once."""
    states = {}
    for c, chain in enumerate(manifest["chains"]):
        for length in range(1, len(chain) + 1):
            if not chain[length - 1].get("fuzzy"):
                states.setdefault(chain[length - 1]["id"], (c, length))
    for entry_id in sorted(states, reverse=True):
        yield states[entry_id]


def new_entry(entry_id, kind, folder, files, table_rows, metadata):
    """The manifest entry of a backup whose `files` (records) are written
    (a full backup's gets its catalog's `describe()` too)."""
    return {"id": entry_id, "kind": kind, "folder": folder, "files": files,
            "bytes": sum(f["bytes"] for f in files), "table_rows": table_rows,
            "metadata": metadata or {}, "time": time.time()}


def with_entry(manifest, base, entry, keep_chains):
    """A new manifest with `entry` added.

    A full entry starts a new chain; the chains of full backups older than
    the `keep_chains` newest are dropped. A delta continues the state
    `base` (chain index, length): entries after it in that chain and chains
    after it are dropped (they belong to a state that was not restored).
    """
    chains = [list(chain) for chain in manifest["chains"]]
    if entry["kind"] == "full":
        chains = _newest_fulls(chains + [[entry]], keep_chains)
    else:
        c, length = base
        chains = chains[:c + 1]
        chains[c] = chains[c][:length] + [entry]
    return {"format": FORMAT, "next_id": max(manifest["next_id"],
                                             entry["id"] + 1),
            "chains": chains}


def with_chain(manifest, entries, keep_chains):
    """A new manifest with a new chain of `entries` (a full backup and the
    deltas after it). When it starts with the full backup of chains
    already listed (its deltas merged), only the newest of those stays, as
    its fallback. Chains of full backups older than the `keep_chains`
    newest are dropped."""
    full = entries[0]["id"]
    sharing = [c for c, chain in enumerate(manifest["chains"])
               if chain[0]["id"] == full]
    chains = [list(chain) for c, chain in enumerate(manifest["chains"])
              if c not in sharing[:-1]] + [list(entries)]
    return {"format": FORMAT, "next_id": max(
        [manifest["next_id"]] + [entry["id"] + 1 for entry in entries]),
        "chains": _newest_fulls(chains, keep_chains)}


def _newest_fulls(chains, keep):
    """The `chains` that start with one of the `keep` newest full
    backups."""
    kept = sorted({chain[0]["id"] for chain in chains})[-keep:]
    return [chain for chain in chains if chain[0]["id"] in kept]


def check_file(path, entry, record):
    """Raises BackupCorruptError naming `path` (a file of `entry`) if it is
    missing or its size is not the one recorded (a truncated write)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        raise BackupCorruptError(
            f"Backup file {path!r} of {entry['kind']} backup {entry['id']} "
            "is missing. Fix: the backup directory must be the same shared "
            "folder for the chief and every ps; restore() falls back to the "
            "newest complete backup before it.") from None
    if size != record["bytes"]:
        raise BackupCorruptError(
            f"Backup file {path!r} of {entry['kind']} backup {entry['id']} "
            f"has {size} bytes where {record['bytes']} were written: it was "
            "truncated or overwritten. restore() falls back to the newest "
            "complete backup before it.")


def corrupt_file_error(path, entry, reason):
    return BackupCorruptError(
        f"Backup file {path!r} of {entry['kind']} backup {entry['id']} is "
        f"corrupt: {reason}. restore() falls back to the newest complete "
        "backup before it.")


def delta_bytes(chain, length):
    """Bytes of the deltas in the first `length` entries of `chain`."""
    return sum(entry["bytes"] for entry in chain[1:length])


def still_restores(manifest):
    """What a restore of `manifest`'s directory loads, in words."""
    if not manifest or not manifest["chains"]:
        return "there is no earlier backup to restore"
    entry = manifest["chains"][-1][-1]
    return (f"restore() loads {entry['kind']} backup {entry['id']}, the "
            "newest before it, as it did")


@contextlib.contextmanager
def write_failures(target, directory, what, still):
    """Turns a failed write of backup `what` at `target` (its folder or
    file, in `directory`) inside the block into a BackupWriteError, with
    `target` removed so it does not keep a full volume full. `still`: what
    restores instead. Other errors (a TF error that does not name
    `target`: a lost ps, say) pass unchanged."""
    try:
        yield
    except (tf.errors.OpError, OSError) as error:
        failed = _write_failed(error, target, directory, what, still)
        if failed is None:
            raise
        if os.path.isdir(target):
            shutil.rmtree(target, ignore_errors=True)
        else:
            try:
                os.remove(target)
            except FileNotFoundError:
                pass
        raise failed from error


def _write_failed(error, target, directory, what, still):
    if isinstance(error, OSError):
        reason = (os.strerror(error.errno) if error.errno
                  else str(error).splitlines()[0])
    elif isinstance(error, tf.errors.OpError) and target in error.message:
        # TF's WriteFile names the file: "<path>; No space left on device".
        line = next(line for line in error.message.splitlines()
                    if target in line)
        reason = line.split(target, 1)[1].split("; ", 1)[-1].strip()
    else:
        return None
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:,.1f} MiB free there"
    except OSError:
        free = "its free space unknown"
    return BackupWriteError(
        f"Backup {what} could not be written to {directory!r}: {reason} "
        f"({free}). Nothing of it was published and its files were "
        f"removed; {still}. Fix: free space on that volume, or give the "
        "backup a directory on a larger, writable one (`backup_dir` of "
        "BackupAndRestore, `directory` of IncrementalBackup).")


def write_atomically(path, data):
    """Writes `data` (str or bytes) to `path` via a temporary file and rename."""
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.tmp-{os.getpid()}")
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        with open(tmp, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)  # a full volume keeps no half-written file
        except FileNotFoundError:
            pass
        raise


def sync_files(folder, stopped):
    """Has the kernel write every file of `folder`, and the folder itself,
    to the disk (fsync), whichever process wrote them; stops early once
    `stopped()` (asked between files) is true."""
    paths = [os.path.join(folder, name) for name in sorted(os.listdir(folder))]
    for path in paths + [folder]:
        if stopped():
            return
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


@dataclasses.dataclass(frozen=True)
class BackupEntry:
    """One backup written or restored.

    Attributes:
        id: its number in the directory (increasing).
        kind: `"full"` or `"delta"`.
        bytes: bytes of its files.
        files: how many files it has.
        table_rows: rows of row-tracked tables it holds (with their slots).
        deltas: deltas in its chain up to it (0 for a full backup).
        metadata: the dict given when it was saved.
        seconds: how long saving (or restoring) it took.
        problems: when restoring: why each newer backup could not be
            restored (empty when the newest one was).
    """

    id: int
    kind: str
    bytes: int
    files: int
    table_rows: int
    deltas: int
    metadata: dict
    seconds: float = 0.0
    problems: tuple = ()


def entry_info(entry, deltas, seconds=0.0, problems=()):
    return BackupEntry(
        id=entry["id"], kind=entry["kind"], bytes=entry["bytes"],
        files=len(entry["files"]), table_rows=entry["table_rows"],
        deltas=deltas, metadata=entry.get("metadata") or {}, seconds=seconds,
        problems=tuple(problems))


def has_backup(directory):
    """Whether `directory` holds an incremental backup (its manifest)."""
    return os.path.exists(os.path.join(directory, MANIFEST_FILE))


def check_int(name, value, minimum, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}"
                         f"{' or None' if allow_none else ''}. Received: "
                         f"{name}={value!r}.")


def check_options(max_deltas=20, max_delta_bytes=None, keep_chains=2,
                  min_table_bytes=0, merge_below=0.25):
    """Raises ValueError naming the first bad IncrementalBackup option."""
    check_int("max_deltas", max_deltas, 1)
    check_int("max_delta_bytes", max_delta_bytes, 1, allow_none=True)
    check_int("keep_chains", keep_chains, 1)
    check_int("min_table_bytes", min_table_bytes, 0)
    if (isinstance(merge_below, bool)
            or not isinstance(merge_below, (int, float))
            or not 0 <= merge_below <= 1):
        raise ValueError(
            "merge_below must be a number from 0 (compaction always writes "
            "a full backup) to 1. Received: "
            f"merge_below={merge_below!r}.")
