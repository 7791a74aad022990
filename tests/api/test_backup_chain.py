"""The manifest of an incremental backup directory (keras_ps.backups._chain):
which states restore, in which order, what a new entry drops, and what is
published. No cluster needed."""

import json
import os
import shutil
import threading

import pytest

from keras_ps.backups import _chain as _backup_chain
from keras_ps.errors import BackupCorruptError

pytestmark = pytest.mark.timeout(60)


def entry(entry_id, kind, size=10):
    return {"id": entry_id, "kind": kind, "bytes": size, "files": [],
            "folder": _backup_chain.folder_name(kind, entry_id)}


def manifest_of(*chains):
    manifest = _backup_chain.empty()
    for chain in chains:
        for e in chain:
            base = (None if e["kind"] == "full"
                    else _backup_chain.locate(manifest, e["id"] - 1))
            manifest = _backup_chain.with_entry(manifest, base, e, 5)
    return manifest


def test_states_newest_first_fall_back_delta_by_delta_then_chain_by_chain():
    manifest = manifest_of([entry(1, "full"), entry(2, "delta")],
                           [entry(3, "full"), entry(4, "delta"),
                            entry(5, "delta")])
    assert list(_backup_chain.states_newest_first(manifest)) == [
        (1, 3), (1, 2), (1, 1), (0, 2), (0, 1)]
    assert _backup_chain.locate(manifest, 4) == (1, 2)
    assert _backup_chain.locate(manifest, 9) is None
    assert manifest["next_id"] == 6


def test_a_delta_after_a_restored_state_drops_what_came_after_it():
    manifest = manifest_of([entry(1, "full"), entry(2, "delta")],
                           [entry(3, "full"), entry(4, "delta"),
                            entry(5, "delta")])
    # Restored (chain 0, length 2): chain 1 is dropped.
    after = _backup_chain.with_entry(manifest, (0, 2), entry(6, "delta"), 5)
    assert [[e["id"] for e in c] for c in after["chains"]] == [[1, 2, 6]]
    # Restored (chain 1, length 2): delta 5 is dropped.
    after = _backup_chain.with_entry(manifest, (1, 2), entry(6, "delta"), 5)
    assert [[e["id"] for e in c] for c in after["chains"]] == [[1, 2],
                                                              [3, 4, 6]]


def test_a_fuzzy_full_backup_is_a_state_only_with_its_first_delta():
    fuzzy = dict(entry(3, "full"), fuzzy=True)
    manifest = manifest_of([entry(1, "full"), entry(2, "delta")])
    # Published with the delta that seals it, as a new chain.
    after = _backup_chain.with_chain(manifest, [fuzzy, entry(5, "delta")], 2)
    assert [[e["id"] for e in c] for c in after["chains"]] == [[1, 2], [3, 5]]
    assert after["next_id"] == 6
    assert list(_backup_chain.states_newest_first(after)) == [
        (1, 2), (0, 2), (0, 1)]
    assert [[e["id"] for e in c] for c in _backup_chain.with_chain(
        after, [dict(entry(6, "full"), fuzzy=True), entry(7, "delta")], 2
    )["chains"]] == [[3, 5], [6, 7]]


def test_a_merged_chain_shares_its_full_backup_and_falls_back_by_time():
    full = entry(1, "full")
    manifest = manifest_of([full, entry(2, "delta"), entry(3, "delta")])
    merged = dict(entry(4, "delta"), fuzzy=True)  # rows changed since 1
    # Delta 5 was saved on the old chain while the merged delta was
    # written; delta 6 seals it.
    manifest = _backup_chain.with_entry(manifest, (0, 3), entry(5, "delta"),
                                        2)
    after = _backup_chain.with_chain(manifest, [full, merged,
                                                entry(6, "delta")], 2)
    assert [[e["id"] for e in c] for c in after["chains"]] == [
        [1, 2, 3, 5], [1, 4, 6]]
    # Newest state first, whichever chain holds it; no state ends with the
    # merged delta; the full backup alone once.
    assert list(_backup_chain.states_newest_first(after)) == [
        (1, 3), (0, 4), (0, 3), (0, 2), (0, 1)]
    assert after["next_id"] == 7
    # Merged again: the chain merged stays as the fallback, the one
    # before it goes; the full backup's folder stays listed.
    again = _backup_chain.with_chain(
        _backup_chain.with_entry(after, (1, 3), entry(7, "delta"), 2),
        [full, dict(entry(8, "delta"), fuzzy=True), entry(9, "delta")], 2)
    assert [[e["id"] for e in c] for c in again["chains"]] == [
        [1, 4, 6, 7], [1, 8, 9]]
    # keep_chains counts full backups: two new ones leave only theirs.
    newer = _backup_chain.with_entry(again, None, entry(10, "full"), 2)
    assert [[e["id"] for e in c] for c in newer["chains"]] == [
        [1, 4, 6, 7], [1, 8, 9], [10]]
    newest = _backup_chain.with_entry(newer, None, entry(11, "full"), 2)
    assert [[e["id"] for e in c] for c in newest["chains"]] == [[10], [11]]


def test_a_full_backup_keeps_keep_chains_chains():
    manifest = manifest_of([entry(1, "full")], [entry(2, "full")])
    after = _backup_chain.with_entry(manifest, None, entry(3, "full"), 2)
    assert [[e["id"] for e in c] for c in after["chains"]] == [[2], [3]]
    assert _backup_chain.delta_bytes(
        [entry(1, "full"), entry(2, "delta", 4), entry(3, "delta", 5)], 3) == 9


def test_publish_replaces_the_manifest_and_removes_unlisted_folders(tmp_path):
    for name in ("full-000001", "delta-000002", "delta-000003",
                 "full-000004", "other"):
        os.makedirs(tmp_path / name)
    manifest = manifest_of([entry(1, "full"), entry(2, "delta")])
    removal = _backup_chain.FolderRemoval()
    # full-000004: a full backup being written, kept.
    _backup_chain.publish(str(tmp_path), manifest, ["full-000004"], removal)
    removal.wait()
    assert sorted(os.listdir(tmp_path)) == [
        "delta-000002", "full-000001", "full-000004", "manifest.json",
        "other"]
    _backup_chain.publish(str(tmp_path), manifest, [], removal)
    removal.wait()
    assert sorted(os.listdir(tmp_path)) == [
        "delta-000002", "full-000001", "manifest.json", "other"]
    assert _backup_chain.read(str(tmp_path)) == manifest
    assert _backup_chain.read(str(tmp_path / "none")) is None


def test_a_publish_with_a_folder_removal_returns_before_the_folders_go(
        tmp_path, monkeypatch):
    """Deleting a dropped chain can take seconds; publishing does not wait
    for it. The file system's slowness is played by holding each delete
    until the test lets it go."""
    for name in ("full-000001", "delta-000002", "full-000003", "other"):
        os.makedirs(tmp_path / name)
    let_go, deleting = threading.Event(), threading.Event()
    rmtree, deleted = shutil.rmtree, []

    def slow_rmtree(path, ignore_errors=False):
        deleted.append(os.path.basename(path))
        deleting.set()
        assert let_go.wait(30)
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(_backup_chain.shutil, "rmtree", slow_rmtree)
    removal = _backup_chain.FolderRemoval()
    manifest = manifest_of([entry(3, "full")])
    _backup_chain.publish(str(tmp_path), manifest, [], removal)
    assert _backup_chain.read(str(tmp_path)) == manifest
    assert deleting.wait(30)
    assert {"full-000001", "delta-000002"} <= set(os.listdir(tmp_path))
    # Queued again while being deleted: once only.
    removal.remove([str(tmp_path / "full-000001")])
    let_go.set()
    removal.wait(str(tmp_path / "delta-000002"))
    assert "delta-000002" not in os.listdir(tmp_path)
    removal.wait()
    assert sorted(os.listdir(tmp_path)) == ["full-000003", "manifest.json",
                                            "other"]
    assert deleted == ["delta-000002", "full-000001"]
    # Nothing queued: no thread, and wait() returns at once.
    assert removal._thread is None
    removal.remove([])
    assert removal._thread is None
    removal.wait()


def test_sync_files_syncs_each_file_then_the_folder_and_stops_when_asked(
        tmp_path, monkeypatch):
    """A compaction's files are synced by the chief, which did not write
    them: each file, then the folder (its names), and no more once the
    compaction is dropped. The fsyncs are recorded by the path they were
    given (and still run)."""
    for name in ("rows.1", "rows.0", "bundle.0"):
        (tmp_path / name).write_bytes(name.encode() * 1000)
    fsync, synced = os.fsync, []

    def recording_fsync(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    monkeypatch.setattr(_backup_chain.os, "fsync", recording_fsync)
    _backup_chain.sync_files(str(tmp_path), lambda: False)
    assert synced == [str(tmp_path / n) for n in ("bundle.0", "rows.0",
                                                  "rows.1")] + [str(tmp_path)]
    del synced[:]
    asked = []

    def stopped():
        asked.append(True)
        return len(asked) > 1

    _backup_chain.sync_files(str(tmp_path), stopped)
    assert synced == [str(tmp_path / "bundle.0")]
    # Its folder removed meanwhile (the compaction dropped): named.
    with pytest.raises(FileNotFoundError, match="gone"):
        _backup_chain.sync_files(str(tmp_path / "gone"), lambda: False)


def test_an_unreadable_manifest_or_file_is_named(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BackupCorruptError, match="manifest.json"):
        _backup_chain.read(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(BackupCorruptError, match="format 99"):
        _backup_chain.read(str(tmp_path))
    path = str(tmp_path / "rows.0")
    with open(path, "wb") as f:
        f.write(b"12345")
    e = entry(7, "delta")
    _backup_chain.check_file(path, e, {"bytes": 5})
    with pytest.raises(BackupCorruptError, match="has 5 bytes where 6"):
        _backup_chain.check_file(path, e, {"bytes": 6})
    with pytest.raises(BackupCorruptError, match="missing"):
        _backup_chain.check_file(path + "x", e, {"bytes": 5})
