"""A coordinator process for the dynamic-shard tests; prints JSON lines.

Every record carries its id (column 0 of x). The model's train_step adds 1
to `counts[id]`, a non-trainable weight on a ps, with one atomic scatter_add
per step, after every other update of the step: a record is counted when
its step was applied. A callback reads and clears the counts at each epoch
end, and notes the optimizer's iterations of the epoch. So the test sees,
per epoch, how many times each record was trained by an applied step and how
many steps the optimizer ran, and compares both with the shard ledger's
figures.
The model runs STEPS_PER_EXECUTION steps per execution (the shard
function's minimum), so a shard of 4 batches is one full execution.

Usage:
  python tests/_shards_job.py MODE DATA_DIR [CLUSTER_SPEC_JSON BACKUP_DIR]
    plain    3 workers, 2 epochs, nothing happens
    kill     SIGKILL worker 1 mid-epoch 0, between two steps of an
             execution, and restart it at once
    stop     SIGSTOP worker 1 mid-epoch 0, between two steps of an
             execution, past the hang timeout, then SIGCONT
    kill_in_step
             SIGKILL worker 1 mid-epoch 0 inside a step, once the step's
             updates are on the ps and before its progress mark (the step
             waits PAUSE_US on the worker after its updates), and restart it
    chaos    a kill and a stop in epoch 0, a kill in epoch 1
    reset    at shards 3, 7, 11, 15 and 19 of each epoch, every TCP
             connection to the ps and from this process to the workers is
             aborted (ss -K: a network path that drops them), every
             process running on
    elastic  2 agents through a rendezvous; a third joins mid-epoch 0 and
             leaves (SIGTERM to its agent) once it trained 2 shards
    backup   fit with BackupAndRestore(save_freq=1) on an existing cluster;
             the test SIGKILLs this process mid-epoch 1 and runs it again
    ps_recover [in_validation|exit_in_validation|resume]
             1 ps, 3 workers, BackupAndRestore(save_freq=2): the ps (which
             holds the model, the counts and the shards' progress) is
             SIGKILLed and started again at once mid-epoch 0 (in_validation:
             as epoch 0's validation begins, after its last backup); the
             same fit recovers it from the newest backup. exit_in_validation:
             this process leaves there instead (exit status 3); resume: run
             again, nothing happens
"""

import functools
import json
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
from _results import say
from keras_ps import _tf_adapter
from keras_ps.tables import _blockwise_init

FILES, RECORDS_PER_FILE, BATCH, EPOCHS = 24, 64, 16, 2
STEPS_PER_EXECUTION = 4
READ_SLEEP_US = 2500  # per record: a shard takes about 0.2 s
PAUSE_US = 3_000_000  # kill_in_step: a step's wait after its updates




def write_files(data_dir):
    """FILES TFRecord files of RECORDS_PER_FILE records; ids 0..N-1."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for f in range(FILES):
        path = os.path.join(data_dir, f"part-{f:03d}.tfrecord")
        paths.append(path)
        if os.path.exists(path):
            continue
        with tf.io.TFRecordWriter(path + ".tmp") as writer:
            for i in range(RECORDS_PER_FILE):
                x = rng.normal(size=8).astype("float32")
                record_id = f * RECORDS_PER_FILE + i
                y = float(x[:4].sum() > x[4:].sum())
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(
                        value=[float(record_id)] + x.tolist())),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(
                        value=[y]))}))
                writer.write(example.SerializeToString())
        os.replace(path + ".tmp", path)
    return paths


def read_fn(filename):
    features = {"x": tf.io.FixedLenFeature([9], tf.float32),
                "y": tf.io.FixedLenFeature([1], tf.float32)}

    def parse(record):
        parsed = tf.io.parse_single_example(record, features)
        return parsed["x"], parsed["y"]

    # Each record waits for a tick of a sleeping dataset beside it, never
    # for a sleep over the records: see _tf_adapter.sleep_dataset.
    return tf.data.Dataset.zip((
        tf.data.TFRecordDataset(filename),
        _tf_adapter.sleep_ticks(READ_SLEEP_US))).map(
            lambda record, _: parse(record))


class CountingModel(keras.Model):
    """Column 0 of x is the record id; the rest are features.

    With `pause`, each step then waits `pause_us` microseconds (a weight on
    the ps, 0 until a test sets it) on its worker, after all its updates:
    the step's progress mark on the ps waits for that wait, so a worker
    killed meanwhile leaves a step applied and not marked."""

    def __init__(self, num_records, pause=False, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1, activation="sigmoid")
        self.counts = self.add_weight(shape=(num_records,), initializer="zeros",
                                      trainable=False, dtype="int32",
                                      name="counts")
        self.pause_us = self.add_weight(
            shape=(), initializer="zeros", trainable=False, dtype="int64",
            name="pause_us") if pause else None

    def call(self, x):
        return self.out(self.hidden(x[:, 1:]))

    def train_step(self, data):
        x, _ = data
        ids = tf.cast(x[:, 0], tf.int32)
        # Made before the updates, so the count needs nothing the worker
        # computes after them: it is applied with the step's other updates.
        ones = tf.ones_like(ids)
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        logs = super().train_step(data)
        updates = [op for op in graph.get_operations()[first:]
                   if op.op_def.is_stateful]
        # One atomic op on the ps, after the step's other updates:
        # counts[ids] += 1.
        with tf.control_dependencies(updates):
            count = tf.raw_ops.ResourceScatterAdd(
                resource=self.counts._value.handle, indices=ids,
                updates=ones)
        if self.pause_us is not None:
            with tf.control_dependencies([count]):
                _wait_on_worker(tf.convert_to_tensor(self.pause_us))
        return logs


def _wait_on_worker(microseconds):
    """Waits `microseconds` where the step runs (a stateful op, so the
    step's progress mark waits for it)."""
    return tf.data.Dataset.from_tensors(tf.constant(0)).apply(
        _tf_adapter.sleep_dataset(microseconds)).get_single_element()


def build(strategy, pause=False):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = CountingModel(FILES * RECORDS_PER_FILE, pause=pause)
        model.compile(keras.optimizers.Adam(0.02), "binary_crossentropy",
                      metrics=["accuracy"],
                      steps_per_execution=STEPS_PER_EXECUTION)
    return model


class Counts(keras.callbacks.Callback):
    """At each epoch end: the counts, then cleared; the ledger's view; the
    last shard reported to the batch callbacks."""

    def __init__(self, data, coordinator):
        super().__init__()
        self.data, self.coordinator = data, coordinator
        self.epochs = {}
        self._iterations = 0  # the optimizer's, when the epoch began
        self._last_batch = {}  # epoch: the highest batch (shard) index

    def on_epoch_begin(self, epoch, logs=None):
        # After BackupAndRestore's restore: a rerun counts its own steps.
        self._iterations = self._optimizer_iterations()
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._last_batch[self._epoch] = max(
            batch, self._last_batch.get(self._epoch, -1))

    def on_epoch_end(self, epoch, logs=None):
        counts = self.model.counts.numpy()
        self.model.counts.assign(np.zeros_like(counts))
        steps = self._optimizer_iterations() - self._iterations
        ledger = keras_ps.shards.epoch.state_for(
            self.data, self.coordinator).current.ledger
        lost = ledger.lost_shards()
        self.epochs[epoch] = dict(
            missing=[int(i) for i in np.flatnonzero(counts == 0)],
            twice=[int(i) for i in np.flatnonzero(counts > 1)],
            extra=int(np.maximum(counts - 1, 0).sum()),
            max_count=int(counts.max()), steps=steps,
            logs={k: v for k, v in logs.items()
                  if not isinstance(v, float)
                  or k.startswith(("shards", "records"))},
            lost_shards=lost,
            lost_ids=[int(i) for s in lost for i in self.shard_ids(s)],
            handed_out=[i for i in range(len(ledger)) if ledger.attempts(i)],
            last_batch=self._last_batch.get(epoch))
        print(f"EPOCH {epoch} {json.dumps(self.epochs[epoch]['logs'])}",
              flush=True)

    def _optimizer_iterations(self):
        return int(self.model.optimizer.iterations.numpy())

    def shard_ids(self, shard):
        return range(shard * RECORDS_PER_FILE, (shard + 1) * RECORDS_PER_FILE)


class AtShard(keras.callbacks.Callback):
    """Runs `action` once, when `shards` shards of epoch 0 are done."""

    def __init__(self, shards, action, epoch=0):
        super().__init__()
        self.shards, self.action, self.epoch = shards, action, epoch
        self.fired = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.fired and self._epoch == self.epoch and \
                batch + 1 >= self.shards:
            self.fired = True
            self.action()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def fit_and_report(model, data, coordinator, callbacks, **extra):
    counts = Counts(data, coordinator)
    history = model.fit(data, epochs=EPOCHS, callbacks=[counts] + callbacks,
                        verbose=0)
    say(epochs=counts.epochs, history_epochs=history.epoch,
        states=[w.state.value for w in coordinator.workers],
        closures=[w.closures_run for w in coordinator.workers], **extra)


def sharded_input(paths):
    return keras_ps.ShardedInput(paths, read_fn=read_fn, batch_size=BATCH,
                                 seed=5)


def on_local_cluster(mode, data_dir):
    paths = write_files(data_dir)
    with keras_ps.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy, pause=mode == "kill_in_step")
        coordinator = keras_ps.ClusterCoordinator(strategy)
        data = sharded_input(paths)
        events = {}

        def shards_of(index, ledger):
            return [i for i in range(len(ledger))
                    if ledger.state(i).value == "handed_out"
                    and ledger.workers_tried(i)[-1] == index]

        def between_steps(index=1, timeout=30):
            """Waits until worker `index` is inside an execution: some of
            its steps applied, not all (read from the shard's progress on
            the ps), so a kill or stop lands where a step may be in flight.
            True once seen; False at the deadline."""
            state = keras_ps.shards.epoch.state_for(data, coordinator)
            ledger = state.current.ledger
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                mine = shards_of(index, ledger)
                applied = state.applied.numpy()
                if any(applied[i] < RECORDS_PER_FILE and
                       applied[i] % (BATCH * STEPS_PER_EXECUTION)
                       for i in mine):
                    return True
            return False

        def inside_step(index=1, timeout=60):
            """Waits until worker `index` is inside a step after its
            updates: the counts of its shard's records (on the ps) exceed
            the shard's progress, read after them, so a step of the shard
            was applied and not marked. True once seen; False at the
            deadline."""
            state = keras_ps.shards.epoch.state_for(data, coordinator)
            ledger = state.current.ledger
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                mine = shards_of(index, ledger)
                counts = model.counts.numpy()
                applied = state.applied.numpy()
                if any(counts[(i * RECORDS_PER_FILE):
                              (i + 1) * RECORDS_PER_FILE].sum() > applied[i]
                       for i in mine):
                    return True
            return False

        def kill_inside_step():
            model.pause_us.assign(PAUSE_US)

            def run():
                events["inside_step"] = inside_step()
                kill()
                model.pause_us.assign(0)
            threading.Thread(target=run, daemon=True).start()

        def in_background(action):
            def run():
                events["between_steps"] = between_steps()
                action()
            return lambda: threading.Thread(target=run, daemon=True).start()

        def kill(index=1, key=""):
            worker = coordinator.workers[index]
            cluster.kill("worker", index)
            events[f"killed{key}"] = True

            def restart():
                wait_for(lambda: worker.state is not
                         keras_ps.coordinator.WorkerState.HEALTHY, 30,
                         "the kill to be noticed")
                cluster.restart("worker", index)
                events[f"restarted{key}"] = True
            threading.Thread(target=restart, daemon=True).start()

        def stop(index=1, key=""):
            worker = coordinator.workers[index]
            cluster.pause("worker", index)
            events[f"stopped{key}"] = True

            def resume():
                wait_for(lambda: worker.state is
                         keras_ps.coordinator.WorkerState.HUNG, 120,
                         "the hang to be noticed")
                cluster.resume("worker", index)
                events[f"continued{key}"] = True
            threading.Thread(target=resume, daemon=True).start()

        def stop_when_back(index, key, restarted):
            """The chaos stop: waits (holding the fit) until the worker
            killed before is re-admitted (event `restarted`, and every
            worker runnable: a re-admission pushes the cluster to every
            worker, a stopped one too, and would wait for it), then, in the
            background, stops worker `index` once it is inside an execution,
            so its call hangs and the hang is noticed."""
            def act():
                wait_for(lambda: events.get(restarted) and all(
                    w.state.value in ("healthy", "readmitted")
                    for w in coordinator.workers), 120,
                    "the killed worker's re-admission")

                def run():
                    between_steps(index)
                    stop(index, key)
                threading.Thread(target=run, daemon=True).start()
            return act

        def reset(key):
            """Aborts every connection to the ps (the workers' and this
            process') and this process' to the workers."""
            port = {(job, i): int(cluster.address(job, i).rsplit(":", 1)[1])
                    for job, i in [("ps", 0)] + [("worker", i)
                                                 for i in range(3)]}
            aborted = sum(reset_connections(pid, port["ps", 0]) for pid in [
                cluster.pid("worker", i) for i in range(3)] + [os.getpid()])
            aborted += sum(reset_connections(os.getpid(), port["worker", i])
                           for i in range(3))
            events[f"reset_{key}"] = aborted

        callbacks = {
            "reset": [AtShard(shard, functools.partial(reset, f"{e}_{shard}"),
                              epoch=e)
                      for e in range(EPOCHS) for shard in (3, 7, 11, 15, 19)],
            "plain": [], "kill": [AtShard(6, in_background(kill))],
            "stop": [AtShard(6, in_background(stop))],
            "kill_in_step": [AtShard(6, kill_inside_step)],
            # The long variant: a kill and a stop in epoch 0, a kill in 1.
            "chaos": [AtShard(4, lambda: kill(1, "_0")),
                      AtShard(14, stop_when_back(2, "_0", "restarted_0")),
                      AtShard(6, lambda: kill(0, "_1"), epoch=1)]}[mode]
        fit_and_report(model, data, coordinator, callbacks, events=events)


def ps_recover(data_dir, backup_dir, when="mid_epoch"):
    paths = write_files(data_dir)
    with keras_ps.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        # The recovery leaves every variable unwritten until the restore
        # (as it does a table of 256 MiB and more): the restore must write
        # them all, the per-record counts included.
        _blockwise_init.BLOCKWISE_MIN_BYTES = 0
        coordinator = keras_ps.ClusterCoordinator(strategy)
        data = sharded_input(paths)
        events, before = {}, {}

        def kill_and_restart():
            cluster.kill("ps", 0)
            cluster.restart("ps", 0)
            events["killed_and_restarted"] = True

        counts = Counts(data, coordinator)
        callbacks = [counts,
                     keras_ps.callbacks.BackupAndRestore(backup_dir,
                                                         save_freq=2)]
        validation = None
        if when == "mid_epoch":
            callbacks.insert(1, AtShard(9, kill_and_restart))
        else:  # as epoch 0's validation begins, after its last backup
            evaluate = model.evaluate

            def evaluate_after_a_loss(*args, **kwargs):
                if not before and when != "resume":
                    before.update({k: float(v) for k, v in
                                   model.get_metrics_result().items()})
                    if when == "exit_in_validation":
                        say(before=before)
                        print("LEAVING in epoch 0's validation", flush=True)
                        os._exit(3)
                    kill_and_restart()
                return evaluate(*args, **kwargs)

            model.evaluate = evaluate_after_a_loss
            rng = np.random.default_rng(3)
            validation = (np.concatenate([np.zeros((64, 1)), rng.normal(
                size=(64, 8))], axis=1).astype("float32"),
                rng.integers(0, 2, (64, 1)).astype("float32"))
        history = model.fit(data, epochs=EPOCHS, verbose=0,
                            callbacks=callbacks, validation_data=validation)
        say(epochs=counts.epochs, history_epochs=history.epoch,
            recoveries=history.history["ps_recoveries"],
            rolled_back=history.history["shards_rolled_back"], events=events,
            states=[w.state.value for w in coordinator.workers],
            before=before, loss=history.history["loss"],
            accuracy=history.history["accuracy"])


def elastic(data_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tutorials"))
    import subprocess

    from elastic import Agent, free_address  # tutorials/elastic.py
    from keras_ps.cluster import wait_for_port
    from keras_ps.elastic import RendezvousConfig, RendezvousServer

    paths = write_files(data_dir)
    rdzv = RendezvousServer(RendezvousConfig(gather_timeout=0.5))
    endpoint = f"127.0.0.1:{rdzv.start()}"
    ps_address = free_address()
    ps = subprocess.Popen(
        [sys.executable, "-m", "keras_ps.server", "--job_name", "ps",
         "--cluster_spec", json.dumps({"ps": [ps_address]})],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log_dir = os.path.join(data_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    def start_agents(names, attempts=3):
        """Agents whose workers serve (started together: the rendezvous
        admits them once min_workers are waiting); one is started again when
        it gave up reaching the rendezvous (seen on a very busy machine)."""
        started = {}
        for attempt in range(attempts):
            for name in names:
                if name not in started:
                    started[name] = Agent(endpoint, log_dir,
                                          f"{name}-{attempt}")
            for name in names:
                agent = started[name]
                if not wait_for_port(agent.address, 90, agent.process):
                    agent.stop()
                    del started[name]
            if len(started) == len(names):
                return [started[name] for name in names]
        raise RuntimeError(f"{names} did not start; see {log_dir}")

    agents = []
    third = []
    try:
        agents.extend(start_agents(["agent-0", "agent-1"]))
        resolver = keras_ps.elastic.ElasticClusterResolver(
            endpoint, ps=[ps_address], min_workers=2, poll_interval=0.5,
            startup_timeout=90)
        strategy = keras_ps.ParameterServerStrategy(resolver)
        model = build(strategy)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        data = sharded_input(paths)
        events = {}

        def find(address):
            return next((w for w in coordinator.workers
                         if w.address == address), None)

        def grow():
            # Holds the fit until the new worker serves, so shards are left.
            agent, = start_agents(["agent-2"])
            third.append(agent)

            def leave():
                wait_for(lambda: find(agent.address) is not None and
                         find(agent.address).closures_run >= 2, 120,
                         "the third worker to train 2 shards")
                events["third_ran"] = find(agent.address).closures_run
                events["third_exit"] = agent.stop()
            threading.Thread(target=leave, daemon=True).start()

        fit_and_report(model, data, coordinator, [AtShard(3, grow)],
                       events=events)
        coordinator.shutdown()
        resolver.close()
    finally:
        for agent in agents + third:
            agent.stop()
        ps.send_signal(signal.SIGTERM)
        ps.wait(30)
        rdzv.stop(0)


class _Progress(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"PROGRESS epoch={self._epoch} shards={batch + 1}", flush=True)


def backup(data_dir, spec_json, backup_dir):
    paths = write_files(data_dir)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(spec_json)), rpc_layer="grpc")
    strategy = keras_ps.ParameterServerStrategy(resolver)
    model = build(strategy)
    coordinator = keras_ps.ClusterCoordinator(strategy)
    data = sharded_input(paths)
    backup_cb = keras_ps.callbacks.BackupAndRestore(backup_dir, save_freq=1)
    restored = []

    class Restored(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            ledger = keras_ps.shards.epoch.state_for(
                data, coordinator).current.ledger
            restored.append([epoch, [i for i in range(len(ledger)) if
                                     ledger.state(i).value == "done"],
                             backup_cb.resume_position()])

    fit_and_report(model, data, coordinator,
                   [Restored(), backup_cb, _Progress()],
                   restored=restored)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO if os.environ.get(
        "SHARDS_JOB_LOG") else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s")
    mode = sys.argv[1]
    if mode == "backup":
        backup(sys.argv[2], sys.argv[3], sys.argv[4])
    elif mode == "elastic":
        elastic(sys.argv[2])
    elif mode == "ps_recover":
        ps_recover(*sys.argv[2:5])
    else:
        on_local_cluster(mode, sys.argv[2])
