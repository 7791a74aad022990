"""A coordinator process for tests of the ps' preemption notices; prints
RESULT lines the test reads.

Usage:
  python tests/_notice_job.py ways_to_stop
      a LocalCluster of 3 ps (KERAS_PS_PREEMPTION_GRACE=3) watched by a
      PsNoticeWatch. ps 0 gets SIGTERM and is never released; ps 1 gets a
      second SIGTERM once its notice is heard; ps 2's watch stops once its
      notice is heard; ps 0, started again and never asked, gets SIGTERM.
      Each notice must be heard within 30 s (else the job fails). Reports
      each ps' stop line.
  python tests/_notice_job.py no_kernels
      a LocalCluster whose ps runs without keras_ps' C++ kernels
      (KERAS_PS_NATIVE=0): the watch does not start; the ps gets SIGTERM.
      Reports whether the watch started and the ps' stop line.
  python tests/_notice_job.py custom_loop
      a custom loop (2 ps, 2 workers) that adds 1 to a variable on each ps
      per step, watching notices: ps 0 gets SIGTERM mid-loop (and is started
      again once it exits, as a restart policy does); at the next step the
      loop writes a checkpoint, releases the ps, waits for it to be lost,
      recovers it, restores the checkpoint and goes on. Reports the
      variables' values and the steps planned.
"""

import os
import signal
import sys
import threading

import psutil
import tensorflow as tf

import keras_ps
from keras_ps.cluster.ps_notices import PsNoticeWatch
from _polling import wait_until
from _results import say


def _stop_line(cluster, index, pid, timeout=60):
    """The stop line of ps `index` (process `pid`), once it has exited."""
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass  # exited already
    with open(os.path.join(cluster.log_dir, f"ps-{index}.log")) as f:
        return [line.strip() for line in f if "stopping" in line][-1]


def _noticed(watch, index):
    """Waits for the watch to hear ps `index`'s notice (the job fails after
    30 s)."""
    wait_until(lambda: index in watch.noticed(), 30,
               f"the notice of ps {index} heard")


def ways_to_stop():
    with keras_ps.LocalCluster(num_workers=1, num_ps=3, env={
            "KERAS_PS_PREEMPTION_GRACE": "3"}) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        watch = PsNoticeWatch(strategy)
        started = watch.start()
        lines = {}
        pids = {i: cluster.pid("ps", i) for i in range(3)}

        # Never released, still watched: it stops when its grace is over.
        os.kill(pids[0], signal.SIGTERM)
        _noticed(watch, 0)
        lines["grace"] = _stop_line(cluster, 0, pids[0])

        # A second SIGTERM stops it at once.
        os.kill(pids[1], signal.SIGTERM)
        _noticed(watch, 1)
        os.kill(pids[1], signal.SIGTERM)
        lines["second_signal"] = _stop_line(cluster, 1, pids[1])

        # The coordinator stops watching (its fit ended): it stops.
        os.kill(pids[2], signal.SIGTERM)
        _noticed(watch, 2)
        watch.stop()
        lines["unwatched_while_noticed"] = _stop_line(cluster, 2, pids[2])

        # A ps no coordinator has asked stops at once.
        cluster.restart("ps", 0)
        pid = cluster.pid("ps", 0)
        os.kill(pid, signal.SIGTERM)
        lines["never_watched"] = _stop_line(cluster, 0, pid)
        say(started=started, lines=lines)


def no_kernels():
    with keras_ps.LocalCluster(num_workers=1, num_ps=1, env={
            "KERAS_PS_NATIVE": "0"}) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        watch = PsNoticeWatch(strategy)
        started = watch.start()
        pid = cluster.pid("ps", 0)
        os.kill(pid, signal.SIGTERM)
        say(started=started, line=_stop_line(cluster, 0, pid))


def custom_loop(steps=300, notice_at=60):
    with keras_ps.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            counts = [tf.Variable(0.0), tf.Variable(0.0)]
        assert {v.device.split("/task:")[1][0] for v in counts} == {"0", "1"}
        checkpoint = tf.train.Checkpoint(counts=counts)
        prefix = os.path.join(sys.argv[2], "ckpt")

        @tf.function
        def step():
            for v in counts:
                v.assign_add(1.0)

        def restart_policy():
            cluster.stop("ps", 0, timeout=60)  # SIGTERM; waits for the exit
            cluster.restart("ps", 0)

        watch = PsNoticeWatch(strategy)
        assert watch.start()
        policy = threading.Thread(target=restart_policy)
        done, recovered, saved_at = 0, 0, None
        while done < steps:
            if done == notice_at:
                policy.start()
                # A loop checks at each step; this one waits for the notice
                # to be heard, so that it comes mid-loop on any machine.
                wait_until(watch.noticed, 30, "the notice of ps 0 heard")
            noticed = watch.noticed()
            if noticed:
                coordinator.join()  # every step scheduled is in the save
                path = checkpoint.write(prefix)
                saved_at = done
                watch.release(noticed)
                wait_until(lambda: coordinator.lost_parameter_servers(), 30,
                           "the released ps seen lost")
                coordinator.recover_parameter_servers()
                checkpoint.read(path).assert_consumed()
                recovered += 1
            coordinator.schedule(step)
            done += 1
        coordinator.join()
        policy.join()
        watch.stop()
        say(values=[float(v.numpy()) for v in counts], steps=steps,
            recovered=recovered, saved_at=saved_at, notice_at=notice_at)


if __name__ == "__main__":
    {"ways_to_stop": ways_to_stop, "custom_loop": custom_loop,
     "no_kernels": no_kernels}[sys.argv[1]]()
