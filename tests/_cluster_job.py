"""A coordinator process for tests of connecting and per-worker datasets
around workers that are down; prints RESULT lines the test reads.

Usage: python tests/_cluster_job.py connect|dataset_while_down|second_cluster|
    made_before|release_after_restart|release_after_ps_recovery|
    release_after_hang
"""

import logging
import os
import sys
import threading
import time

import keras
import numpy as np
import portpicker
import tensorflow as tf

import keras_ps
from _results import say


class _Seen(logging.Handler):
    """Sets `event` when a log record contains `text`."""

    def __init__(self, text):
        super().__init__()
        self.text, self.event = text, threading.Event()

        self.messages = []  # (level name, message) of those records

    def emit(self, record):
        if self.text in record.getMessage():
            self.messages.append((record.levelname, record.getMessage()))
            self.event.set()


def _count_steps(strategy, steps):
    """Runs `steps` steps that each add 1 to a ps variable; its value."""
    coordinator = keras_ps.ClusterCoordinator(strategy)
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def step():
        v.assign_add(1.0)

    for _ in range(steps):
        coordinator.schedule(step)
    coordinator.join()
    return float(v.numpy())


def connect():
    """A strategy waits for a worker that is still starting; one whose
    worker never answers fails with an error naming it."""
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        spec = {job: list(tasks) for job, tasks in cluster.spec.items()}
        nobody = f"localhost:{portpicker.pick_unused_port()}"
        os.environ["KERAS_PS_CONNECT_TIMEOUT"] = "2"
        # Said at WARNING, which shows without any logging set up.
        still = _Seen("still waiting for")
        logging.getLogger("keras_ps").addHandler(still)
        start = time.monotonic()
        try:
            keras_ps.ParameterServerStrategy(keras_ps.cluster.resolver_from_spec(
                {"ps": spec["ps"], "worker": spec["worker"] + [nobody]}))
            unreachable = None
        except tf.errors.UnavailableError as error:
            unreachable = dict(type=type(error).__name__, message=str(error),
                               seconds=time.monotonic() - start)
        os.environ["KERAS_PS_CONNECT_TIMEOUT"] = "60"
        logging.getLogger("keras_ps").removeHandler(still)

        cluster.kill("worker", 0)
        seen = _Seen("waiting for")
        logging.getLogger("keras_ps").addHandler(seen)
        logging.getLogger("keras_ps").setLevel(logging.INFO)

        def restart_once_waited():
            if seen.event.wait(60):
                cluster.restart("worker", 0)

        threading.Thread(target=restart_once_waited, daemon=True).start()
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        total = _count_steps(strategy, 10)
        say(unreachable=unreachable, still_waiting=still.messages,
            waited=seen.event.is_set(), total=total)


def dataset_while_down():
    """Per-worker datasets made while a worker is down: made on the others,
    and on that worker once it is back."""
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)
        cluster.kill("worker", 1)
        from_fn = coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(1.0).repeat())
        from_dataset = coordinator.create_per_worker_dataset(
            tf.data.Dataset.from_tensors(2.0).repeat())
        iterators = (iter(from_fn), iter(from_dataset))
        state_after_create = coordinator.workers[1].state.value

        @tf.function
        def step(a, b):
            total.assign_add(next(a) + next(b))

        cluster.restart("worker", 1)
        for _ in range(100):
            coordinator.schedule(step, args=iterators)
        readmitted = coordinator.workers[1].wait_until_runnable(timeout=60)
        for _ in range(200):
            coordinator.schedule(step, args=iterators)
        coordinator.join()
        say(state_after_create=state_after_create, readmitted=readmitted,
            total=float(total.numpy()),
            per_worker=[w.closures_run for w in coordinator.workers])


def dataset_no_worker():
    """A per-worker dataset made while its only worker is down (as right
    after a coordinator restart): asking for its element_spec waits for the
    worker to be re-admitted, and names the timeout when it is not."""
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            tf.Variable(0.0)  # the model is built before the data
        cluster.kill("worker", 0)
        dataset = coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(tf.ones([3])).repeat())
        os.environ["KERAS_PS_CONNECT_TIMEOUT"] = "2"
        # Said at WARNING, which shows without any logging set up.
        still = _Seen("still waiting for")
        logging.getLogger("keras_ps").addHandler(still)
        start = time.monotonic()
        try:
            dataset.element_spec
            timed_out = None
        except RuntimeError as error:
            timed_out = {"message": str(error),
                         "seconds": time.monotonic() - start}
        os.environ["KERAS_PS_CONNECT_TIMEOUT"] = "60"
        logging.getLogger("keras_ps").removeHandler(still)
        cluster.restart("worker", 0)
        spec = dataset.element_spec
        say(timed_out=timed_out, spec=[spec.shape.as_list(), spec.dtype.name])


def second_cluster():
    """Clusters one after another in one process, as a notebook makes them."""
    runs, old, old_model = [], None, None
    for _ in range(4):
        resolver = keras_ps.create_in_process_cluster(num_workers=2, num_ps=1)
        strategy = keras_ps.ParameterServerStrategy(resolver)
        runs.append(_count_steps(strategy, 40))
        if old is None:
            old = strategy
            with strategy.scope():
                old_model = keras.Sequential([keras.Input((4,)),
                                              keras.layers.Dense(2)])
            old_model.predict(np.ones((1, 4), "float32"), verbose=0)
    refused = {}
    for name, use in (("coordinator", lambda: keras_ps.ClusterCoordinator(old)),
                      # Its weights are on the first cluster's ps: reading
                      # them through the new connection crashed the process.
                      ("predict", lambda: old_model.predict(
                          np.ones((1, 4), "float32"), verbose=0))):
        try:
            use()
            refused[name] = None
        except keras_ps.errors.ClusterConfigError as error:
            refused[name] = str(error)
    say(runs=runs, refused=refused)


def made_before():
    """A scheduled step reading a variable, or a Keras model, made before
    the strategy connected to the cluster; then a step that may run."""
    early = tf.Variable(1.0, name="early")
    early_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    strategy = keras_ps.ParameterServerStrategy(
        keras_ps.create_in_process_cluster(num_workers=1, num_ps=1))
    coordinator = keras_ps.ClusterCoordinator(strategy)
    refused = {}
    for name, read in (("variable", lambda: early + 1.0),
                       ("model", lambda: early_model(tf.ones((1, 2))))):
        try:
            coordinator.schedule(tf.function(read))
            coordinator.join()
            refused[name] = None
        except ValueError as error:
            refused[name] = str(error)
    with strategy.scope():
        late = tf.Variable(1.0)
    result = coordinator.schedule(tf.function(lambda: late.assign_add(1.0)))
    coordinator.join()
    say(refused=refused, late=float(result.fetch()))


def _lines_made_again():
    """A _Seen of the iterator release lines made again after a cluster
    push (logged at INFO, "[worker:N] its iterator release line is made
    again: ..."), from now on."""
    seen = _Seen("release line is made again")
    release_logger = logging.getLogger("keras_ps.coordinator.iterator_release")
    release_logger.setLevel(logging.INFO)
    release_logger.addHandler(seen)
    return seen


def _workers_of(seen):
    """The worker indices of the lines `seen` (_lines_made_again)."""
    return [int(message.split("]")[0].split(":")[1])
            for _, message in seen.messages]


def release_after_restart():
    """Iterators released (ClusterCoordinator.release_iterators) before and
    after a worker is killed, restarted and re-admitted."""
    import tempfile

    from _open_files import open_on, reading_iterator, write_records
    from _polling import wait_until

    folder = tempfile.mkdtemp()
    paths = [write_records(os.path.join(folder, f"{k}.tfrecord"))
             for k in range(4)]
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        coordinator = keras_ps.ClusterCoordinator(
            keras_ps.ParameterServerStrategy(cluster.resolver))
        pids = lambda: [cluster.pid("worker", i) for i in range(2)]

        def read_and_release(path):
            iterator = reading_iterator(coordinator, path)
            coordinator.release_iterators(iterator)

        made_again = _lines_made_again()
        iterator = reading_iterator(coordinator, paths[0])
        first = open_on(pids(), paths[0])
        coordinator.release_iterators(iterator)
        del iterator
        cluster.kill("worker", 1)
        read_and_release(paths[1])  # worker 1 fails; not handed to its line
        cluster.restart("worker", 1)
        readmitted = coordinator.workers[1].wait_until_runnable(timeout=60)
        read_and_release(paths[2])
        iterator = reading_iterator(coordinator, paths[3])
        held, reading = open_on(pids(), paths[2]), open_on(pids(), paths[3])
        coordinator.release_iterators(iterator)
        del iterator
        read_and_release(paths[0])
        wait_until(lambda: open_on(pids(), paths[3]) == [0, 0], 60,
                   "the released iterators' files to be closed")
        say(readmitted=readmitted, first=first, held=held, reading=reading,
            freed=open_on(pids(), paths[3]),
            made_again=_workers_of(made_again))


def release_after_ps_recovery():
    """Iterators a ps recovery replaced (the workers kept their processes):
    released, held until the next release, not dropped the plain way."""
    import tempfile

    from _open_files import open_on, reading_iterator, write_records
    from _polling import wait_until

    folder = tempfile.mkdtemp()
    first, second = [write_records(os.path.join(folder, f"{k}.tfrecord"))
                     for k in range(2)]
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            tf.Variable(1.0)  # what the ps loses
        coordinator = keras_ps.ClusterCoordinator(strategy)
        pids = lambda: [cluster.pid("worker", i) for i in range(2)]
        made_again = _lines_made_again()
        # Released before the loss: held by each worker's line.
        before = reading_iterator(coordinator, second)
        coordinator.release_iterators(before)
        del before
        iterator = reading_iterator(coordinator, first)
        reading = open_on(pids(), first)
        held_before = open_on(pids(), second)
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        recovery = coordinator.recover_parameter_servers(timeout=120)
        # The recovery made `iterator`'s datasets again (their new readers
        # have not opened the file yet); dropped the plain way, the replaced
        # ones would be destroyed by the time another iterator has read.
        other = reading_iterator(coordinator, second)
        held = open_on(pids(), first)
        coordinator.release_iterators(other)
        wait_until(lambda: open_on(pids(), first) == [0, 0], 60,
                   "the replaced iterators' files to be closed")
        del iterator
        say(lost=list(recovery.lost), reading=reading, held=held,
            freed=open_on(pids(), first), held_before=held_before,
            made_again=_workers_of(made_again))


def release_after_hang():
    """Iterators replaced when a hung worker (SIGSTOP, then SIGCONT) is
    re-admitted: it kept its process, so they are released, held until the
    next release, not dropped the plain way."""
    import tempfile

    from _open_files import open_on, reading_iterator, write_records
    from _polling import wait_until
    from keras_ps.coordinator.worker_states import WorkerState

    folder = tempfile.mkdtemp()
    first, second = [write_records(os.path.join(folder, f"{k}.tfrecord"))
                     for k in range(2)]

    @tf.function
    def step():
        return tf.constant(1)

    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        coordinator = keras_ps.ClusterCoordinator(
            keras_ps.ParameterServerStrategy(cluster.resolver))
        on_worker_1 = lambda: open_on([cluster.pid("worker", 1)], first)[0]
        iterator = reading_iterator(coordinator, first)
        reading = on_worker_1()
        # Traced before the pause: TF registers a new function on every
        # worker, and waits for the stopped one.
        for _ in range(2):
            [coordinator.schedule(step) for _ in range(8)]
            coordinator.join()
        cluster.pause("worker", 1)

        def seen_hung():
            # Steps go on being scheduled until worker 1 has taken some
            # (worker 0 may take the first ones all).
            if coordinator.workers[1].state is WorkerState.HUNG:
                return True
            coordinator.schedule(step)
            return False

        wait_until(seen_hung, 120, "worker 1 to be seen hung", interval=0.1)
        cluster.resume("worker", 1)
        readmitted = coordinator.workers[1].wait_until_runnable(timeout=120)
        coordinator.join()
        # Worker 1's datasets were made again (their new reader has not
        # opened the file yet); dropped the plain way, the replaced
        # iterator would be destroyed by the time another one has read.
        other = reading_iterator(coordinator, second)
        held = on_worker_1()
        coordinator.release_iterators(other)
        wait_until(lambda: on_worker_1() == 0, 60,
                   "the replaced iterator's file to be closed")
        del iterator
        say(readmitted=readmitted, reading=reading, held=held,
            freed=on_worker_1())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    {"connect": connect, "dataset_while_down": dataset_while_down,
     "dataset_no_worker": dataset_no_worker,
     "second_cluster": second_cluster, "made_before": made_before,
     "release_after_restart": release_after_restart,
     "release_after_ps_recovery": release_after_ps_recovery,
     "release_after_hang": release_after_hang}[sys.argv[1]]()
