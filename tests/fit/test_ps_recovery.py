"""Model.fit through the loss of a parameter server, for real: ps tasks
SIGKILLed mid-epoch and started again on their addresses at once (what a
restart policy does), with keras_ps' BackupAndRestore. The same `fit` call
gives the ps its variables back, restores the newest backup and finishes
(tests/_fit_job.py ps_recover)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from _kills import can_reset_connections
from _kills import run_cutting_job
from _paths import TESTS
from _results import last_report
from _results import run_child

JOB = os.path.join(TESTS, "_fit_job.py")
LOST_JOB = os.path.join(TESTS, "_ps_lost_job.py")
PER_EXECUTION = 2  # the job's steps_per_execution
BACKUP_EVERY = 4  # the job's save_freq


def run_job(*args):
    """(exit code, output) of tests/_fit_job.py with `args`, in its own
    process group; a crash of the job prints its threads' stacks
    (faulthandler)."""
    return run_child([sys.executable, JOB, *args], 240, env=dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1"))


def run(tmp_path, kills, in_restore=None, recover_ps=None):
    code, output = run_job(
        "ps_recover", str(tmp_path / "backup"), json.dumps(kills),
        "-" if in_restore is None else str(in_restore),
        *([recover_ps] if recover_ps else []))
    return code, output, last_report(output, code)


# -m slow (10-60 s): the policy's short test is
# fit/test_backup_write_errors.py::test_a_write_failing_on_a_connection_is_made_again_while_every_ps_holds.
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_backup_whose_connection_drops_is_written_again(tmp_path):
    # The backup's read of ps 0 is in flight (the ps SIGSTOPped meanwhile)
    # when the chief's connections to it are aborted (ss -K): every ps holds
    # its variables, so the backup is written again and fit goes on with
    # nothing rolled back. Before, the UnavailableError ended fit.
    if not can_reset_connections():
        pytest.skip("this machine does not let `ss -K` abort a connection")
    code, output = run_job("backup_reset", str(tmp_path / "backup"))
    assert code == 0, output[-4000:]
    result = last_report(output, code)
    assert result["reset"] >= 1, result
    assert result["epochs"] == [0, 1, 2]
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION, result
    assert result["recoveries"] == [0, 0, 0], result
    assert result["rolled_back"] == [0, 0, 0], result
    assert len(result["warnings"]) == 1, result["warnings"]
    assert re.fullmatch(
        r"\[chief\] backup \d+ failed on a connection \(UnavailableError: "
        r".*\), every ps holding its variables; writing it again \(2 of 3\)",
        result["warnings"][0]), result["warnings"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    code, output, result = run(tmp_path_factory.mktemp("undisturbed"), [])
    assert code == 0, output[-3000:]
    assert result["recoveries"] == [0, 0, 0]
    return result


KILLS = {
    "once": ([[1, 21, [0]]], None),
    "twice_in_one_epoch": ([[1, 13, [0]], [1, 29, [1]]], None),
    "both_ps_at_once": ([[1, 21, [0, 1]]], None),
    # Killed at the end of a batch whose backup comes next: the backup
    # fails and the previous one is restored.
    "during_a_backup": ([[1, 23, [1]]], None),
    # ps 1 is killed while the recovery of ps 0 reads the backup.
    "during_a_recovery": ([[1, 21, [0]]], 1),
}


# Two kills in one epoch, both ps at once, and the plain single kill run
# apart (-m slow): the suite keeps a kill during a backup and one during a
# recovery, each a single kill mid-epoch recovered in the same call and
# checked as the plain one is (the plain kill and its recovery are the
# first half of "during_a_recovery"; a single ps kill recovered in the same
# fit is also in test_shards, test_incremental_backups and
# test_dynamic_embedding).
SLOW_KILLS = {"twice_in_one_epoch", "both_ps_at_once", "once"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow) if c in SLOW_KILLS else c
    for c in sorted(KILLS)])
def test_fit_recovers_a_lost_ps_in_the_same_call(case, tmp_path, undisturbed):
    kills, in_restore = KILLS[case]
    code, output, result = run(tmp_path, kills, in_restore)
    assert code == 0, output[-4000:]
    assert "KILLED AND RESTARTED" in output
    assert result["kills"] == [k[:2] for k in kills]
    assert result["epochs"] == [0, 1, 2]
    # Restored to a backup: the steps after it are trained again, so the
    # optimizer's count ends at the plan; at most one packed execution per
    # worker may run twice (at-least-once), as without a ps loss.
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION, output[-3000:]
    # Every loss was recovered and reported in the epoch it happened in.
    assert sum(result["recoveries"]) == len(kills)
    assert result["recoveries"][1] == len(kills)
    rolled_back = result["rolled_back"][1]
    assert 0 < rolled_back <= len(kills) * (BACKUP_EVERY + 2 * PER_EXECUTION)
    # No worse than an undisturbed run by more than half a point. It may
    # come out better: the rolled-back steps train again on new batches, so
    # a recovered run has seen more examples (up to 0.8 point more seen).
    assert result["accuracy"] >= undisturbed["accuracy"] - 0.005, \
        (result["accuracy"], undisturbed["accuracy"])
    assert result["accuracy"] <= undisturbed["accuracy"] + 0.02, \
        (result["accuracy"], undisturbed["accuracy"])


def run_notice(tmp_path, incremental, notice):
    code, output = run_job("ps_notice", str(tmp_path / "backup"),
                           json.dumps(incremental), "1" if notice else "0")
    assert code == 0, output[-4000:]
    return output, last_report(output)


@pytest.fixture(scope="module")
def undisturbed_notice_job(tmp_path_factory):
    return run_notice(tmp_path_factory.mktemp("undisturbed"), False, False)[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("incremental", [False, True])
def test_a_ps_preemption_notice_is_backed_up_first_and_costs_no_step(
        incremental, tmp_path, undisturbed_notice_job):
    # save_freq="epoch" and SIGTERM to ps 0 at step 40 of epoch 0: without
    # the notice heard, the ps would stop at once, with no backup yet to
    # recover from. With it, the ps serves on until a backup is written at
    # the next step, is released and stops; fit recovers it from that
    # backup (started again by a restart policy) and trains no step twice.
    output, result = run_notice(tmp_path, incremental, True)
    released = re.findall(r"backup \d+ \(epoch (\d+), step (\d+)\) written "
                          r"after the preemption notice of ps \[0\]: released",
                          output)
    assert len(released) == 1, output[-4000:]
    restored = re.findall(r"training again from epoch (\d+), step (\d+) "
                          r"\((\d+) steps rolled back\)", output)
    assert restored == [released[0] + ("0",)], output[-4000:]
    # Ended by the signal, so a restart policy starts it again.
    assert result["exit_code"] == -signal.SIGTERM
    assert "stopping on SIGTERM, released by the coordinator after its " \
        "backup" in result["stop_line"]
    assert sum(result["recoveries"]) == 1
    assert result["rolled_back"] == [0, 0]
    assert result["iterations"] == result["planned"], result
    # Async steps end this job 0.991-0.997 accurate with or without a
    # notice (8 runs beside the suite): within a point of the undisturbed.
    assert result["accuracy"] >= undisturbed_notice_job["accuracy"] - 0.01, \
        (result["accuracy"], undisturbed_notice_job["accuracy"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("named_by", ["platform_resolver", "rendezvous"])
def test_a_ps_back_on_another_address_is_followed_there(named_by, tmp_path,
                                                        undisturbed):
    # A replacement machine with another address (a pod rescheduled and
    # addressed by its IP, a new VM), named by the cluster resolver as TF's
    # Kubernetes and GCE resolvers do, or announced by the new ps to the
    # rendezvous of ElasticClusterResolver: the same fit call recovers the
    # ps there. Waiting on the old address, fit failed after
    # KERAS_PS_PS_RECOVERY_TIMEOUT (60 s here).
    mode = {"platform_resolver": "moved", "rendezvous": "moved_elastic"}
    code, output = run_child(
        [sys.executable, LOST_JOB, mode[named_by], str(tmp_path / "backup")],
        240,
        env=dict(
            os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1",
            KERAS_PS_PS_RECOVERY_TIMEOUT="60"))
    assert code == 0, output[-4000:]
    result = last_report(output, code)
    assert result["new"] != result["old"]
    assert result["ps_now"] == result["new"]
    assert result["moved"] == [
        f"[chief] ps 0 answers at {result['new']} now, not at "
        f"{result['old']} (where the cluster resolver names it): the "
        "cluster follows it there"], result["moved"]
    if named_by == "rendezvous":
        assert len(result["announced"]) == 1, result["announced"]
        assert f"ps:0 announced {result['new']} to the rendezvous 127.0.0.1:" \
            in result["announced"][0], result["announced"]
    assert result["epochs"] == [0, 1, 2]
    assert result["recoveries"] == [0, 1, 0]
    assert 0 < result["rolled_back"][1] <= BACKUP_EVERY + 2 * PER_EXECUTION
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION, output[-3000:]
    assert result["accuracy"] >= undisturbed["accuracy"] - 0.005, \
        (result["accuracy"], undisturbed["accuracy"])


# Run apart (-m slow): about 45 s, most of it the wait for the connections
# to the vanished machine to be given up (the suite keeps a worker's machine
# vanishing: coordinator/test_vanished_machines.py).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ps_whose_machine_vanishes_is_recovered_on_its_replacement(
        tmp_path, undisturbed):
    # ps 0's old machine drops every packet (no reset), and a replacement
    # answers at another address. The steps' calls to the old one waited on
    # open connections until the ps was given up after
    # KERAS_PS_PS_RECOVERY_TIMEOUT (300 s by default: past this job's 200 s).
    # Now they fail once KERAS_PS_PEER_TIMEOUT (30 s) ends the connections,
    # and the same fit call recovers the ps at its new address.
    code, output = run_cutting_job(
        [sys.executable, LOST_JOB, "moved_vanished", str(tmp_path / "backup")],
        200, PYTHONFAULTHANDLER="1")
    assert code == 0, output[-4000:]
    result = last_report(output, code)
    assert result["ps_now"] == result["new"] != result["old"], result
    assert len(result["moved"]) == 1, result["moved"]
    assert result["recoveries"] == [0, 1, 0]
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION, output[-3000:]
    assert result["accuracy"] >= undisturbed["accuracy"] - 0.005, \
        (result["accuracy"], undisturbed["accuracy"])


@pytest.mark.timeout(240)
def test_a_ps_lost_in_validation_keeps_the_epochs_metrics(tmp_path):
    # Lost after the epoch's last backup, as its validation begins: the
    # recovery resumes at the epoch's end with nothing to train again. Its
    # callbacks got zeros for the epoch's loss and accuracy (the metrics
    # reset at its begin, no step run since), which EarlyStopping or
    # ModelCheckpoint on "loss" take for a best epoch.
    code, output = run_child(
        [sys.executable, LOST_JOB, "in_validation", str(tmp_path / "backup")],
        200, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                      PYTHONFAULTHANDLER="1"))
    assert code == 0, output[-4000:]
    result = last_report(output, code)
    assert "KILLED AND RESTARTED ps 0" in output
    assert result["epochs"] == [0, 1, 2]
    assert result["planned"] == result["iterations"]
    assert result["history"]["ps_recoveries"] == [0, 1, 0]
    assert result["history"]["steps_rolled_back"] == [0, 0, 0]
    assert [e for e, _ in result["ends"]] == [0, 1, 2]
    epoch_1 = result["ends"][1][1]
    assert result["before"]["loss"] > 0
    for name in ("loss", "accuracy"):
        assert epoch_1[name] == pytest.approx(result["before"][name]), \
            (result["before"], epoch_1)
        assert result["history"][name][1] == epoch_1[name]
    assert {"val_loss", "val_accuracy"} <= set(epoch_1)


def test_epoch_rates_set_a_resumed_epoch_back_to_its_first_rate():
    import types

    import keras

    from keras_ps.training._epoch_rates import RATE_KEY, EpochRates

    def rate(optimizer):
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    adam = keras.optimizers.Adam(0.02)
    backup = types.SimpleNamespace(state_providers={}, restored_state=None)
    rates = EpochRates()
    rates.keep_with(backup)  # no backup restored: nothing resumes
    assert not rates.resuming and backup.state_providers[RATE_KEY]() is None
    rates.begin(0, adam)
    adam.learning_rate = 0.01  # the epoch's callbacks change it
    assert backup.state_providers[RATE_KEY]() == [0, pytest.approx(0.02)]
    rates.resuming = True  # a recovery resumes epoch 0
    rates.begin(0, adam)
    assert rate(adam) == pytest.approx(0.02)
    rates.begin(1, adam)  # a new epoch begins as it is
    assert rate(adam) == pytest.approx(0.02)
    # A fit started from a backup of epoch 1: its record is the backup's.
    restarted = EpochRates()
    restarted.keep_with(types.SimpleNamespace(
        state_providers={}, restored_state={RATE_KEY: [1, 0.005]}))
    assert restarted.resuming
    restarted.begin(1, adam)
    assert rate(adam) == pytest.approx(0.005)
    # A schedule follows the iterations: left alone, nothing recorded.
    scheduled = keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, 10, 0.5))
    other = EpochRates()
    other.keep_with(types.SimpleNamespace(
        state_providers={}, restored_state={RATE_KEY: [1, 0.005]}))
    other.begin(1, scheduled)
    assert other.state() is None
    assert rate(scheduled) == pytest.approx(0.02)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("resumed_by", ["ps_recovery", "restarted_fit"])
def test_a_resumed_epoch_begins_again_on_the_rate_it_began_with(resumed_by,
                                                               tmp_path):
    # LearningRateScheduler(lambda epoch, lr: lr * 0.5) from 0.02. Epoch 1
    # is resumed at step 20 (the backup before batch 21): by a ps recovery
    # in the same fit, or by a fit run again after its process left. Its
    # callbacks see it begin again; the scheduler halved the restored rate,
    # already halved for epoch 1, a second time (0.0025 at epoch 1, 0.00125
    # at the end instead of 0.0025).
    def job(fault):
        return run_child([sys.executable, LOST_JOB, "lr_schedule",
                          str(tmp_path / "backup"), fault], 240, env=dict(
            os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1"))

    rate = [0.02 * 0.5 ** (epoch + 1) for epoch in range(3)]
    if resumed_by == "ps_recovery":
        code, output = job("kill")
        assert code == 0, output[-4000:]
        assert "KILLED AND RESTARTED ps 0" in output
        result = last_report(output, code)
        assert result["recoveries"] == [0, 1, 0]
        expected = [[0, rate[0]], [1, rate[1]], [1, rate[1]], [2, rate[2]]]
    else:
        code, output = job("exit")
        assert code == 3 and "LEAVING at epoch 1, batch 21" in output, \
            output[-4000:]
        code, output = job("none")
        assert code == 0, output[-4000:]
        result = last_report(output, code)
        assert result["epochs"] == [1, 2]  # resumed in epoch 1
        expected = [[1, rate[1]], [2, rate[2]]]
    assert result["iterations"] == result["planned"]
    assert [e for e, _ in result["begins"]] == [e for e, _ in expected]
    assert [r for _, r in result["begins"]] == pytest.approx(
        [r for _, r in expected], rel=1e-6), result["begins"]
    assert result["final"] == pytest.approx(rate[2], rel=1e-6)


@pytest.mark.timeout(300)
def test_a_fit_run_again_after_a_loss_in_validation_keeps_the_epochs_metrics(
        tmp_path):
    # The coordinator's process leaves as epoch 1's validation begins,
    # after the epoch's last backup; run again, fit resumes at epoch 1's
    # end with nothing to train. Its callbacks and History got zeros for
    # the epoch's loss and accuracy: the backup kept no metrics.
    def job(fault):
        return run_child([sys.executable, LOST_JOB, "in_validation",
                          str(tmp_path / "backup"), fault], 240, env=dict(
            os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1"))

    code, output = job("exit")
    assert code == 3 and "LEAVING in epoch 1's validation" in output, \
        output[-4000:]
    before = last_report(output, code)["before"]
    code, output = job("none")
    assert code == 0, output[-4000:]
    result = last_report(output, code)
    assert result["epochs"] == [1, 2]
    assert result["planned"] == result["iterations"]
    assert [e for e, _ in result["ends"]] == [1, 2]
    epoch_1 = result["ends"][0][1]
    assert before["loss"] > 0
    for name in ("loss", "accuracy"):
        assert epoch_1[name] == pytest.approx(before[name]), (before, epoch_1)
        assert result["history"][name][0] == epoch_1[name]
    assert {"val_loss", "val_accuracy"} <= set(epoch_1)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("restart", ["on_fits_thread", "beside"])
def test_lost_ps_with_no_backup_yet_fails_within_10s_naming_it(restart,
                                                              tmp_path):
    # Killed at step 2, before the first backup (step 4): nothing to give
    # the ps its variables back from.
    beside = restart == "beside"
    code, output, result = run(tmp_path, [[0, 1, [0]] + beside * ["beside"]])
    assert code == 1, output[-3000:]
    assert result["error"] == "ParameterServerUnavailableError"
    if beside:
        # A restart policy starts the ps again while fit goes on: the error
        # comes within 10 s of the kill, whether the ps is back by then or
        # not.
        assert result["seconds"] < 10, result
    else:
        # The ps is started again on fit's own thread (a new process
        # importing TensorFlow: seconds on a loaded machine, during which
        # fit can do nothing), and found back with nothing on it: the error
        # comes within 10 s of that.
        assert result["seconds_after_back"] < 10, result
    assert "ps 0 (localhost:" in result["message"]
    assert "no backup yet" in result["message"]
    assert "Restart the job" in result["message"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("incremental", [
    pytest.param(False, marks=pytest.mark.slow), True])
def test_lost_shards_mode_restores_the_lost_ps_only(incremental, tmp_path):
    # After a backup every float variable is changed, then ps 0 is killed
    # and restarted: ps 0 gets the backup's values back, ps 1 keeps the
    # changed ones (a full restore would have reverted them too).
    code, output = run_job("lost_shards_restore", str(tmp_path / "b"),
                           json.dumps(incremental))
    assert code == 0, output[-3000:]
    result = last_report(output, code)
    assert result["lost"] == [0]
    assert result["position"] == [1, 0]  # the backup at the epoch's end
    assert min(result["variables"]) > 0, result
    assert result["ps0_is_backup"], result
    assert result["ps1_kept"], result
    assert result["incremental_files"] == incremental


@pytest.mark.timeout(300)
def test_fit_in_lost_shards_mode_goes_on_without_a_rollback(tmp_path,
                                                           undisturbed):
    kills = [[1, 21, [0]]]
    code, output, result = run(tmp_path, kills, recover_ps="lost_shards")
    assert code == 0, output[-4000:]
    assert "KILLED AND RESTARTED" in output
    assert "the other ps kept theirs" in output, output[-3000:]
    assert result["epochs"] == [0, 1, 2]
    assert result["recoveries"] == [0, 1, 0]
    # The step count is carried forward, not rewound: the plan, plus at
    # most one packed execution per worker that ran twice.
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION, output[-3000:]
    # Only executions the loss interrupted are trained again, never the
    # steps back to the backup.
    assert result["rolled_back"][1] <= 2 * PER_EXECUTION, result
    assert result["accuracy"] >= undisturbed["accuracy"] - 0.005, \
        (result["accuracy"], undisturbed["accuracy"])


def test_lost_shards_mode_is_refused_with_a_sharded_input(tmp_path):
    # Refused before training starts, naming the value and the fix.
    out = subprocess.run(
        [sys.executable, "-c", LOST_SHARDS_WITH_SHARDED_INPUT,
         str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=240, cwd=TESTS,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stdout[-3000:]
    message = last_report(out.stdout)["message"]
    assert "recover_ps='lost_shards'" in message
    assert "Fix: recover_ps=True" in message


LOST_SHARDS_WITH_SHARDED_INPUT = """
import sys
import keras
import numpy as np
import keras_ps
from _results import say
with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    data = keras_ps.ShardedInput(
        (np.zeros((64, 2), "float32"), np.zeros((64, 1), "float32")),
        records_per_shard=16, batch_size=8)
    try:
        model.fit(data, epochs=1, verbose=0, callbacks=[
            keras_ps.callbacks.BackupAndRestore(
                sys.argv[1], recover_ps="lost_shards")])
    except ValueError as error:
        say(message=str(error))
"""


# -- a ps that does not answer (SIGSTOP: a hung process, a frozen machine,
# a network partition) --------------------------------------------------------
# Short timeouts, so that giving it up comes within seconds.
SILENT_ENV = {"KERAS_PS_HANG_TIMEOUT": "2", "KERAS_PS_PS_RECOVERY_TIMEOUT": "8"}


def run_silent(*args, **env):
    code, output = run_child([sys.executable, JOB, *args], 200, env=dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1",
        **dict(SILENT_ENV, **env)))
    return code, output, last_report(output, code)


def _names_the_silent_ps(warnings, timeout=8):
    """The watchdog named ps 0 as what the steps wait for, and blamed no
    worker for calls that only waited for it."""
    assert any("ps 0 at localhost:" in m and "has not answered for" in m
               and f"KERAS_PS_PS_RECOVERY_TIMEOUT={timeout}s" in m
               for m in warnings), warnings
    assert not any(m.startswith("[worker:") for m in warnings), warnings


# Run apart (-m slow): a ps back before the timeout, one recovered after
# it, and one killed and never restarted. The suite keeps a ps silent for
# good (in fit, which ends with the same error as the killed one, and in a
# custom loop) and one silent during a backup, then killed and recovered.
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_ps_silent_for_less_than_the_timeout_costs_no_rollback(tmp_path):
    # Named once a probe of it has waited its probe timeout (3 s): SIGSTOPped
    # for 10 s, well under the 60 s after which it is given up.
    code, output, result = run_silent("ps_pause", str(tmp_path / "b"), "10",
                                      KERAS_PS_PS_RECOVERY_TIMEOUT="60")
    assert code == 0, output[-4000:]
    assert result["paused"] and result["resumed_before_end"]
    # The steps waited and went on: none failed, none ran twice, nothing
    # was restored.
    assert result["iterations"] == result["planned"]
    assert result["recoveries"] == [0, 0, 0]
    assert result["rolled_back"] == [0, 0, 0]
    _names_the_silent_ps(result["warnings"], timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_ps_silent_past_the_timeout_is_recovered_once_it_answers(tmp_path):
    # Given up as lost after 8 s of silence; continued once fit begins its
    # recovery, it answers and is restored from the backup in the same fit
    # call, like a ps that died.
    code, output, result = run_silent("ps_pause", str(tmp_path / "b"),
                                      "given_up")
    assert code == 0, output[-4000:]
    assert sum(result["recoveries"]) == 1 == result["recoveries"][1]
    assert result["rolled_back"][1] > 0
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION
    _names_the_silent_ps(result["warnings"])


@pytest.mark.timeout(240)
def test_a_ps_that_stays_silent_ends_fit_with_an_error_naming_it(tmp_path):
    # Given up after 8 s of silence, then waited for 8 s more by the
    # recovery: fit raises, never waits for good.
    code, output, result = run_silent("ps_pause", str(tmp_path / "b"),
                                      "forever")
    assert code == 1, output[-4000:]
    assert result["error"] == "ParameterServerRecoveryError"
    assert result["unavailable"]  # a ParameterServerUnavailableError too
    for text in ("Parameter server 0 at localhost:", "within 8s",
                 "kill a process that is hung", "KERAS_PS_PS_RECOVERY_TIMEOUT"):
        assert text in result["message"], result["message"]
    assert 16 <= result["seconds"] < 120, result["seconds"]
    _names_the_silent_ps(result["warnings"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_ps_killed_and_never_restarted_ends_fit_after_the_timeout(tmp_path):
    # fit's recovery waited 8 s for it, then tried again, and again: it
    # looped for good. It now raises once the wait is over.
    code, output, result = run_silent("ps_pause", str(tmp_path / "b"), "kill")
    assert code == 1, output[-4000:]
    assert result["error"] == "ParameterServerRecoveryError"
    assert "Parameter server 0 at localhost:" in result["message"]
    assert 8 <= result["seconds"] < 120, result["seconds"]


@pytest.mark.timeout(240)
def test_a_ps_silent_while_the_chief_writes_a_backup_is_named(tmp_path):
    # No worker call waits for it, the backup's reads on the chief do: the
    # watchdog names it all the same (it watches the ps throughout fit), and
    # once it is killed and restarted, fit recovers it in the same call.
    # Before, fit waited for good without a word.
    code, output, result = run_silent("ps_pause_in_backup",
                                      str(tmp_path / "b"))
    assert code == 0, output[-4000:]
    assert result["paused"]
    assert sum(result["recoveries"]) == 1
    assert result["planned"] <= result["iterations"] <= \
        result["planned"] + 2 * PER_EXECUTION
    _names_the_silent_ps(result["warnings"])


@pytest.mark.timeout(240)
def test_a_custom_loop_waiting_on_a_silent_ps_gets_an_error_naming_it():
    code, output, result = run_silent("ps_pause_loop")
    assert code == 0, output[-4000:]
    assert result["error"] == "ParameterServerUnavailableError"
    for text in ("Parameter server 0 at localhost:", "has not answered for",
                 "recover_parameter_servers()", "KERAS_PS_PS_RECOVERY_TIMEOUT"):
        assert text in result["message"], result["message"]
    assert 8 <= result["seconds"] < 120, result["seconds"]
    _names_the_silent_ps(result["warnings"])
