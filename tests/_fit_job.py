"""A coordinator process for Model.fit fault tests; prints JSON lines.

Usage:
  python tests/_fit_job.py backup CLUSTER_SPEC_JSON BACKUP_DIR
      fit with BackupAndRestore(save_freq=4) on an existing cluster; the test
      SIGKILLs this process mid-epoch and starts it again.
  python tests/_fit_job.py hold CLUSTER_SPEC_JSON BACKUP_DIR
      fit with BackupAndRestore on an existing cluster (so it holds
      BACKUP_DIR's lock); at the end of its first batch it prints HOLDING and
      reads a line from stdin (the test kills it meanwhile, or writes one),
      then trains on to the end and reports.
  python tests/_fit_job.py hold_incremental CLUSTER_SPEC_JSON BACKUP_DIR
      a custom loop's keras_ps.IncrementalBackup(BACKUP_DIR) on an existing
      cluster: a full backup (metadata step 0), then it prints HOLDING and
      reads a line from stdin (the test kills it meanwhile, or writes one);
      then a delta (step 1) and close(), prints CLOSED, reads another line
      and reports.
  python tests/_fit_job.py preempt CLUSTER_SPEC_JSON BACKUP_DIR mid|at_end|-
      fit(epochs=2, steps_per_epoch=100) with BackupAndRestore(
      save_freq=False, save_before_preemption=True) on an existing cluster.
      mid: at the end of batch 19 of epoch 0 (after BackupAndRestore's
      hook), prints WAITING FOR SIGTERM and waits until the test's SIGTERM
      has come. at_end: a callback after BackupAndRestore SIGTERMs this
      process at the end of the last epoch. -: neither.
  python tests/_fit_job.py worker_kill 0|1
      fit on its own 3-worker LocalCluster; with 1, SIGKILL worker 2 in the
      middle of epoch 2.
  python tests/_fit_job.py ps_restart BACKUP_DIR 1|0
      fit with BackupAndRestore(save_freq=4) on its own LocalCluster; with 1,
      SIGKILL ps 0 mid-epoch 1 and report the error fit raised and how long
      after the kill; with 0 (the same script run again, on a new cluster),
      resume from the backup and finish.
  python tests/_fit_job.py keras_backup CLUSTER_SPEC_JSON BACKUP_DIR 1|0
      fit(epochs=4, steps_per_epoch=4) with Keras' own
      keras.callbacks.BackupAndRestore; with 1, SIGKILL this process at the
      end of epoch 1 (after the callback saved); with 0, run to the end.
  python tests/_fit_job.py ps_recover BACKUP_DIR KILLS [IN_RESTORE]
      fit with BackupAndRestore(save_freq=4) on its own LocalCluster;
      KILLS is a JSON list of [epoch, batch, [ps indices]]: at the end of
      that batch (first time seen, before the backup of that batch) those
      ps are SIGKILLed and started again on their addresses at once, as a
      restart policy does (on fit's thread; a fourth element "beside"
      restarts them on a thread of their own); [] runs undisturbed. With IN_RESTORE (a ps
      index), that ps is killed and restarted while the first recovery
      reads the backup. Reports iterations, accuracy and the recovery logs.
  python tests/_fit_job.py ps_notice BACKUP_DIR INCREMENTAL 1|0
      fit(epochs=2, steps_per_epoch=400) with BackupAndRestore(
      save_freq="epoch", save_before_preemption=True,
      incremental=INCREMENTAL (JSON)) on its own LocalCluster; with 1, ps 0
      gets SIGTERM (a preemption notice) at the first batch end from batch
      40 of epoch 0 on
      and, once it has exited, is started again on its address (a restart
      policy), beside fit. Reports iterations, accuracy, the recovery logs,
      the ps' exit code, how long it served on and its stop line.
  python tests/_fit_job.py ps_pause BACKUP_DIR SECONDS|given_up|forever|kill
      fit with BackupAndRestore(save_freq=4) on its own LocalCluster; at
      batch 21 of epoch 1, ps 0 is SIGSTOPped and continued SECONDS later
      (given_up: once fit logs that it recovers it; forever: never), or
      SIGKILLed and never started again (kill).
      Reports what fit returned or raised, the seconds from the fault, and
      the watchdog's warnings.
  python tests/_fit_job.py ps_pause_in_backup BACKUP_DIR
      as ps_pause, but ps 0 is SIGSTOPped as the first backup of epoch 1
      starts (the chief's own reads wait for it, no worker call does), and
      SIGKILLed and started again once the watchdog names it.
  python tests/_fit_job.py ps_pause_loop
      a custom loop (no backup) on its own LocalCluster; ps 0 is SIGSTOPped
      for good with steps in flight. Reports what join raised and when.
  python tests/_fit_job.py worker_stop_unroll
      fit on its own 2-worker LocalCluster; worker 1 is SIGSTOPped after
      the first execution of epoch 1, before the step function is due to
      switch to steps written out (KERAS_PS_UNROLL_AFTER=24), and continued
      once worker 0 ran 12 executions alone (or after 90 s).
  python tests/_fit_job.py worker_stop_after_switch
      the same cluster and model; worker 1 is SIGSTOPped the moment fit
      makes its step function with steps written out (after 24 executions),
      so that form is handed out before the stop and runs after it.
"""

import json
import logging
import os
import signal
import sys
import threading
import time

import keras
import numpy as np
import tensorflow as tf

import keras_ps
from _kills import reset_connections
from _kills import unread_bytes
from _results import say

EPOCHS, STEPS, PER_EXECUTION = 3, 40, 2




def data(seed=0, n=4096):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, :4].sum(1, keepdims=True) > x[:, 4:].sum(1, keepdims=True))
    return x, y.astype("float32")


def build(strategy, learning_rate=0.02):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.Adam(learning_rate), "binary_crossentropy",
                      metrics=["accuracy"], steps_per_execution=PER_EXECUTION)
    return model


def dataset_creator(batch_size=32):
    x, y = data()

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        return ds.shuffle(512, seed=context.input_pipeline_id).batch(
            batch_size).repeat()

    return keras_ps.DatasetCreator(dataset_fn)


class _Progress(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(f"PROGRESS epoch={self._epoch} batch={batch}", flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def backup(spec_json, backup_dir):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), rpc_layer="grpc")
    strategy = keras_ps.ParameterServerStrategy(resolver)
    model = build(strategy)
    backup_cb = keras_ps.callbacks.BackupAndRestore(backup_dir, save_freq=4)
    history = model.fit(dataset_creator(), epochs=EPOCHS, steps_per_epoch=STEPS,
                        callbacks=[backup_cb, _Progress()], verbose=0)
    say(iterations=int(model.optimizer.iterations.numpy()),
        planned=EPOCHS * STEPS, epochs=history.epoch,
        resumed=backup_cb.resume_position())


class _HoldAtFirstBatch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.held = False

    def on_train_batch_end(self, batch, logs=None):
        if not self.held:
            self.held = True
            print("HOLDING", flush=True)
            sys.stdin.readline()  # a line, or the end of stdin


def hold(spec_json, backup_dir):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), rpc_layer="grpc")
    model = build(keras_ps.ParameterServerStrategy(resolver))
    backup_cb = keras_ps.callbacks.BackupAndRestore(backup_dir, save_freq=4)
    model.fit(dataset_creator(), epochs=1, steps_per_epoch=8, verbose=0,
              callbacks=[backup_cb, _HoldAtFirstBatch()])
    say(iterations=int(model.optimizer.iterations.numpy()))


def hold_incremental(spec_json, backup_dir):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), rpc_layer="grpc")
    strategy = keras_ps.ParameterServerStrategy(resolver)
    model = build(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    with keras_ps.IncrementalBackup(model, backup_dir) as backup:
        backup.save_full(metadata={"step": 0})
        print("HOLDING", flush=True)
        sys.stdin.readline()
        entry = backup.save(metadata={"step": 1})
    print("CLOSED", flush=True)
    sys.stdin.readline()
    say(kind=entry.kind, id=entry.id)


PREEMPT_EPOCHS, PREEMPT_STEPS = 2, 100


class _WaitForSigterm(keras.callbacks.Callback):
    def __init__(self, backup):
        super().__init__()
        self.backup = backup

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (0, 19):
            print("WAITING FOR SIGTERM", flush=True)
            deadline = time.monotonic() + 120
            while (not self.backup._notice.received
                   and time.monotonic() < deadline):
                time.sleep(0.01)  # the handler runs in this thread


class _TermSelfAtTheEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == PREEMPT_EPOCHS - 1:
            print("SIGTERM to self after the last epoch", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


def preempt(spec_json, backup_dir, mode):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), rpc_layer="grpc")
    model = build(keras_ps.ParameterServerStrategy(resolver))
    backup_cb = keras_ps.callbacks.BackupAndRestore(
        backup_dir, save_freq=False, save_before_preemption=True)
    callbacks = [backup_cb, _Progress()]
    if mode == "mid":
        callbacks.append(_WaitForSigterm(backup_cb))
    if mode == "at_end":
        callbacks.append(_TermSelfAtTheEnd())
    history = model.fit(dataset_creator(), epochs=PREEMPT_EPOCHS,
                        steps_per_epoch=PREEMPT_STEPS, callbacks=callbacks,
                        verbose=0)
    say(iterations=int(model.optimizer.iterations.numpy()),
        planned=PREEMPT_EPOCHS * PREEMPT_STEPS, epochs=history.epoch,
        resumed=backup_cb.resume_position())


class _KillSelfAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            print(f"KILLED after epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def keras_backup(spec_json, backup_dir, kill):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), rpc_layer="grpc")
    strategy = keras_ps.ParameterServerStrategy(resolver)
    model = build(strategy)
    # Keras' callback first: it saves at the end of the epoch before the kill.
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir)]
    if kill:
        callbacks.append(_KillSelfAfterEpoch(1))
    history = model.fit(dataset_creator(), epochs=4, steps_per_epoch=4,
                        callbacks=callbacks, verbose=0)
    say(epochs=history.epoch,
        iterations=int(model.optimizer.iterations.numpy()))


class _KillWorker(keras.callbacks.Callback):
    def __init__(self, cluster):
        super().__init__()
        self.cluster = cluster

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 1 and batch == STEPS // 2 - 1:
            self.cluster.kill("worker", 2)
            print("KILLED worker 2", flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def worker_kill(kill):
    with keras_ps.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        callbacks = [_KillWorker(cluster)] if kill else []
        history = model.fit(dataset_creator(), epochs=EPOCHS,
                            steps_per_epoch=STEPS, callbacks=callbacks,
                            verbose=0)
        x, y = data(seed=7, n=1024)
        accuracy = model.evaluate(x, y, batch_size=128, verbose=0,
                                  return_dict=True)["accuracy"]
        coordinator = keras_ps.ClusterCoordinator(strategy)
        say(epochs=history.epoch, accuracy=accuracy,
            iterations=int(model.optimizer.iterations.numpy()),
            states=[w.state.value for w in coordinator.workers])


class _StopWorker(keras.callbacks.Callback):
    """SIGSTOPs worker 1 after the first execution of epoch 1 is scheduled
    (both workers have run the loop form in epoch 0), before the form with
    steps written out is due (after 24 executions with
    KERAS_PS_UNROLL_AFTER=24); continues it once worker 0 has run
    `while_stopped` executions alone, or after 90 s."""

    def __init__(self, cluster, coordinator, while_stopped):
        super().__init__()
        self.cluster, self.coordinator = cluster, coordinator
        self.while_stopped = while_stopped
        self.report = {}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == (1, PER_EXECUTION - 1):
            self.stop_now()

    def stop_now(self):
        workers = self.coordinator.workers
        deadline = time.monotonic() + 60
        while min(w.closures_run for w in workers) == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("a worker never ran an execution")
            time.sleep(0.01)
        self.cluster.pause("worker", 1)
        self.report["stopped"] = True
        ran = self.coordinator.workers[0].closures_run

        def watch():
            deadline = time.monotonic() + 90
            while (self.coordinator.workers[0].closures_run - ran
                   < self.while_stopped and time.monotonic() < deadline):
                time.sleep(0.05)
            self.report["ran_while_stopped"] = (
                self.coordinator.workers[0].closures_run - ran)
            self.report["resumed_at"] = time.monotonic()
            self.cluster.resume("worker", 1)
        self._watch = threading.Thread(target=watch, daemon=True)
        self._watch.start()


class _StepLog(logging.Handler):
    """When fit's step function switched to steps written out, and how often
    a stand-in ran in its place. With `stop_on_switch`, stops worker 1 the
    moment of the switch (the chief logs it as it makes the function,
    before that is scheduled): the new form is handed out while both
    workers answer, and comes to run while one is stopped."""

    def __init__(self, stopper=None):
        super().__init__(logging.INFO)
        self.stopper, self.at, self.stood_in = stopper, [], 0
        for name in ("keras_ps.training._step_functions",
                     "keras_ps.coordinator.packing"):
            log = logging.getLogger(name)
            log.setLevel(logging.INFO)
            log.addHandler(self)

    def emit(self, record):
        message = record.getMessage()
        if "steps an iteration from now on" in message:
            self.at.append(time.monotonic())
            if self.stopper is not None and "stopped" not in self.stopper.report:
                self.stopper.stop_now()
        elif "gives way to its stand-in" in message:
            self.stood_in += 1


def worker_stop_unroll(at_switch):
    """Worker 1 stopped in epoch 1, before the form with steps written out
    is due, or (`at_switch`) the moment fit makes that form.
    KERAS_PS_UNROLL_AFTER (small) and KERAS_PS_HANG_TIMEOUT come from the
    test's environment."""
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        model = build(strategy)
        stop = _StopWorker(cluster, coordinator, while_stopped=12)
        steps = _StepLog(stop if at_switch else None)
        history = model.fit(dataset_creator(), epochs=EPOCHS,
                            steps_per_epoch=STEPS,
                            callbacks=[] if at_switch else [stop], verbose=0)
        stop._watch.join()
        if not coordinator.workers[1].wait_until_runnable(120):
            raise RuntimeError("worker 1 was not re-admitted")
        # Then with every worker running: the form with steps written out.
        model.fit(dataset_creator(), epochs=1, steps_per_epoch=5 * STEPS,
                  verbose=0)
        say(epochs=history.epoch, planned=EPOCHS * STEPS + 5 * STEPS,
            iterations=int(model.optimizer.iterations.numpy()),
            ran_while_stopped=stop.report["ran_while_stopped"],
            switched_after_resume=[t > stop.report["resumed_at"]
                                   for t in steps.at],
            stood_in=steps.stood_in,
            run_twice=PER_EXECUTION * sum(
                w.closures_run_twice for w in coordinator.workers),
            states=[w.state.value for w in coordinator.workers])


class _KillPs(keras.callbacks.Callback):
    def __init__(self, cluster):
        super().__init__()
        self.cluster, self.killed_at = cluster, None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):

        if self._epoch == 1 and batch >= STEPS // 2 and self.killed_at is None:
            self.cluster.kill("ps", 0)
            self.killed_at = time.monotonic()
            print("KILLED ps 0", flush=True)


def ps_restart(backup_dir, kill):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        backup_cb = keras_ps.callbacks.BackupAndRestore(
            backup_dir, save_freq=4, recover_ps=False)
        killer = _KillPs(cluster)
        callbacks = [backup_cb, _Progress()] + ([killer] if kill else [])
        try:
            history = model.fit(dataset_creator(), epochs=EPOCHS,
                                steps_per_epoch=STEPS, callbacks=callbacks,
                                verbose=0)
        except Exception as error:  # what the user sees, reported to the test
            say(error=type(error).__name__, message=str(error),
                is_unavailable=isinstance(error, tf.errors.UnavailableError),
                seconds=time.monotonic() - killer.killed_at
                if killer.killed_at else None)
            sys.exit(1)
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, epochs=history.epoch,
            resumed=backup_cb.resume_position())


class _KillAndRestartPs(keras.callbacks.Callback):
    """SIGKILLs ps tasks at given (epoch, batch) and starts them again at
    once: a restart policy brings them back before anyone notices.

    A kill [epoch, batch, indices] restarts the ps on fit's own thread, so
    the next step finds them back with nothing on them; [epoch, batch,
    indices, "beside"] restarts them on a thread of their own, as a restart
    policy does beside the job, and fit goes on at once."""

    def __init__(self, cluster, kills):
        super().__init__()
        self.cluster = cluster
        self.kills = {(k[0], k[1]): (k[2], k[3:] == ["beside"]) for k in kills}
        self.done = []
        self.killed_at = self.back_at = None
        self._beside = []

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        key = (self._epoch, batch)
        if key in self.kills and key not in self.done:
            self.done.append(key)
            indices, beside = self.kills[key]
            self.killed_at = time.monotonic()
            for index in indices:
                self.cluster.kill("ps", index)
            if beside:
                thread = threading.Thread(target=self._restart, args=(indices,))
                thread.start()
                self._beside.append(thread)
            else:
                self._restart(indices)
            print(f"KILLED AND RESTARTED ps {indices} at {key}", flush=True)

    def _restart(self, indices):
        for index in indices:
            self.cluster.restart("ps", index)
        self.back_at = time.monotonic()

    def join(self):
        """Waits for the restarts on threads of their own (before the
        cluster is shut down, so that none starts a ps after it)."""
        for thread in self._beside:
            thread.join()


class _KillInRestore(keras_ps.callbacks.BackupAndRestore):
    """Kills and restarts ps `index` as the first recovery reads the backup:
    a ps lost while a recovery is under way."""

    def __init__(self, cluster, index, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster, self.index, self.restores = cluster, index, 0

    def restore_latest(self):
        self.restores += 1
        if self.restores == 2 and self.index is not None:  # 1: train begin
            self.cluster.kill("ps", self.index)
            self.cluster.restart("ps", self.index)
            print(f"KILLED AND RESTARTED ps {self.index} in the restore",
                  flush=True)
        return super().restore_latest()


def ps_recover(backup_dir, kills, in_restore=None, recover_ps=True):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        killer = _KillAndRestartPs(cluster, kills)
        backup = _KillInRestore(cluster, in_restore, backup_dir, save_freq=4,
                                recover_ps=recover_ps)
        try:
            history = model.fit(
                dataset_creator(), epochs=EPOCHS, steps_per_epoch=STEPS,
                callbacks=[killer, backup], verbose=0)
        except Exception as error:  # what the user sees, reported to the test
            raised_at = time.monotonic()
            killer.join()
            say(error=type(error).__name__, message=str(error),
                seconds=raised_at - killer.killed_at,
                seconds_after_back=raised_at - killer.back_at
                if killer.back_at and killer.back_at < raised_at else None)
            sys.exit(1)
        killer.join()
        x, y = data(seed=1, n=1024)
        _, accuracy = model.evaluate(x, y, batch_size=128, verbose=0)
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, epochs=history.epoch, kills=killer.done,
            accuracy=float(accuracy), restores=backup.restores,
            recoveries=history.history.get("ps_recoveries"),
            rolled_back=history.history.get("steps_rolled_back"))


NOTICE_EPOCHS, NOTICE_STEPS, NOTICE_AT = 2, 400, (0, 40)


class _NoticePs(keras.callbacks.Callback):
    """SIGTERMs ps 0 at NOTICE_AT and, on a thread of its own, waits for it
    to exit and starts it again on its address (what a restart policy does
    after a preemption)."""

    def __init__(self, cluster):
        super().__init__()
        self.cluster = cluster
        self.thread = None
        self.exit_code = self.served_on = self.stop_line = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) >= NOTICE_AT and self.thread is None:
            self.thread = threading.Thread(target=self._notice)
            self.thread.start()
            print(f"SIGTERM TO ps 0 at {NOTICE_AT}", flush=True)

    def _notice(self):
        started = time.monotonic()
        self.exit_code = self.cluster.stop("ps", 0, timeout=60)
        self.served_on = time.monotonic() - started
        with open(os.path.join(self.cluster.log_dir, "ps-0.log")) as f:
            self.stop_line = [line.strip() for line in f
                              if "stopping" in line][-1]
        self.cluster.restart("ps", 0)

    def join(self):
        if self.thread is not None:
            self.thread.join()


def ps_notice(backup_dir, incremental, notice):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        # 800 steps of 32 at Adam's 0.02 end 0.97-0.99 accurate with the
        # load of the machine (async steps' staleness); at 0.005,
        # 0.983-0.991; in batches of 128 at 0.005, 0.991-0.997.
        model = build(strategy, learning_rate=0.005)
        notifier = _NoticePs(cluster)
        backup = keras_ps.callbacks.BackupAndRestore(
            backup_dir, save_freq="epoch", save_before_preemption=True,
            incremental=incremental)
        history = model.fit(
            dataset_creator(batch_size=128), epochs=NOTICE_EPOCHS,
            steps_per_epoch=NOTICE_STEPS, verbose=0,
            callbacks=[notifier] * notice + [backup])
        notifier.join()
        x, y = data(seed=1, n=1024)
        _, accuracy = model.evaluate(x, y, batch_size=128, verbose=0)
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=NOTICE_EPOCHS * NOTICE_STEPS, accuracy=float(accuracy),
            recoveries=history.history.get("ps_recoveries"),
            rolled_back=history.history.get("steps_rolled_back"),
            exit_code=notifier.exit_code, served_on=notifier.served_on,
            stop_line=notifier.stop_line)


class _Warnings(logging.Handler):
    """Keeps the messages of WARNING records (the watchdog's); `seen` is set
    once one holds `text`."""

    def __init__(self, name, text=None):
        super().__init__(logging.WARNING)
        self.messages, self.text, self.seen = [], text, threading.Event()
        logging.getLogger(name).addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())
        if self.text is not None and self.text in record.getMessage():
            self.seen.set()


class _PausePs(keras.callbacks.Callback):
    """SIGSTOPs ps 0 at batch 21 of epoch 1 and continues it `seconds` later
    (None: never), or once `after` is set; with `kill`, SIGKILLs it
    instead, never restarted."""

    def __init__(self, cluster, seconds, kill=False, after=None):
        super().__init__()
        self.cluster, self.seconds, self.kill = cluster, seconds, kill
        self.after = after
        self.at = self.resumed_at = None
        self._timer = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch != 1 or batch < 21 or self.at is not None:
            return
        if self.kill:
            self.cluster.kill("ps", 0)
        else:
            self.cluster.pause("ps", 0)
        self.at = time.monotonic()
        if self.seconds is not None:
            self._timer = threading.Timer(self.seconds, self._resume)
            self._timer.start()
        elif self.after is not None:
            threading.Thread(target=lambda: self.after.wait(120)
                             and self._resume(), daemon=True).start()

    def _resume(self):
        self.cluster.resume("ps", 0)
        self.resumed_at = time.monotonic()

    def cancel(self):
        if self._timer is not None:
            self._timer.cancel()


def ps_pause(backup_dir, pause):
    warnings = _Warnings("keras_ps.coordinator.watchdog")
    recovering = _Warnings("keras_ps.training._fit_epochs", "recovering from")
    seconds = (None if pause in ("forever", "kill", "given_up")
               else float(pause))
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        pauser = _PausePs(cluster, seconds, kill=pause == "kill",
                          after=recovering.seen if pause == "given_up"
                          else None)
        backup = keras_ps.callbacks.BackupAndRestore(backup_dir, save_freq=4)
        try:
            history = model.fit(dataset_creator(), epochs=EPOCHS,
                                steps_per_epoch=STEPS,
                                callbacks=[pauser, backup], verbose=0)
        except Exception as error:  # what the user sees, reported to the test
            say(error=type(error).__name__, message=str(error),
                seconds=time.monotonic() - pauser.at,
                unavailable=isinstance(
                    error, keras_ps.errors.ParameterServerUnavailableError),
                warnings=warnings.messages)
            sys.exit(1)
        finally:
            pauser.cancel()
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, epochs=history.epoch,
            recoveries=history.history.get("ps_recoveries"),
            rolled_back=history.history.get("steps_rolled_back"),
            paused=pauser.at is not None,
            resumed_before_end=pauser.resumed_at is not None,
            warnings=warnings.messages)


class _PauseInBackup(keras_ps.callbacks.BackupAndRestore):
    """Stops ps 0 as its first backup of epoch 1 starts; kills it and starts
    it again once `named` is set (the watchdog named it)."""

    def __init__(self, cluster, named, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster, self.named, self.at = cluster, named, None

    def _backup(self, epoch, step):
        if epoch == 1 and self.at is None:
            self.cluster.pause("ps", 0)
            self.at = time.monotonic()
            threading.Thread(target=self._restart, daemon=True).start()
        return super()._backup(epoch, step)

    def _restart(self):
        if self.named.wait(120):
            self.cluster.kill("ps", 0)
            self.cluster.restart("ps", 0)


class _ResetInBackup(keras_ps.callbacks.BackupAndRestore):
    """As its first backup of epoch 1 starts, once the steps in flight
    ended, stops ps 0; once the backup's read of ps 0 is sent (unread there),
    aborts this process' connections to ps 0 (ss -K), and continues it.
    `reset`: how many were aborted."""

    def __init__(self, cluster, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster, self.reset = cluster, None

    def _backup(self, epoch, step):
        if epoch == 1 and self.reset is None:
            keras_ps.ClusterCoordinator(self.model.distribute_strategy).join()
            port = int(self.cluster.address("ps", 0).rsplit(":", 1)[1])
            before = unread_bytes(os.getpid(), port)
            self.cluster.pause("ps", 0)
            self.reset = 0
            threading.Thread(target=self._reset, args=(port, before),
                             daemon=True).start()
        return super()._backup(epoch, step)

    def _reset(self, port, before):
        deadline = time.monotonic() + 60
        while (unread_bytes(os.getpid(), port) <= before
               and time.monotonic() < deadline):
            time.sleep(0.01)
        self.reset = reset_connections(os.getpid(), port)
        self.cluster.resume("ps", 0)


def backup_reset(backup_dir):
    warnings = _Warnings("keras_ps.callbacks._backup_modes")
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        backup = _ResetInBackup(cluster, backup_dir, save_freq=4)
        history = model.fit(dataset_creator(), epochs=EPOCHS,
                            steps_per_epoch=STEPS, callbacks=[backup],
                            verbose=0)
        x, y = data(seed=1, n=1024)
        _, accuracy = model.evaluate(x, y, batch_size=128, verbose=0)
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, epochs=history.epoch, reset=backup.reset,
            accuracy=float(accuracy), warnings=warnings.messages,
            recoveries=history.history.get("ps_recoveries"),
            rolled_back=history.history.get("steps_rolled_back"))


def ps_pause_in_backup(backup_dir):
    warnings = _Warnings("keras_ps.coordinator.watchdog", "ps 0 at localhost")
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        backup = _PauseInBackup(cluster, warnings.seen, backup_dir,
                                save_freq=4)
        history = model.fit(dataset_creator(), epochs=EPOCHS,
                            steps_per_epoch=STEPS, callbacks=[backup],
                            verbose=0)
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, paused=backup.at is not None,
            recoveries=history.history.get("ps_recoveries"),
            warnings=warnings.messages)


def ps_pause_loop():
    warnings = _Warnings("keras_ps.coordinator.watchdog")
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            a, b = tf.Variable(0.0), tf.Variable(0.0)  # one on each ps

        @tf.function
        def step():
            a.assign_add(1.0)
            b.assign_add(1.0)
            return a + b

        for _ in range(20):
            coordinator.schedule(step)
        coordinator.join()
        cluster.pause("ps", 0)
        paused_at = time.monotonic()
        for _ in range(20):
            coordinator.schedule(step)
        try:
            coordinator.join()
            error = None
        except Exception as e:  # what the user sees, reported to the test
            error = e
        seconds = time.monotonic() - paused_at
        cluster.kill("ps", 0)  # the steps still waiting on it fail
        say(error=type(error).__name__, message=str(error), seconds=seconds,
            unavailable=isinstance(
                error, keras_ps.errors.ParameterServerUnavailableError),
            warnings=warnings.messages)


def lost_shards_restore(backup_dir, incremental):
    """A backup, then every float variable changed, then ps 0 killed and
    restarted: `restore_lost_shards([0])` gives ps 0 the backup's values and
    leaves ps 1's as they were."""
    with keras_ps.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=keras_ps.partitioners.FixedShardsPartitioner(2))
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(256, 8), keras.layers.Flatten(),
                keras.layers.Dense(1, activation="sigmoid")])
            model.compile(keras.optimizers.Adagrad(0.1), "binary_crossentropy")
        x = np.random.default_rng(0).integers(0, 256, (256, 4)).astype("int32")
        y = (x[:, :1] % 2).astype("float32")
        callback = keras_ps.callbacks.BackupAndRestore(
            backup_dir, delete_checkpoint=False, incremental=incremental,
            recover_ps="lost_shards")
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=8,
                  callbacks=[callback], verbose=0)

        def floats(index):
            # The model's and the optimizer's (metric state is not backed up).
            return [v for v in strategy.variables_on_ps(index)
                    if v.dtype == tf.float32 and not v.name.startswith("loss/")]

        backed = [[v.numpy() for v in floats(i)] for i in range(2)]
        for i in range(2):
            for variable in floats(i):
                variable.assign_add(tf.ones_like(variable))
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        recovery = coordinator.recover_parameter_servers(restore_follows=True)
        position = callback.restore_lost_shards(recovery.lost)
        say(lost=list(recovery.lost), position=list(position),
            variables=[len(floats(i)) for i in range(2)],
            ps0_is_backup=all(np.array_equal(v.numpy(), b)
                              for v, b in zip(floats(0), backed[0])),
            ps1_kept=all(np.array_equal(v.numpy(), b + 1)
                         for v, b in zip(floats(1), backed[1])),
            incremental_files=os.path.isdir(
                os.path.join(backup_dir, "incremental")))


if __name__ == "__main__":
    # FIT_JOB_LOG=1: keras_ps' INFO log too (worker states, function
    # switches), for a test that shows the output when the job hangs.
    logging.basicConfig(level=logging.INFO if os.environ.get("FIT_JOB_LOG")
                        else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    if sys.argv[1] == "backup":
        backup(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "hold":
        hold(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "hold_incremental":
        hold_incremental(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "preempt":
        preempt(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "ps_restart":
        ps_restart(sys.argv[2], sys.argv[3] == "1")
    elif sys.argv[1] == "keras_backup":
        keras_backup(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    elif sys.argv[1] == "ps_notice":
        ps_notice(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1")
    elif sys.argv[1] == "ps_pause":
        ps_pause(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "backup_reset":
        backup_reset(sys.argv[2])
    elif sys.argv[1] == "ps_pause_in_backup":
        ps_pause_in_backup(sys.argv[2])
    elif sys.argv[1] == "ps_pause_loop":
        ps_pause_loop()
    elif sys.argv[1] == "ps_recover":
        ps_recover(sys.argv[2], json.loads(sys.argv[3]),
                   int(sys.argv[4]) if sys.argv[4:5] not in ([], ["-"])
                   else None, *sys.argv[5:6])
    elif sys.argv[1] == "lost_shards_restore":
        lost_shards_restore(sys.argv[2], json.loads(sys.argv[3]))
    elif sys.argv[1] == "worker_stop_unroll":
        worker_stop_unroll(at_switch=False)
    elif sys.argv[1] == "worker_stop_after_switch":
        worker_stop_unroll(at_switch=True)
    else:
        worker_kill(sys.argv[2] == "1")
