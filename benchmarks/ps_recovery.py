"""Model.fit through a lost parameter server: backup cost, recovery stall, memory.

Embedding(R, 64) on 2 ps (FixedShardsPartitioner(2)) + MLP 128-64-1, batch
256 x 16 Zipf-like ids, keras_ps.optimizers.LazyAdam, steps_per_execution=10
(the model of fit_large_tables.py), on a multi-process keras_ps.LocalCluster
(2 ps, 2 workers; the coordinator is the child process this script starts
per run). Each (R, repeat) runs in its own process, one after the other.

In one process, on one cluster and one model:

  phase A  fit(epochs=2, steps_per_epoch=400), no callbacks: steps/s of
           epoch 2 (epoch 1 is warm-up).
  phase B  fit(epochs=1 + kills, steps_per_epoch=500) (--plan full) with
           keras_ps.callbacks.BackupAndRestore(save_freq=100) (recover_ps on):
           - backups: each timed (the join of the steps in flight, then
             save_weights and the state file), with the .weights.h5 size;
             steps/s with backups = 400 steps / the time from the end of the
             backup at step 100 to the end of the backup at step 500 of the
             first epoch (4 backups in that window), against the mean of
             phases A and C.
           - in each later epoch, at the end of step 250 (50 steps after the
             backup at step 200; once step 250 has run), ps 0 is SIGKILLed and started again on its
             address at once (in a thread, as a restart policy would, the
             chief goes on). Timeline: kill; the chief's "lost its
             variables" warning (detection); its "recovered in" warning
             (breakdown parsed); the end of the first execution scheduled
             after it (its logs are read once, which waits for it).
             stall = end of that execution - kill.
           - memory: a thread samples VmRSS/VmHWM in /proc/<pid>/status of
             both ps (the new ps 0 from its start) and of the coordinator
             every 20 ms; VmHWM is also read when the recovery is logged.
  phase C  as phase A, after B: the machine is shared, so the steps/s
           without backups is the mean of a fit before and one after B.

--notice: ps 0 gets SIGTERM instead of SIGKILL (a preemption notice), and
BackupAndRestore has save_before_preemption=True: the ps serves on until the
chief has written a backup and released it; it is started again once it has
exited. The timeline starts at the SIGTERM.

--plan notice: as short, but the epoch is 600 steps, so that a notice
(--notice) is heard and answered within it.

--plan short (for tables whose backup takes minutes): phase B is one epoch
of 180 steps per kill, ps 0 killed at the end of step 150 (50 steps after
the only backup, at step 100), no throughput window (the slowdown is only
implied: 1 + backup write time / time of 100 steps without backups), and
the backups after the recovery are skipped.

    .venv/bin/python benchmarks/ps_recovery.py --rows 1000000 --repeats 3 --json > 1m.json
    .venv/bin/python benchmarks/ps_recovery.py --rows 10000000 --plan short --json > 10m.json
    .venv/bin/python benchmarks/ps_recovery.py --from-json 1m.json,10m.json
"""

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = (1_000_000, 10_000_000)
SAVE_FREQ = 100
PLAIN_EPOCHS, PLAIN_STEPS = 2, 400
# Phase B plans. full: epochs of 500 steps; the throughput window is steps
# 100..500 of epoch 0; one kill per later epoch at the end of step 250.
# short (for tables whose backup takes minutes on a loaded machine): one
# epoch of 180 steps per kill, ps 0 killed at the end of step 150 (50 steps
# after the backup at 100); no window (the slowdown is given as implied by
# the write time), and no backup after the recovery is measured (the
# callback skips them), so a run costs one backup and one restore per kill.
PLANS = {
    "full": {"steps": 500, "kill_batch": 249, "first_kill_epoch": 1,
             "window": (100, 500), "backups_after_recovery": True},
    "short": {"steps": 180, "kill_batch": 149, "first_kill_epoch": 0,
              "window": None, "backups_after_recovery": False},
    # short, with the epoch going on long enough after the SIGTERM of
    # --notice for the notice to be heard (about a second) within it.
    "notice": {"steps": 600, "kill_batch": 149, "first_kill_epoch": 0,
               "window": None, "backups_after_recovery": False},
}
SAMPLE_S = 0.02

_RECOVERED = re.compile(
    r"recovered in (?P<total>[\d.]+)s \((?P<waiting>[\d.]+)s waiting for calls "
    r"and the ps, (?P<reconnecting>[\d.]+)s reconnecting, (?P<recreating>"
    r"[\d.]+)s re-creating (?P<variables>\d+) variables, (?:(?P<restarting>"
    r"[\d.]+)s restarting functions and iterators, )?(?P<reading>[\d.]+)s "
    r"reading the backup\); training again from epoch (?P<epoch>\d+), step "
    r"(?P<step>\d+) \((?P<rolled_back>\d+) steps rolled back\)")


def proc_status(pid):
    """(VmRSS, VmHWM) of `pid` in bytes, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    values = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            values[key] = int(value.split()[0]) * 1024
    if "VmRSS" not in values:
        return None  # a zombie
    return values["VmRSS"], values["VmHWM"]


def meminfo():
    """The machine's Dirty, Writeback, MemFree and Cached, in GB: page
    cache not yet written back when a ps is lost and made again."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Dirty", "Writeback", "MemFree", "Cached"):
                values[key] = int(rest.split()[0]) / 2**20
    return values


class Sampler(threading.Thread):
    """Samples VmRSS/VmHWM of the ps (whatever process holds each place now)
    and of this process; keeps the series (seconds, name, pid, rss, hwm)."""

    def __init__(self, cluster, num_ps):
        super().__init__(daemon=True)
        self.cluster, self.num_ps = cluster, num_ps
        self.samples = []
        self.stopped = threading.Event()

    def pids(self):
        pids = {f"ps{i}": self.cluster.pid("ps", i) for i in range(self.num_ps)}
        pids["coordinator"] = os.getpid()
        return pids

    def run(self):
        while not self.stopped.is_set():
            now = time.monotonic()
            for name, pid in self.pids().items():
                status = proc_status(pid)
                if status:
                    self.samples.append((now, name, pid) + status)
            time.sleep(SAMPLE_S)

    def between(self, name, start, end, pid=None):
        return [s for s in self.samples if s[1] == name and start <= s[0] <= end
                and (pid is None or s[2] == pid)]


def run_one(rows, kills, plan_name="full", incremental="auto", notice=False):
    plan = PLANS[plan_name]
    logging.basicConfig(level=logging.WARNING)
    # Each incremental backup written, published, restored.
    logging.getLogger("keras_ps.backups.incremental_backup").setLevel(logging.INFO)
    import keras
    import numpy as np  # noqa: F401  (keras needs it; imported early)
    import tensorflow as tf

    import keras_ps
    from keras_ps.coordinator import ClusterCoordinator
    from keras_ps.partitioners import FixedShardsPartitioner
    sys.path.insert(0, HERE)
    from fit_large_tables import DIM, dataset_fn_for, table_model

    cluster = keras_ps.LocalCluster(num_workers=2, num_ps=2)
    backup_dir = tempfile.mkdtemp(prefix="ps_recovery_backup_")
    sampler = Sampler(cluster, 2)
    sampler.start()
    try:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
        keras.utils.set_random_seed(0)
        build_start = time.monotonic()
        with strategy.scope():
            model = table_model(keras, rows,
                                keras_ps.optimizers.LazyAdam(0.01), ["accuracy"])
        build_s = time.monotonic() - build_start
        data = keras_ps.DatasetCreator(dataset_fn_for(tf, rows))

        # -- phase A: no backups ------------------------------------------------
        epoch_ends = []

        class EpochTimer(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                epoch_ends.append(time.monotonic())

        def plain_fit():
            epoch_ends.clear()
            start = time.monotonic()
            model.fit(data, epochs=PLAIN_EPOCHS, steps_per_epoch=PLAIN_STEPS,
                      verbose=0, callbacks=[EpochTimer()])
            return {
                "first_epoch_s": epoch_ends[0] - start,
                "epoch_s": [b - a for a, b in zip(epoch_ends, epoch_ends[1:])],
                "steps_per_s": PLAIN_STEPS * (PLAIN_EPOCHS - 1)
                / (epoch_ends[-1] - epoch_ends[0]),
            }

        plain_before = plain_fit()

        # -- phase B: backups every 100 steps, ps 0 killed in each later epoch --
        backups, skipped_backups = [], []

        class TimedBackup(keras_ps.callbacks.BackupAndRestore):
            def _backup(self, epoch, step):
                if not plan["backups_after_recovery"] and events and \
                        "first_step_done" in events[-1]:
                    skipped_backups.append((epoch, step))
                    return
                t0 = time.monotonic()
                ClusterCoordinator(self.model.distribute_strategy).join()
                t1 = time.monotonic()
                super()._backup(epoch, step)  # its own join finds nothing
                t2 = time.monotonic()
                state = self._read_state()
                weights = state.get("weights")
                backups.append({
                    "epoch": epoch, "step": step, "serial": state["serial"],
                    "start": t0, "end": t2, "join_s": t1 - t0,
                    "write_s": t2 - t1,
                    "bytes": os.path.getsize(
                        os.path.join(self.backup_dir, weights)) if weights
                    else None,
                    "kind": state.get("kind", "keras_h5"),
                    "incremental_id": state.get("incremental"),
                })
                if weights is None:
                    # Sizes of the incremental backups published so far
                    # (a delta written in the background is published by
                    # the next save).
                    from keras_ps.backups import _chain as _backup_chain
                    manifest = _backup_chain.read(
                        self._incremental.directory) or {"chains": []}
                    sizes = {e["id"]: e["bytes"] for chain in
                             manifest["chains"] for e in chain}
                    for b in backups:
                        if b["incremental_id"] in sizes:
                            b["bytes"] = sizes[b["incremental_id"]]

            def restore_latest(self):
                t0 = time.monotonic()
                position = super().restore_latest()
                restores.append({"start": t0, "end": time.monotonic(),
                                 "position": position})
                return position

        restores = []
        events = []  # one dict per kill

        class ChiefLog(logging.Handler):
            def emit(self, record):
                now = time.monotonic()
                message = record.getMessage()
                if not events:
                    return
                event = events[-1]
                # "lost its variables" (it answers, empty) or "lost (...);
                # recovering" (it did not answer).
                lost = "lost its variables" in message or (
                    ") lost (" in message and "recovering" in message)
                if lost and "detected" not in event:
                    event["detected"] = now
                    event["meminfo_detected"] = meminfo()
                elif "recovered in" in message:
                    event["recovered"] = now
                    event["meminfo_recovered"] = meminfo()
                    event["log_line"] = message
                    match = _RECOVERED.search(message)
                    if match:
                        event["breakdown"] = {
                            k: (int(v) if k in ("variables", "epoch", "step",
                                                "rolled_back") else float(v))
                            for k, v in match.groupdict().items()
                            if v is not None}
                    # Peaks up to the end of the restore, read right here.
                    event["hwm_at_recovered"] = {
                        name: proc_status(pid)
                        for name, pid in sampler.pids().items()}

        handler = ChiefLog(logging.WARNING)
        fit_logger = logging.getLogger("keras_ps.training._fit_epochs")
        fit_logger.addHandler(handler)

        class KillAndRestart(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.done = set()

            def on_epoch_begin(self, epoch, logs=None):
                self._epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if events and "recovered" in events[-1] and \
                        "first_step_done" not in events[-1]:
                    event = events[-1]
                    event["first_step_scheduled"] = (self._epoch, batch)
                    len(logs)  # reading the logs waits for this execution (once)
                    event["first_step_done"] = time.monotonic()
                key = (self._epoch, batch)
                if self._epoch >= plan["first_kill_epoch"] and \
                        batch == plan["kill_batch"] and \
                        key not in self.done:
                    self.done.add(key)
                    # The chief schedules ahead: wait until step 250 has
                    # run (reading the logs waits for this execution), so
                    # the kill comes 50 steps after the backup, not while
                    # it is still being written in the background.
                    len(logs)
                    old_pid = cluster.pid("ps", 0)
                    before = {name: proc_status(pid)
                              for name, pid in sampler.pids().items()}
                    event = {"at": key, "old_pid": old_pid, "before": before,
                             "backups_before": len(backups)}
                    events.append(event)
                    event["meminfo_kill"] = meminfo()
                    event["kill"] = time.monotonic()
                    if not notice:
                        cluster.kill("ps", 0)
                    event["killed"] = time.monotonic()

                    def restart():
                        if notice:  # SIGTERM, then its exit once released
                            cluster.stop("ps", 0, timeout=120)
                            event["exited"] = time.monotonic()
                        cluster.restart("ps", 0)
                        event["ps_answering"] = time.monotonic()
                        event["new_pid"] = cluster.pid("ps", 0)
                    thread = threading.Thread(target=restart, daemon=True)
                    thread.start()
                    event["thread"] = thread

        backup_cb = TimedBackup(backup_dir, save_freq=SAVE_FREQ,
                                incremental=incremental,
                                save_before_preemption=notice)
        killer = KillAndRestart()
        b_start = time.monotonic()
        history = model.fit(data, epochs=plan["first_kill_epoch"] + kills,
                            steps_per_epoch=plan["steps"],
                            verbose=0, callbacks=[killer, backup_cb])
        b_s = time.monotonic() - b_start
        fit_logger.removeHandler(handler)
        # -- phase C: no backups again (the machine is shared: A and C bracket B)
        plain_after = plain_fit()
        plain = {"before": plain_before, "after": plain_after,
                 "steps_per_s": (plain_before["steps_per_s"]
                                 + plain_after["steps_per_s"]) / 2}
        end_status = {name: proc_status(pid) for name, pid in sampler.pids().items()}
        sampler.stopped.set()
        sampler.join()

        # -- summarise ------------------------------------------------------------
        window = None
        if plan["window"]:
            first, last = plan["window"]
            at = {b["step"]: b for b in backups if b["epoch"] == 0}
            in_window = [b for b in backups
                         if b["epoch"] == 0 and first < b["step"] <= last]
            window = {
                "steps": last - first,
                "seconds": at[last]["end"] - at[first]["end"],
                "backups": len(in_window),
                "write_s": sum(b["write_s"] for b in in_window),
                # The chief schedules 100 steps at once, then the backup's
                # join waits for them: the joins are the training time.
                "join_s": sum(b["join_s"] for b in in_window)}
            window["steps_per_s"] = window["steps"] / window["seconds"]
            window["steps_per_s_between_backups"] = (
                window["steps"] / window["join_s"])
        gb = 2**30
        recoveries = []
        for event in events:
            event.pop("thread").join(timeout=60)
            kill = event["kill"]
            rec = {"at_epoch_batch": event["at"],
                   "backups_before": event["backups_before"]}
            if "recovered" not in event:
                rec["error"] = "no recovery logged"
                recoveries.append(rec)
                continue
            new_pid = event.get("new_pid")
            restore = [r for r in restores if r["start"] >= kill]
            rec.update({
                "stall_s": event["first_step_done"] - kill,
                "ps_answering_s": event["ps_answering"] - kill,
                "detected_s": event["detected"] - kill,
                "recovered_s": event["recovered"] - kill,
                "ps_exited_s": event["exited"] - kill
                if "exited" in event else None,
                "first_execution_after_restore_s":
                    event["first_step_done"] - event["recovered"],
                "breakdown": event.get("breakdown"),
                "log_line": event["log_line"],
                "meminfo_gb": {when: event.get("meminfo_" + when) for when in
                               ("kill", "detected", "recovered")},
                "restore_latest_s": (restore[0]["end"] - restore[0]["start"])
                if restore else None,
            })
            # Memory, GB.
            old_rss, old_hwm = event["before"]["ps0"]
            new_series = sampler.between("ps0", kill, event["recovered"], new_pid)
            hwm_new = event["hwm_at_recovered"]["ps0"]
            other_before = event["before"]["ps1"]
            other_after = event["hwm_at_recovered"]["ps1"]
            coord_before = event["before"]["coordinator"]
            coord_after = event["hwm_at_recovered"]["coordinator"]
            coord_window = sampler.between("coordinator", kill, event["recovered"])
            rec["memory_gb"] = {
                "ps0_rss_before_kill": old_rss / gb,
                "ps0_hwm_before_kill": old_hwm / gb,
                "new_ps0_peak_sampled_rss": max(s[3] for s in new_series) / gb
                if new_series else None,
                "new_ps0_hwm_at_recovered": hwm_new[1] / gb if hwm_new else None,
                "new_ps0_rss_at_recovered": hwm_new[0] / gb if hwm_new else None,
                "ps1_hwm_before_kill": other_before[1] / gb,
                "ps1_rss_before_kill": other_before[0] / gb,
                # Peak during the restore over the steady state (RSS
                # before the kill): the new ps 0 against the old one; ps 1
                # (also restored) its peak sampled from the kill to the
                # end of the recovery against its RSS before.
                "new_ps0_peak_over_steady": (hwm_new[1] / old_rss)
                if hwm_new else None,
                "ps1_peak_over_steady": max(
                    [s[3] for s in sampler.between(
                        "ps1", kill, event["recovered"])] or [0]) / other_before[0],
                "ps1_hwm_at_recovered": other_after[1] / gb,
                "coordinator_rss_before_kill": coord_before[0] / gb,
                "coordinator_hwm_before_kill": coord_before[1] / gb,
                "coordinator_peak_sampled_rss_in_recovery":
                    max(s[3] for s in coord_window) / gb if coord_window else None,
                "coordinator_hwm_at_recovered": coord_after[1] / gb,
            }
            recoveries.append(rec)
        table_bytes = rows * DIM * 4 * 3 + rows * 8
        result = {
            "rows": rows, "kills": kills, "build_s": build_s, "notice": notice,
            "table_and_slots_gb": table_bytes / gb,
            "plain": plain,
            "plan": plan_name,
            "with_backups_steps_per_s": window["steps_per_s"] if window else None,
            "backup_overhead_ratio": plain["steps_per_s"] / window["steps_per_s"]
            if window else None,
            # 1 + one backup's write time over the time of SAVE_FREQ steps.
            "implied_overhead_ratio": 1 + statistics.median(
                b["write_s"] for b in backups) * plain["steps_per_s"] / SAVE_FREQ,
            "window": window,
            "skipped_backups": skipped_backups,
            "backups": [{k: v for k, v in b.items() if k not in ("start", "end")}
                        for b in backups],
            "backup_write_s": [b["write_s"] for b in backups],
            "backup_gb": backups[-1]["bytes"] / gb if backups[-1]["bytes"]
            else None,
            "incremental": incremental,
            "delta_gb": [b["bytes"] / gb for b in backups
                         if b["kind"] == "delta" and b["bytes"]],
            "full_gb": [b["bytes"] / gb for b in backups
                        if b["kind"] == "full" and b["bytes"]],
            "phase_b_s": b_s,
            "iterations": int(model.optimizer.iterations.numpy()),
            "ps_recoveries": history.history.get("ps_recoveries"),
            "steps_rolled_back": history.history.get("steps_rolled_back"),
            "recoveries": recoveries,
            "end_gb": {name: (s[0] / gb, s[1] / gb) if s else None
                       for name, s in end_status.items()},
            "coordinator_peak_gb": max(
                s[4] for s in sampler.samples if s[1] == "coordinator") / gb,
            "load_average": os.getloadavg(),
            "keras_ps_source": [os.path.dirname(keras_ps.__file__),
                                os.path.dirname(sys.modules[
                                    type(backup_cb).__mro__[1].__module__].__file__)],
        }
        return result
    finally:
        sampler.stopped.set()
        cluster.shutdown()
        shutil.rmtree(backup_dir, ignore_errors=True)


def run_child(rows, kills, plan, incremental, notice=False, timeout=5400):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_child", str(rows),
             str(kills), plan, incremental, str(int(notice))],
            capture_output=True, text=True,
            env=env,
            timeout=timeout)
    except subprocess.TimeoutExpired as error:
        tail = error.stderr or ""
        if isinstance(tail, bytes):
            tail = tail.decode(errors="replace")
        return {"rows": rows, "error": f"timed out after {timeout}s: "
                + tail[-1500:]}
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"rows": rows, "error": f"exit {out.returncode}: "
                + out.stderr[-3000:]}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.monotonic() - start
    # The chief's warnings (recoveries, a delta not published).
    result["chief_warnings"] = [l for l in out.stderr.splitlines()
                                if "[chief]" in l][-40:]
    return result


def spread(values, digits=2):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (f"{min(values):.{digits}f} / **{statistics.median(values):.{digits}f}**"
            f" / {max(values):.{digits}f}")


def describe(result, log):
    if "error" in result:
        log(f"R={result['rows']:,}: FAILED {result['error'][-800:]}")
        return
    plain, window = result["plain"], result["window"]
    measured = (
        f"{window['steps_per_s']:.1f} with (window {window['seconds']:.1f} s: "
        f"{window['write_s']:.1f} s writing, {window['join_s']:.1f} s "
        f"training), x{result['backup_overhead_ratio']:.2f}" if window
        else "no window (short plan)")
    log(f"R={result['rows']:,} ({result.get('plan', 'full')}): "
        f"{plain['before']['steps_per_s']:.1f} / "
        f"{plain['after']['steps_per_s']:.1f} steps/s without backups (before "
        f"/ after), {measured}; implied x"
        f"{result['implied_overhead_ratio']:.2f}; backup "
        f"{statistics.median(result['backup_write_s']):.2f} s median, "
        f"{_sizes(result)}; wall {result.get('wall_s', 0):.0f} s")
    for rec in result["recoveries"]:
        if "error" in rec:
            log(f"  recovery: {rec['error']}")
            continue
        m = rec["memory_gb"]
        log(f"  stall {rec['stall_s']:.2f} s (detected {rec['detected_s']:.2f}, "
            f"ps answering {rec['ps_answering_s']:.2f}, recovered "
            f"{rec['recovered_s']:.2f}, first execution "
            f"{rec['first_execution_after_restore_s']:.2f}); {rec['log_line']}")
        log(f"  ps0 RSS before kill {m['ps0_rss_before_kill']:.2f} GB, new ps0 "
            f"peak {m['new_ps0_hwm_at_recovered']:.2f} GB; coordinator HWM "
            f"{m['coordinator_hwm_before_kill']:.2f} -> "
            f"{m['coordinator_hwm_at_recovered']:.2f} GB")


def _sizes(result):
    """The backups' sizes in GB: the last file, or full and delta medians."""
    if result.get("backup_gb"):
        return f"{result['backup_gb']:.2f} GB"
    parts = [f"{kind} {statistics.median(result[key]):.3f} GB"
             for kind, key in (("full", "full_gb"), ("delta", "delta_gb"))
             if result.get(key)]
    return ", ".join(parts) or "sizes unknown"


def _complete(result):
    """Fills what runs saved by an earlier version of this script lack."""
    if "error" not in result:
        result.setdefault("plan", "full")
        result.setdefault("implied_overhead_ratio", 1 + statistics.median(
            result["backup_write_s"]) * result["plain"]["steps_per_s"] / SAVE_FREQ)
    return result


def markdown(runs, command):
    runs = [_complete(r) for r in runs]
    lines = [
        "## ps recovery (Model.fit, BackupAndRestore)",
        "",
        f"`{command}`: `benchmarks/ps_recovery.py`. Embedding(R, 64) on 2 ps "
        "(FixedShardsPartitioner(2)) + MLP 128-64-1, batch 256 x 16 Zipf ids, "
        "LazyAdam, steps_per_execution=10, multi-process LocalCluster (2 ps, "
        "2 workers, the coordinator in the run's process); each R and repeat "
        "in its own process. Steps/s without backups (the mean of fits A "
        f"and C, epoch 2 of {PLAIN_STEPS} steps each) and with "
        f"BackupAndRestore(save_freq={SAVE_FREQ}) (fit B, `--plan full`: "
        "steps 100..500 of its first epoch, 400 steps and 4 backups) come "
        "from consecutive fits A, B, C of the same model in the same "
        "process. Backup write = save_weights + state file, after the join "
        "of the steps in flight; implied slowdown = 1 + (median write) / "
        "(time of 100 steps without backups). Full plan: in B's later "
        "epochs, ps 0 is SIGKILLed at the end of step 250 (50 steps after "
        "the last backup); short plan: one epoch of 180 steps, ps 0 killed "
        "at the end of step 150 (50 steps after the only backup), no "
        "window. Either way ps 0 is started again on its address at once "
        "(in a thread; the chief goes on). Stall = end of the first execution (10 steps) "
        "scheduled after the restore - kill. Figures min / **median** / max "
        "over all runs and kills.",
        "",
        "| R (table + slots) | steps/s no backups | steps/s backups every 100 "
        "| measured slowdown | backup write s | implied slowdown "
        "| backup GB |",
        "|---|---|---|---|---|---|---|",
    ]
    ok = [r for r in runs if "error" not in r]
    for rows in sorted({r["rows"] for r in runs}):
        mine = [r for r in ok if r["rows"] == rows]
        if not mine:
            failed = [r for r in runs if r["rows"] == rows]
            lines.append(f"| {rows / 1e6:g}M | failed: "
                         f"{failed[0]['error'][:120]!r} | | | | | |")
            continue
        writes = [w for r in mine for w in r["backup_write_s"]]
        plans = sorted({r.get("plan", "full") for r in mine})
        lines.append(
            f"| {rows / 1e6:g}M ({mine[0]['table_and_slots_gb']:.2f} GB, "
            f"{'/'.join(plans)} plan) "
            f"| {spread([r['plain']['steps_per_s'] for r in mine], 1)} "
            f"| {spread([r['with_backups_steps_per_s'] for r in mine], 1)} "
            f"| {spread([r['backup_overhead_ratio'] for r in mine])}"
            f"{'x' if any(r['backup_overhead_ratio'] for r in mine) else ''} "
            f"| {spread(writes)} ({len(writes)} backups) "
            f"| {spread([r['implied_overhead_ratio'] for r in mine])}x "
            f"| {'; '.join(sorted({_sizes(r) for r in mine}))} |")
    lines += [
        "",
        "| R | kills | stall s | detected s | recovered s | waiting s "
        "| reconnecting s | re-creating s | reading backup s "
        "| first execution s | rolled back |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rows in sorted({r["rows"] for r in ok}):
        recs = [x for r in ok if r["rows"] == rows for x in r["recoveries"]
                if "error" not in x]
        if not recs:
            continue

        def b(key):
            return [x["breakdown"][key] for x in recs if x.get("breakdown")]
        lines.append(
            f"| {rows / 1e6:g}M | {len(recs)} | {spread([x['stall_s'] for x in recs])} "
            f"| {spread([x['detected_s'] for x in recs])} "
            f"| {spread([x['recovered_s'] for x in recs])} "
            f"| {spread(b('waiting'))} | {spread(b('reconnecting'))} "
            f"| {spread(b('recreating'))} | {spread(b('reading'))} "
            f"| {spread([x['first_execution_after_restore_s'] for x in recs])} "
            f"| {spread(b('rolled_back'), 0)} |")
    lines += [
        "",
        "| R (incremental) | ps 0 RSS before kill GB | new ps 0 peak (VmHWM at recovery) GB "
        "| ps 1 VmHWM before / after GB | coordinator VmHWM before kill / "
        "after recovery GB | coordinator peak over the run GB "
        "| restore peak / steady RSS: new ps 0, ps 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows in sorted({r["rows"] for r in ok}):
        recs = [(r, x) for r in ok if r["rows"] == rows for x in r["recoveries"]
                if "error" not in x]
        if not recs:
            continue

        def m(key):
            return [x["memory_gb"][key] for _, x in recs]
        lines.append(
            f"| {rows / 1e6:g}M ({'/'.join(sorted({str(r.get('incremental', 'auto')) for r, _ in recs}))}) "
            f"| {spread(m('ps0_rss_before_kill'))} "
            f"| {spread(m('new_ps0_hwm_at_recovered'))} "
            f"| {spread(m('ps1_hwm_before_kill'))} / {spread(m('ps1_hwm_at_recovered'))} "
            f"| {spread(m('coordinator_hwm_before_kill'))} / "
            f"{spread(m('coordinator_hwm_at_recovered'))} "
            f"| {spread([r['coordinator_peak_gb'] for r in ok if r['rows'] == rows])} "
            f"| {spread([x['memory_gb'].get('new_ps0_peak_over_steady') for _, x in recs])}x, "
            f"{spread([x['memory_gb'].get('ps1_peak_over_steady') for _, x in recs])}x |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(str(r) for r in ROWS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kills", type=int, default=1,
                        help="ps 0 kills per run, one per epoch after the first")
    parser.add_argument("--json", action="store_true",
                        help="print the runs as one JSON line (logs to stderr)")
    parser.add_argument("--from-json", help="format saved --json outputs "
                        "(comma-separated files)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="full",
                        help="phase B: full (4 backups measured, kill after "
                        "8 backups) or short (1 backup, then the kill)")
    parser.add_argument("--incremental", choices=("auto", "true", "false"),
                        default="auto", help="BackupAndRestore's incremental:"
                        " auto (incremental backups from 256 MiB of "
                        "tables: 1M and up here), true, or false (Keras "
                        "weights files through the chief)")
    parser.add_argument("--notice", action="store_true",
                        help="SIGTERM ps 0 (a preemption notice) instead of "
                        "SIGKILL, with save_before_preemption=True")
    parser.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    command = "python " + " ".join(
        ["benchmarks/ps_recovery.py"] + sys.argv[1:])
    if args._child:
        incremental = {"auto": "auto", "true": True,
                       "false": False}[args._child[3]]
        result = run_one(int(args._child[0]), int(args._child[1]),
                         args._child[2], incremental, args._child[4] == "1")
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    if args.from_json:
        runs, commands = [], []
        for path in args.from_json.split(","):
            with open(path) as f:
                saved = json.loads(f.read().strip().splitlines()[-1])
            runs += saved["runs"]
            commands.append(saved["command"])
        print("\n".join(markdown(runs, "`; `".join(commands))))
        return
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json \
        else (lambda *a: print(*a, flush=True))
    runs = []
    for repeat in range(args.repeats):
        for rows in [int(r) for r in args.rows.split(",")]:
            result = run_child(rows, args.kills, args.plan, args.incremental,
                               args.notice)
            result["repeat"] = repeat
            runs.append(result)
            describe(result, log)
    summary = {"command": command, "runs": runs}
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(markdown(runs, command)))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
