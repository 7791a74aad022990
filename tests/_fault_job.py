"""A coordinator process for fault tests: prints JSON lines the test reads.

Usage: python tests/_fault_job.py worker_kill|worker_restart|ps_kill|ps_restart|
                                   worker_state_lost|worker_stop|
                                   trace_while_stopped|
                                   trace_waits_for_an_idle_stopped_worker|
                                   preempted_while_cancelling|
                                   ps_loss_mid_read
"""

import logging
import os
import subprocess
import sys
import threading
import time

import tensorflow as tf

import keras_ps
from _kills import reset_connections
from _kills import unread_bytes
from _results import say
from keras_ps.coordinator import packing as packing_lib
from keras_ps.cluster._network import probe




def schedule_until_worker_ran(coordinator, step, iterator, steps, index=1):
    """Schedules `steps` closures and returns once worker `index` has run 20
    of them (so a fault injected next hits a running loop)."""
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    deadline = time.monotonic() + 60
    while coordinator.workers[index].closures_run < 20:
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {index} never ran")
        time.sleep(0.01)


class count_readmissions(logging.Handler):
    """Counts the re-admissions of worker `index` from here on (the line
    the coordinator logs for each)."""

    def __init__(self, index):
        super().__init__(logging.INFO)
        self.count = 0
        self._prefix = f"[worker:{index}] rebuilt in"
        log = logging.getLogger("keras_ps.coordinator.failure_handling")
        log.setLevel(logging.INFO)
        log.addHandler(self)

    def emit(self, record):
        if record.getMessage().startswith(self._prefix):
            self.count += 1


def restart_at_once(cluster, job, index):
    """Starts a killed task again on its address, as a restart policy does,
    and returns once it answers a probe."""
    cluster.restart(job, index)
    deadline = time.monotonic() + 60
    while not probe(cluster.spec[job][index], 1):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the restarted {job} {index} never answered")
        time.sleep(0.05)


def run_after_readmission(coordinator, step, iterator, index=1, steps=300):
    """Waits until worker `index` takes closures again, runs `steps` more;
    returns (re-admitted in time, closures that worker ran of them)."""
    worker = coordinator.workers[index]
    back = worker.wait_until_runnable(timeout=60)
    before = worker.closures_run
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    return back, worker.closures_run - before


def main(mode):
    from tensorflow.python.data.experimental.ops import testing  # sleep-bound steps

    with keras_ps.LocalCluster(num_workers=3 if mode == "worker_kill" else 2,
                               num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)

        built_on = []  # worker index of every dataset_fn call

        def dataset_fn(context):
            built_on.append(context.input_pipeline_id)
            return tf.data.Dataset.from_tensors(1.0).repeat().apply(
                testing.sleep(5000))

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        traces = []  # one entry each time step's Python body is traced

        @tf.function
        def step(it):
            traces.append(1)
            total.assign_add(next(it))

        if mode == "worker_kill":
            steps = 500
            schedule_until_worker_ran(coordinator, step, iterator, steps)
            cluster.kill("worker", 1)
            coordinator.join()
            first = dict(steps=steps, total=float(total.numpy()),
                         per_worker=[w.closures_run for w in coordinator.workers],
                         states=[w.state.value for w in coordinator.workers])
            # Restart the killed worker: it is re-admitted, its dataset is
            # rebuilt, and it runs closures again.
            cluster.restart("worker", 1)
            back, ran = run_after_readmission(coordinator, step, iterator)
            say(**first, readmitted=back, after_restart=ran,
                built_on=built_on, total_after=float(total.numpy()),
                states_after=[w.state.value for w in coordinator.workers])
        elif mode == "worker_restart":
            # A restart policy brings a killed worker back on its address
            # before any call to it fails: the worker answers every probe,
            # but a call fails on the connection, and its retry on the eager
            # context this job made there, which is gone.
            for _ in range(20):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
            cluster.kill("worker", 1)
            restart_at_once(cluster, "worker", 1)
            before = [w.closures_run for w in coordinator.workers]

            scale = tf.constant(1.0)  # copied to a worker at each call

            @tf.function
            def scaled_step(it, scale):
                total.assign_add(next(it) * scale)

            try:
                for _ in range(100):
                    coordinator.schedule(scaled_step, args=(iterator, scale))
                coordinator.join()
                back = coordinator.workers[1].wait_until_runnable(60)
                error = None
            except Exception as e:  # what the user sees
                back, error = False, f"{type(e).__name__}: {e}"[:2000]
            say(error=error, total=float(total.numpy()), readmitted=back,
                ran_after=[w.closures_run - b
                           for w, b in zip(coordinator.workers, before)],
                built_on=built_on,
                states=[w.state.value for w in coordinator.workers])
        elif mode == "ps_recover":
            # A custom loop that survives a ps loss: catch the error, bring
            # the ps back, recover, restore the checkpoint, go on.
            import tempfile
            checkpoint = tf.train.Checkpoint(total=total)
            for _ in range(20):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
            path = checkpoint.write(tempfile.mkdtemp() + "/ckpt")
            for _ in range(30):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
            cluster.kill("ps", 0)
            start = time.monotonic()
            try:
                for _ in range(100):
                    coordinator.schedule(step, args=(iterator,))
                coordinator.join()
                raise RuntimeError("the ps loss was not seen")
            except keras_ps.errors.ParameterServerUnavailableError:
                seen = time.monotonic() - start
            cluster.restart("ps", 0)
            traced_before = len(traces)
            recovery = coordinator.recover_parameter_servers(timeout=60)
            checkpoint.read(path).assert_consumed()
            restored = float(total.numpy())
            before = [w.closures_run for w in coordinator.workers]
            scheduled, deadline = 0, time.monotonic() + 60
            # 100 steps, then 10 more at a time until both workers took
            # steps (a worker re-admitted late may find the 100 taken).
            while scheduled < 100 or (
                    min(w.closures_run - b for w, b in
                        zip(coordinator.workers, before)) == 0
                    and time.monotonic() < deadline):
                for _ in range(100 if scheduled == 0 else 10):
                    coordinator.schedule(step, args=(iterator,))
                    scheduled += 1
                coordinator.join()
            say(seen=seen, lost=list(recovery.lost),
                variables=recovery.variables, restored=restored,
                total=float(total.numpy()), scheduled=scheduled,
                states=[w.state.value for w in coordinator.workers],
                traced=[traced_before, len(traces)])
        elif mode == "worker_state_lost":
            # Each closure reads a variable the user placed on its worker:
            # a restarted worker has lost it, so its first call after its
            # re-admission fails. That is the function's error, raised at
            # once with what to do, never retried in a loop.
            from keras_ps.strategy._per_worker import PerWorkerValues
            scales = []
            for i in range(2):
                with tf.device(f"/job:worker/replica:0/task:{i}/device:CPU:0"):
                    scales.append(tf.Variable(1.0))

            @tf.function
            def scaled_step(it, scale):
                total.assign_add(next(it) * scale)

            scale = PerWorkerValues(scales)
            for _ in range(200):
                coordinator.schedule(scaled_step, args=(iterator, scale))
            coordinator.join()
            readmissions = count_readmissions(1)
            cluster.kill("worker", 1)
            worker = coordinator.workers[1]
            start = time.monotonic()
            try:
                for _ in range(100):
                    coordinator.schedule(scaled_step, args=(iterator, scale))
                # Worker 1 is seen failed, then comes back.
                if not worker.wait_for_state(
                        keras_ps.coordinator.WorkerState.FAILED, 60):
                    raise RuntimeError("worker 1 was never seen failed")
                cluster.restart("worker", 1)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    coordinator.schedule(scaled_step, args=(iterator, scale))
                    coordinator.join()
                say(error=None)
            except Exception as e:  # what the user sees
                say(error=type(e).__name__, seconds=time.monotonic() - start,
                    message=str(e), notes=getattr(e, "__notes__", []),
                    is_keras_ps=isinstance(e, keras_ps.errors.KerasPSError),
                    readmissions=readmissions.count)
        else:
            for _ in range(20):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
            cluster.kill("ps", 0)
            if mode == "ps_restart":
                # Back on its address before any closure fails: every probe
                # finds it alive, but its variables are gone.
                restart_at_once(cluster, "ps", 0)
            start = time.monotonic()
            try:
                for _ in range(100):
                    coordinator.schedule(step, args=(iterator,))
                coordinator.join()
                say(error=None)
            except tf.errors.UnavailableError as e:
                say(error=type(e).__name__, seconds=time.monotonic() - start,
                    message=str(e))


def worker_stop():
    """SIGSTOP a worker mid-loop for longer than the hang timeout: training
    must not hang; after SIGCONT the worker is re-admitted."""
    from tensorflow.python.data.experimental.ops import testing

    with keras_ps.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)
        iterator = iter(coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(1.0).repeat().apply(
                testing.sleep(5000))))

        @tf.function
        def step(it):
            total.assign_add(next(it))

        steps = 400
        schedule_until_worker_ran(coordinator, step, iterator, steps)
        cluster.pause("worker", 1)
        stopped = time.monotonic()
        coordinator.join()
        joined_after = time.monotonic() - stopped
        # Eager ops of kinds this process has not run yet, while the worker
        # is stopped: TF's default would register each on every task and
        # wait for the stopped one, holding the GIL (the job would hang).
        rows = tf.unstack(tf.reshape(tf.range(21.0), [7, 3]), num=7)
        new_ops = [float(tf.math.reduce_logsumexp(r)) for r in rows[:2]]
        state_while_stopped = coordinator.workers[1].state.value
        cluster.resume("worker", 1)
        back, ran = run_after_readmission(coordinator, step, iterator)
        say(steps=steps + 300, total=float(total.numpy()),
            joined_after=joined_after, state_while_stopped=state_while_stopped,
            new_ops_while_stopped=new_ops, readmitted=back, after_resume=ran)


def preempted_while_cancelling():
    """TF's one-worker-preemption-with-cancellation case on a real cluster:
    a long closure runs on one worker, a closure fails on the other, and
    the long one's worker is SIGKILLed meanwhile (then restarted). join()
    raises the error; the long closure's fetch() raises CancelledError (it
    is not run again elsewhere); closures scheduled next run."""
    from tensorflow.python.data.experimental.ops import testing

    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)
        # No map under the sleeps: a cancelled read must not deadlock.
        slow = iter(coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(1.0).repeat().apply(
                testing.sleep(60_000_000))))
        delayed = iter(coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.from_tensors(0.0).repeat().apply(
                testing.sleep(3_000_000))))

        @tf.function
        def long_step(it):
            return total.assign_add(next(it))

        @tf.function
        def bad_step(it):
            return tf.debugging.check_numerics(next(it) / 0.0, "loss is NaN")

        @tf.function
        def step():
            return total.assign_add(1.0)

        long_result = coordinator.schedule(long_step, args=(slow,))
        deadline = time.monotonic() + 120
        running = []
        while not running:  # the long closure is in flight on a worker
            assert time.monotonic() < deadline, "the long closure never ran"
            running = [w.index for w in coordinator.workers
                       if w.in_flight_seconds() is not None]
            time.sleep(0.01)
        coordinator.schedule(bad_step, args=(delayed,))
        while coordinator.workers[1 - running[0]].in_flight_seconds() is None:
            assert time.monotonic() < deadline, "the failing closure never ran"
            time.sleep(0.01)
        cluster.kill("worker", running[0])
        cluster.restart("worker", running[0])
        raised = None
        try:
            coordinator.join()
        except tf.errors.InvalidArgumentError as error:
            raised = type(error).__name__
        try:
            long_result.fetch()
            fetched = "value"
        except tf.errors.CancelledError:
            fetched = "CancelledError"
        except tf.errors.OpError as error:
            fetched = type(error).__name__
        after = [coordinator.schedule(step) for _ in range(6)]
        coordinator.join()
        say(join_raised=raised, long_fetch=fetched,
            after=sorted(float(r.fetch()) for r in after),
            total=float(total.numpy()))


def _reading_slowly(coordinator, strategy, read_s, update_after_s):
    """(total, iterator, step): a variable on the ps; per-worker iterators
    whose every element takes `read_s` seconds to read (no map under the
    sleep); a tf.function `step(iterator)` that adds 1 to `total` once it
    waited `update_after_s` seconds on the worker, reading its element in
    parallel, and returns the element."""
    from tensorflow.python.data.experimental.ops import testing

    with strategy.scope():
        total = tf.Variable(0.0)
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors(1.0).repeat().apply(
            testing.sleep(int(read_s * 1e6)))))

    @tf.function
    def step(it):
        delay = tf.data.Dataset.from_tensors(0.0).apply(
            testing.sleep(int(update_after_s * 1e6))).get_single_element()
        with tf.control_dependencies([delay]):
            total.assign_add(1.0)
        return next(it)

    return total, iterator, step


def ps_loss_mid_read():
    """A custom loop whose step fails on a lost ps while the step's read of
    its iterator is still under way (TF then cancels that read): after
    recover_parameter_servers() and a checkpoint restore, the next steps
    read their iterators again instead of ending with End of sequence."""
    import tempfile

    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        # A ps lost while the update waits fails it mid-read.
        total, iterator, step = _reading_slowly(coordinator, strategy,
                                                read_s=3, update_after_s=1)
        coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        path = tf.train.Checkpoint(total=total).write(
            os.path.join(tempfile.mkdtemp(), "ckpt"))
        result = coordinator.schedule(step, args=(iterator,))
        while coordinator.workers[0].in_flight_seconds() is None:
            time.sleep(0.01)
        cluster.kill("ps", 0)  # back only once the loss is reported
        try:
            coordinator.join()
            failed = None
        except tf.errors.OpError as error:
            failed = type(error).__name__
        try:
            result.fetch()
        except tf.errors.OpError:
            pass
        cluster.restart("ps", 0)
        coordinator.recover_parameter_servers(timeout=60)
        tf.train.Checkpoint(total=total).read(path).assert_consumed()

        @tf.function
        def touch():
            return total + 0.0

        # Until the worker reaches the restarted ps itself (its connection
        # comes back after a backoff), so the next steps are not failed and
        # the worker is not re-admitted (which would rebuild its iterators).
        deadline = time.monotonic() + 120
        while True:
            try:
                with tf.device(coordinator.workers[0].device):
                    touch().numpy()
                break
            except tf.errors.UnavailableError:
                assert time.monotonic() < deadline, "the worker never reached the ps"
                time.sleep(0.1)
        values = [coordinator.schedule(step, args=(iterator,))
                  for _ in range(2)]
        coordinator.join()
        say(failed=failed, after=[float(v.fetch()) for v in values],
            total=float(total.numpy()))


def connection_reset_mid_read():
    """A step whose worker's connection to the ps is reset (ss -K, as a
    network path that drops it) while the step's read of its iterator is
    under way: the step fails on a worker that answers and a ps that holds
    its variables, and is retried; TF cancelled the read, which ends the
    iterator for good, so the retry reads the worker's iterator again
    (started over) instead of failing with End of sequence."""
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        # The worker's call to the ps is under way while the update waits,
        # and the reset comes before the update is sent.
        total, iterator, step = _reading_slowly(coordinator, strategy,
                                                read_s=5, update_after_s=2)
        coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        log = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: log.append(record.getMessage())
        for name in ("keras_ps.coordinator.worker",
                     "keras_ps.coordinator.failure_handling"):
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(handler)
        result = coordinator.schedule(step, args=(iterator,))
        worker = coordinator.workers[0]
        seconds = None
        while seconds is None or seconds < 0.3:
            time.sleep(0.01)
            seconds = worker.in_flight_seconds()
        call_started = time.monotonic() - seconds
        ps_port = int(cluster.address("ps", 0).rsplit(":", 1)[1])
        reset = reset_connections(cluster.pid("worker", 0), ps_port)
        reset_at = time.monotonic() - call_started  # seconds into the call
        first = float(result.fetch())
        values = [coordinator.schedule(step, args=(iterator,))
                  for _ in range(2)]
        coordinator.join()
        say(reset=reset, reset_at=reset_at, first=first,
            after=[float(v.fetch()) for v in values],
            total=float(total.numpy()),
            failed=[m for m in log if "closure failed with" in m],
            made_again=[m for m in log if "datasets made again" in m],
            states=[w.state.value for w in coordinator.workers])


def marker_read_reset():
    """The coordinator's check that a ps still holds this job's variables
    (a read of its marker) has its connection aborted under it: the ps is
    SIGSTOPped, so the read waits in flight, its connection is aborted (ss
    -K), and the ps continued. The ps lost nothing."""
    with keras_ps.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)
        ps_port = int(cluster.address("ps", 0).rsplit(":", 1)[1])
        assert strategy.ps_holds_state(0)
        cluster.pause("ps", 0)
        before = unread_bytes(os.getpid(), ps_port)
        seen = {}
        check = threading.Thread(
            target=lambda: seen.update(holds=strategy.ps_holds_state(0)))
        check.start()
        deadline = time.monotonic() + 60
        while unread_bytes(os.getpid(), ps_port) <= before:  # the read sent
            assert time.monotonic() < deadline, "the marker read never left"
            time.sleep(0.01)
        reset = reset_connections(os.getpid(), ps_port)
        cluster.resume("ps", 0)
        check.join(60)

        @tf.function
        def step():
            total.assign_add(1.0)

        coordinator.schedule(step)
        coordinator.join()
        say(reset=reset, holds=seen.get("holds"),
            lost=coordinator.lost_parameter_servers(),
            total=float(total.numpy()))


def trace_while_stopped():
    """A function of the user's first traced while a worker is stopped: TF
    registers it on every worker, and waits for the stopped one. Only the
    tracing thread may wait: a thread of this process, once the coordinator
    logs that a trace waits and the hang watchdog gave the stopped worker
    up, runs on for 2 s and continues the worker (a frozen process never
    would: then a process outside continues it after 120 s, and the test
    fails instead of hanging). The call given up in its trace is not run."""
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)

        @tf.function
        def warm():
            total.assign_add(1.0)

        for _ in range(20):
            coordinator.schedule(warm)
        coordinator.join()

        with strategy.scope():
            runs = tf.Variable(0.0)

        @tf.function
        def fresh(x):  # never traced before the stop
            runs.assign_add(1.0)
            return total.read_value() * 0.0 + x * 3.0

        trace_waits = threading.Event()
        waiting_log = logging.Handler(logging.WARNING)
        waiting_log.emit = lambda record: trace_waits.set() if \
            "must trace a new function" in record.getMessage() else None
        logging.getLogger("keras_ps.coordinator.worker").addHandler(waiting_log)
        outside = subprocess.Popen([sys.executable, "-c", (
            "import os, signal, time; time.sleep(120); "
            f"os.kill({cluster.pid('worker', 1)}, signal.SIGCONT)")])
        cluster.pause("worker", 1)
        done, ticks_while_trace_waits, resumed_at = threading.Event(), [], []

        def continue_the_worker_from_here():
            given_up = coordinator.workers[1].wait_for_state(
                keras_ps.coordinator.WorkerState.HUNG, 60)
            if not (trace_waits.wait(60) and given_up):
                return
            seen = time.monotonic()
            while not done.wait(0.05):
                ticks_while_trace_waits.append(time.monotonic())
                if time.monotonic() - seen > 2:
                    resumed_at.append(time.monotonic())
                    cluster.resume("worker", 1)
                    return

        thread = threading.Thread(target=continue_the_worker_from_here)
        thread.start()
        # Several calls: each worker takes some, and traces them.
        results = [coordinator.schedule(fresh, args=(tf.constant(2.0),))
                   for _ in range(5)]
        coordinator.join()
        joined_at = time.monotonic()
        outside_continued = outside.poll() is not None
        outside.kill()
        done.set()
        thread.join()
        before = [w.closures_run for w in coordinator.workers]
        for _ in range(40):
            coordinator.schedule(warm)
        coordinator.join()
        say(values=[float(r.fetch()) for r in results], runs=float(runs.numpy()),
            trace_waited=trace_waits.is_set(),
            outside_continued=outside_continued,
            resumed_before_join=bool(resumed_at) and resumed_at[0] < joined_at,
            ticks_while_trace_waits=len(ticks_while_trace_waits),
            ran_after=[w.closures_run - b
                       for w, b in zip(coordinator.workers, before)],
            states=[w.state.value for w in coordinator.workers])

def trace_waits_for_an_idle_stopped_worker():
    """A worker stops while idle, during another worker's trace of a new
    pack size (slowed by a sleep in its Python, which runs only while
    tracing). TF registers the traced function on every worker,
    so that trace waits for the stopped one, and no call of the stopped
    worker ages to show it. The watchdog sets it aside and gives the
    waiting call up (the function has a size traced already): the third
    worker runs its closures, and `join` returns while the worker is still
    stopped. A process outside continues it after 90 s, so a job that
    waits for it fails the test instead of hanging."""
    with keras_ps.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            runs = tf.Variable(0.0)
        # A trace of seconds (as of fit's steps written out): packs of 2
        # sleep in their Python, which runs while they are traced only.
        pack = packing_lib._pack

        def slow_pack(fn):
            python = pack(fn).python_function

            def run_all(calls):
                if len(calls) == 2:
                    time.sleep(4.0)
                return python(calls)

            return tf.function(run_all)

        packing_lib._pack = slow_pack

        @tf.function
        def step():
            runs.assign_add(1.0)

        for _ in range(3):  # size 1 traced
            coordinator.schedule(step).fetch()
        results = [coordinator.schedule(step) for _ in range(6)]
        # One worker takes 2 and traces their pack (4 s in `step`'s body);
        # the others run the other 4 with the size traced, then are idle.
        deadline = time.monotonic() + 60
        while True:
            calls = {w.index: w.in_flight_call() for w in coordinator.workers}
            tracing = [i for i, c in calls.items()
                       if c is not None and c.tracing]
            idle = [i for i, c in calls.items() if c is None]
            if float(runs.numpy()) >= 7 and tracing and idle:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no trace with an idle worker beside it "
                                   f"in 60 s: runs {float(runs.numpy())}, "
                                   f"tracing {tracing}, idle {idle}")
            time.sleep(0.01)
        stopped = idle[0]
        cluster.pause("worker", stopped)
        outside = subprocess.Popen([sys.executable, "-c", (
            "import os, signal, time; time.sleep(90); "
            f"os.kill({cluster.pid('worker', stopped)}, signal.SIGCONT)")])
        paused_at = time.monotonic()
        coordinator.join()
        joined_after = time.monotonic() - paused_at
        outside_continued = outside.poll() is not None
        states = [w.state.value for w in coordinator.workers]
        ran = float(runs.numpy())
        cluster.resume("worker", stopped)
        outside.kill()
        back = [w.wait_until_runnable(120) for w in coordinator.workers]
        for _ in range(30):
            coordinator.schedule(step)
        coordinator.join()
        say(tracing=tracing, stopped=stopped, joined_after=joined_after,
            outside_continued=outside_continued, states_at_join=states,
            runs_at_join=ran, done=[r.fetch() is None for r in results],
            back=back, runs=float(runs.numpy()))


if __name__ == "__main__":
    if sys.argv[1] == "worker_stop":
        worker_stop()
    elif sys.argv[1] == "trace_while_stopped":
        trace_while_stopped()
    elif sys.argv[1] == "preempted_while_cancelling":
        preempted_while_cancelling()
    elif sys.argv[1] == "ps_loss_mid_read":
        ps_loss_mid_read()
    elif sys.argv[1] == "connection_reset_mid_read":
        connection_reset_mid_read()
    elif sys.argv[1] == "marker_read_reset":
        marker_read_reset()
    elif sys.argv[1] == "trace_waits_for_an_idle_stopped_worker":
        trace_waits_for_an_idle_stopped_worker()
    else:
        main(sys.argv[1])
