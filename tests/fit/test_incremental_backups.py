"""Incremental backups (keras_ps.IncrementalBackup, BackupAndRestore's
`incremental`) on a real LocalCluster with 2 ps, each job in its own
coordinator process (tests/_incremental_job.py).

- A full backup and deltas restore, into another number of shards, exactly
  (every bit of every model and optimizer variable) the model at the last
  delta and the Keras weights file written at that step: Adam (its table
  written whole), LazyAdam, Adagrad, SGD and Ftrl, saved in 2 or 3 shards;
  also with deltas written in the background while the model trains on.
- A delta holds the rows the steps since the previous backup touched, not
  the table.
- A truncated, altered or missing delta file: an error naming the file, and
  the fallback to the backup before it; training goes on from there.
- A crash after a delta's files are written, before it is published: the
  previous chain restores (an exception in-process, and a real process
  exit); the next backup removes the orphan files.
- Compaction after `max_deltas` deltas or `max_delta_bytes` bytes; written
  while training goes on, sealed by the next delta, restored bit for bit;
  dropped by a restore.
- BackupAndRestore(incremental=True) through fit and its restore;
  incremental="auto" stays off for a small model; a ps lost mid-fit is
  recovered from full + deltas.

The runs that need no process of their own (equivalence, faults,
compaction written while training, the restore after a process crash,
BackupAndRestore, a zeroed generation) are parts of one job, on one
cluster, shared by the module's tests: a job's start takes about as long as
a part.
"""

import os
import sys

import pytest

from _paths import TESTS
from _results import PREFIX
from _results import last_report
from _results import reports
from _results import run_child

JOB = os.path.join(TESTS, "_incremental_job.py")
ROWS, TOUCHED = 60, 24  # as the job's table: ids are drawn below TOUCHED


def run(mode, directory, *args, timeout=900, cases=None):
    os.makedirs(directory, exist_ok=True)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if cases:
        env["KERAS_PS_TEST_CASES"] = ",".join(cases)
    return run_child([sys.executable, JOB, mode, str(directory),
                      *map(str, args)], timeout, cwd=TESTS, env=env)


def by_part(output):
    """The reports of a `shared` job, by part (each after `PART name`)."""
    parts, part = {}, None
    for line in output.splitlines():
        if line.startswith("PART "):
            part = parts.setdefault(line[len("PART "):], [])
        elif line.startswith(PREFIX):
            part.append(reports(line)[0])
    return parts


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A process crash between a delta's files and its manifest: the
    crash_write job's exit code and output, and the backup it left."""
    directory = tmp_path_factory.mktemp("crash") / "backup"
    code, output = run("crash_write", directory, timeout=600)
    return code, output, directory


@pytest.fixture(scope="module")
def shared_output(crashed, tmp_path_factory):
    """The output of the `shared` job: its equivalence part with the
    default suite's cases, its crash_restore part on crash_write's
    backup."""
    code, output = run("shared", tmp_path_factory.mktemp("shared"),
                       crashed[2], timeout=1500, cases=SHORT)
    assert code == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def shared(shared_output):
    """Every part of the `shared` job, by part."""
    return by_part(shared_output)


CASES = [f"{opt}-{saved}-to-{restored}"
         for opt in ("adam", "lazy_adam", "adagrad", "sgd", "ftrl")
         for saved, restored in ((2, 3), (3, 2))] + [
            "lazy_adam-2-to-1", "lazy_adam_background-2-to-3",
            "adagrad_background-3-to-2"]
# The default suite: Adam, LazyAdam, Adagrad and SGD, both directions and a
# background delta; `-m slow` runs every case (Ftrl, 2 shards into 1 too).
# LazyAdam's deltas written in the foreground restore exactly in the faults,
# crash_restore and compaction parts (2 shards into 1 and 3).
SHORT = ["adam-2-to-3", "adagrad-2-to-3", "sgd-3-to-2",
         "lazy_adam_background-2-to-3"]


def equivalence_of(cases, tmp_path_factory):
    code, output = run("equivalence", tmp_path_factory.mktemp("equivalence"),
                       timeout=1500, cases=cases)
    assert code == 0, output[-4000:]
    return {r["case"]: r for r in reports(output)}


@pytest.fixture(scope="module")
def equivalence(shared):
    return {r["case"]: r for r in shared["equivalence"]}


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("case", SHORT)
def test_full_plus_deltas_restore_bit_for_bit_into_other_shards(
        case, equivalence):
    check_equivalence(case, equivalence[case])


@pytest.mark.timeout(1600)
def test_row_files_written_past_the_page_cache_restore_bit_for_bit(
        tmp_path_factory, monkeypatch):
    # KERAS_PS_DIRECT_IO=1: the ps write their row files with O_DIRECT
    # (tests/sharding/test_native_kernels.py checks that no page of them is
    # cached on ext4, XFS or Btrfs); full + background deltas restore bit
    # for bit into another number of shards all the same.
    monkeypatch.setenv("KERAS_PS_DIRECT_IO", "1")
    case = "lazy_adam_background-2-to-3"
    check_equivalence(case, equivalence_of([case], tmp_path_factory)[case])


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_every_case_restores_bit_for_bit(tmp_path_factory):
    results = equivalence_of(CASES, tmp_path_factory)
    assert sorted(results) == sorted(CASES)
    for case in CASES:
        check_equivalence(case, results[case])


def check_equivalence(case, result):
    saved, restored = (int(x) for x in case.split("-")[-3::2])
    assert result["shards"] == [restored, saved]
    assert result["restored_id"] == result["last_id"]
    # Every model and optimizer variable: same bits as the model at the
    # last backup and as its Keras weights file loaded into the new model.
    assert result["vs_model"] == [] and result["vs_keras_file"] == []
    if result["optimizer"] == "adam":
        # Dense Adam moves every row: nothing tracked, each backup holds the
        # table whole, so a delta is as big as a full backup and the next
        # backup is full again (compaction by bytes).
        assert result["tracked"] == []
        assert result["kinds"] == ["full", "delta", "full"]
        assert len(set(result["bytes"])) == 1
    else:
        assert any(p.endswith("table/embeddings") for p in result["tracked"])
        assert result["kinds"] == ["full", "delta", "delta"]
        full, *deltas = result["embedding_rows"]
        # The table rows the ids reached (below TOUCHED), never the rest.
        assert full == ROWS and all(0 < d <= TOUCHED for d in deltas), result
        assert all(b < result["bytes"][0] for b in result["bytes"][1:])


@pytest.fixture(scope="module")
def faults(shared):
    return shared["faults"]


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("how", ["truncated", "altered", "missing"])
def test_a_damaged_delta_is_named_and_restore_falls_back(how, faults):
    report = faults[0]
    outcome = report["outcomes"][how]
    damaged = report["damaged"]
    full, first_delta, last_delta = report["ids"]
    assert f"delta-{last_delta:06d}" in damaged
    # fallback=False: the error names the file.
    assert damaged in outcome["strict"]["error"], outcome
    expected = {"truncated": "bytes", "altered": "fingerprint",
                "missing": "missing"}[how]
    assert expected in outcome["strict"]["error"], outcome
    # fallback=True: the newest complete chain, exactly.
    fallback = outcome["fallback"]
    assert fallback["id"] == first_delta and fallback["equal"], fallback
    assert len(fallback["problems"]) == 1
    assert damaged in fallback["problems"][0]
    assert report["intact"] == {"id": last_delta, "problems": [],
                                "equal": True}


@pytest.mark.timeout(1600)
def test_training_goes_on_from_the_fallback(faults):
    ids = faults[0]["ids"]
    report = faults[1]
    # The next delta follows the restored backup; the damaged one is gone.
    assert report["new_kind"] == "delta"
    assert report["chain"] == [ids[0], ids[1], report["new_id"]]
    assert not report["damaged_folder_left"]
    assert report["after_fallback"] == {"id": report["new_id"],
                                        "problems": [], "equal": True}


@pytest.mark.timeout(1600)
def test_a_crash_before_publishing_leaves_the_previous_chain(faults):
    report = faults[2]
    published = faults[1]["new_id"]
    # Full, 2 deltas and the crashed delta's files, unpublished.
    assert report["folders_after_crash"] == [
        "delta-000002", f"delta-{published:06d}",
        f"delta-{published + 1:06d}", "full-000001"]
    assert report["after_crash"] == {"id": published, "problems": [],
                                     "equal": True}
    # The next delta (the crashed one's number again) holds the crashed
    # one's rows too: their marks were kept.
    assert report["next_kind"] == "delta"
    assert report["after_crash_next"] == {"id": published + 1,
                                          "problems": [], "equal": True}


@pytest.mark.timeout(1600)
def test_compaction_after_max_deltas_or_max_delta_bytes(faults):
    kinds = faults[3]["compaction"]
    assert kinds["deltas"] == ["full", "delta", "delta", "full", "delta",
                               "delta", "full"]
    assert kinds["deltas_chains"] == [["full", "delta", "delta"], ["full"]]
    assert kinds["bytes"] == ["full", "delta", "full", "delta", "full",
                              "delta", "full"]


@pytest.fixture(scope="module")
def background_compaction(shared):
    return {r["case"]: r for r in shared["background_compaction"]}


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("optimizer", ["lazy_adam", "adagrad"])
def test_compaction_written_while_training_restores_bit_for_bit(
        optimizer, background_compaction):
    # Compaction due (max_deltas=2): save() returns while the full backup
    # is still being written (a step must train before each of its blocks,
    # so it cannot have finished), the old chain takes deltas meanwhile,
    # and the first save after the write seals it with a delta of the rows
    # the steps changed since it began: a new chain, restored into 3 shards
    # exactly as the model at the last backup. (adagrad: background deltas.)
    result = background_compaction[optimizer]
    assert result["compacting_after_save"] is True
    # Each ps wrote its blocks (16 at least: 30-row shards, 4 rows a
    # block), each after a step trained since its previous one.
    assert result["block_devices"] == 2 and result["blocks"] >= 16, result
    assert result["steps"] >= result["blocks"] // 2, result
    assert result["kinds"] == ["full"] + ["delta"] * 6
    assert result["deltas"] == [0, 1, 2, 3, 4, 1, 2]
    old = [["full", False]] + [["delta", False]] * 4
    assert result["chains_before_seal"] == [old], result
    assert result["chains"] == [old, [["full", True], ["delta", False],
                                      ["delta", False]]]
    assert result["seal_rows"] > 0
    assert result["restored_id"] == result["last_id"]
    assert result["vs_model"] == []


@pytest.mark.timeout(1600)
def test_compaction_merges_the_deltas_when_few_rows_changed(
        background_compaction):
    # The same plan with merge_below=0.9, background deltas: 24 of the
    # embedding's 60 rows are ever updated (52% of the tracked bytes, with
    # the dense layers'), so the compaction writes the rows changed since
    # the full backup (a merged delta), not a full backup. The new chain
    # starts with the old chain's full backup (its files shared), then the
    # merged delta and the delta sealing it, and restores into 3 shards
    # exactly as the model at the last backup.
    result = background_compaction["lazy_adam_merged"]
    assert result["compacting_after_save"] is True
    assert result["block_devices"] == 2 and result["blocks"] >= 16, result
    old = [["full", False]] + [["delta", False]] * 4
    assert result["chains_before_seal"] == [old], result
    assert result["chains"] == [old, [["full", False], ["delta", True],
                                      ["delta", False], ["delta", False]]]
    assert result["deltas"] == [0, 1, 2, 3, 4, 2, 3]
    old_ids, new_ids = result["chain_ids"]
    assert new_ids[0] == old_ids[0]
    full_rows, merged_rows, seal_rows, _ = result["new_chain_rows"]
    assert full_rows == 60 and 0 < merged_rows <= 24, result
    assert seal_rows > 0
    assert result["restored_id"] == result["last_id"]
    assert result["vs_model"] == []
    # Its merged delta truncated: the newest state of the old chain (the
    # delta saved while the merged one was written) restores, exactly.
    assert result["fallback_id"] == old_ids[-1]
    assert result["fallback_problems"], result
    for problem in result["fallback_problems"]:
        assert result["damaged"] in problem and "truncated" in problem
    assert result["fallback_equal"] is True
    # The chain counts the merged delta and its seal as deltas: with
    # max_deltas=2 the save after the seal merged again.
    assert result["merging_again"] is True and result["stop_merging"] is True


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("case", ["lazy_adam", "adagrad"])
def test_a_restore_drops_the_compaction_being_written(
        case, background_compaction):
    result = background_compaction[case]
    # The restore took the delta saved as the compaction started; the
    # compaction's thread stopped before its next block and its folder went
    # at the next publish; training and deltas go on, a compaction starts
    # again and stop_compaction() stops it.
    assert result["dropped_restored"] == result["dropped_started"]
    assert result["dropped_equal"] is True
    assert result["dropped_thread_alive"] is False
    assert result["dropped_error"] == "WriteStopped"
    assert result["dropped_folder_left"] is False
    assert result["after_kind"] == "delta"
    assert result["started_again"] is True
    assert result["stop_compaction"] is True
    assert result["stopped_error"] == "WriteStopped"


@pytest.mark.timeout(1600)
def test_a_process_crash_between_files_and_manifest(crashed, shared):
    code, output, _ = crashed
    assert code == 17, output[-4000:]  # the job's os._exit in publish
    published = last_report(output)["published"]
    # Restored by the shared job's crash_restore part, another process.
    result = shared["crash_restore"][-1]
    # Full, delta and the crashed delta's folder (and the lock file the
    # crashed job held); the crashed one is not restored; the next delta
    # takes its number (its folder written anew).
    assert result["folders_before"] == [
        "backup.lock", f"delta-{published:06d}", f"delta-{published + 1:06d}",
        "full-000001", "manifest.json"]
    assert result["restored"] == published and result["equal"]
    assert result["folders_after"] == result["folders_before"]
    assert result["listed"] == [1, published, published + 1]


@pytest.mark.timeout(1600)
def test_backup_and_restore_writes_deltas_and_restores_them(shared):
    fit_report, auto_report = shared["callback"]
    # save_freq=3 over 2 epochs of 9 steps, plus each epoch's end; after
    # max_deltas=3 deltas the full backup is written in the background, so
    # the backups fit waits for stay deltas.
    assert fit_report["kinds"][:5] == ["full", "delta", "delta", "delta",
                                       "delta"], fit_report
    assert fit_report["resume"] == [2, 0]
    assert fit_report["equal"]
    assert fit_report["state"]["weights"] is None
    assert "incremental=False" in auto_report["auto"]["small"]
    assert "incremental=True" in auto_report["auto"]["over"]


@pytest.mark.timeout(900)
def test_a_lost_ps_is_recovered_from_full_plus_deltas(tmp_path):
    code, output = run("ps_loss", tmp_path)
    assert code == 0, output[-4000:]
    result = last_report(output)
    assert result["killed"] and sum(result["recoveries"]) == 1
    assert result["planned"] <= result["iterations"] <= result["planned"] + 4
    assert result["rolled_back"][1] > 0
    assert result["finite"], result


# Run apart (-m slow): it hung once in five runs; 12 of 12 passed after the
# per-worker dataset lifetime fix, and 120 of 120 later (100 beside the whole
# suite or the fault tests), but the hang's cause was never shown.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_delta_written_across_a_ps_loss_is_dropped_without_a_wait(tmp_path):
    # The ps is killed while a background delta waits to be written, and the
    # write goes on only once the restarted ps was given its variables back:
    # the restore drops that delta without waiting for its write (which may
    # never return: its copies on the lost ps are gone), takes the backup
    # before it, and the optimizer's step count ends at the plan.
    code, output = run("ps_loss_background", tmp_path, timeout=240)
    assert code == 0, output[-4000:]
    result = last_report(output)
    assert result["killed"] and sum(result["recoveries"]) == 1
    assert result["planned"] <= result["iterations"] <= result["planned"] + 4
    assert ("a ps lost its variables while a delta was written in the "
            "background" in output), output[-4000:]


@pytest.mark.timeout(1600)
def test_a_delta_written_while_a_ps_lost_its_state_is_dropped(shared):
    # A ps' generation set to 0 (as a recovery leaves it) while a background
    # delta is written: that delta is not published; the chain ends at the
    # full backup before it.
    zeroed = shared["zeroed_generation"][-1]["zeroed"]
    assert zeroed["error"] == (
        f"a ps lost its variables while delta {zeroed['full'] + 1} was "
        "written"), zeroed
    assert zeroed["latest"] == zeroed["full"], zeroed


@pytest.mark.timeout(1600)  # the first test selected runs the shared job
def test_backups_and_restores_do_not_warn_of_retracing(shared_output):
    """Each ps' group of variables has its own write, snapshot and restore
    functions, made from one Python function and traced once each: TF would
    warn the user to stop "creating @tf.function repeatedly in a loop"."""
    assert "triggered tf.function retracing" not in shared_output
