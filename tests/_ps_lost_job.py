"""Coordinator processes that lose ps 0 in ways tests/_fit_job.py does not:
fit with BackupAndRestore(save_freq=4) on its own LocalCluster, the model
and data of tests/_fit_job.py. Prints a RESULT line.

Usage:
  python tests/_ps_lost_job.py moved BACKUP_DIR
      under a cluster resolver that names the cluster as a platform's does
      (asked at each call): at the end of batch 21 of epoch 1, ps 0 is
      SIGKILLed and a new ps 0 started on a new port, which the resolver
      then names.
  python tests/_ps_lost_job.py moved_elastic BACKUP_DIR
      the same under ElasticClusterResolver, the workers admitted by a
      rendezvous: the new ps 0 announces its address to the rendezvous
      (python -m keras_ps.server --rdzv_endpoint).
  python tests/_ps_lost_job.py moved_vanished BACKUP_DIR
      as moved, ps 0's old machine vanishing instead of its process
      dying: every packet to or from its old port is dropped (no reset
      tells anyone), then it is SIGKILLed.
  python tests/_ps_lost_job.py in_validation BACKUP_DIR [kill|exit|none]
      with validation_data: ps 0 is SIGKILLed and started again on its
      address as epoch 1's validation begins (after the epoch's last
      backup, before its end's callbacks). Reports the metrics of epoch 1
      before the loss and the logs each epoch end got. With exit, this
      process leaves there instead (exit status 3) after reporting those
      metrics; run it again with none, and it resumes from the backup.
  python tests/_ps_lost_job.py lr_schedule BACKUP_DIR [kill|exit|none]
      with LearningRateScheduler(lambda epoch, lr: lr * 0.5) before a
      callback that records the rate each epoch begins with: at the end of
      batch 21 of epoch 1, ps 0 is SIGKILLed and started again on its
      address (kill), or this process leaves at once (exit, exit status 3:
      run it again, it resumes from the backup), or nothing happens (none).
"""

import concurrent.futures
import logging
import os
import sys

import keras
import portpicker
import tensorflow as tf

import keras_ps
from keras_ps.elastic import RendezvousClient
from keras_ps.elastic import RendezvousConfig
from keras_ps.elastic import RendezvousServer
from _fit_job import EPOCHS, STEPS, build, data, dataset_creator
from _kills import KillAndRestartPs, Vanish, start_task
from _results import say

AT = (1, 21)


class _PlatformResolver(tf.distribute.cluster_resolver.ClusterResolver):
    """The cluster as `spec` says at each call, as TF's Kubernetes and GCE
    resolvers ask their platform."""

    def __init__(self, spec):
        self.spec = spec

    def cluster_spec(self):
        return tf.train.ClusterSpec(self.spec)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""


class _MovePs(keras.callbacks.Callback):
    def __init__(self, cluster, resolver, rendezvous=None, vanish=False):
        super().__init__()
        self.cluster, self.resolver = cluster, resolver
        self.rendezvous, self.vanish = rendezvous, vanish
        self.process = self.old = self.new = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.process is not None or (self._epoch, batch) < AT:
            return
        if self.vanish:
            self.vanish = Vanish(int(self.cluster.address("ps", 0).rsplit(
                ":", 1)[1]))
        self.cluster.kill("ps", 0)
        self.old = self.cluster.address("ps", 0)
        self.new = f"localhost:{portpicker.pick_unused_port()}"
        spec = {job: list(tasks) for job, tasks in self.cluster.spec.items()}
        spec["ps"][0] = self.new
        with open(os.path.join(self.cluster.log_dir, "moved-ps-0.log"),
                  "w") as log:
            self.process = start_task(
                spec, "ps", 0, log, flags=() if self.rendezvous is None else
                ("--rdzv_endpoint", self.rendezvous))
        if self.rendezvous is None:
            self.resolver.spec = spec
        print(f"KILLED ps 0 at {self.old}, STARTED it at {self.new}",
              flush=True)


def _admitted(endpoint, workers):
    """Registers `workers` with the rendezvous at `endpoint`, as their
    agents would, and waits until they are admitted."""
    client = RendezvousClient(endpoint)
    with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
        for view in pool.map(lambda w: client.get_cluster_spec(
                w, len(workers), len(workers), timeout=60), workers):
            assert view.size == len(workers), view
    client.close()


def _lines(cluster, needle):
    """The lines of the moved ps' output that hold `needle`."""
    with open(os.path.join(cluster.log_dir, "moved-ps-0.log")) as log:
        return [line.strip() for line in log if needle in line]


def moved(backup_dir, elastic=False, vanish=False):
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("keras_ps").addHandler(handler)
    rendezvous = None
    if elastic:  # a long lease: no agent renews the workers' here
        rendezvous = RendezvousServer(RendezvousConfig(
            gather_timeout=0.1, keepalive_timeout=300))
        rendezvous = f"127.0.0.1:{rendezvous.start()}"
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        if elastic:
            _admitted(rendezvous, cluster.spec["worker"])
            resolver = keras_ps.elastic.ElasticClusterResolver(
                rendezvous, ps=cluster.spec["ps"], min_workers=2,
                startup_timeout=60)
        else:
            resolver = _PlatformResolver(
                {job: list(tasks) for job, tasks in cluster.spec.items()})
        strategy = keras_ps.ParameterServerStrategy(resolver)
        model = build(strategy)
        move = _MovePs(cluster, resolver, rendezvous, vanish)
        try:
            history = model.fit(
                dataset_creator(), epochs=EPOCHS, steps_per_epoch=STEPS,
                verbose=0, callbacks=[move, keras_ps.callbacks.BackupAndRestore(
                    backup_dir, save_freq=4)])
            x, y = data(seed=1, n=1024)
            _, accuracy = model.evaluate(x, y, batch_size=128, verbose=0)
            say(iterations=int(model.optimizer.iterations.numpy()),
                planned=EPOCHS * STEPS, epochs=history.epoch,
                accuracy=float(accuracy), old=move.old, new=move.new,
                ps_now=strategy.cluster_spec["ps"][0],
                recoveries=history.history.get("ps_recoveries"),
                rolled_back=history.history.get("steps_rolled_back"),
                moved=[w for w in warnings if "answers at" in w],
                announced=_lines(cluster, "announced"))
        finally:  # the moved ps, before the cluster's tasks
            if vanish and move.vanish is not True:
                move.vanish.heal()
            if move.process is not None:
                move.process.kill()
                move.process.wait()

class _EpochEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append([epoch, {k: float(v) for k, v in logs.items()}])


def in_validation(backup_dir, fault="kill"):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        evaluate, before = model.evaluate, {}
        ends = _EpochEnds()

        def evaluate_after_a_loss(*args, **kwargs):
            if len(ends.ends) == 1 and not before and fault != "none":
                before.update({k: float(v) for k, v in  # epoch 1's
                               model.get_metrics_result().items()})
                if fault == "exit":
                    say(before=before)
                    print("LEAVING in epoch 1's validation", flush=True)
                    os._exit(3)
                cluster.kill("ps", 0)
                cluster.restart("ps", 0)
                print("KILLED AND RESTARTED ps 0 in epoch 1's validation",
                      flush=True)
            return evaluate(*args, **kwargs)

        model.evaluate = evaluate_after_a_loss
        history = model.fit(
            dataset_creator(), epochs=EPOCHS, steps_per_epoch=STEPS,
            validation_data=data(seed=2, n=512), verbose=0, callbacks=[
                ends, keras_ps.callbacks.BackupAndRestore(backup_dir,
                                                          save_freq=4)])
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, epochs=history.epoch, before=before,
            ends=ends.ends, history=history.history)


class _Rates(keras.callbacks.Callback):
    """The learning rate each epoch begins with (after the scheduler), and
    leaves this process at `exit_at` (epoch, batch) when given."""

    def __init__(self, exit_at=None):
        super().__init__()
        self.begins, self.exit_at = [], exit_at

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self.begins.append(
            [epoch, float(keras.ops.convert_to_numpy(
                self.model.optimizer.learning_rate))])

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self.exit_at:
            print(f"LEAVING at epoch {self._epoch}, batch {batch}",
                  flush=True)
            os._exit(3)


def lr_schedule(backup_dir, fault="kill"):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        model = build(strategy)
        rates = _Rates(AT if fault == "exit" else None)
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
            rates, keras_ps.callbacks.BackupAndRestore(backup_dir,
                                                       save_freq=4)]
        if fault == "kill":
            callbacks.insert(0, KillAndRestartPs(cluster, AT))
        history = model.fit(dataset_creator(), epochs=EPOCHS,
                            steps_per_epoch=STEPS, verbose=0,
                            callbacks=callbacks)
        say(iterations=int(model.optimizer.iterations.numpy()),
            planned=EPOCHS * STEPS, epochs=history.epoch,
            begins=rates.begins, recoveries=history.history.get(
                "ps_recoveries"), final=float(keras.ops.convert_to_numpy(
                    model.optimizer.learning_rate)))


if __name__ == "__main__":
    {"moved": moved, "in_validation": in_validation,
     "moved_elastic": lambda backup: moved(backup, elastic=True),
     "moved_vanished": lambda backup: moved(backup, vanish=True),
     "lr_schedule": lr_schedule}[sys.argv[1]](*sys.argv[2:])
